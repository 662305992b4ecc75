//! `Attention` and the per-forward `Plan` that says which ring entries a forward writes and which
//! keys each query may see (Transformers 5.18 `models/gemma4/modeling_gemma4.py`,
//! `Gemma4TextAttention`).
//!
//! q = rope(q_norm(q_proj(x))), k = rope(k_norm(k_proj(x))), v = v_norm(v_proj(x)) (no scale);
//! scores use scaling 1.0 (the q/k norms replace 1/sqrt(d)), softmax in float32 inside SDPA, GQA
//! maps query head h to KV head h / (heads / kv_heads). KV-shared layers have no k/v projections:
//! they read the keys and values their donor layer (`LayerSpec::kv_source`, computed from the
//! config) attended to in the same forward.
//!
//! Masks (Transformers 5.18 `masking_utils.py`, `causal_mask_function` and
//! `sliding_window_overlay`): full layers see key j iff j <= i; sliding layers iff i - W < j <= i,
//! computed from the ring's positions, one row of positions per sequence slot. `Source` says which
//! keys a forward reads: a later chunk of T > 1 prompt tokens on a sliding layer attends over the
//! ring as it was plus the chunk itself (so a chunk longer than the window still sees exactly the
//! right keys), and then leaves its last min(T, ring) keys in the ring.

use crate::error::{Error, Result};
use crate::gemma4::cache::{KvCache, Rows};
use crate::gemma4::config::{Config, LayerSpec, LayerType};
use crate::gemma4::norm::RmsNorm;
use crate::gemma4::rope::{Rope, RopeAt};
use crate::gemma4::weights::Weights;
use crate::tensor::Tensor;

/// What the slots of a forward held before it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Fill {
    /// Nothing: the first chunk of a prompt.
    Empty,
    /// Earlier tokens: later prompt chunks and decode steps.
    Partial,
}

/// Which keys a forward attends to.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Source {
    /// Write the new keys into the ring first, then attend over the whole ring (decode steps, and
    /// later prompt chunks on full layers, whose ring never wraps).
    Ring,
    /// Attend over `cat(ring, chunk)`, then leave the chunk's tail in the ring (later prompt chunks
    /// on sliding layers, where writing first could overwrite keys an earlier query of the same
    /// chunk still needs).
    RingAndChunk,
    /// The first chunk into empty slots: attend over the chunk alone, the same computation as an
    /// uncached reference forward; then fill the ring.
    Chunk,
}

/// How one layer type reads and writes the cache during one forward. Computing it writes nothing.
pub struct Plan {
    pub rope: RopeAt,
    /// bool `[rows, 1, T, keys]`: true where the query may see the key.
    pub mask: Tensor,
    pub source: Source,
    /// Ring entries to write, int64 `[rows, tail]`, for the last `tail` tokens of the forward.
    pub entries: Tensor,
    pub tail: i64,
    /// `[rows, 1]` int64 0..rows: the row half of the write index.
    pub row_index: Tensor,
    /// The ring positions once this forward is done, `[rows, ring + 1]`.
    pub positions_after: Tensor,
}

/// The rows of a forward whose tokens are real. `Padding(live)` (bool `[rows, 1]`) marks the rest,
/// which write to the never-visible entry `ring` (see cache.rs) and record no position.
pub enum Liveness {
    AllLive,
    Padding(Tensor),
}

impl Plan {
    /// Plan a forward of `pos` (`[rows, T]` int64 on the device) for layers of `kind`, whose
    /// rings of `ring` entries hold `ring_positions` (`[rows, ring + 1]`).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        kind: LayerType,
        pos: &Tensor,
        fill: Fill,
        ring_positions: &Tensor,
        ring: i64,
        row_index: &Tensor,
        live: &Liveness,
        rope: &Rope,
        window: i64,
    ) -> Result<Plan> {
        let [_, t] = dims2(pos)?;
        let source = match fill {
            Fill::Empty => Source::Chunk,
            Fill::Partial if kind == LayerType::Sliding && t > 1 => Source::RingAndChunk,
            Fill::Partial => Source::Ring,
        };
        let tail = if source == Source::Ring { t } else { t.min(ring) };
        let tail_pos = pos.narrow(1, t - tail, tail)?;
        let (entries, written) = match live {
            Liveness::AllLive => (tail_pos.remainder(ring)?, tail_pos.shallow_clone()?),
            Liveness::Padding(live) => (
                Tensor::where_int(live, &tail_pos.remainder(ring)?, ring)?,
                Tensor::where_int(live, &tail_pos, -1)?,
            ),
        };
        let positions_after = ring_positions.index_put(&[Some(row_index), Some(&entries)], &written)?;
        let keys = match source {
            Source::Ring => positions_after.shallow_clone()?,
            Source::Chunk => pos.shallow_clone()?,
            Source::RingAndChunk => Tensor::cat(&[ring_positions, pos], 1)?,
        };
        Ok(Plan {
            rope: rope.at(pos)?,
            mask: visible(kind, &keys, pos, window)?,
            source,
            entries,
            tail,
            row_index: row_index.shallow_clone()?,
            positions_after,
        })
    }
}

