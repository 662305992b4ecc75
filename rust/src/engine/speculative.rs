//! Speculative decoding. Before a decode step each decoding slot gets up to `k` draft tokens, by one of two
//! methods (`Method`): prompt lookup, where the host finds the context's last n-gram earlier in the context and
//! copies what followed it there (Transformers 5.18 `generation/candidate_generator.py`,
//! `PromptLookupCandidateGenerator`; vLLM's `v1/spec_decode/ngram_proposer.py`, whose
//! `prompt_lookup_min` / `prompt_lookup_max` / `num_speculative_tokens` these settings mirror); or Gemma 4's MTP
//! assistant, a small model that drafts on the device from the target's rings and last hidden state
//! (gemma4/assistant.rs, engine/drafter.rs; vLLM's `method: mtp`). The target
//! then reads each slot's last token and its drafts, `k + 1` positions, in one forward (a "verify
//! step"), and keeps the drafts its own choices agree with, then one token more: its choice after the
//! last kept draft. Position `j`'s choice is the one a plain step would make there (`Sampler::choose_ahead`):
//! the argmax for a greedy request; for a sampled one, the draw with the uniform number of that token's
//! index in the request's seeded stream (sampling.rs). So every token a slot gets is the one it would get
//! without speculation, token for token, greedy or seeded, up to float rounding: the verify forward computes
//! the same logits with other kernels (more rows), so a greedy near-tie or a draw whose uniform number lies
//! within that rounding of a CDF boundary can go the other way. For a sampled request this is rejection sampling
//! with a draft that is one token rather than a distribution (Leviathan et al., "Fast Inference from
//! Transformers via Speculative Decoding", 2023, with q one-hot at the draft): a draft is kept with
//! probability p(draft), and what is drawn follows the target's distribution p.
//!
//! On the device, per row of the bucket: `t` `[b, k + 1]` the choices; draft `j` is kept while
//! every draft up to it equals the target's choice before it and that choice is not one of the slot's
//! stop tokens (the slot would stop there: nothing after a stop token is written, as in a plain step,
//! slots.rs), and while the row has drafts (`offered`, at most the slot's room to its length limit
//! less one). With `a` drafts kept the row's tokens are `t[0..=a]`: `t[a]` is its next input and it
//! moves `a + 1` positions on.
//!
//! The rings: the verify step writes keys at the row's positions `p..=p + k`. A full ring holds a
//! position at its own entry, so a rejected position's key sits past the row's position, hidden by the
//! causal mask until the position is written again. A sliding ring holds only the window: writing
//! position `p + j` overwrites `p + j - ring`, which a later query may still need when `p + j` is
//! rejected. So the entries a verify step writes are saved before it and the rejected ones put back
//! after it (`KvCache::sliding_entries`, `put_back`): no rejected token stays in a ring, and the prefix
//! cache's histories and snapshots (taken at prompt ends) never see one. The ring must hold `k + 1`
//! distinct entries, so `k` is at most the sliding ring less one.
//!
//! A slot whose drafts keep failing is offered none for a while (`Backoff`).
//!
//! Penalties, grammars and log-probabilities hold under speculation as in a plain step. Position `j`'s
//! penalties count the drafts before it as generated (`Ahead::before`: where its choice matters those drafts
//! are the tokens the slot drew), and the kept tokens enter the histories after the step. A grammar-constrained
//! row's drafts are taken on the host by a look-ahead of its grammar (a clone of the request's matcher) before the
//! forward: the mask after each becomes the next position's, and the drafts end at the first the grammar refuses
//! (columns.rs). An assistant drafts under those masks, one draft at a time (each comes back to the host), so its
//! drafts follow the grammar; prompt-lookup drafts are cut. The matcher itself only ever takes the tokens the read
//! point hands it, so a rejected draft never advances it. Log-probabilities are those of each position's
//! distribution, one set a position (`column_logprobs`).
//!
//! Which steps speculate: those with at most `Speculative::max_batch` decoding slots, in a decode bucket no larger
//! than `Speculative::max_bucket` when one is set (from measured costs, engine/tuning.rs), of which some did not opt
//! out (`Request::speculate`; a slot that did is offered no drafts), run right after a read point (the drafts
//! need every slot's tokens on the host, and the host each slot's room), and where some slot has a draft (with
//! an assistant: some slot has room; a slot whose hidden state the drafter lacks is offered none). While a batch
//! can speculate, every turn ends in a read point. Where the engine compiles, a verify step's device work
//! (verify.rs) is captured and replayed per key as a plain step is (compiled.rs); drafting stays eager (an
//! assistant's drafts come back to the host one at a time under grammars), and neither has a CUDA graph.

