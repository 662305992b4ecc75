//! `Attention` and the per-forward `Plan` that says which ring entries a forward writes and which
//! keys each query may see (Transformers 5.18 `models/gemma4/modeling_gemma4.py`,
//! `Gemma4TextAttention`).
//!
//! q = rope(q_norm(q_proj(x))), k = rope(k_norm(k_proj(x))), v = v_norm(v_proj(x)) (no scale), the
//! three projections one matrix product whose output is split into heads-first views;
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
use crate::gemma4::cache::{EMPTY, KvCache, Rows};
use crate::gemma4::config::{Config, LayerSpec, LayerType};
use crate::gemma4::norm::RmsNorm;
use crate::gemma4::rope::{Rope, RopeAt};
use crate::gemma4::linear::Linear;
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

/// The positions of a forward's tokens, in the shapes its plans read.
pub struct Positions {
    pub rows: i64,
    pub t: i64,
    /// int64 `[rows, T]`.
    pub grid: Tensor,
    /// `[rows * T]`.
    pub flat: Tensor,
    /// `[rows, 1, T, 1]`: the query side of a mask.
    pub query: Tensor,
}

impl Positions {
    /// From `grid` (int64 `[rows, T]`); a decode step keeps its `Positions` (views) from step to step.
    pub fn new(grid: &Tensor) -> Result<Positions> {
        let [rows, t] = dims2(grid)?;
        Ok(Positions {
            rows,
            t,
            flat: grid.reshape(&[rows * t])?,
            query: grid.reshape(&[rows, 1, t, 1])?,
            grid: grid.shallow_clone()?,
        })
    }
}

/// How one layer type reads and writes the cache during one forward. Computing it writes nothing.
pub struct Plan {
    pub rope: RopeAt,
    /// bool `[rows, 1, T, keys]`: true where the query may see the key.
    pub mask: Tensor,
    pub source: Source,
    /// Ring entries to write, int64 `[rows, 1, tail]`, for the last `tail` tokens of the forward.
    pub entries: Tensor,
    pub tail: i64,
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
    /// Plan a forward of `pos` for layers of `kind`, whose rings of `ring` entries hold
    /// `ring_positions` (`[rows, ring + 1]`); `row_index` is `[rows, 1]` int64 `0..rows`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        kind: LayerType,
        pos: &Positions,
        fill: Fill,
        ring_positions: &Tensor,
        ring: i64,
        row_index: &Tensor,
        live: &Liveness,
        rope: &Rope,
        window: i64,
    ) -> Result<Plan> {
        let (rows, t) = (pos.rows, pos.t);
        let source = match fill {
            Fill::Empty => Source::Chunk,
            Fill::Partial if kind == LayerType::Sliding && t > 1 => Source::RingAndChunk,
            Fill::Partial => Source::Ring,
        };
        let tail = if source == Source::Ring { t } else { t.min(ring) };
        let tail_pos = if tail == t { pos.grid.shallow_clone()? } else { pos.grid.narrow(1, t - tail, tail)? };
        // A full ring holds the whole context, so a position is its own entry.
        let wrap = |p: &Tensor| if kind == LayerType::Full { p.shallow_clone() } else { p.remainder(ring) };
        let (entries, written) = match live {
            Liveness::AllLive => (wrap(&tail_pos)?, tail_pos),
            Liveness::Padding(live) => (
                Tensor::where_int(live, &wrap(&tail_pos)?, ring)?,
                Tensor::where_int(live, &tail_pos, EMPTY)?,
            ),
        };
        let positions_after = ring_positions.index_put(&[Some(row_index), Some(&entries)], &written)?;
        let keys = match source {
            Source::Ring => positions_after.shallow_clone()?,
            Source::Chunk => pos.grid.shallow_clone()?,
            Source::RingAndChunk => Tensor::cat(&[ring_positions, &pos.grid], 1)?,
        };
        Ok(Plan {
            rope: rope.at(pos)?,
            mask: visible(kind, &keys, &pos.query, window)?,
            source,
            entries: entries.reshape(&[rows, 1, tail])?,
            tail,
            positions_after,
        })
    }
}

