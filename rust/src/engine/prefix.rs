//! Prefix caching across requests: what each slot's rings hold once its request is gone, and which
//! free slot a new request should resume from. Pure host bookkeeping; the copies it asks for are
//! the cache's (gemma4/cache.rs `copy_slot`, `snapshot`, `restore`).
//!
//! A finished request's slot keeps its rings and the exact tokens it wrote (`History`). A new
//! request goes to the free slot holding its longest *valid* prefix and reads only the rest of its
//! prompt, from position `P` on (a later prompt chunk, engine/mod.rs). Valid means every layer holds
//! exactly what a read of `0..P` would have left:
//!
//! - Full rings hold every position written, so they resume anywhere up to what they hold.
//! - A sliding ring that has written positions `0..H` in order holds the last window ending at
//!   `H - 1` (cache.rs module docs). A read at `P` needs the positions `(P - W, P)`, so the ring can
//!   resume at `P = H` or `P = H - 1` (position `H - 1` is then written again, with the same key), or
//!   anywhere while it never wrapped (`H <= ring`); anywhere else it holds keys of the wrong
//!   positions. So the sliding rings are also copied (`Mark`) where the next request is likely to
//!   resume: where the conversation's next turn departs from the prompt (`Mark::Turn`), and at the
//!   boundary the caller marks (`Request::cache_boundary`: the end of the system turn and tool
//!   declarations that every user of an agent shares). The next turn departs where the caller says
//!   (`Request::next_turn`: a chat template may end a prompt with markup that its rendering of the
//!   reply drops, as Gemma 4's empty thought channel with thinking off), else at the prompt's end (a
//!   template that re-renders nothing of the prompt; a regenerated reply re-reads the same prompt).
//!   A snapshot taken at `c` resumes at `c`, `c - 1`, or anywhere up to `c` while `c <= ring`. A
//!   prompt is read in chunks that end at its marks (engine/schedule.rs), since a snapshot is the
//!   rings as a read left them.
//!
//!   Two rows, not a third at the prompt's end beside `next_turn`: a regenerated reply of a prompt
//!   with `next_turn` resumes there and reads the prompt's last few tokens again (4 on Gemma 4's
//!   template), where a third copy of every sliding ring would cost each slot 50 % more snapshot
//!   memory (8 to 20 % of the slots the operator's memory plan fits, E2B to 12B).
//! - KV-shared layers store nothing: they read their donor's ring, restored with it.
//!
//! This is vLLM's rule for sliding-window layers ("the last sliding_window - 1 tokens must be
//! cached", `vllm/v1/core/single_type_kv_cache_manager.py`, `SlidingWindowManager`) in ring form,
//! with llama.cpp's context checkpoints (`tools/server/server-context.cpp`, SWA checkpoints taken
//! near each prompt's end) as the snapshots. A hit is at most `n - 1` tokens of an `n`-token prompt,
//! as in both: the last token is read for the logits.
//!
//! Choosing the slot: the longest valid hit among the free slots of the same `cache_salt` (ties: a
//! hit that continues its slot's whole history, then the most recently used). The request resumes in
//! place when it continues that history (the next turn of a chat), else the donor's rings are copied
//! to the least recently used free slot, so the donor keeps its history for others (a shared system
//! prompt). Eviction is least recently used; a slot's history is dropped when the slot is
//! overwritten, after `Engine::logits`, and when a forward of its request failed.

use crate::engine::request::Request;

/// A slot's snapshot rows (gemma4/cache.rs `SNAPSHOTS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mark {
    /// At `Request::cache_boundary`.
    Boundary = 0,
    /// Where the next turn departs: at `Request::next_turn`, else at the end of the prompt.
    Turn = 1,
}

/// Snapshots a slot keeps, one per `Mark`.
const MARKS: usize = crate::gemma4::cache::SNAPSHOTS as usize;

impl Mark {
    const ALL: [Mark; MARKS] = [Mark::Boundary, Mark::Turn];

    pub(super) fn row(self) -> i64 {
        self as i64
    }
}

