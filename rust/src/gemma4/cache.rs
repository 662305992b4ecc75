//! The KV cache: one fixed-shape ring per sequence slot and layer, written only through its own
//! methods.
//!
//! Layout: every layer that computes its own keys holds its keys and values in one tensor
//! `[max_batch, 2 * kv_heads, ring + 1, head_dim]` (the keys' heads, then the values'), so a step
//! whose keys and values sit side by side writes both in one call. `ring` is `context` for
//! full-attention layers and `min(sliding_window, context)` for sliding ones; KV-shared layers hold
//! nothing and read their
//! donor's keys (Transformers 5.18 `models/gemma4/modeling_gemma4.py`, `Gemma4TextAttention.forward`,
//! `kv_shared_layer_index`). The extra entry at index `ring` is never visible: a decode step's
//! padding rows (slots that are free or still reading their prompt) write their keys there, so a step
//! can run every slot below the highest live one without touching the rings of slots that are not
//! decoding.
//!
//! Which position an entry holds is a function of the row's position, so nothing tracks it: a row
//! at position `q` has written positions `0..=q` in order (a prompt chunk longer than the ring leaves
//! its last `ring` positions), so full-ring entry `j` holds position `j`, and sliding-ring entry `j`
//! the latest `p <= q` with `p = j (mod ring)`, which exists iff `j <= q` and then lies in
//! `(q - ring, q]`, inside the window since `ring <= sliding_window`. In both rings a query at `q`
//! that has just written its key may see entry `j` iff `j <= q`: the mask of a decode step (and of a
//! later prompt chunk on a full ring) is one comparison with `ring_order` (`0..ring`, then `EMPTY`
//! for the padding entry), a constant, whatever slot held before. `held_before` gives the positions a
//! sliding ring holds before a later prompt chunk, which attends over the ring and the chunk.
//!
//! Snapshots (prefix caching, engine/prefix.rs): with `snapshots` on, each slot also owns
//! `SNAPSHOTS` copies of its sliding rings, taken at chosen prompt positions (`snapshot`) and copied
//! back (`restore`) when a later request resumes there. A sliding ring only holds the last window, so
//! it can resume a read only where it stopped writing; a snapshot keeps the ring as it was at a
//! position a later request is likely to resume at. Full rings need none: they hold every position.
//! Every copy is a whole slot row of fixed shape (`copy_slot`, `snapshot`, `restore`), so no new
//! tensor shape appears per prompt length.
//!
//! Memory: `bytes_per_slot = sum over own-KV layers of 2 * kv_heads * (ring(type) + 1) * head_dim *
//! dtype bytes`, plus with snapshots `SNAPSHOTS * sum over own-KV sliding layers of 2 * kv_heads *
//! (ring + 1) * head_dim * dtype bytes`; the whole cache is `max_batch * bytes_per_slot`. Per-slot rings (rather than one
//! paged pool) keep every shape fixed and every slot's keys contiguous, which is what a compiled or
//! captured step wants; the price is that a slot reserves a full context whether its request uses it
//! or not.
//!
//! A forward works on `Rows`: a contiguous range of slots. Views of the tensors are narrowed to the
//! range once per range and kept, so writes through them land in the cache (ATen views share
//! storage) and a decode step makes no call to find its slots. The design of a cache
//! that owns its writes (`append` from a forward that takes `&mut`) is candle's
//! `candle-transformers/src/models/gemma3.rs`.

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::gemma4::config::{Config, LayerSpec, LayerType};
use crate::tensor::{DType, Tensor};

/// Snapshot rows per slot (engine/prefix.rs `Mark`): one at the request's marked boundary, one at
/// the end of its prompt.
pub const SNAPSHOTS: i64 = 2;

/// The position of an entry that holds nothing: later than any query, so the causal test
/// `key <= query` alone hides it.
pub const EMPTY: i64 = 1 << 60;

/// A contiguous range of sequence slots `[start, start + len)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rows {
    pub start: i64,
    pub len: i64,
}

impl Rows {
    pub fn one(slot: i64) -> Rows {
        Rows { start: slot, len: 1 }
    }
    pub fn first(len: i64) -> Rows {
        Rows { start: 0, len }
    }
}