use std::path::PathBuf;

use crate::engine::Engine;
use crate::engine::columns::Columns;
use crate::engine::compiled::StepParts;
use crate::engine::read_point::{Drawn, Verified};
use crate::engine::verify::{Checked, VerifyKey, verify};
use crate::error::{Error, Result};
use crate::gemma4::config::LayerType;
use crate::tensor::{DType, Tensor};

/// The most draft tokens a step may propose per slot.
pub const MAX_TOKENS: i64 = 16;

/// Verify steps in a row that keep none of a slot's drafts before it waits (`Backoff`).
const MISSES: u32 = 2;
/// The longest wait, in steps.
const MAX_WAIT: u32 = 64;

/// When a slot is offered drafts. A verify step whose drafts all fail costs about two plain steps on a CPU at
/// batch 1 (README, "Speculative decoding"), so a slot whose drafts keep failing stops being offered any for a
/// while: after `MISSES` verify steps in a row that kept none of its drafts, its next offer comes 2 steps later
/// (one step without), after each further such verify step twice as late, up to `MAX_WAIT`; a verify step that
/// keeps a draft ends it. Which drafts are offered never changes a token, only the speed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Backoff {
    misses: u32,
    wait: u32,
}

impl Backoff {
    /// After a verify step that offered the slot `offered` drafts, of which it kept `kept`.
    pub fn after(&mut self, offered: usize, kept: usize) {
        if offered == 0 {
            return;
        }
        if kept > 0 {
            *self = Backoff::default();
            return;
        }
        self.misses += 1;
        if self.misses >= MISSES {
            self.wait = (2u32 << (self.misses - MISSES).min(5)).min(MAX_WAIT);
        }
    }

    /// Whether the slot is offered drafts at this step; a step it waits out counts.
    pub fn offer(&mut self) -> bool {
        self.wait = self.wait.saturating_sub(1);
        self.wait == 0
    }
}

/// Where drafts come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Method {
    /// Prompt lookup (`propose`), on the host.
    Ngram,
    /// The MTP assistant drafter in this directory (gemma4/assistant.rs, engine/drafter.rs), on the device.
    Mtp(PathBuf),
}

/// Speculative decoding (`Settings::speculative`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Speculative {
    pub method: Method,
    /// Draft tokens proposed per slot and step (`num_speculative_tokens`).
    pub tokens: i64,
    /// The shortest and longest n-gram looked up (`prompt_lookup_min`, `prompt_lookup_max`).
    pub lookup_min: i64,
    pub lookup_max: i64,
    /// Above this many decoding slots a step does not speculate.
    pub max_batch: i64,
    /// Set from measured step costs (engine/tuning.rs): no step of a decode bucket above it speculates.
    pub max_bucket: Option<i64>,
}

impl Speculative {
    /// From the binding's arguments: None with neither a method nor a token count nor a model; the settings
    /// are checked with the engine's (`check`).
    pub fn from_args(
        method: Option<&str>,
        tokens: Option<i64>,
        (lookup_min, lookup_max): (i64, i64),
        max_batch: i64,
        model: Option<PathBuf>,
    ) -> Result<Option<Speculative>> {
        let method = match (method, model) {
            (None, None) if tokens.is_none() => return Ok(None),
            (Some("ngram"), None) => Method::Ngram,
            (Some("mtp"), Some(dir)) => Method::Mtp(dir),
            (Some("ngram"), Some(_)) => {
                return Err(Error::Input(
                    "speculative_model is the drafter of speculative_method \"mtp\"; \"ngram\" takes none".into(),
                ));
            }
            (Some("mtp"), None) => {
                return Err(Error::Input(
                    "speculative_method \"mtp\" needs speculative_model (the assistant drafter's directory)".into(),
                ));
            }
            (None, Some(_)) => {
                return Err(Error::Input("speculative_model needs speculative_method \"mtp\"".into()));
            }
            (None, None) => {
                return Err(Error::Input(
                    "num_speculative_tokens needs a speculative_method (\"ngram\" or \"mtp\")".into(),
                ));
            }
            (Some(other), _) => {
                return Err(Error::Input(format!(
                    "speculative_method must be \"ngram\" (prompt lookup) or \"mtp\" (an assistant drafter), got {other:?}"
                )));
            }
        };
        let tokens = tokens.ok_or_else(|| {
            Error::Input(format!("speculative_method {:?} needs num_speculative_tokens", method_name(&method)))
        })?;
        Ok(Some(Speculative { method, tokens, lookup_min, lookup_max, max_batch, max_bucket: None }))
    }