/// bool `[rows, 1, T, keys]`: key position `kpos[r, j]` is visible to query position
/// `q[r, 0, i, 0]`: `j <= i`, and on sliding layers `i - W < j`. Empty entries hold `EMPTY`, later
/// than any query.
fn visible(kind: LayerType, kpos: &Tensor, q: &Tensor, window: i64) -> Result<Tensor> {
    let [rows, keys] = dims2(kpos)?;
    let k = kpos.reshape(&[rows, 1, 1, keys])?;
    let keep = k.le(q)?;
    if kind == LayerType::Sliding {
        return keep.logical_and(&k.gt(&q.add_int(-window)?)?);
    }
    Ok(keep)
}

fn dims2(t: &Tensor) -> Result<[i64; 2]> {
    match t.size()?[..] {
        [a, b] => Ok([a, b]),
        ref other => Err(Error::Internal(format!("expected a 2-d tensor, got shape {other:?}"))),
    }
}

/// The k/v half of a layer that computes its own keys.
struct KvNorms {
    k_norm: RmsNorm,
    v_norm: RmsNorm,
}

pub struct Attention {
    /// q_proj, or (on layers with their own keys) q_proj, k_proj and v_proj stacked: one product.
    proj: Linear,
    q_norm: RmsNorm,
    /// None on KV-shared layers.
    kv: Option<KvNorms>,
    /// The layer whose keys a KV-shared layer reads.
    donor: Option<usize>,
    o_proj: Linear,
    num_heads: i64,
    num_kv_heads: i64,
    head_dim: i64,
}

/// The keys and values each layer attended to in the current forward, by layer index; KV-shared
/// layers read their donor's entry.
pub type Attended = Vec<Option<(Tensor, Tensor)>>;

/// `y` `[rows * T, heads * d]` as `[rows, heads, T, d]` (a view when T is 1).
fn heads_first(y: &Tensor, rows: i64, t: i64, heads: i64, d: i64) -> Result<Tensor> {
    if t == 1 {
        return y.reshape(&[rows, heads, 1, d]);
    }
    y.reshape(&[rows, t, heads, d])?.transpose(1, 2)
}

impl Attention {
    pub fn load(w: &Weights, cfg: &Config, spec: &LayerSpec, prefix: &str) -> Result<Attention> {
        let (h, d, nh, nkv) = (cfg.hidden_size, spec.head_dim, cfg.num_heads, spec.num_kv_heads);
        let eps = cfg.rms_norm_eps;
        let name = |n: &str| format!("{prefix}.{n}");
        let (q, k, v) = (name("q_proj"), name("k_proj"), name("v_proj"));
        // Shared layers' k/v tensors, which some checkpoints ship, are never read
        // (modeling_gemma4.py, Gemma4TextAttention: `is_kv_shared_layer`).
        let (proj, kv) = match spec.kv_source {
            Some(_) => (w.linear(&q, nh * d, h)?, None),
            None => (
                w.fused(&[(&q, nh * d), (&k, nkv * d), (&v, nkv * d)], h)?,
                Some(KvNorms { k_norm: RmsNorm::load(w, &name("k_norm"), d, eps)?, v_norm: RmsNorm::no_scale(eps) }),
            ),
        };
        Ok(Attention {
            proj,
            q_norm: RmsNorm::load(w, &name("q_norm"), d, eps)?,
            kv,
            donor: spec.kv_source,
            o_proj: w.linear(&name("o_proj"), h, nh * d)?,
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: d,
        })
    }