/// One layer's keys and values, `[max_batch, 2 * kv_heads, ring + 1, head_dim]` (keys after
/// k_norm/RoPE, then values after v_norm), and int64 `0..kv_heads` and `0..2 * kv_heads` as
/// `[1, heads, 1]` (the head part of a write's index).
struct LayerKv {
    kv: Tensor,
    kind: LayerType,
    kv_heads: i64,
    heads: Tensor,
    heads2: Tensor,
}

/// One layer's keys, values and both, narrowed to a `Rows`.
struct RowsKv {
    k: Tensor,
    v: Tensor,
    kv: Tensor,
}

/// Views of the cache narrowed to one `Rows`, made once (`KvCache::prepare`), so a forward makes no
/// ATen call to find its slots.
struct RowsViews {
    /// Per layer (None for KV-shared layers).
    kv: Vec<Option<RowsKv>>,
    /// `0..len` as int64 `[len, 1, 1]`: the row part of a write's index.
    row_index3: Tensor,
}

pub struct KvCache {
    layers: Vec<Option<LayerKv>>,
    /// Per layer, for own-KV sliding layers when snapshots are on: `[max_batch * SNAPSHOTS, 2 *
    /// kv_heads, ring + 1, head_dim]`, slot `s`'s snapshot `m` at row `s * SNAPSHOTS + m`.
    snaps: Vec<Option<Tensor>>,
    /// Per layer type (`LayerType::index`): `0..ring`, then `EMPTY`, int64 `[1, 1, 1, ring + 1]`
    /// (module docs).
    ring_order: [Tensor; 2],
    ring: [i64; 2],
    views: HashMap<Rows, RowsViews>,
    /// Some(max_batch) when the rings have one row more than the slots: where a compiled prompt chunk runs
    /// (engine/chunks.rs), so its graph reads and writes one fixed row whichever slot it reads for.
    chunk_row: Option<i64>,
}
/// The cache geometry, computable before anything is allocated.
#[derive(Clone, Copy, Debug)]
pub struct CacheSize {
    /// Rings and snapshots of one slot.
    pub bytes_per_slot: i64,
    /// The snapshots' part of `bytes_per_slot` (0 without snapshots).
    pub snapshot_bytes_per_slot: i64,
    pub max_batch: i64,
    /// One more row of rings, without snapshots (`KvCache::chunk_row`).
    pub chunk_row: bool,
}

impl CacheSize {
    pub fn of(cfg: &Config, context: i64, max_batch: i64, dtype: DType, snapshots: bool, chunk_row: bool) -> CacheSize {
        let ring = ring_sizes(cfg, context);
        let bytes = |l: &LayerSpec| 2 * l.num_kv_heads * (ring[l.kind.index()] + 1) * l.head_dim * dtype.size();
        let own = || cfg.layers.iter().filter(|l| l.kv_source.is_none());
        let kv: i64 = own().map(bytes).sum();
        let sliding: i64 = own().filter(|l| l.kind == LayerType::Sliding).map(bytes).sum();
        let snaps = if snapshots { SNAPSHOTS * sliding } else { 0 };
        CacheSize { bytes_per_slot: kv + snaps, snapshot_bytes_per_slot: snaps, max_batch, chunk_row }
    }

    pub fn total(&self) -> i64 {
        self.bytes_per_slot * self.max_batch + self.chunk_row_bytes()
    }

    /// The chunk row's rings (0 without one).
    pub fn chunk_row_bytes(&self) -> i64 {
        if self.chunk_row { self.bytes_per_slot - self.snapshot_bytes_per_slot } else { 0 }
    }
}

/// Ring entries per layer type: sliding rings hold the window, full rings the context.
pub fn ring_sizes(cfg: &Config, context: i64) -> [i64; 2] {
    [cfg.sliding_window.min(context), context]
}

