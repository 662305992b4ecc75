//! `Attention` and the per-forward `Plan` that says which ring entries a forward writes and which
//! keys each query may see (Transformers 5.18 `models/gemma4/modeling_gemma4.py`,
//! `Gemma4TextAttention`).
//!
//! q = rope(q_norm(q_proj(x))), k = rope(k_norm(k_proj(x))), v = v_norm(v_proj(x)) (no scale; on a K=V
//! layer, `attention_k_eq_v`'s full layers, v = v_norm(k_proj(x)): there is no v_proj), the
//! three projections one matrix product whose output is split into heads-first views (in a
//! one-token forward, views of a buffer made once: scratch.rs); in float32 the three norms are one
//! weightless norm and one multiply by the heads' weights (`QkvNorms`); scores use scaling 1.0 (the
//! q/k norms replace 1/sqrt(d)), softmax in float32 inside SDPA, GQA maps query head h to KV head
//! h / (heads / kv_heads). In 16 bits on the CPU with at most 16 query rows a sequence (decode steps),
//! the shim computes the same in float32 with two matrix products and a softmax instead of ATen's
//! flash kernel, which is several times slower there (aten.cpp `few_row_attention`). KV-shared layers
//! have no k/v projections: they read the keys and values their donor layer (`LayerSpec::kv_source`,
//! computed from the config) attended to in the same forward.
//!
//! Masks (Transformers 5.18 `masking_utils.py`, `causal_mask_function` and
//! `sliding_window_overlay`): full layers see key j iff j <= i; sliding layers iff i - W < j <= i.
//! Over a ring that holds the forward's own keys the mask is `entry <= query` (cache.rs module
//! docs); over a chunk it compares positions. `Source` says which
//! keys a forward reads: a later chunk of T > 1 prompt tokens on a sliding layer attends over the
//! ring as it was plus the chunk itself (so a chunk longer than the window still sees exactly the
//! right keys), and then leaves its last min(T, ring) keys in the ring.

use crate::error::{Error, Result};
use crate::gemma4::cache::{KvCache, Rows, held_before};
use crate::gemma4::config::{Config, LayerSpec, LayerType};
use crate::gemma4::linear::Linear;
use crate::gemma4::norm::RmsNorm;
use crate::gemma4::parallel::Split;
use crate::gemma4::rope::{Rope, RopeAt};
use crate::gemma4::scratch::Scratch;
use crate::gemma4::weights::{Slice, Weights};
use crate::tensor::{DType, Tensor};

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
    /// `[rows, 1, T]`: the shape of a write's ring entries.
    pub grid3: Tensor,
    /// `[rows, 1, T, 1]`: the query side of a mask.
    pub query: Tensor,
    /// For one row reading a later prompt chunk: the positions its sliding ring holds before the chunk
    /// (`cache::held_before`), int64 `[1, ring + 1]`.
    pub held: Option<Tensor>,
}

impl Positions {
    /// From `grid` (int64 `[rows, T]`); a decode step keeps its `Positions` (views) from step to step.
    pub fn new(grid: &Tensor) -> Result<Positions> {
        let [rows, t] = dims2(grid)?;
        Ok(Positions {
            rows,
            t,
            flat: grid.reshape(&[rows * t])?,
            grid3: grid.reshape(&[rows, 1, t])?,
            query: grid.reshape(&[rows, 1, t, 1])?,
            grid: grid.shallow_clone()?,
            held: None,
        })
    }

    /// Positions `start..end` of one row, on the device of `like`, whose sliding rings hold `ring`
    /// entries.
    pub fn chunk(start: i64, end: i64, ring: i64, like: &Tensor) -> Result<Positions> {
        let grid = Tensor::arange(start, end, DType::I64, like)?.unsqueeze(0)?;
        let held = if start > 0 {
            Some(Tensor::from_i64(&held_before(ring, start))?.to_like(like, DType::I64)?.reshape(&[1, ring + 1])?)
        } else {
            None
        };
        Ok(Positions { held, ..Positions::new(&grid)? })
    }
}