/// The positions inside its prompt where request `r` asks for snapshots (its chunks end there); the
/// prompt's end, `Mark::Turn` without `next_turn`, is not among them.
pub(super) fn marks(r: &Request) -> impl Iterator<Item = (Mark, usize)> {
    [(Mark::Boundary, r.cache_boundary), (Mark::Turn, r.next_turn)].into_iter().filter_map(|(m, c)| Some((m, c?)))
}

/// What a free slot's rings hold.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct History {
    /// The tokens at positions `0..tokens.len()`, exactly.
    pub(super) tokens: Vec<i64>,
    /// Positions the rings have written, in order: `tokens.len()`, or more when the last few are not
    /// known on the host (a request cancelled between read points).
    pub(super) written: usize,
    /// Per `Mark`: the position its snapshot was taken at (the sliding rings after writing `0..c`).
    pub(super) snaps: [Option<usize>; MARKS],
    pub(super) salt: Option<String>,
    /// The clock of its last use (0: never used).
    pub(super) last_used: u64,
}

/// Whether a sliding ring of `ring` entries that has written `0..h` in order can resume a read at
/// `p <= h` (module docs).
fn resumes(p: usize, h: usize, ring: usize) -> bool {
    p + 1 >= h || h <= ring
}

impl History {
    /// The longest valid resume point for `prompt` and the snapshot to restore first (None: the
    /// rings as they are), or None when nothing can be reused.
    pub(super) fn hit(&self, prompt: &[i64], ring: usize) -> Option<(usize, Option<Mark>)> {
        let common = self.tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count();
        let cap = common.min(prompt.len().saturating_sub(1));
        let exact = self.tokens.len() == self.written;
        let in_place = (self.written <= ring || exact && resumes(cap, self.written, ring)).then_some((cap, None));
        let snapshots = Mark::ALL.into_iter().filter_map(|m| {
            let c = self.snaps[m as usize]?;
            let p = cap.min(c);
            resumes(p, c, ring).then_some((p, Some(m)))
        });
        in_place.into_iter().chain(snapshots).filter(|(p, _)| *p > 0).max_by_key(|(p, m)| (*p, m.is_none()))
    }

    /// Whether `prompt` continues this whole history (the next turn of its chat, or the same prompt
    /// again), so a request resuming in this slot loses nothing of it.
    fn continued_by(&self, prompt: &[i64]) -> bool {
        self.tokens.len() == self.written && prompt.starts_with(&self.tokens)
    }
}

/// Where a request resumes: the slot whose rings it reuses, the position, the snapshot to restore
/// first, and whether the request continues the slot's whole history.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Hit {
    pub(super) donor: usize,
    pub(super) at: usize,
    pub(super) restore: Option<Mark>,
    pub(super) continues: bool,
}

/// The slots' histories and the clock of their use.
pub(super) struct PrefixCache {
    histories: Vec<History>,
    /// Entries of a sliding ring (`KvCache::ring`).
    ring: usize,
    clock: u64,
}

impl PrefixCache {
    pub(super) fn new(slots: usize, ring: usize) -> PrefixCache {
        PrefixCache { histories: vec![History::default(); slots], ring, clock: 0 }
    }

    #[cfg(test)]
    pub(super) fn history(&self, s: usize) -> &History {
        &self.histories[s]
    }

    /// The best hit for `prompt` among the `free` slots whose salt is `salt` (module docs).
    pub(super) fn best(&self, free: &[usize], prompt: &[i64], salt: &Option<String>) -> Option<Hit> {
        free.iter()
            .filter(|&&s| self.histories[s].salt == *salt)
            .filter_map(|&s| {
                let h = &self.histories[s];
                let (at, restore) = h.hit(prompt, self.ring)?;
                let continues = h.continued_by(prompt);
                Some(((at, continues, h.last_used), Hit { donor: s, at, restore, continues }))
            })
            .max_by_key(|(key, _)| *key)
            .map(|(_, hit)| hit)
    }

