//! The decode step: one forward of the slots `0..b` at their positions, the choice of each row's
//! next token, and the moves of each slot's next token, position and sampling state, all on the
//! device. `b` is a bucket (`buckets`), so a device sees a few fixed shapes; on CUDA each shape is
//! captured once as a CUDA graph and replayed (`Graphs`).

use std::collections::{HashMap, HashSet};

use crate::engine::sampling::{Chosen, Sampler, Stages};
use crate::engine::slots::Slots;
use crate::error::{Error, Result};
use crate::gemma4::attention::{Fill, Liveness, Positions};
use crate::gemma4::cache::{KvCache, Rows};
use crate::gemma4::model::{Model, Output};
use crate::tensor::{CudaGraph, Tensor};

/// The decode-step batch sizes: powers of two below `max_batch`, and `max_batch`.
pub fn buckets(max_batch: i64) -> Vec<i64> {
    let mut b: Vec<i64> = std::iter::successors(Some(1i64), |x| Some(x * 2)).take_while(|x| *x < max_batch).collect();
    b.push(max_batch);
    b
}

/// What decides the ATen calls of a decode step: its bucket, whether it may have padding rows, and
/// the sampling stages its rows need. Everything else a step reads is on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct StepKey {
    pub(super) b: i64,
    /// Some row of the bucket may not decode: a free slot, one still reading its prompt, or one that
    /// stopped on the device since the last read point (slots.rs), which the host cannot see.
    pub(super) padded: bool,
    pub(super) stages: Stages,
}

impl StepKey {
    /// The key of this step's forward, which its sampling stages do not change.
    pub(super) fn forward(self) -> ForwardKey {
        ForwardKey { b: self.b, padded: self.padded }
    }
}

/// What decides the ATen calls of a decode step's forward (`forward`): its bucket and whether it may have
/// padding rows. Steps that differ only in their sampling stages share it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct ForwardKey {
    pub(super) b: i64,
    pub(super) padded: bool,
}

impl std::fmt::Display for ForwardKey {
    /// `decode b=4 padded forward`: the name a captured forward goes by in logs and `/v1/engine`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let padded = if self.padded { " padded" } else { "" };
        write!(f, "decode b={}{padded} forward", self.b)
    }
}

impl std::fmt::Display for StepKey {
    /// `decode b=4 padded greedy`, `decode b=1 draw+grammar+logprobs20`: the name a step's captured
    /// choice (compiled.rs) goes by in logs and `/v1/engine`, and its CUDA graph's in fallbacks.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let padded = if self.padded { " padded" } else { "" };
        write!(f, "decode b={}{padded} {}", self.b, stage_names(self.stages))
    }
}

/// The stages a step runs joined by `+` (`draw+grammar+logprobs20`), `greedy` for none: part of a captured
/// step's name.
pub(super) fn stage_names(s: Stages) -> String {
    let mut parts: Vec<String> = [
        (s.bias, "bias"),
        (s.repetition, "repetition"),
        (s.presence_frequency, "presence_frequency"),
        (s.draw, "draw"),
        (s.grammar, "grammar"),
    ]
    .iter()
    .filter(|(on, _)| *on)
    .map(|(_, name)| name.to_string())
    .collect();
    parts.extend(s.logprobs.map(|k| format!("logprobs{k}")));
    if parts.is_empty() { "greedy".to_string() } else { parts.join("+") }
}

/// A decode step's inputs for slots `0..b`: views of the slots' device tensors (`Slots`).
pub(super) struct StepViews {
    /// The bucket: slots `0..b`.
    pub(super) b: i64,
    pub(super) next: Tensor,
    pub(super) positions: Tensor,
    /// `positions` as a forward reads them.
    pub(super) pos: Positions,
    pub(super) live: Tensor,
    /// `live` as `[b, 1, 1]`.
    pub(super) live3: Tensor,
    /// `live` as `[b, 1]`.
    pub(super) live2: Tensor,
    /// The slots' stop tables, `[b, vocab]`.
    pub(super) keep: Tensor,
}

impl StepViews {
    pub(super) fn new(b: i64, next: &Tensor, positions: &Tensor, live: &Tensor, keep: &Tensor) -> Result<StepViews> {
        let positions = positions.narrow(0, 0, b)?;
        let live = live.narrow(0, 0, b)?;
        Ok(StepViews {
            b,
            next: next.narrow(0, 0, b)?,
            pos: Positions::new(&positions.unsqueeze(1)?)?,
            positions,
            live3: live.reshape(&[b, 1, 1])?,
            live2: live.reshape(&[b, 1])?,
            live,
            keep: keep.narrow(0, 0, b)?,
        })
    }
}