/// Where a forward writes its keys into the rings of one layer type.
pub struct Writes {
    pub source: Source,
    /// Ring entries to write, int64 `[rows, 1, tail]`, for the last `tail` tokens of the forward.
    pub entries: Tensor,
    pub tail: i64,
}

/// The tokens of a forward that are real. `Padding(live)` (bool `[rows, 1, 1]` for whole rows, or
/// `[rows, 1, T]` per token) marks the rest, which write to the never-visible entry `ring` (see
/// cache.rs).
pub enum Liveness {
    AllLive,
    Padding(Tensor),
}

impl Writes {
    /// The writes of a forward of `pos` on layers of `kind`, whose rings hold `ring` entries.
    pub fn new(kind: LayerType, pos: &Positions, fill: Fill, ring: i64, live: &Liveness) -> Result<Writes> {
        let t = pos.t;
        let source = match fill {
            Fill::Empty => Source::Chunk,
            Fill::Partial if kind == LayerType::Sliding && t > 1 => Source::RingAndChunk,
            Fill::Partial => Source::Ring,
        };
        let tail = if source == Source::Ring { t } else { t.min(ring) };
        let tail_pos = if tail == t { pos.grid3.shallow_clone()? } else { pos.grid3.narrow(2, t - tail, tail)? };
        // A full ring holds the whole context, so a position is its own entry.
        let wrap = |p: &Tensor| if kind == LayerType::Full { p.shallow_clone() } else { p.remainder(ring) };
        let entries = match live {
            Liveness::AllLive => wrap(&tail_pos)?,
            Liveness::Padding(live) => {
                let per_token = live.size()?[2];
                let live =
                    if per_token > tail { live.narrow(2, per_token - tail, tail)? } else { live.shallow_clone()? };
                Tensor::where_int(&live, &wrap(&tail_pos)?, ring)?
            }
        };
        Ok(Writes { source, entries, tail })
    }
}

/// How one layer type reads and writes the cache during one forward.
pub struct Plan {
    pub rope: RopeAt,
    /// bool `[rows, 1, T, keys]`: true where the query may see the key.
    pub mask: Tensor,
    pub writes: Writes,
}

impl Plan {
    /// Plan a forward of `pos` for layers of `kind`, whose rings are `cache`'s. Computing it writes
    /// nothing. `blocks` (int64 `[rows, T]`, model.rs `Injection::blocks`) lets a sliding layer's
    /// queries see later keys of their own block (`bidirectional`).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        kind: LayerType,
        pos: &Positions,
        fill: Fill,
        cache: &KvCache,
        live: &Liveness,
        rope: &Rope,
        window: i64,
        blocks: Option<&Tensor>,
    ) -> Result<Plan> {
        let writes = Writes::new(kind, pos, fill, cache.ring(kind), live)?;
        let sliding = (kind == LayerType::Sliding).then_some(window);
        let keys = |keys: &Tensor| -> Result<Tensor> {
            let [r, n] = dims2(keys)?;
            keys.reshape(&[r, 1, 1, n])
        };
        let mask = match writes.source {
            // The ring after this forward's writes: a constant order (cache.rs module docs).
            Source::Ring => visible(cache.ring_order(kind), &pos.query, None)?,
            Source::Chunk => visible(&keys(&pos.grid)?, &pos.query, sliding)?,
            Source::RingAndChunk => {
                let held =
                    pos.held.as_ref().ok_or_else(|| Error::Internal("a later prompt chunk of unknown start".into()))?;
                visible(&keys(&Tensor::cat(&[held, &pos.grid], 1)?)?, &pos.query, sliding)?
            }
        };
        let mask = match (blocks, sliding, writes.source) {
            (Some(b), Some(w), Source::Chunk | Source::RingAndChunk) => {
                let ring_keys = mask.size()?[3] - pos.t;
                bidirectional(&mask, b, &pos.grid, ring_keys, w)?
            }
            _ => mask,
        };
        Ok(Plan { rope: rope.at(pos)?, mask, writes })
    }
}