    /// `x` `[rows * T, hidden]` → `[rows * T, hidden]`, for layer `layer` over the slots `rows`.
    pub fn forward(
        &self,
        x: &Tensor,
        plan: &Plan,
        layer: usize,
        rows: Rows,
        cache: &mut KvCache,
        attended: &mut Attended,
    ) -> Result<Tensor> {
        let (n, d) = (rows.len, self.head_dim);
        let t = x.size()?[0] / n;
        let (nh, nkv) = (self.num_heads, self.num_kv_heads);
        let (q, k_all, v_all) = match (&self.kv, self.donor) {
            (Some(kv), _) => {
                let y = heads_first(&self.proj.forward(x)?, n, t, nh + 2 * nkv, d)?;
                let [q, k, v] = <[Tensor; 3]>::try_from(y.split(&[nh, nkv, nkv], 1)?)
                    .map_err(|_| Error::Internal("split gave the wrong number of parts".into()))?;
                let k = plan.rope.apply(&kv.k_norm.forward(&k)?)?;
                let v = kv.v_norm.forward(&v)?;
                let (k_all, v_all) = self.attend_to(plan, layer, rows, cache, &k, &v)?;
                attended[layer] = Some((k_all.shallow_clone()?, v_all.shallow_clone()?));
                (q, k_all, v_all)
            }
            (None, Some(donor)) => {
                let (k, v) = attended.get(donor).and_then(|e| e.as_ref()).ok_or_else(|| {
                    Error::Internal(format!("KV-shared layer {layer} ran before its donor layer {donor}"))
                })?;
                (heads_first(&self.proj.forward(x)?, n, t, nh, d)?, k.shallow_clone()?, v.shallow_clone()?)
            }
            (None, None) => return Err(Error::Internal(format!("layer {layer} has neither K/V nor a donor"))),
        };
        let q = plan.rope.apply(&self.q_norm.forward(&q)?)?;
        let out = Tensor::sdpa(&q, &k_all, &v_all, &plan.mask, 1.0)?; // [rows, heads, T, d]
        let out = if t == 1 { out.reshape(&[n, nh * d])? } else { out.transpose(1, 2)?.reshape(&[n * t, nh * d])? };
        self.o_proj.forward(&out)
    }

    /// Store this forward's keys (`[rows, kv_heads, T, d]`) in the cache as the plan says, and
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
        let t = k.size()?[2];
        let tail = |x: &Tensor| if plan.tail == t { x.shallow_clone() } else { x.narrow(2, t - plan.tail, plan.tail) };
        let missing = || Error::Internal(format!("layer {layer} has no ring"));
        match plan.source {
            Source::Ring => {
                cache.write(layer, rows, &plan.entries, k, v)?;
                let (rk, rv) = cache.kv(layer, rows)?.ok_or_else(missing)?;
                Ok((rk.shallow_clone()?, rv.shallow_clone()?))
            }
            Source::Chunk => {
                cache.write(layer, rows, &plan.entries, &tail(k)?, &tail(v)?)?;
                Ok((k.shallow_clone()?, v.shallow_clone()?))
            }
            Source::RingAndChunk => {
                let (rk, rv) = cache.kv(layer, rows)?.ok_or_else(missing)?;
                // cat copies, so the ring can take the chunk's tail right after.
                let both = (Tensor::cat(&[rk, k], 2)?, Tensor::cat(&[rv, v], 2)?);
                cache.write(layer, rows, &plan.entries, &tail(k)?, &tail(v)?)?;
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
        let qpos = Tensor::from_i64(&[query]).unwrap().reshape(&[1, 1, 1, 1]).unwrap();
        visible(kind, &kpos, &qpos, window).unwrap().to_dtype(DType::I64).unwrap().to_vec_i64().unwrap()
    }

    #[test]
    fn a_wrapped_sliding_ring_shows_only_the_window_and_never_the_padding_entry() {
        // A 4-entry ring after position 9: entries hold 8, 9, 6, 7; the fifth is the padding entry.
        let held = [8, 9, 6, 7, EMPTY];
        assert_eq!(mask(LayerType::Sliding, &held, 9, 3), vec![1, 1, 0, 1, 0]);
        assert_eq!(mask(LayerType::Full, &held, 9, 3), vec![1, 1, 1, 1, 0]);
        // A query earlier than some keys (a chunk's first token) does not see the later ones.
        assert_eq!(mask(LayerType::Full, &held, 7, 3), vec![0, 0, 1, 1, 0]);
    }
}