    /// The slot a request with `hit` goes to among the `free` ones (not empty): the donor when the
    /// request continues its history or no other slot is free, else the least recently used (never
    /// used first, then the lowest).
    pub(super) fn target(&self, free: &[usize], hit: Option<&Hit>) -> usize {
        let lru = |skip: Option<usize>| {
            free.iter().copied().filter(|s| Some(*s) != skip).min_by_key(|&s| (self.histories[s].last_used, s))
        };
        match hit {
            Some(h) if h.continues => h.donor,
            Some(h) => lru(Some(h.donor)).unwrap_or(h.donor),
            None => lru(None).unwrap_or(0),
        }
    }

    /// Slot `s` takes a request that resumes at `at` (0 without a hit) from `donor`'s rings (copied
    /// to `s` already when they differ): it keeps the donor's snapshots taken at or before `at`.
    /// Until `retire`, its history offers no hit.
    pub(super) fn claim(&mut self, s: usize, donor: Option<usize>, at: usize) {
        self.clock += 1;
        let mut snaps = [None; MARKS];
        if let Some(d) = donor {
            snaps = self.histories[d].snaps.map(|c| c.filter(|c| *c <= at));
        }
        self.histories[s] = History { snaps, last_used: self.clock, ..History::default() };
    }

    /// Slot `s` took the snapshot `mark` at position `at`.
    pub(super) fn mark(&mut self, s: usize, mark: Mark, at: usize) {
        self.histories[s].snaps[mark as usize] = Some(at);
    }

    /// Slot `s` gets the snapshots of slot `from` (a follower's rings copied from its leader).
    pub(super) fn copy_marks(&mut self, from: usize, s: usize) {
        self.histories[s].snaps = self.histories[from].snaps;
    }

    /// Slot `s` is free again and its rings hold `tokens` (`written` positions in all, see `History`).
    pub(super) fn retire(&mut self, s: usize, tokens: Vec<i64>, written: usize, salt: Option<String>) {
        self.clock += 1;
        let h = &mut self.histories[s];
        *h = History { tokens, written, salt, last_used: self.clock, snaps: h.snaps };
    }