impl Plan {
    /// A plan that writes nothing and reads keys by `mask`: an assistant drafter's layers, which attend to the
    /// target's rings (gemma4/assistant.rs). Only KV-shared layers may run under it.
    pub fn reading(rope: RopeAt, mask: Tensor) -> Result<Plan> {
        let entries = Tensor::full(&[0], 0.0, DType::I64, &mask)?;
        Ok(Plan { rope, mask, writes: Writes { source: Source::Ring, entries, tail: 0 } })
    }
}

/// bool `[rows, 1, T, keys]`: key position `k[r, 0, 0, j]` is visible to query position
/// `q[r, 0, i, 0]`: `j <= i`, and with a window `W`, `i - W < j`. Empty entries hold `EMPTY`, later
/// than any query.
fn visible(k: &Tensor, q: &Tensor, window: Option<i64>) -> Result<Tensor> {
    let keep = k.le(q)?;
    match window {
        Some(w) => keep.logical_and(&k.gt(&q.add_int(-w)?)?),
        None => Ok(keep),
    }
}

/// `mask` (`[rows, 1, T, ring_keys + T]`, the ring's keys first) with each query also seeing the later
/// keys of its own block among the forward's: Transformers' sliding mask with a blockwise overlay,
/// `(j <= i or block(i) == block(j) >= 0) and i - W < j` (masking_utils.py `blockwise_overlay`,
/// `sliding_window_overlay`; modeling_gemma4.py `create_masks_for_vision_model`). A block never spans
/// chunks (engine/media.rs `chunk_end`), so the ring's keys gain nothing.
fn bidirectional(mask: &Tensor, blocks: &Tensor, grid: &Tensor, ring_keys: i64, window: i64) -> Result<Tensor> {
    let [rows, t] = dims2(blocks)?;
    let (bq, bk) = (blocks.reshape(&[rows, 1, t, 1])?, blocks.reshape(&[rows, 1, 1, t])?);
    let same = bq.le(&bk)?.logical_and(&bk.le(&bq)?)?.logical_and(&bq.gt_scalar(-0.5)?)?;
    let (q, k) = (grid.reshape(&[rows, 1, t, 1])?, grid.reshape(&[rows, 1, 1, t])?);
    let chunk = same.logical_and(&k.gt(&q.add_int(-window)?)?)?;
    let chunk = if ring_keys > 0 {
        let none = Tensor::full(&[rows, 1, t, ring_keys], 0.0, DType::Bool, blocks)?;
        Tensor::cat(&[&none, &chunk], 3)?
    } else {
        chunk
    };
    mask.logical_or(&chunk)
}

/// The keys and values in `layer`'s ring for `rows`, `[rows, kv_heads, ring + 1, d]` (views).
fn ring(cache: &KvCache, layer: usize, rows: Rows) -> Result<(Tensor, Tensor)> {
    let (k, v) = cache.kv(layer, rows)?.ok_or_else(|| Error::Internal(format!("layer {layer} has no ring")))?;
    Ok((k.shallow_clone()?, v.shallow_clone()?))
}

fn dims2(t: &Tensor) -> Result<[i64; 2]> {
    match t.size()?[..] {
        [a, b] => Ok([a, b]),
        ref other => Err(Error::Internal(format!("expected a 2-d tensor, got shape {other:?}"))),
    }
}

/// How a layer that computes its own keys normalizes q, k and v (its q/k/v heads are one tensor).
enum QkvNorms {
    /// q_norm, k_norm and v_norm, one call each: in 16-bit dtypes each rounds its product with the
    /// weight once, as the reference does.
    Separate { k_norm: RmsNorm, v_norm: RmsNorm },
    /// float32 (`Weights::folds`): one weightless norm over every head, then every head's weight in
    /// one multiply by `weight` (`[heads + 2 * kv_heads, 1, d]`: q_norm's weight for the query heads,
    /// k_norm's for the key heads, ones for the value heads, which v_norm leaves unscaled). The norm
    /// kernel multiplies by its weight after normalizing, in float32, so the values are the same.
    Joint { weight: Tensor, eps: f64 },
}

