//! Compiled prompt chunks: one slot's prompt read a chunk at a time (`Engine::read_prompt`), captured
//! once per length bucket and fill and replayed, as compiled.rs does decode steps.
//!
//! An eager chunk is shaped by host values: its slot (which rows of the rings it narrows), its length,
//! its first position and what its sliding rings held before it. A compiled chunk makes each of them
//! either part of its key or a tensor its graph reads:
//! - length: a chunk of `n` tokens runs as one of `bucket(n)` columns (`buckets`), the ids
//!   right-aligned and the columns before them token 0 at position `context - 1`, not live: the left
//!   padding a grouped prompt read already uses (schedule.rs `padded_prompts`). No real query sees a
//!   padding key (its position is later than every prompt position), and a padding column writes its
//!   keys into the ring entry no query sees (cache.rs);
//! - ids, positions, liveness and the sliding ring's held positions (`cache::held_before`): written
//!   into one int64 buffer per bucket (`packed`) before each call, the buffer an input of the graph;
//! - slot: every compiled chunk runs on the cache's chunk row (`KvCache::chunk_row`, allocated when
//!   the engine has a compiler). A later chunk first copies its slot's rings there; every chunk copies
//!   the row back to its slot after it. Each copy moves one slot's rings (`Layout::kv_bytes_per_slot`
//!   less snapshots; not timed apart from the chunk here);
//! - whether it is the prompt's first chunk: the key's `later` (the first attends over the chunk
//!   alone, a later one over its rings too: attention.rs `Source`).
//!
//! A compiled chunk always returns the last column's logits (one row of the head; the eager path skips
//! it before the last chunk), so one graph serves every chunk of a bucket.
//!
//! Chunks that place media (their soft tokens are per request) or whose prompt log-probabilities are
//! asked for (every position's hidden state), and grouped reads of several slots' prompts (their
//! rectangle changes with every group), run as without a compiler.

use super::Engine;
use crate::error::{Error, Result};
use crate::gemma4::attention::{Fill, Liveness, Positions};
use crate::gemma4::cache::{KvCache, Rows, held_before};
use crate::gemma4::config::LayerType;
use crate::gemma4::model::{Model, Output};
use crate::tensor::{DType, Tensor};

/// The smallest chunk bucket: shorter chunks run padded to it.
const MIN_BUCKET: i64 = 16;

/// Chunk lengths a compiled chunk runs at: powers of two from `MIN_BUCKET` below `prefill_chunk`,
/// then `prefill_chunk` (the longest a chunk is).
pub fn buckets(prefill_chunk: i64) -> Vec<i64> {
    let mut b: Vec<i64> =
        std::iter::successors(Some(MIN_BUCKET), |x| Some(x * 2)).take_while(|x| *x < prefill_chunk).collect();
    b.push(prefill_chunk);
    b
}

/// The bucket a chunk of `n` tokens runs at.
fn bucket(n: i64, prefill_chunk: i64) -> i64 {
    buckets(prefill_chunk).into_iter().find(|b| *b >= n).unwrap_or(prefill_chunk)
}

/// What decides the ATen calls of a compiled chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ChunkKey {
    /// Columns (`buckets`).
    pub(crate) t: i64,
    /// Not the prompt's first chunk: it attends over its rings too.
    pub(crate) later: bool,
}

impl std::fmt::Display for ChunkKey {
    /// `prompt t=64 first`, `prompt t=256 later`: the name a captured chunk goes by in logs and `/v1/engine`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "prompt t={} {}", self.t, if self.later { "later" } else { "first" })
    }
}

/// A chunk's inputs on the host, `3 * t + ring + 1` values: the ids `ids` (positions `start..`) at the
/// right end of `t` columns, each column's position (`pad_pos` before the ids), 1 where a column is
/// live, then the positions a sliding ring of `ring` entries holds before `start`.
pub(super) fn packed(ids: &[i64], start: i64, t: i64, pad_pos: i64, ring: i64) -> Vec<i64> {
    let n = ids.len() as i64;
    let pad = (t - n).max(0) as usize;
    let mut out = Vec::with_capacity((3 * t + ring + 1) as usize);
    out.extend(std::iter::repeat_n(0, pad).chain(ids.iter().copied()));
    out.extend(std::iter::repeat_n(pad_pos, pad).chain(start..start + n));
    out.extend(std::iter::repeat_n(0, pad).chain(std::iter::repeat_n(1, n as usize)));
    out.extend(held_before(ring, start));
    out
}