impl KvCache {
    /// The rings of `max_batch` slots, and their snapshots when `snapshots` (prefix caching); with
    /// `chunk_row` one more row of rings (`chunk_row`).
    pub fn new(
        cfg: &Config,
        context: i64,
        max_batch: i64,
        like: &Tensor,
        dtype: DType,
        snapshots: bool,
        chunk_row: bool,
    ) -> Result<KvCache> {
        let ring = ring_sizes(cfg, context);
        let rows = max_batch + i64::from(chunk_row);
        let layers = cfg
            .layers
            .iter()
            .map(|l| {
                if l.kv_source.is_some() {
                    return Ok(None);
                }
                let h = l.num_kv_heads;
                let heads = |n: i64| Tensor::arange(0, n, DType::I64, like)?.reshape(&[1, n, 1]);
                Ok(Some(LayerKv {
                    kv: Tensor::full(&[rows, 2 * h, ring[l.kind.index()] + 1, l.head_dim], 0.0, dtype, like)?,
                    kind: l.kind,
                    kv_heads: h,
                    heads: heads(h)?,
                    heads2: heads(2 * h)?,
                }))
            })
            .collect::<Result<Vec<_>>>()?;
        let snaps = cfg
            .layers
            .iter()
            .zip(&layers)
            .map(|(l, kv)| match kv {
                Some(kv) if snapshots && l.kind == LayerType::Sliding => {
                    let [_, h2, r, d] = dims4(&kv.kv)?;
                    Tensor::full(&[max_batch * SNAPSHOTS, h2, r, d], 0.0, dtype, like).map(Some)
                }
                _ => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        let order = |ring: i64| -> Result<Tensor> {
            let values: Vec<i64> = (0..ring).chain([EMPTY]).collect();
            Tensor::from_i64(&values)?.to_like(like, DType::I64)?.reshape(&[1, 1, 1, ring + 1])
        };
        let ring_order = [order(ring[0])?, order(ring[1])?];
        let chunk_row = chunk_row.then_some(max_batch);
        Ok(KvCache { layers, snaps, ring_order, ring, views: HashMap::new(), chunk_row })
    }

    /// The row of rings past the slots where compiled prompt chunks run, when there is one.
    pub fn chunk_row(&self) -> Option<i64> {
        self.chunk_row
    }

    pub fn ring(&self, kind: LayerType) -> i64 {
        self.ring[kind.index()]
    }

    /// How many layers of `kind` hold their own ring.
    pub fn own_rings(&self, kind: LayerType, cfg: &Config) -> i64 {
        cfg.layers.iter().zip(&self.layers).filter(|(l, r)| l.kind == kind && r.is_some()).count() as i64
    }

    /// Make the views of `rows` (once; a later call finds them made).
    pub fn prepare(&mut self, rows: Rows) -> Result<()> {
        if self.views.contains_key(&rows) {
            return Ok(());
        }
        let narrow = |t: &Tensor| t.narrow(0, rows.start, rows.len);
        let kv = self
            .layers
            .iter()
            .map(|l| {
                l.as_ref()
                    .map(|l| {
                        let kv = narrow(&l.kv)?;
                        Ok(RowsKv { k: kv.narrow(1, 0, l.kv_heads)?, v: kv.narrow(1, l.kv_heads, l.kv_heads)?, kv })
                    })
                    .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        let row_index3 = Tensor::arange(0, rows.len, DType::I64, &self.ring_order[0])?.reshape(&[rows.len, 1, 1])?;
        let views = RowsViews { kv, row_index3 };
        self.views.insert(rows, views);
        Ok(())
    }

    fn views(&self, rows: Rows) -> Result<&RowsViews> {
        self.views
            .get(&rows)
            .ok_or_else(|| Error::Internal(format!("cache rows {rows:?} used before KvCache::prepare")))
    }

    /// `0..ring`, then `EMPTY`, as `[1, 1, 1, ring + 1]`: the key side of the mask of a forward that
    /// has just written its keys into the ring (module docs).
    pub fn ring_order(&self, kind: LayerType) -> &Tensor {
        &self.ring_order[kind.index()]
    }

    /// Keys and values of `layer` for `rows`, `[rows, kv_heads, ring + 1, head_dim]` (views).
    pub fn kv(&self, layer: usize, rows: Rows) -> Result<Option<(&Tensor, &Tensor)>> {
        Ok(self.views(rows)?.kv[layer].as_ref().map(|l| (&l.k, &l.v)))
    }

    /// Write `k`, `v` (`[rows, kv_heads, T, head_dim]`) of `layer` at ring entries `entries`
    /// (`[rows, 1, T]` int64): `cache[row, h, entries[row, 0, t]] = k[row, h, t]`.
    pub fn write(&mut self, layer: usize, rows: Rows, entries: &Tensor, k: &Tensor, v: &Tensor) -> Result<()> {
        let (Some(l), views) = (&self.layers[layer], self.views(rows)?) else { return Ok(()) };
        let Some(ring) = &views.kv[layer] else { return Ok(()) };
        let idx = [Some(&views.row_index3), Some(&l.heads), Some(entries)];
        ring.k.index_put_(&idx, k)?;
        ring.v.index_put_(&idx, v)
    }

    /// The keys and values at sliding-ring entries `entries` (int64 `[rows, 1, T]`) of `rows`, one
    /// `[rows, 2 * kv_heads, T, head_dim]` copy per layer that holds a sliding ring of its own, in layer
    /// order: what a forward that writes there overwrites (`put_back` returns it).
    pub fn sliding_entries(&self, rows: Rows, entries: &Tensor) -> Result<Vec<Tensor>> {
        let views = self.views(rows)?;
        self.sliding_rings(views)
            .map(|(l, ring)| ring.kv.index(&[Some(&views.row_index3), Some(&l.heads2), Some(entries)]))
            .collect()
    }

    /// Write `saved` (`sliding_entries` of the same `rows` and `entries`) back where `keep` (bool
    /// `[rows, 1, T, 1]`) is false, leaving the entries where it is true as they are: a speculative
    /// forward's rejected positions (engine/speculative.rs) leave the sliding rings as they were.
    pub fn put_back(&mut self, rows: Rows, entries: &Tensor, saved: &[Tensor], keep: &Tensor) -> Result<()> {
        let views = self.views(rows)?;
        let rings: Vec<_> = self.sliding_rings(views).collect();
        if rings.len() != saved.len() {
            return Err(Error::Internal(format!("{} sliding rings, {} saved entries", rings.len(), saved.len())));
        }
        for ((l, ring), old) in rings.into_iter().zip(saved) {
            let idx = [Some(&views.row_index3), Some(&l.heads2), Some(entries)];
            let now = ring.kv.index(&idx)?;
            ring.kv.index_put_(&idx, &Tensor::where_(keep, &now, old)?)?;
        }
        Ok(())
    }

    /// The layers that hold a sliding ring of their own, in layer order, with their views in `views`.
    fn sliding_rings<'a>(&'a self, views: &'a RowsViews) -> impl Iterator<Item = (&'a LayerKv, &'a RowsKv)> {
        self.layers.iter().zip(&views.kv).filter_map(|(l, ring)| match (l, ring) {
            (Some(l), Some(ring)) if l.kind == LayerType::Sliding => Some((l, ring)),
            _ => None,
        })
    }

    /// Copy slot `from`'s rings and snapshots to slot `to`, whole rows (a follower of an `n > 1`
    /// prompt, or a prefix-cache hit moved to another slot).
    pub fn copy_slot(&mut self, from: i64, to: i64) -> Result<()> {
        self.copy_rings(from, to)?;
        for snap in self.snaps.iter().flatten() {
            snap.narrow(0, to * SNAPSHOTS, SNAPSHOTS)?.copy_(&snap.narrow(0, from * SNAPSHOTS, SNAPSHOTS)?)?;
        }
        Ok(())
    }

    /// Copy row `from`'s rings to row `to`, without snapshots (a slot's rings to the chunk row and back).
    pub fn copy_rings(&mut self, from: i64, to: i64) -> Result<()> {
        for l in self.layers.iter().flatten() {
            l.kv.narrow(0, to, 1)?.copy_(&l.kv.narrow(0, from, 1)?)?;
        }
        Ok(())
    }

    /// Copy slot `slot`'s sliding rings into its snapshot `mark`.
    pub fn snapshot(&mut self, slot: i64, mark: i64) -> Result<()> {
        for (l, snap) in self.layers.iter().zip(&self.snaps) {
            if let (Some(l), Some(snap)) = (l, snap) {
                snap.narrow(0, slot * SNAPSHOTS + mark, 1)?.copy_(&l.kv.narrow(0, slot, 1)?)?;
            }
        }
        Ok(())
    }

    /// Copy slot `slot`'s snapshot `mark` back into its sliding rings.
    pub fn restore(&mut self, slot: i64, mark: i64) -> Result<()> {
        for (l, snap) in self.layers.iter().zip(&self.snaps) {
            if let (Some(l), Some(snap)) = (l, snap) {
                l.kv.narrow(0, slot, 1)?.copy_(&snap.narrow(0, slot * SNAPSHOTS + mark, 1)?)?;
            }
        }
        Ok(())
    }

    /// `write` for keys and values side by side, `kv` `[rows, 2 * kv_heads, T, head_dim]`: one call.
    pub fn write_both(&mut self, layer: usize, rows: Rows, entries: &Tensor, kv: &Tensor) -> Result<()> {
        let (Some(l), views) = (&self.layers[layer], self.views(rows)?) else { return Ok(()) };
        let Some(ring) = &views.kv[layer] else { return Ok(()) };
        ring.kv.index_put_(&[Some(&views.row_index3), Some(&l.heads2), Some(entries)], kv)
    }
}

fn dims4(t: &Tensor) -> Result<[i64; 4]> {
    match t.size()?[..] {
        [a, b, c, d] => Ok([a, b, c, d]),
        ref other => Err(Error::Internal(format!("expected a 4-d tensor, got shape {other:?}"))),
    }
}

/// The positions the `ring` + 1 entries of a sliding ring hold before a row reads a prompt chunk that
/// starts at position `start` (module docs): entry `j` holds the latest position before `start` equal
/// to `j` mod `ring`, if there is one.
pub fn held_before(ring: i64, start: i64) -> Vec<i64> {
    let last = start - 1;
    let held = |j: i64| match last - (last - j).rem_euclid(ring) {
        p if p < 0 => EMPTY,
        p => p,
    };
    (0..ring).map(held).chain([EMPTY]).collect()
}

/// `held_before` of each row's next position `positions` (int64 `[b]`), on their device: int64
/// `[b, ring + 1]` (a verify step's later keys, engine/speculative.rs; a drafter's view of the rings,
/// gemma4/assistant.rs).
pub fn held_before_rows(positions: &Tensor, ring: i64) -> Result<Tensor> {
    let b = positions.size()?[0];
    let last = positions.reshape(&[b, 1])?.add_int(-1)?;
    let j = Tensor::arange(0, ring, DType::I64, positions)?.reshape(&[1, ring])?;
    let held = last.sub(&last.sub(&j)?.remainder(ring)?)?;
    let empty = Tensor::full(&[b, ring + 1], EMPTY as f64, DType::I64, positions)?;
    let held = Tensor::cat(&[&held, &empty.narrow(1, ring, 1)?], 1)?;
    Tensor::where_(&held.lt_scalar(0.0)?, &empty, &held)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The positions a ring of `ring` entries holds after a row wrote positions `0..n` in order.
    fn written(ring: i64, n: i64) -> Vec<i64> {
        let mut held = vec![EMPTY; ring as usize + 1];
        for p in 0..n {
            held[p.rem_euclid(ring) as usize] = p;
        }
        held
    }

    #[test]
    fn after_its_own_write_a_query_sees_exactly_the_entries_at_or_below_its_position() {
        // Sliding ring of 4 entries (window 4) and a full ring of 12, queries at every position: the
        // mask from what the ring holds (causal and window) equals the mask from the entry order.
        for (ring, window) in [(4, 4), (12, i64::MAX)] {
            for q in 0..12 {
                let held = written(ring, q + 1);
                let order: Vec<i64> = (0..ring).chain([EMPTY]).collect();
                for j in 0..=ring as usize {
                    let by_held = held[j] <= q && held[j] > q.saturating_sub(window);
                    assert_eq!(by_held, order[j] <= q, "ring {ring}, query {q}, entry {j}");
                }
            }
        }
    }

    #[test]
    fn held_before_a_chunk_is_what_the_earlier_positions_left() {
        for start in 1..12 {
            assert_eq!(held_before(4, start), written(4, start), "start {start}");
        }
    }
}