    /// "ngram" or "mtp".
    pub fn method_name(&self) -> &'static str {
        method_name(&self.method)
    }

    /// The settings by the names the binding takes them under.
    pub fn named(&self) -> [(&'static str, i64); 4] {
        [
            ("num_speculative_tokens", self.tokens),
            ("prompt_lookup_min", self.lookup_min),
            ("prompt_lookup_max", self.lookup_max),
            ("speculative_max_batch", self.max_batch),
        ]
    }

    pub(super) fn check(&self) -> Result<()> {
        let s = self;
        if !(1..=MAX_TOKENS).contains(&s.tokens) {
            return Err(Error::Input(format!("num_speculative_tokens must be in 1..={MAX_TOKENS}, got {}", s.tokens)));
        }
        if s.lookup_min < 1 || s.lookup_max < s.lookup_min {
            return Err(Error::Input(format!(
                "prompt_lookup_min must be >= 1 and prompt_lookup_max >= prompt_lookup_min, got {} and {}",
                s.lookup_min, s.lookup_max
            )));
        }
        if s.max_batch < 1 {
            return Err(Error::Input(format!("speculative_max_batch must be >= 1, got {}", s.max_batch)));
        }
        Ok(())
    }
}

fn method_name(method: &Method) -> &'static str {
    match method {
        Method::Ngram => "ngram",
        Method::Mtp(_) => "mtp",
    }
}

/// Up to `k` tokens that followed the earliest earlier occurrence of the context's last n tokens, for
/// the largest n in `min_n..=max_n` that occurs (Transformers' `PromptLookupCandidateGenerator`: the
/// longest n-gram first, its first match in the context). Empty when none occurs or `k` is 0.
pub fn propose(context: &[i64], k: usize, min_n: usize, max_n: usize) -> Vec<i64> {
    let len = context.len();
    if k == 0 {
        return Vec::new();
    }
    for n in (min_n.max(1)..=max_n.min(len.saturating_sub(1))).rev() {
        let tail = &context[len - n..];
        // A match must end before the context's end, so that at least one token follows it.
        if let Some(start) = (0..len - n).find(|&i| &context[i..i + n] == tail) {
            let from = start + n;
            return context[from..(from + k).min(len)].to_vec();
        }
    }
    Vec::new()
}

/// The drafts of one verify step, on the host.
pub(super) struct Drafts {
    /// Draft columns per row.
    k: i64,
    /// `[b, k]` draft ids (0 past a row's drafts), then `[b]` drafts per row: one upload.
    packed: Vec<i64>,
    /// Drafts per row.
    offered: Vec<usize>,
}

impl Drafts {
    /// `k` columns a row: row `i`'s drafts `found[i]` (none past `found`'s rows: token 0, which engine/tuning.rs
    /// offers to time a verify step), `offered[i]` of them offered.
    pub(super) fn pack(k: i64, found: &[Vec<i64>], offered: Vec<usize>) -> Drafts {
        let mut packed = vec![0; offered.len() * k as usize];
        for (row, f) in found.iter().enumerate() {
            packed[row * k as usize..][..f.len()].copy_from_slice(f);
        }
        packed.extend(offered.iter().map(|n| *n as i64));
        Drafts { k, packed, offered }
    }
}

impl Engine {
    /// Whether a decode step of `rows` may speculate (module docs), the drafts aside.
    pub(super) fn speculates(&self, rows: &[Option<usize>]) -> bool {
        let Some(spec) = &self.speculative else { return false };
        let decoding = rows.iter().flatten().count() as i64;
        let willing = rows.iter().flatten().any(|s| self.slots.get(*s).is_some_and(|slot| slot.request.speculate));
        let bucket = rows.len() as i64;
        willing && decoding <= spec.max_batch && spec.max_bucket.is_none_or(|top| bucket <= top)
    }

    /// Draft columns a verify step has: `spec.tokens`, at most the sliding ring less one (the ring must hold the
    /// step's k + 1 positions apart, module docs).
    pub(super) fn draft_columns(&self, spec: &Speculative) -> i64 {
        spec.tokens.min(self.cache.ring(LayerType::Sliding) - 1)
    }