/// bool `[rows, 1, T, keys]`: key position `kpos[r, j]` is visible to query position `qpos[r, i]`.
fn visible(kind: LayerType, kpos: &Tensor, qpos: &Tensor, window: i64) -> Result<Tensor> {
    let k = kpos.unsqueeze(1)?; // [rows, 1, keys]
    let q = qpos.unsqueeze(2)?; // [rows, T, 1]
    let mut keep = k.ge_scalar(0.0)?.logical_and(&k.le(&q)?)?;
    if kind == LayerType::Sliding {
        keep = keep.logical_and(&k.gt(&q.add_int(-window)?)?)?;
    }
    keep.unsqueeze(1)
}

fn dims2(t: &Tensor) -> Result<[i64; 2]> {
    match t.size()?[..] {
        [a, b] => Ok([a, b]),
        ref other => Err(Error::Internal(format!("expected a 2-d tensor, got shape {other:?}"))),
    }
}

struct KvProj {
    k_proj: Tensor,
    v_proj: Tensor,
    k_norm: RmsNorm,
    v_norm: RmsNorm,
}

pub struct Attention {
    q_proj: Tensor,
    q_norm: RmsNorm,
    /// None on KV-shared layers.
    kv: Option<KvProj>,
    /// The layer whose keys a KV-shared layer reads.
    donor: Option<usize>,
    o_proj: Tensor,
    num_heads: i64,
    num_kv_heads: i64,
    head_dim: i64,
}

/// The keys and values each layer attended to in the current forward, by layer index; KV-shared
/// layers read their donor's entry.
pub type Attended = Vec<Option<(Tensor, Tensor)>>;

impl Attention {
    pub fn load(w: &Weights, cfg: &Config, spec: &LayerSpec, prefix: &str) -> Result<Attention> {
        let (h, d, nh, nkv) = (cfg.hidden_size, spec.head_dim, cfg.num_heads, spec.num_kv_heads);
        let eps = cfg.rms_norm_eps;
        // Shared layers' k/v tensors, which some checkpoints ship, are never read
        // (modeling_gemma4.py, Gemma4TextAttention: `is_kv_shared_layer`).
        let kv = match spec.kv_source {
            Some(_) => None,
            None => Some(KvProj {
                k_proj: w.linear(&format!("{prefix}.k_proj"), nkv * d, h)?,
                v_proj: w.linear(&format!("{prefix}.v_proj"), nkv * d, h)?,
                k_norm: RmsNorm::load(w, &format!("{prefix}.k_norm"), d, eps)?,
                v_norm: RmsNorm::no_scale(eps),
            }),
        };
        Ok(Attention {
            q_proj: w.linear(&format!("{prefix}.q_proj"), nh * d, h)?,
            q_norm: RmsNorm::load(w, &format!("{prefix}.q_norm"), d, eps)?,
            kv,
            donor: spec.kv_source,
            o_proj: w.linear(&format!("{prefix}.o_proj"), h, nh * d)?,
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: d,
        })
    }