/// The device work of one decode step of slots `0..key.b`: the forward (`forward`), the choice, and the
/// moves of each slot's next token, position and sampling state (`choose`). Returns what it chose.
pub(super) fn step(
    model: &mut Model,
    cache: &mut KvCache,
    sampler: &mut Sampler,
    slots: &mut Slots,
    key: StepKey,
) -> Result<Chosen> {
    let logits = forward(model, cache, slots, key.forward())?;
    choose(sampler, slots, &logits, key)
}

/// The first half of a decode step: the forward of slots `0..key.b` at their positions, writing each
/// row's keys and values into the cache. Returns the logits, `[b, vocab]`.
pub(super) fn forward(model: &mut Model, cache: &mut KvCache, slots: &Slots, key: ForwardKey) -> Result<Tensor> {
    let v = slots.views(key.b)?;
    let live = if key.padded { Liveness::Padding(v.live3.shallow_clone()?) } else { Liveness::AllLive };
    model
        .forward(cache, Rows::first(key.b), &v.next, &v.pos, &live, Fill::Partial, Output::Logits, None)?
        .ok_or_else(|| Error::Internal("a decode step returned no logits".into()))
}

/// The second half of a decode step: each row's next token chosen from `logits` (`[b, vocab]`, the
/// forward's) by the stages of `key`, and the moves of each slot's next token, position and sampling
/// state. Returns what it chose.
pub(super) fn choose(sampler: &mut Sampler, slots: &mut Slots, logits: &Tensor, key: StepKey) -> Result<Chosen> {
    let b = key.b;
    let chosen = sampler.choose(logits, 0, b)?;
    // Only decoding rows move on; padding rows keep their position and sampling state.
    let live = if key.padded { Some(&slots.views(b)?.live) } else { None };
    sampler.advance(&chosen.tokens, 0, b, live)?;
    slots.advance(b, &chosen.tokens, None, key.padded)?;
    Ok(chosen)
}

/// CUDA graphs of the decode step, one per `StepKey`: a key's first step runs eagerly (the warm-up
/// that makes the cache's views and the libraries' workspaces), its second is captured and then
/// replayed, and later ones replay it. A step reads only tensors that live as long as the engine
/// (weights, the cache and its views, the step views, the sampler's tables) and host values fixed by
/// its key, so replaying it is the same computation as running it (torch.cuda.graph's contract,
/// PyTorch docs "CUDA Graphs"). Prompt chunks run eagerly.
#[derive(Default)]
pub(super) struct Graphs {
    seen: HashSet<StepKey>,
    captured: HashMap<StepKey, (CudaGraph, Chosen)>,
}

impl Graphs {
    /// The step of `key`, whose device work `eager` does: run, or captured on `like`'s device and
    /// replayed (then a copy of what it chose: the next replay overwrites the graph's outputs).
    /// Every step graph allocates from the first one's memory pool: they run one at a time, and
    /// each one's outputs are copied out right after its replay.
    pub(super) fn step(
        &mut self,
        key: StepKey,
        like: &Tensor,
        eager: impl FnOnce() -> Result<Chosen>,
    ) -> Result<Chosen> {
        if self.seen.insert(key) {
            return eager();
        }
        if !self.captured.contains_key(&key) {
            let share = self.captured.values().next().map(|(g, _)| g);
            let graph_and_out = CudaGraph::capture(like, share, eager)?;
            self.captured.insert(key, graph_and_out);
        }
        let (graph, out) = self.captured.get(&key).ok_or_else(|| Error::Internal("a captured step vanished".into()))?;
        graph.replay()?;
        out.copy()
    }

    /// Whether the next step of `key` is the one captured.
    pub(super) fn will_capture(&self, key: &StepKey) -> bool {
        self.seen.contains(key) && !self.captured.contains_key(key)
    }

    /// The graphs captured so far.
    pub(super) fn captured(&self) -> usize {
        self.captured.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_powers_of_two_below_max_batch_then_max_batch() {
        assert_eq!(buckets(1), vec![1]);
        assert_eq!(buckets(8), vec![1, 2, 4, 8]);
        assert_eq!(buckets(6), vec![1, 2, 4, 6]);
    }
}