pub struct Attention {
    /// q_proj, or (on layers with their own keys) q_proj, k_proj and v_proj stacked: one product.
    proj: Linear,
    q_norm: RmsNorm,
    /// None on KV-shared layers.
    kv: Option<QkvNorms>,
    /// The layer whose keys a KV-shared layer reads.
    donor: Option<usize>,
    /// Row-parallel: this rank's query heads' input columns; `split` sums the ranks' outputs.
    o_proj: Linear,
    split: Split,
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
    /// This rank's heads (parallel.rs): its query heads and the KV heads they read (q/k/v
    /// column-parallel), and o_proj's columns for those query heads (row-parallel).
    pub fn load(w: &Weights, cfg: &Config, spec: &LayerSpec, prefix: &str, split: &Split) -> Result<Attention> {
        let tp = split.tp;
        let (h, d, all_heads, all_kv) = (cfg.hidden_size, spec.head_dim, cfg.num_heads, spec.num_kv_heads);
        let (nh, (kv0, nkv)) = (all_heads / tp.size, tp.kv_heads(all_heads, all_kv));
        let eps = cfg.rms_norm_eps;
        let name = |n: &str| format!("{prefix}.{n}");
        let (q, k, v) = (name("q_proj"), name("k_proj"), name("v_proj"));
        // Shared layers' k/v tensors, which some checkpoints ship, are never read
        // (modeling_gemma4.py, Gemma4TextAttention: `is_kv_shared_layer`).
        // K=V layers (LayerSpec::values_from_keys) stack k_proj twice: the value heads are the key
        // projection's raw output, which v_norm then normalizes as it would v_proj's.
        let v = if spec.values_from_keys { k.clone() } else { v };
        let q_rows = tp.rows(all_heads * d);
        let kv_rows = if tp.size == 1 { Slice::All } else { Slice::Rows(kv0 * d, nkv * d) };
        let (proj, kv) = match spec.kv_source {
            Some(_) => (w.linear_slice(&q, all_heads * d, h, q_rows)?, None),
            None => {
                let parts = [(q.as_str(), all_heads * d, q_rows), (&k, all_kv * d, kv_rows), (&v, all_kv * d, kv_rows)];
                (w.fused_slices(&parts, h)?, Some(()))
            }
        };
        let q_weight = w.vector(&name("q_norm.weight"), &[d], w.dtype)?;
        let q_norm = RmsNorm::new(q_weight.shallow_clone()?, eps);
        let kv = match kv {
            None => None,
            Some(()) if w.folds() => {
                let kw = w.vector(&name("k_norm.weight"), &[d], w.dtype)?;
                let (qw, kw) = (q_weight.reshape(&[1, 1, d])?, kw.reshape(&[1, 1, d])?);
                let ones = Tensor::full(&[1, 1, d], 1.0, w.dtype, &qw)?;
                let per_head = [(&qw, nh), (&kw, nkv), (&ones, nkv)];
                let heads: Vec<&Tensor> = per_head.iter().flat_map(|(t, n)| (0..*n).map(move |_| *t)).collect();
                Some(QkvNorms::Joint { weight: Tensor::cat(&heads, 0)?, eps })
            }
            Some(()) => Some(QkvNorms::Separate {
                k_norm: RmsNorm::load(w, &name("k_norm"), d, eps)?,
                v_norm: RmsNorm::no_scale(eps),
            }),
        };
        Ok(Attention {
            proj,
            q_norm,
            kv,
            donor: spec.kv_source,
            o_proj: w.linear_slice(&name("o_proj"), h, all_heads * d, tp.cols(all_heads * d))?,
            split: split.clone(),
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: d,
        })
    }