    /// `x` `[rows, T, hidden]` → `[rows, T, hidden]`, for layer `layer` over the slots `rows`.
    pub fn forward(
        &self,
        x: &Tensor,
        plan: &Plan,
        layer: usize,
        rows: Rows,
        cache: &mut KvCache,
        attended: &mut Attended,
    ) -> Result<Tensor> {
        let [n, t, _] = x.size()?[..] else { return Err(Error::Internal("attention input must be 3-d".into())) };
        let q = x.linear(&self.q_proj)?.reshape(&[n, t, self.num_heads, self.head_dim])?;
        let q = plan.rope.apply(&self.q_norm.forward(&q)?)?.transpose(1, 2)?;

        let (k_all, v_all) = match (&self.kv, self.donor) {
            (Some(kv), _) => {
                let shape = [n, t, self.num_kv_heads, self.head_dim];
                let k = plan.rope.apply(&kv.k_norm.forward(&x.linear(&kv.k_proj)?.reshape(&shape)?)?)?;
                let v = kv.v_norm.forward(&x.linear(&kv.v_proj)?.reshape(&shape)?)?;
                let both = self.attend_to(plan, layer, rows, cache, &k, &v)?;
                attended[layer] = Some((both.0.shallow_clone()?, both.1.shallow_clone()?));
                both
            }
            (None, Some(donor)) => {
                let (k, v) = attended.get(donor).and_then(|e| e.as_ref()).ok_or_else(|| {
                    Error::Internal(format!("KV-shared layer {layer} ran before its donor layer {donor}"))
                })?;
                (k.shallow_clone()?, v.shallow_clone()?)
            }
            (None, None) => return Err(Error::Internal(format!("layer {layer} has neither K/V nor a donor"))),
        };

        let out = Tensor::sdpa(&q, &k_all, &v_all, &plan.mask, 1.0)?; // [rows, heads, T, d]
        out.transpose(1, 2)?.reshape(&[n, t, self.num_heads * self.head_dim])?.linear(&self.o_proj)
    }

    /// Store this forward's keys (`[rows, T, kv_heads, d]`) in the cache as the plan says, and
    /// return the keys and values to attend over, `[rows, kv_heads, keys, d]`.
    fn attend_to(
        &self,
        plan: &Plan,
        layer: usize,
        rows: Rows,
        cache: &mut KvCache,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let t = k.size()?[1];
        let tail = |x: &Tensor| x.narrow(1, t - plan.tail, plan.tail);
        let missing = || Error::Internal(format!("layer {layer} has no ring"));
        match plan.source {
            Source::Ring => {
                cache.write(layer, rows, &plan.row_index, &plan.entries, k, v)?;
                cache.kv(layer, rows)?.ok_or_else(missing)
            }
            Source::Chunk => {
                cache.write(layer, rows, &plan.row_index, &plan.entries, &tail(k)?, &tail(v)?)?;
                Ok((k.transpose(1, 2)?, v.transpose(1, 2)?))
            }
            Source::RingAndChunk => {
                let (rk, rv) = cache.kv(layer, rows)?.ok_or_else(missing)?;
                // cat copies, so the ring can take the chunk's tail right after.
                let both = (Tensor::cat(&[&rk, &k.transpose(1, 2)?], 2)?, Tensor::cat(&[&rv, &v.transpose(1, 2)?], 2)?);
                cache.write(layer, rows, &plan.row_index, &plan.entries, &tail(k)?, &tail(v)?)?;
                Ok(both)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DType;

    fn mask(kind: LayerType, held: &[i64], query: i64, window: i64) -> Vec<i64> {
        let kpos = Tensor::from_i64(held).unwrap().reshape(&[1, held.len() as i64]).unwrap();
        let qpos = Tensor::from_i64(&[query]).unwrap().reshape(&[1, 1]).unwrap();
        visible(kind, &kpos, &qpos, window).unwrap().to_dtype(DType::I64).unwrap().to_vec_i64().unwrap()
    }

    #[test]
    fn a_wrapped_sliding_ring_shows_only_the_window_and_never_the_padding_entry() {
        // A 4-entry ring after position 9: entries hold 8, 9, 6, 7; the fifth is the padding entry.
        let held = [8, 9, 6, 7, -1];
        assert_eq!(mask(LayerType::Sliding, &held, 9, 3), vec![1, 1, 0, 1, 0]);
        assert_eq!(mask(LayerType::Full, &held, 9, 3), vec![1, 1, 1, 1, 0]);
        // A query earlier than some keys (a chunk's first token) does not see the later ones.
        assert_eq!(mask(LayerType::Full, &held, 7, 3), vec![0, 0, 1, 1, 0]);
    }
}
