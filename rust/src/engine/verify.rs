//! The device work of a verify step (speculative.rs says what a verify step is): once its drafts, the drafts each
//! row is offered and its grammar masks are on the device, one forward of every row's last token and drafts, the
//! choice at each position, the drafts kept, the rejected positions put back in the sliding rings, and every slot
//! moved on by what it kept. What decides its ATen calls is its `VerifyKey`; everything else it reads lives as
//! long as the engine (`Checked` names the three inputs, which a compiled engine keeps in buffers of its own per
//! key, compiled.rs `Compiled::stage`), so it is captured and replayed per key as a decode step is (compiled.rs).

use crate::engine::compiled::{from_outputs, to_outputs};
use crate::engine::sampling::{Ahead, Chosen, Sampler, Stages};
use crate::engine::slots::Slots;
use crate::engine::step::stage_names;
use crate::error::{Error, Result};
use crate::gemma4::attention::{Fill, Liveness, Positions};
use crate::gemma4::cache::{KvCache, Rows, held_before_rows};
use crate::gemma4::config::LayerType;
use crate::gemma4::model::{Model, Output};
use crate::tensor::{DType, Tensor};

/// What decides the ATen calls of a verify step's device work.
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
    /// An assistant drafts: the step returns every position's hidden state and the drafts kept (drafter.rs).
    pub(super) hidden: bool,
}

impl std::fmt::Display for VerifyKey {
    /// `verify b=2 k=5 greedy`, `verify b=4 k=3 padded draw+grammar hidden`: the name a captured verify step goes
    /// by in logs and `/v1/engine`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let padded = if self.padded { " padded" } else { "" };
        let hidden = if self.hidden { " hidden" } else { "" };
        write!(f, "verify b={} k={}{padded} {}{hidden}", self.b, self.k, stage_names(self.stages))
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

/// What a verify step's device work returns.
pub(super) struct Verdict {
    /// Tokens as the read point takes them (read_point.rs): `[b * (k + 2)]`, each row's count of tokens drawn
    /// then its `k + 1` choices; log-probabilities one set a column.
    pub(super) chosen: Chosen,
    /// With `VerifyKey::hidden`: every position's hidden state `[b * (k + 1), hidden]` and the drafts kept `[b]`.
    pub(super) kept: Option<(Tensor, Tensor)>,
}

impl Verdict {
    /// The tensors a captured verify step returns: the choice's (compiled.rs `to_outputs`), then the hidden
    /// states and drafts kept when kept.
    pub(super) fn outputs(&self) -> Result<Vec<Tensor>> {
        let mut out = to_outputs(&self.chosen)?;
        if let Some((hidden, kept)) = &self.kept {
            out.extend([hidden.shallow_clone()?, kept.shallow_clone()?]);
        }
        Ok(out)
    }

    /// `outputs` back, for a step of `key`.
    pub(super) fn from_outputs(mut out: Vec<Tensor>, key: VerifyKey) -> Result<Verdict> {
        let kept = if key.hidden {
            let (kept, hidden) = (out.pop(), out.pop());
            Some(hidden.zip(kept).ok_or_else(|| Error::Internal(format!("{key} returned too few tensors")))?)
        } else {
            None
        };
        Ok(Verdict { chosen: from_outputs(out, key.stages.logprobs.is_some())?, kept })
    }
}

/// The device work of a verify step of `key` (module docs) over a context of `context` positions.
pub(super) fn verify(
    model: &mut Model,
    cache: &mut KvCache,
    sampler: &mut Sampler,
    slots: &mut Slots,
    inputs: &Checked,
    key: VerifyKey,
    context: i64,
) -> Result<Verdict> {
    let VerifyKey { b, k, padded, .. } = key;
    let Checked { draft, offered, masks } = inputs;
    let ring = cache.ring(LayerType::Sliding);
    let cols = Tensor::arange(0, k + 1, DType::I64, draft)?.reshape(&[1, k + 1])?;
    let (t, kept, hidden, logprobs) = {
        let v = slots.views(b)?;
        let ids = Tensor::cat(&[&v.next.reshape(&[b, 1])?, draft], 1)?.reshape(&[b * (k + 1)])?;
        // Padding rows may sit anywhere: keep their positions inside the context (their keys land in
        // the never-visible entry, their outputs are dropped).
        let grid = v.positions.reshape(&[b, 1])?.add(&cols)?.clamp(0.0, (context - 1) as f64)?;
        let mut pos = Positions::new(&grid)?;
        pos.held = Some(held_before_rows(&v.positions, ring)?);
        let live = if padded { Liveness::Padding(v.live3.shallow_clone()?) } else { Liveness::AllLive };
        let entries = grid.remainder(ring)?.reshape(&[b, 1, k + 1])?;
        let rows = Rows::first(b);
        cache.prepare(rows)?;
        let saved = cache.sliding_entries(rows, &entries)?;
        let hidden = model
            .forward(cache, rows, &ids, &pos, &live, Fill::Partial, Output::Hidden, None)?
            .ok_or_else(|| Error::Internal("a verify step returned no hidden states".into()))?;
        let vocab = model.cfg.vocab_size;
        let logits = model.head(&hidden)?.reshape(&[b, k + 1, vocab])?;
        let columns = (0..=k)
            .map(|j| {
                let before = draft.narrow(1, 0, j)?;
                let mask = masks.as_ref().map(|m| m.narrow(1, j, 1)?.reshape(&[b, -1])).transpose()?;
                let ahead = Ahead { by: j, before: (j > 0).then_some(&before), masks: mask.as_ref() };
                sampler.choose_ahead(&logits.narrow(1, j, 1)?.reshape(&[b, vocab])?, 0, b, &ahead)
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
        cache.put_back(rows, &entries, &saved, &keep_cols)?;
        sampler.advance_verified(&t, &kept.add_int(1)?, 0, b, padded.then_some(&v.live))?;
        (t, kept, hidden, column_logprobs(&columns, b)?)
    };
    let next = t.gather(1, &kept.reshape(&[b, 1])?)?.reshape(&[b])?;
    slots.advance(b, &next, Some(&kept), padded)?;
    let tokens = Tensor::cat(&[&kept.add_int(1)?.reshape(&[b, 1])?, &t], 1)?.reshape(&[b * (k + 2)])?;
    let kept = if key.hidden { Some((hidden, kept)) } else { None };
    Ok(Verdict { chosen: Chosen { tokens, logprobs }, kept })
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