impl Engine {
    /// The lengths compiled prompt chunks run at (`buckets`); none without a chunk row.
    pub fn chunk_buckets(&self) -> Vec<i64> {
        if self.cache.chunk_row().is_some() { buckets(self.prefill_chunk) } else { Vec::new() }
    }

    /// Whether slot's next chunk runs compiled: never one that places media or scores its prompt (module docs).
    pub(super) fn compiles_chunk(&self, media: bool, prompt_logprobs: bool) -> bool {
        !media && !prompt_logprobs && self.cache.chunk_row().is_some() && self.compiles()
    }

    /// Read positions `done..end` of `slot`'s prompt (`ids` on the host) as a compiled chunk; the logits
    /// `[1, vocab]` after its last position.
    pub(super) fn compiled_chunk(&mut self, slot: i64, ids: &[i64], done: usize, end: usize) -> Result<Tensor> {
        let row =
            self.cache.chunk_row().ok_or_else(|| Error::Internal("a compiled chunk without a chunk row".into()))?;
        let key = ChunkKey { t: bucket((end - done) as i64, self.prefill_chunk), later: done > 0 };
        let ring = self.cache.ring(LayerType::Sliding);
        let host = Tensor::from_i64(&packed(&ids[done..end], done as i64, key.t, self.context - 1, ring))?;
        let Engine { model, cache, compiled, like, .. } = self;
        let compiled =
            compiled.as_mut().ok_or_else(|| Error::Internal("a compiled chunk without a compiler".into()))?;
        let inputs = match compiled.chunk_inputs.get(&key.t) {
            Some(t) => t.shallow_clone()?,
            None => {
                let t = host.to_like(like, DType::I64)?;
                compiled.chunk_inputs.insert(key.t, t.shallow_clone()?);
                t
            }
        };
        inputs.copy_(&host)?;
        if key.later {
            cache.copy_rings(slot, row)?;
        }
        let out = compiled.chunk(key, || chunk_forward(model, cache, &inputs, key, ring, row))?;
        cache.copy_rings(row, slot)?;
        out.into_iter().next().ok_or_else(|| Error::Internal(format!("compiled {key} returned no logits")))
    }
}

/// The device work of a compiled chunk: the forward of `inputs` (`packed`) on the chunk row `row`.
fn chunk_forward(
    model: &mut Model,
    cache: &mut KvCache,
    inputs: &Tensor,
    key: ChunkKey,
    ring: i64,
    row: i64,
) -> Result<Vec<Tensor>> {
    let t = key.t;
    let ids = inputs.narrow(0, 0, t)?;
    let mut pos = Positions::new(&inputs.narrow(0, t, t)?.reshape(&[1, t])?)?;
    let live = Liveness::Padding(inputs.narrow(0, 2 * t, t)?.reshape(&[1, 1, t])?.to_dtype(DType::Bool)?);
    let fill = if key.later { Fill::Partial } else { Fill::Empty };
    if key.later {
        pos.held = Some(inputs.narrow(0, 3 * t, ring + 1)?.reshape(&[1, ring + 1])?);
    }
    let logits = model
        .forward(cache, Rows::one(row), &ids, &pos, &live, fill, Output::Logits, None)?
        .ok_or_else(|| Error::Internal("a prompt forward returned no logits".into()))?;
    Ok(vec![logits])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_buckets_are_powers_of_two_from_16_below_prefill_chunk_then_prefill_chunk() {
        assert_eq!(buckets(256), vec![16, 32, 64, 128, 256]);
        assert_eq!(buckets(100), vec![16, 32, 64, 100]);
        assert_eq!(buckets(8), vec![8]);
        assert_eq!(bucket(17, 256), 32);
        assert_eq!(bucket(3, 256), 16);
        assert_eq!(bucket(256, 256), 256);
    }

    #[test]
    fn a_packed_chunk_is_left_padded_and_carries_the_ring_it_follows() {
        let p = packed(&[7, 8, 9], 5, 4, 99, 4);
        assert_eq!(&p[..4], &[0, 7, 8, 9]);
        assert_eq!(&p[4..8], &[99, 5, 6, 7]);
        assert_eq!(&p[8..12], &[0, 1, 1, 1]);
        assert_eq!(&p[12..], held_before(4, 5).as_slice());
    }
}