    /// The drafts for a decode step of bucket `b`, when it speculates and some slot has one.
    pub(super) fn drafts(&mut self, b: i64, rows: &[Option<usize>]) -> Option<Drafts> {
        let spec = self.speculative.as_ref()?;
        if self.stepped || !self.drawn.is_empty() || !self.speculates(rows) {
            return None;
        }
        let k = self.draft_columns(spec);
        if k < 1 {
            return None;
        }
        let mut found = vec![Vec::new(); b as usize];
        let mut offered = vec![0; b as usize];
        let mut room_anywhere = false;
        for (row, s) in rows.iter().enumerate() {
            let Some(s) = *s else { continue };
            let waits = !self.slots.get_mut(s).ok()?.backoff.offer();
            let slot = self.slots.get(s)?;
            let offer = slot.request.speculate && !waits;
            // The last token drawn is the step's input; drafts may reach the length limit, not pass it.
            let room = slot.limit.saturating_sub(slot.drawn()).saturating_sub(1).min(k as usize) * usize::from(offer);
            room_anywhere |= room > 0;
            offered[row] = match &self.drafter {
                // Drafted on the device; a slot without its current state gets it recorded (drafter.rs).
                Some(d) => room * usize::from(d.ready(s, slot.request.id)),
                None => {
                    let context: Vec<i64> = slot.request.prompt.iter().chain(&slot.output).copied().collect();
                    found[row] = propose(&context, room, spec.lookup_min as usize, spec.lookup_max as usize);
                    found[row].len()
                }
            };
        }
        let none = offered.iter().all(|n| *n == 0);
        let k = match (none, self.drafter.is_some() && room_anywhere) {
            (false, _) => k,
            // A step that only records the drafter's states reads one position a row (drafter.rs).
            (true, true) => 0,
            (true, false) => return None,
        };
        Some(Drafts::pack(k, &found, offered))
    }

    /// A verify step of slots `0..b` with `drafts` (module docs): the drafts, offers and grammar masks made
    /// ready (`checked`), then its device work (verify.rs), captured and replayed per key where the engine
    /// compiles; an assistant keeps the hidden states of the positions kept.
    pub(super) fn verify_step(&mut self, b: i64, rows: &[Option<usize>], drafts: Drafts) -> Result<()> {
        let k = drafts.k;
        let padded = rows.iter().any(|r| r.is_none());
        let stages = self.sampler.stages(0, b);
        let key = VerifyKey { b, k, padded, stages, hidden: self.drafter.is_some() };
        let mut columns =
            stages.grammar.then(|| Columns::new(&self.sampler, &self.slots, rows, k, drafts.offered.clone()));
        let checked = self.checked(b, &drafts, columns.as_mut())?;
        let Engine { model, cache, sampler, slots, compiled, context, .. } = self;
        let verdict = match compiled.as_mut().filter(|c| c.replays(b)) {
            Some(c) => c.verify(key, StepParts { model, cache, sampler, slots }, checked, *context)?,
            None => verify(model, cache, sampler, slots, &checked, key, *context)?,
        };
        if let (Some(d), Some(hidden)) = (&mut self.drafter, &verdict.hidden) {
            let requests: Vec<_> =
                rows.iter().map(|s| s.and_then(|s| Some((s, self.slots.get(s)?.request.id)))).collect();
            d.keep(&self.model, hidden, &verdict.kept, k, &requests)?;
        }
        let offered = columns.map_or(drafts.offered, |c| c.offered);
        let verified = Verified { width: (k + 1) as usize, offered };
        self.drawn.push(Drawn { chosen: verdict.chosen, rows: rows.to_vec(), verified: Some(verified) });
        self.stepped = true;
        Ok(())
    }

