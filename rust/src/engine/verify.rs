//! The device work of a verify step (speculative.rs says what a verify step is): once its drafts, the drafts each
//! row is offered and its grammar masks are on the device, one forward of every row's last token and drafts
//! (`forward`), then its checks (`check`): the choice at each position, the drafts kept, the rejected positions put
//! back in the sliding rings, and every slot moved on by what it kept. What decides the forward's ATen calls is its
//! `VerifyForwardKey`, and the checks' its `VerifyKey` (that and the sampling stages); everything else they read
//! lives as long as the engine (`Checked` names the three inputs, `Forwarded` what the forward hands the checks,
//! which a compiled engine keeps in buffers of its own per forward key, compiled.rs), so each half is captured and
//! replayed per key as a decode step's are (compiled.rs), and verify steps that differ only in their stages share
//! the forward.

use crate::engine::compiled::{from_outputs, to_outputs};
use crate::engine::sampling::{Ahead, Chosen, Sampler, Stages};
use crate::engine::slots::Slots;
use crate::engine::step::{StepViews, stage_names};
use crate::error::{Error, Result};
use crate::gemma4::attention::{Fill, Liveness, Positions};
use crate::gemma4::cache::{KvCache, Rows, held_before_rows};
use crate::gemma4::config::LayerType;
use crate::gemma4::model::{Model, Output};
use crate::tensor::{DType, Tensor};

/// What decides the ATen calls of a verify step's checks (`check`), and with `forward` its forward's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct VerifyKey {
    /// The bucket: slots `0..b`.
    pub(super) b: i64,
    /// Draft columns a row.
    pub(super) k: i64,
    /// Some row of the bucket does not decode.
    pub(super) padded: bool,
    /// The sampling stages of the bucket's rows (grammar masks among them).
    pub(super) stages: Stages,
    /// An assistant drafts: the step returns every position's hidden state (drafter.rs).
    pub(super) hidden: bool,
}

impl VerifyKey {
    /// The key of this step's forward, which its sampling stages do not change.
    pub(super) fn forward(self) -> VerifyForwardKey {
        VerifyForwardKey { b: self.b, k: self.k, padded: self.padded, hidden: self.hidden }
    }
}

impl std::fmt::Display for VerifyKey {
    /// `verify b=2 k=5 greedy`, `verify b=4 k=3 padded draw+grammar hidden`: the name a verify step's captured checks
    /// go by in logs and `/v1/engine`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let padded = if self.padded { " padded" } else { "" };
        let hidden = if self.hidden { " hidden" } else { "" };
        write!(f, "verify b={} k={}{padded} {}{hidden}", self.b, self.k, stage_names(self.stages))
    }
}

/// What decides the ATen calls of a verify step's forward (`forward`): its bucket, draft columns, padding, and
/// whether it returns the hidden states. Verify steps that differ only in their sampling stages share it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct VerifyForwardKey {
    pub(super) b: i64,
    pub(super) k: i64,
    pub(super) padded: bool,
    pub(super) hidden: bool,
}

impl std::fmt::Display for VerifyForwardKey {
    /// `verify b=2 k=5 padded forward`, `verify b=1 k=3 hidden forward`: the name a captured verify forward goes by.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let padded = if self.padded { " padded" } else { "" };
        let hidden = if self.hidden { " hidden" } else { "" };
        write!(f, "verify b={} k={}{padded}{hidden} forward", self.b, self.k)
    }
}

/// A verify step's inputs on the device.
pub(super) struct Checked {
    /// int64 `[b, k]`: each row's drafts (0 past a row's drafts).
    pub(super) draft: Tensor,
    /// int64 `[b]`: the drafts each row is offered.
    pub(super) offered: Tensor,
    /// uint8 `[b, k + 1, mask_bytes]`: each position's grammar masks, where a row is constrained.
    pub(super) masks: Option<Tensor>,
}

/// What a verify step's forward hands its checks.
pub(super) struct Forwarded {
    /// `[b, k + 1, vocab]`: the logits at every row's last token and drafts.
    pub(super) logits: Tensor,
    /// The sliding rings' entries the forward wrote, as they were before it (`KvCache::sliding_entries`).
    pub(super) saved: Vec<Tensor>,
    /// With `VerifyForwardKey::hidden`: every position's hidden state `[b * (k + 1), hidden]`.
    pub(super) hidden: Option<Tensor>,
}

impl Forwarded {
    /// The tensors a captured forward returns: the logits, the saved entries, then the hidden states when kept.
    pub(super) fn outputs(&self) -> Result<Vec<Tensor>> {
        let mut out = vec![self.logits.shallow_clone()?];
        for t in self.saved.iter().chain(&self.hidden) {
            out.push(t.shallow_clone()?);
        }
        Ok(out)
    }