    /// `x` `[rows * T, hidden]` → `[rows * T, hidden]`, for layer `layer` over the slots `rows`.
    /// `scratch` (one-token forwards) takes the projections' outputs (scratch.rs).
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        x: &Tensor,
        plan: &Plan,
        layer: usize,
        rows: Rows,
        cache: &mut KvCache,
        attended: &mut Attended,
        scratch: Option<&mut Scratch>,
    ) -> Result<Tensor> {
        let (n, d) = (rows.len, self.head_dim);
        let t = x.size()?[0] / n;
        let (nh, nkv) = (self.num_heads, self.num_kv_heads);
        let (q, k_all, v_all) = match (&self.kv, self.donor, scratch) {
            (Some(norms), _, Some(scratch)) if plan.writes.source == Source::Ring => {
                let q = self.step_qkv(x, norms, plan, layer, rows, cache, scratch)?;
                let (k, v) = ring(cache, layer, rows)?;
                attended[layer] = Some((k.shallow_clone()?, v.shallow_clone()?));
                (q, k, v)
            }
            (Some(norms), _, _) => {
                let y = heads_first(&self.proj.forward(x)?, n, t, nh + 2 * nkv, d)?;
                let [q, k, v] = match norms {
                    QkvNorms::Separate { k_norm, v_norm } => {
                        self.separate(plan, k_norm, v_norm, &y.split_array(&[nh, nkv, nkv], 1)?)?
                    }
                    QkvNorms::Joint { weight, eps } => {
                        let [qk, v] = y.rms_norm(None, *eps)?.mul(weight)?.split_array(&[nh + nkv, nkv], 1)?;
                        let [q, k] = plan.rope.apply(&qk)?.split_array(&[nh, nkv], 1)?;
                        [q, k, v]
                    }
                };
                let (k_all, v_all) = self.attend_to(plan, layer, rows, cache, &k, &v)?;
                attended[layer] = Some((k_all.shallow_clone()?, v_all.shallow_clone()?));
                (q, k_all, v_all)
            }
            (None, Some(donor), scratch) => {
                let (k, v) = attended.get(donor).and_then(|e| e.as_ref()).ok_or_else(|| {
                    Error::Internal(format!("KV-shared layer {layer} ran before its donor layer {donor}"))
                })?;
                let q = match scratch {
                    Some(scratch) => {
                        let b = scratch
                            .get("attention.q", &[n, nh, d], &[n, nh * d], |w| Ok(vec![w.reshape(&[n, nh, 1, d])?]))?;
                        self.proj.forward_into(x, &b.whole)?;
                        b.views[0].shallow_clone()?
                    }
                    None => heads_first(&self.proj.forward(x)?, n, t, nh, d)?,
                };
                (self.query(plan, &q)?, k.shallow_clone()?, v.shallow_clone()?)
            }
            (None, None, _) => return Err(Error::Internal(format!("layer {layer} has neither K/V nor a donor"))),
        };
        let out = Tensor::sdpa(&q, &k_all, &v_all, &plan.mask, 1.0)?; // [rows, heads, T, d]
        let out = if t == 1 { out.reshape(&[n, nh * d])? } else { out.transpose(1, 2)?.reshape(&[n * t, nh * d])? };
        self.split.sum(self.o_proj.forward(&out)?)
    }

    /// A one-token forward's q/k/v on a layer with its own keys, through `scratch`: writes the keys
    /// and values into the ring and returns the queries, `[rows, heads, 1, d]`.
    #[allow(clippy::too_many_arguments)]
    fn step_qkv(
        &self,
        x: &Tensor,
        norms: &QkvNorms,
        plan: &Plan,
        layer: usize,
        rows: Rows,
        cache: &mut KvCache,
        scratch: &mut Scratch,
    ) -> Result<Tensor> {
        let (n, d, nh, nkv) = (rows.len, self.head_dim, self.num_heads, self.num_kv_heads);
        let h = nh + 2 * nkv;
        // Views: every head, then the query, key and value heads.
        let proj = scratch.get("attention.qkv", &[n, nh, nkv, d], &[n, h * d], |w| {
            let heads = w.reshape(&[n, h, 1, d])?;
            let [q, k, v] = heads.split_array(&[nh, nkv, nkv], 1)?;
            Ok(vec![heads, q, k, v])
        })?;
        self.proj.forward_into(x, &proj.whole)?;
        let entries = &plan.writes.entries;
        match norms {
            QkvNorms::Separate { k_norm, v_norm } => {
                let [q, k, v] =
                    self.separate(plan, k_norm, v_norm, &[&proj.views[1], &proj.views[2], &proj.views[3]])?;
                cache.write(layer, rows, entries, &k, &v)?;
                Ok(q)
            }
            QkvNorms::Joint { weight, eps } => {
                // Views: the query and key heads (RoPE), the query heads, the key and value heads.
                let heads = scratch.get("attention.heads", &[n, nh, nkv, d], &[n, h, 1, d], |w| {
                    Ok(vec![w.narrow(1, 0, nh + nkv)?, w.narrow(1, 0, nh)?, w.narrow(1, nh, 2 * nkv)?])
                })?;
                proj.views[0].rms_norm(None, *eps)?.mul_into(weight, &heads.whole)?;
                plan.rope.apply_into(&heads.views[0], &heads.views[0])?;
                cache.write_both(layer, rows, entries, &heads.views[2])?;
                heads.views[1].shallow_clone()
            }
        }
    }

    /// `QkvNorms::Separate`: rope(q_norm(q)), rope(k_norm(k)), v_norm(v) for heads `[rows, heads, T, d]`.
    fn separate<T: std::borrow::Borrow<Tensor>>(
        &self,
        plan: &Plan,
        k_norm: &RmsNorm,
        v_norm: &RmsNorm,
        [q, k, v]: &[T; 3],
    ) -> Result<[Tensor; 3]> {
        Ok([self.query(plan, q.borrow())?, plan.rope.apply(&k_norm.forward(k.borrow())?)?, v_norm.forward(v.borrow())?])
    }

    /// rope(q_norm(q)) for query heads `q` `[rows, heads, T, d]`.
    fn query(&self, plan: &Plan, q: &Tensor) -> Result<Tensor> {
        plan.rope.apply(&self.q_norm.forward(q)?)
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
        let w = &plan.writes;
        let tail = |x: &Tensor| if w.tail == t { x.shallow_clone() } else { x.narrow(2, t - w.tail, w.tail) };
        match w.source {
            Source::Ring => {
                cache.write(layer, rows, &w.entries, k, v)?;
                ring(cache, layer, rows)
            }
            Source::Chunk => {
                cache.write(layer, rows, &w.entries, &tail(k)?, &tail(v)?)?;
                Ok((k.shallow_clone()?, v.shallow_clone()?))
            }
            Source::RingAndChunk => {
                let (rk, rv) = ring(cache, layer, rows)?;
                // cat copies, so the ring can take the chunk's tail right after.
                let both = (Tensor::cat(&[&rk, k], 2)?, Tensor::cat(&[&rv, v], 2)?);
                cache.write(layer, rows, &w.entries, &tail(k)?, &tail(v)?)?;
                Ok(both)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gemma4::cache::EMPTY;

    fn mask(kind: LayerType, held: &[i64], query: i64, window: i64) -> Vec<i64> {
        let kpos = Tensor::from_i64(held).unwrap().reshape(&[1, 1, 1, held.len() as i64]).unwrap();
        let qpos = Tensor::from_i64(&[query]).unwrap().reshape(&[1, 1, 1, 1]).unwrap();
        let window = (kind == LayerType::Sliding).then_some(window);
        visible(&kpos, &qpos, window).unwrap().to_dtype(DType::I64).unwrap().to_vec_i64().unwrap()
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