    /// A verify step's inputs on the device: the drafts (looked up on the host, or drafted by the assistant under
    /// each constrained row's grammar), the drafts each row is offered (a constrained row's cut where its grammar
    /// refuses one: `columns`), and each position's masks.
    fn checked(&mut self, b: i64, drafts: &Drafts, mut columns: Option<&mut Columns>) -> Result<Checked> {
        let k = drafts.k;
        let up = Tensor::from_i64(&drafts.packed)?.to_like(&self.like, DType::I64)?;
        let (looked_up, offered) = (up.narrow(0, 0, b * k)?.reshape(&[b, k])?, up.narrow(0, b * k, b)?);
        let draft = match &self.drafter {
            Some(d) if k > 0 => {
                let v = self.slots.views(b)?;
                let (sampler, like) = (&self.sampler, &self.like);
                // Each draft of a constrained row under its grammar's mask after the drafts before it.
                let mut mask = |j: i64, before: Option<&Tensor>| -> Result<Option<Tensor>> {
                    let Some(c) = columns.as_deref_mut() else { return Ok(None) };
                    if let Some(before) = before {
                        c.take(j as usize - 1, &before.to_vec_i64()?);
                    }
                    Ok(Some(sampler.mask_values(&c.mask(j as usize, like)?)?))
                };
                let draft = d.draft(&self.model, &mut self.cache, v, k, &mut mask)?;
                if let Some(c) = columns.as_deref_mut() {
                    c.take(k as usize - 1, &draft.narrow(1, k - 1, 1)?.reshape(&[b])?.to_vec_i64()?);
                }
                draft
            }
            _ => {
                if let Some(c) = columns.as_deref_mut() {
                    c.take_all(&drafts.packed[..(b * k) as usize]);
                }
                looked_up
            }
        };
        Ok(match columns {
            None => Checked { draft, offered, masks: None },
            Some(c) => {
                let cut: Vec<i64> = c.offered.iter().map(|n| *n as i64).collect();
                let offered = Tensor::from_i64(&cut)?.to_like(&self.like, DType::I64)?;
                Checked { draft, offered, masks: Some(c.masks(&self.like)?) }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gemma4::cache::{self, held_before_rows};

    #[test]
    fn the_longest_ngram_first_and_its_first_match() {
        // "5 6" occurs at 1 and 4; the 3-gram "4 5 6" only at 3.
        let ctx = [9, 5, 6, 4, 5, 6, 7, 4, 5, 6];
        assert_eq!(propose(&ctx, 3, 1, 3), vec![7, 4, 5]);
        assert_eq!(propose(&ctx, 3, 1, 2), vec![4, 5, 6]);
        // What follows the match stops at the context's end.
        assert_eq!(propose(&[1, 2, 1], 5, 1, 1), vec![2, 1]);
        assert_eq!(propose(&ctx, 0, 1, 3), Vec::<i64>::new());
        assert_eq!(propose(&[1, 2, 3], 4, 1, 3), Vec::<i64>::new());
        assert_eq!(propose(&[7], 4, 1, 3), Vec::<i64>::new());
        // Below min_n nothing is looked up.
        assert_eq!(propose(&[1, 2, 3, 2], 2, 2, 3), Vec::<i64>::new());
    }

    #[test]
    fn a_slot_whose_drafts_keep_failing_waits_longer_each_time_until_one_is_kept() {
        let mut b = Backoff::default();
        let offers = |b: &mut Backoff, n: usize| (0..n).map(|_| b.offer()).collect::<Vec<_>>();
        b.after(4, 0);
        assert_eq!(offers(&mut b, 2), [true, true], "one miss: no wait");
        b.after(0, 0); // a step that offered nothing changes nothing
        b.after(4, 0);
        assert_eq!(offers(&mut b, 2), [false, true], "two in a row: 2 steps, this one's included");
        b.after(3, 0);
        assert_eq!(offers(&mut b, 4), [false, false, false, true]);
        for _ in 0..10 {
            b.after(3, 0);
        }
        assert_eq!(offers(&mut b, MAX_WAIT as usize).iter().filter(|o| !**o).count(), MAX_WAIT as usize - 1);
        b.after(4, 1);
        assert_eq!(b, Backoff::default());
    }

    #[test]
    fn held_before_on_the_device_is_the_host_table() {
        for ring in [1, 4, 12] {
            let starts: Vec<i64> = (0..30).collect();
            let got = held_before_rows(&Tensor::from_i64(&starts).unwrap(), ring).unwrap().to_vec_i64().unwrap();
            let want: Vec<i64> = starts.iter().flat_map(|s| cache::held_before(ring, *s)).collect();
            assert_eq!(got, want, "ring {ring}");
        }
    }

    #[test]
    fn settings_out_of_range_name_the_setting() {
        let ok = Speculative {
            method: Method::Ngram,
            tokens: 4,
            lookup_min: 1,
            lookup_max: 3,
            max_batch: 4,
            max_bucket: None,
        };
        assert!(ok.check().is_ok());
        let bad = [
            (Speculative { tokens: 0, ..ok.clone() }, "num_speculative_tokens"),
            (Speculative { tokens: MAX_TOKENS + 1, ..ok.clone() }, "num_speculative_tokens"),
            (Speculative { lookup_min: 4, ..ok.clone() }, "prompt_lookup_max"),
            (Speculative { max_batch: 0, ..ok.clone() }, "speculative_max_batch"),
        ];
        for (s, name) in bad {
            assert!(s.check().unwrap_err().to_string().contains(name), "{s:?}");
        }
    }
}