    /// `outputs` back, for a forward of `key`.
    pub(super) fn from_outputs(mut out: Vec<Tensor>, key: VerifyForwardKey) -> Result<Forwarded> {
        let hidden = if key.hidden { out.pop() } else { None };
        let saved = if out.is_empty() { Vec::new() } else { out.split_off(1) };
        match (out.pop(), hidden.is_some() == key.hidden) {
            (Some(logits), true) => Ok(Forwarded { logits, saved, hidden }),
            _ => Err(Error::Internal(format!("{key} returned too few tensors"))),
        }
    }
}

/// What a verify step's device work returns.
pub(super) struct Verdict {
    /// Tokens as the read point takes them (read_point.rs): `[b * (k + 2)]`, each row's count of tokens drawn
    /// then its `k + 1` choices; log-probabilities one set a column.
    pub(super) chosen: Chosen,
    /// int64 `[b]`: the drafts each row kept.
    pub(super) kept: Tensor,
    /// With `VerifyKey::hidden`: every position's hidden state `[b * (k + 1), hidden]` (the forward's).
    pub(super) hidden: Option<Tensor>,
}

impl Verdict {
    /// The tensors captured checks return: the choice's (compiled.rs `to_outputs`), then the drafts kept.
    pub(super) fn outputs(&self) -> Result<Vec<Tensor>> {
        let mut out = to_outputs(&self.chosen)?;
        out.push(self.kept.shallow_clone()?);
        Ok(out)
    }

    /// `outputs` back, for checks of `key`; the hidden states are the forward's.
    pub(super) fn from_outputs(mut out: Vec<Tensor>, key: VerifyKey) -> Result<Verdict> {
        let kept = out.pop().ok_or_else(|| Error::Internal(format!("{key} returned no tensors")))?;
        Ok(Verdict { chosen: from_outputs(out, key.stages.logprobs.is_some())?, kept, hidden: None })
    }
}

/// The device work of a verify step of `key` (module docs) over a context of `context` positions: its forward,
/// then its checks.
pub(super) fn verify(
    model: &mut Model,
    cache: &mut KvCache,
    sampler: &mut Sampler,
    slots: &mut Slots,
    inputs: &Checked,
    key: VerifyKey,
    context: i64,
) -> Result<Verdict> {
    let forwarded = forward(model, cache, slots, inputs, key.forward(), context)?;
    let verdict = check(cache, sampler, slots, inputs, &forwarded, key, context)?;
    Ok(Verdict { hidden: forwarded.hidden, ..verdict })
}

/// The first half of a verify step: the forward of every row's last token and drafts at their positions, writing
/// their keys and values into the cache, the sliding rings' entries it overwrites saved first.
pub(super) fn forward(
    model: &mut Model,
    cache: &mut KvCache,
    slots: &Slots,
    inputs: &Checked,
    key: VerifyForwardKey,
    context: i64,
) -> Result<Forwarded> {
    let VerifyForwardKey { b, k, padded, .. } = key;
    let v = slots.views(b)?;
    let (_, grid, entries) = columns(v, cache, k, context)?;
    let ids = Tensor::cat(&[&v.next.reshape(&[b, 1])?, &inputs.draft], 1)?.reshape(&[b * (k + 1)])?;
    let mut pos = Positions::new(&grid)?;
    pos.held = Some(held_before_rows(&v.positions, cache.ring(LayerType::Sliding))?);
    let live = if padded { Liveness::Padding(v.live3.shallow_clone()?) } else { Liveness::AllLive };
    let rows = Rows::first(b);
    cache.prepare(rows)?;
    let saved = cache.sliding_entries(rows, &entries)?;
    let hidden = model
        .forward(cache, rows, &ids, &pos, &live, Fill::Partial, Output::Hidden, None)?
        .ok_or_else(|| Error::Internal("a verify step returned no hidden states".into()))?;
    let logits = model.head(&hidden)?.reshape(&[b, k + 1, model.cfg.vocab_size])?;
    Ok(Forwarded { logits, saved, hidden: key.hidden.then_some(hidden) })
}