    /// Forget what slot `s` holds (its rings were written outside the bookkeeping, or a forward
    /// that wrote them failed).
    pub(super) fn drop_history(&mut self, s: usize) {
        self.histories[s] = History::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn history(tokens: Vec<i64>, written: usize, snaps: [Option<usize>; MARKS]) -> History {
        History { tokens, written, snaps, salt: None, last_used: 1 }
    }

    #[test]
    fn the_next_turns_snapshot_serves_a_turn_that_drops_the_prompts_last_tokens() {
        // A 20-token prompt whose last 4 tokens the next turn re-renders differently (next_turn at
        // 16), then a reply of 10: 30 written, ring of 8, so the ring wrapped.
        let h = history((0..30).collect(), 30, [None, Some(16)]);
        // The next turn shares the first 16 tokens, then the reply as it renders it, then more.
        let next: Vec<i64> = (0..16).chain(100..140).collect();
        assert_eq!(h.hit(&next, 8), Some((16, Some(Mark::Turn))));
        // A snapshot at the prompt's end instead serves nothing: 16 < 20 - 1 and the ring wrapped.
        assert_eq!(history((0..30).collect(), 30, [None, Some(20)]).hit(&next, 8), None);
        // The same prompt again (a regenerated reply) resumes at next_turn, 4 tokens before its end.
        assert_eq!(h.hit(&(0..20).collect::<Vec<_>>(), 8), Some((16, Some(Mark::Turn))));
    }

    #[test]
    fn a_wrapped_ring_resumes_only_at_its_end_or_one_before() {
        // Ring of 4 entries; the history wrote 10 positions (wrapped), tokens 0..10 known.
        let h = history((0..10).collect(), 10, [None, None]);
        let with_next = |n: i64| (0..n).collect::<Vec<i64>>();
        // The next prompt extends the whole history: resume at 10.
        assert_eq!(h.hit(&with_next(12), 4), Some((10, None)));
        // The same 10 tokens again: capped at 9 (= H - 1), still in place.
        assert_eq!(h.hit(&with_next(10), 4), Some((9, None)));
        // Diverging at 8 (< H - 1): the wrapped ring holds the wrong window, nothing to reuse.
        let mut diverged = with_next(12);
        diverged[8] = 99;
        assert_eq!(h.hit(&diverged, 4), None);
    }

    #[test]
    fn an_unwrapped_ring_resumes_anywhere_up_to_what_it_holds() {
        let h = history((0..4).collect(), 4, [None, None]);
        assert_eq!(h.hit(&[0, 1, 9, 9, 9], 4), Some((2, None)));
        assert_eq!(h.hit(&[5, 1, 2], 4), None);
    }

    #[test]
    fn a_snapshot_covers_resumes_at_its_position_or_one_before() {
        // Prompt of 6 tokens (snapshot at 6), then a reply of 4: 10 written, ring of 4.
        let h = history((0..10).collect(), 10, [Some(3), Some(6)]);
        // A new prompt sharing the first 7 tokens: the prompt-end snapshot at 6.
        let p: Vec<i64> = (0..7).chain([99, 98]).collect();
        assert_eq!(h.hit(&p, 4), Some((6, Some(Mark::Turn))));
        // The same 6-token prompt again: 5 = c - 1, from the snapshot.
        assert_eq!(h.hit(&(0..6).collect::<Vec<_>>(), 4), Some((5, Some(Mark::Turn))));
        // Sharing 4 tokens: 4 < 6 - 1 and 6 > ring, so the prompt-end snapshot cannot serve; the
        // boundary snapshot at 3 (<= ring) serves 3.
        let p: Vec<i64> = (0..4).chain([99, 98]).collect();
        assert_eq!(h.hit(&p, 4), Some((3, Some(Mark::Boundary))));
    }

    #[test]
    fn a_history_whose_tail_is_unknown_resumes_only_where_the_ring_never_wrapped_or_from_a_snapshot() {
        // 10 positions written, only the first 7 known (a cancel between read points).
        let h = history((0..7).collect(), 10, [None, Some(6)]);
        assert_eq!(h.hit(&(0..12).collect::<Vec<_>>(), 4), Some((6, Some(Mark::Turn))));
        assert_eq!(h.hit(&(0..12).collect::<Vec<_>>(), 16), Some((7, None)));
    }

    #[test]
    fn slots_are_chosen_by_hit_then_continuation_and_salts_never_mix() {
        let mut c = PrefixCache::new(3, 4);
        c.claim(0, None, 0);
        c.retire(0, vec![1, 2, 3], 3, None);
        c.claim(1, None, 0);
        c.retire(1, vec![1, 2, 3], 3, Some("a".into()));
        let prompt = [1, 2, 3, 4];
        // Slot 0 (no salt) continues; the request goes there in place.
        let hit = c.best(&[0, 1, 2], &prompt, &None).unwrap();
        assert_eq!(hit, Hit { donor: 0, at: 3, restore: None, continues: true });
        assert_eq!(c.target(&[0, 1, 2], Some(&hit)), 0);
        // Salt "a" finds slot 1 only; salt "b" nothing.
        assert_eq!(c.best(&[0, 1, 2], &prompt, &Some("a".into())).unwrap().donor, 1);
        assert_eq!(c.best(&[0, 1, 2], &prompt, &Some("b".into())), None);
        // A partial hit (a fork at position 2) moves to the least recently used other free slot
        // (slot 2, never used), so slot 0 keeps its history.
        let partial = c.best(&[0, 1, 2], &[1, 2, 9, 9], &None).unwrap();
        assert_eq!((partial.donor, partial.at, partial.continues), (0, 2, false));
        assert_eq!(c.target(&[0, 1, 2], Some(&partial)), 2);
        // No hit: the least recently used free slot.
        assert_eq!(c.target(&[0, 1], None), 0);
        // Claiming keeps the donor's snapshots at or before the hit only.
        c.mark(0, Mark::Boundary, 2);
        c.mark(0, Mark::Turn, 3);
        c.claim(2, Some(0), 2);
        assert_eq!(c.history(2).snaps, [Some(2), None]);
        c.drop_history(0);
        assert_eq!(c.best(&[0], &prompt, &None), None);
    }
}
