//! Which prompts the next prompt forward reads, and how their rows are laid out: pure functions of
//! the slots' host state, with no device work (the engine module docs say why).
//!
//! Design from vLLM's `v1/core/sched/scheduler.py` (a token budget per step, first come first served).

use crate::engine::prefix;
use crate::engine::slots::{Phase, Slot};

/// A slot still reading its prompt: admission order, slot, tokens read, prompt length, and whether
/// a snapshot mark lies ahead (its chunks end there, engine/prefix.rs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Unread {
    pub(super) seq: u64,
    pub(super) slot: usize,
    pub(super) done: usize,
    pub(super) len: usize,
    pub(super) mark_ahead: bool,
}

/// The slots still reading their prompts.
pub(super) fn unread(slots: &[Option<Slot>]) -> Vec<Unread> {
    slots
        .iter()
        .enumerate()
        .filter_map(|(i, s)| {
            let s = s.as_ref()?;
            let Phase::Prompt { done } = s.phase else { return None };
            let mark_ahead = prefix::marks(&s.request).any(|(_, c)| c > done);
            Some(Unread { seq: s.seq, slot: i, done, len: s.request.prompt.len(), mark_ahead })
        })
        .collect()
}

/// The slots the next prompt forward reads (engine module docs): the oldest unread prompt, and, when
/// it starts, fits `budget` tokens whole and has no snapshot mark ahead, the next unread ones in
/// admission order while each does too, and the forward's rectangle (the slots from the lowest to
/// the highest, times the longest prompt) stays within `budget`. Several slots are read whole; one
/// alone may be read in chunks.
pub(super) fn prompt_group(mut reading: Vec<Unread>, budget: usize) -> Vec<usize> {
    reading.sort();
    let Some(first) = reading.first().copied() else { return Vec::new() };
    let mut group = vec![first.slot];
    if first.done > 0 || first.len > budget || first.mark_ahead {
        return group;
    }
    let (mut lo, mut hi, mut longest) = (first.slot, first.slot, first.len);
    for u in &reading[1..] {
        let (l, h, t) = (lo.min(u.slot), hi.max(u.slot), longest.max(u.len));
        if u.done > 0 || u.mark_ahead || (h - l + 1) * t > budget {
            break;
        }
        group.push(u.slot);
        (lo, hi, longest) = (l, h, t);
    }
    group
}

/// A prompt forward's inputs on the host, `[rows, t]` flattened: token ids, positions, and 1 where
/// a token is real.
#[derive(Debug, PartialEq)]
pub(super) struct Padded {
    pub(super) ids: Vec<i64>,
    pub(super) positions: Vec<i64>,
    pub(super) live: Vec<i64>,
}

/// Each row's prompt (None: a slot in the range that reads nothing) at the right end of `t`
/// columns; the columns before it hold token 0 at position `pad_pos`, not live (engine module docs).
pub(super) fn padded_prompts(prompts: &[Option<&[i64]>], t: usize, pad_pos: i64) -> Padded {
    let mut out = Padded { ids: Vec::new(), positions: Vec::new(), live: Vec::new() };
    for p in prompts {
        let p = p.unwrap_or(&[]);
        let pad = t - p.len();
        out.ids.extend(std::iter::repeat_n(0, pad).chain(p.iter().copied()));
        out.positions.extend(std::iter::repeat_n(pad_pos, pad).chain(0..p.len() as i64));
        out.live.extend(std::iter::repeat_n(0, pad).chain(std::iter::repeat_n(1, p.len())));
    }
    out
}

/// The slots that follow slot `leader` (`Phase::Follow`), oldest first.
pub(super) fn followers(slots: &[Option<Slot>], leader: usize) -> Vec<usize> {
    let mut found: Vec<(u64, usize)> = slots
        .iter()
        .enumerate()
        .filter_map(|(i, x)| x.as_ref().map(|x| (x, i)))
        .filter(|(x, _)| matches!(x.phase, Phase::Follow { leader: l } if l == leader))
        .map(|(x, i)| (x.seq, i))
        .collect();
    found.sort();
    found.into_iter().map(|(_, i)| i).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unread(seq: u64, slot: usize, done: usize, len: usize) -> Unread {
        Unread { seq, slot, done, len, mark_ahead: false }
    }

    #[test]
    fn short_prompts_that_fit_the_budget_are_read_together_in_admission_order() {
        // Slots 0..4 hold prompts of 10, 20, 5 and 30 tokens, admitted in order 3, 0, 1, 2.
        let burst = vec![unread(2, 1, 0, 20), unread(1, 0, 0, 10), unread(4, 3, 0, 30), unread(3, 2, 0, 5)];
        assert_eq!(prompt_group(burst.clone(), 256), vec![0, 1, 2, 3]);
        // 3 rows x 20 = 60 fit; adding slot 3 makes 4 x 30 = 120.
        assert_eq!(prompt_group(burst.clone(), 100), vec![0, 1, 2]);
        // The oldest alone when it does not fit whole, or is already part read.
        assert_eq!(prompt_group(burst, 9), vec![0]);
        assert_eq!(prompt_group(vec![unread(1, 0, 8, 20), unread(2, 1, 0, 4)], 256), vec![0]);
        // A gap in the slots counts as padding rows: slots 0 and 3 make a 4-row rectangle.
        assert_eq!(prompt_group(vec![unread(1, 0, 0, 10), unread(2, 3, 0, 10)], 39), vec![0]);
        assert_eq!(prompt_group(vec![unread(1, 0, 0, 10), unread(2, 3, 0, 10)], 40), vec![0, 3]);
        assert_eq!(prompt_group(Vec::new(), 256), Vec::<usize>::new());
        // A prompt with a snapshot mark ahead is read alone, in chunks that end there.
        let marked = Unread { mark_ahead: true, ..unread(2, 1, 0, 20) };
        assert_eq!(prompt_group(vec![unread(1, 0, 0, 10), marked], 256), vec![0]);
        assert_eq!(prompt_group(vec![Unread { seq: 0, ..marked }, unread(1, 0, 0, 10)], 256), vec![1]);
    }

    #[test]
    fn padded_prompts_sit_at_the_right_end_of_their_rows() {
        let p = padded_prompts(&[Some(&[5, 6][..]), None, Some(&[7, 8, 9][..])], 3, 99);
        assert_eq!(p.ids, vec![0, 5, 6, 0, 0, 0, 7, 8, 9]);
        assert_eq!(p.positions, vec![99, 0, 1, 99, 99, 99, 0, 1, 2]);
        assert_eq!(p.live, vec![0, 1, 1, 0, 0, 0, 1, 1, 1]);
    }
}