/// The second half of a verify step of `key`: the choice at each position from `forwarded`'s logits, the drafts
/// kept, the rejected positions' sliding-ring entries put back, and the sampler and slots moved on by what each
/// row kept.
pub(super) fn check(
    cache: &mut KvCache,
    sampler: &mut Sampler,
    slots: &mut Slots,
    inputs: &Checked,
    forwarded: &Forwarded,
    key: VerifyKey,
    context: i64,
) -> Result<Verdict> {
    let VerifyKey { b, k, padded, .. } = key;
    let Checked { draft, offered, masks } = inputs;
    let (t, kept, logprobs) = {
        let v = slots.views(b)?;
        let (cols, _, entries) = columns(v, cache, k, context)?;
        let columns = (0..=k)
            .map(|j| {
                let before = draft.narrow(1, 0, j)?;
                let mask = masks.as_ref().map(|m| m.narrow(1, j, 1)?.reshape(&[b, -1])).transpose()?;
                let ahead = Ahead { by: j, before: (j > 0).then_some(&before), masks: mask.as_ref() };
                let logits = forwarded.logits.narrow(1, j, 1)?.reshape(&[b, -1])?;
                sampler.choose_ahead(&logits, 0, b, &ahead)
            })
            .collect::<Result<Vec<_>>>()?;
        let picks = columns.iter().map(|c| c.tokens.reshape(&[b, 1])).collect::<Result<Vec<_>>>()?;
        let t = Tensor::cat(&picks.iter().collect::<Vec<_>>(), 1)?;
        let choices = t.narrow(1, 0, k)?;
        let agree = draft.eq(&choices)?.logical_and(&v.keep.gather(1, &choices)?)?;
        // Drafts kept: the length of the run of agreeing ones from the first, at most those offered.
        let broken = agree.lt_scalar(0.5)?.to_dtype(DType::I64)?.cumsum(1)?;
        let run = broken.lt_scalar(0.5)?.to_dtype(DType::I64)?.sum_dim(1)?;
        let kept = Tensor::where_(&run.lt(offered)?, &run, offered)?;
        let keep_cols = cols.le(&kept.reshape(&[b, 1])?)?.reshape(&[b, 1, k + 1, 1])?;
        cache.put_back(Rows::first(b), &entries, &forwarded.saved, &keep_cols)?;
        sampler.advance_verified(&t, &kept.add_int(1)?, 0, b, padded.then_some(&v.live))?;
        (t, kept, column_logprobs(&columns, b)?)
    };
    let next = t.gather(1, &kept.reshape(&[b, 1])?)?.reshape(&[b])?;
    slots.advance(b, &next, Some(&kept), padded)?;
    let tokens = Tensor::cat(&[&kept.add_int(1)?.reshape(&[b, 1])?, &t], 1)?.reshape(&[b * (k + 2)])?;
    Ok(Verdict { chosen: Chosen { tokens, logprobs }, kept, hidden: None })
}

/// A verify step's columns `0..=k` as `[1, k + 1]`, their positions in each row, `[b, k + 1]`, and the sliding-ring
/// entries those write, `[b, 1, k + 1]`. Padding rows may sit anywhere: their positions are kept inside the context
/// (their keys land in the never-visible entry, their outputs are dropped).
fn columns(v: &StepViews, cache: &KvCache, k: i64, context: i64) -> Result<(Tensor, Tensor, Tensor)> {
    let cols = Tensor::arange(0, k + 1, DType::I64, &v.positions)?.reshape(&[1, k + 1])?;
    let grid = v.positions.reshape(&[v.b, 1])?.add(&cols)?.clamp(0.0, (context - 1) as f64)?;
    let entries = grid.remainder(cache.ring(LayerType::Sliding))?.reshape(&[v.b, 1, k + 1])?;
    Ok((cols, grid, entries))
}

/// The log-probabilities of a verify step's columns (`Sampler::choose_ahead`, one `[b]`-row `Chosen` a column) as
/// one `Chosen`'s: row `r`'s column `j` at `r * (k + 1) + j`.
fn column_logprobs(columns: &[Chosen], b: i64) -> Result<Option<(Tensor, Tensor, Tensor)>> {
    let parts: Option<Vec<_>> = columns.iter().map(|c| c.logprobs.as_ref()).collect();
    let Some(parts) = parts else { return Ok(None) };
    let w = parts.len() as i64;
    let stack = |pick: &dyn Fn(&(Tensor, Tensor, Tensor)) -> &Tensor| -> Result<Tensor> {
        let each = parts.iter().map(|p| pick(p).unsqueeze(1)).collect::<Result<Vec<_>>>()?;
        let t = Tensor::cat(&each.iter().collect::<Vec<_>>(), 1)?;
        let top = t.size()?.get(2).copied();
        t.reshape(&top.map_or(vec![b * w], |n| vec![b * w, n]))
    };
    Ok(Some((stack(&|p| &p.0)?, stack(&|p| &p.1)?, stack(&|p| &p.2)?)))
}
