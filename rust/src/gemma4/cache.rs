//! The KV cache: one fixed-shape ring per sequence slot and layer, written only through its own
//! methods.
//!
//! Layout: every layer that computes its own keys holds `k` and `v` of shape
//! `[max_batch, kv_heads, ring, head_dim]`, where `ring` is `context` for full-attention layers and
//! `min(sliding_window, context)` for sliding ones; KV-shared layers hold nothing and read their
//! donor's keys (Transformers 5.18 `models/gemma4/modeling_gemma4.py`, `Gemma4TextAttention.forward`,
//! `kv_shared_layer_index`). Which position each ring entry holds is tracked per layer type in
//! `positions` (`[max_batch, ring + 1]` int64, `EMPTY` = empty); the attention masks are computed from
//! it, so a decode step runs the same shapes at every position. The extra entry at index `ring` is
//! never visible: a decode step's padding rows (slots that are free or still reading their prompt)
//! write their keys there, so a step can run every slot below the highest live one without
//! touching the rings of slots that are not decoding.
//!
//! Memory: `bytes_per_slot = sum over own-KV layers of 2 * kv_heads * (ring(type) + 1) * head_dim *
//! dtype bytes` (+ 8 bytes per ring entry of each type for the positions), and the whole cache is
//! `max_batch * bytes_per_slot`. Per-slot rings (rather than one paged pool) keep every shape fixed
//! and every slot's keys contiguous, which is what a compiled or captured step wants; the price is
//! that a slot reserves a full context whether its request uses it or not.
//!
//! A forward works on `Rows`: a contiguous range of slots. Views of the tensors are narrowed to the
//! range once per range and kept, so writes through them land in the cache (ATen views share
//! storage) and a decode step makes no call to find its slots. The design of a cache
//! that owns its writes (`append` from a forward that takes `&mut`) is candle's
//! `candle-transformers/src/models/gemma3.rs`.

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::gemma4::config::{Config, LayerType};
use crate::tensor::{DType, Tensor};

/// The position an empty ring entry holds: later than any query, so the causal test `key <= query`
/// alone hides it.
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

/// One layer's keys and values, `[max_batch, kv_heads, ring + 1, head_dim]`, after k_norm/RoPE and
/// v_norm, and `[1, kv_heads, 1]` int64 `0..kv_heads` (the head part of a write's index).
struct LayerKv {
    k: Tensor,
    v: Tensor,
    heads: Tensor,
}

/// Views of the cache narrowed to one `Rows`, made once (`KvCache::prepare`), so a forward makes no
/// ATen call to find its slots.
struct RowsViews {
    /// Per layer (None for KV-shared layers).
    kv: Vec<Option<(Tensor, Tensor)>>,
    /// Per layer type, `[len, ring + 1]`, and the same as `[len, 1, 1, ring + 1]` (a mask's key side).
    positions: [Tensor; 2],
    positions4: [Tensor; 2],
    /// `0..len` as int64 `[len, 1, 1]`: the row part of a write's index.
    row_index3: Tensor,
}

pub struct KvCache {
    layers: Vec<Option<LayerKv>>,
    /// Ring positions per layer type (`LayerType::index`), int64 `[max_batch, ring + 1]`.
    positions: [Tensor; 2],
    ring: [i64; 2],
    views: HashMap<Rows, RowsViews>,
}
/// The cache geometry, computable before anything is allocated.
#[derive(Clone, Copy, Debug)]
pub struct CacheSize {
    pub bytes_per_slot: i64,
    pub max_batch: i64,
}

impl CacheSize {
    pub fn of(cfg: &Config, context: i64, max_batch: i64, dtype: DType) -> CacheSize {
        let ring = ring_sizes(cfg, context);
        let kv: i64 = cfg
            .layers
            .iter()
            .filter(|l| l.kv_source.is_none())
            .map(|l| 2 * l.num_kv_heads * (ring[l.kind.index()] + 1) * l.head_dim * dtype.size())
            .sum();
        CacheSize { bytes_per_slot: kv + 8 * (ring[0] + ring[1] + 2), max_batch }
    }

    pub fn total(&self) -> i64 {
        self.bytes_per_slot * self.max_batch
    }
}

/// Ring entries per layer type: sliding rings hold the window, full rings the context.
pub fn ring_sizes(cfg: &Config, context: i64) -> [i64; 2] {
    [cfg.sliding_window.min(context), context]
}

impl KvCache {
    pub fn new(cfg: &Config, context: i64, max_batch: i64, like: &Tensor, dtype: DType) -> Result<KvCache> {
        let ring = ring_sizes(cfg, context);
        let layers = cfg
            .layers
            .iter()
            .map(|l| {
                if l.kv_source.is_some() {
                    return Ok(None);
                }
                let shape = [max_batch, l.num_kv_heads, ring[l.kind.index()] + 1, l.head_dim];
                Ok(Some(LayerKv {
                    k: Tensor::full(&shape, 0.0, dtype, like)?,
                    v: Tensor::full(&shape, 0.0, dtype, like)?,
                    heads: Tensor::arange(0, l.num_kv_heads, DType::I64, like)?.reshape(&[1, l.num_kv_heads, 1])?,
                }))
            })
            .collect::<Result<Vec<_>>>()?;
        let positions = [
            Tensor::full(&[max_batch, ring[0] + 1], EMPTY as f64, DType::I64, like)?,
            Tensor::full(&[max_batch, ring[1] + 1], EMPTY as f64, DType::I64, like)?,
        ];
        Ok(KvCache { layers, positions, ring, views: HashMap::new() })
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
            .map(|l| l.as_ref().map(|l| Ok((narrow(&l.k)?, narrow(&l.v)?))).transpose())
            .collect::<Result<Vec<_>>>()?;
        let row_index3 = Tensor::arange(0, rows.len, DType::I64, &self.positions[0])?.reshape(&[rows.len, 1, 1])?;
        let positions = [narrow(&self.positions[0])?, narrow(&self.positions[1])?];
        let as4 = |p: &Tensor, kind: usize| p.reshape(&[rows.len, 1, 1, self.ring[kind] + 1]);
        let views = RowsViews { kv, positions4: [as4(&positions[0], 0)?, as4(&positions[1], 1)?], positions, row_index3 };
        self.views.insert(rows, views);
        Ok(())
    }

    fn views(&self, rows: Rows) -> Result<&RowsViews> {
        self.views.get(&rows).ok_or_else(|| Error::Internal(format!("cache rows {rows:?} used before KvCache::prepare")))
    }

    /// Forget everything `slot` held (its K/V values stay but are masked out).
    pub fn clear(&mut self, slot: i64) -> Result<()> {
        let rows = Rows::one(slot);
        self.prepare(rows)?;
        for p in &self.views(rows)?.positions {
            p.fill_(EMPTY as f64)?;
        }
        Ok(())
    }

    /// The positions `rows` hold for layers of `kind`, `[rows, ring + 1]` (a view).
    pub fn positions(&self, kind: LayerType, rows: Rows) -> Result<&Tensor> {
        Ok(&self.views(rows)?.positions[kind.index()])
    }

    /// The same positions as `[rows, 1, 1, ring + 1]` (a view).
    pub fn positions4(&self, kind: LayerType, rows: Rows) -> Result<&Tensor> {
        Ok(&self.views(rows)?.positions4[kind.index()])
    }

    /// Record that the ring entries `entries` (`[rows, 1, T]` int64) of the layers of `kind` hold
    /// positions `written` (same shape) for `rows`.
    pub fn record_positions(&mut self, kind: LayerType, rows: Rows, entries: &Tensor, written: &Tensor) -> Result<()> {
        let views = self.views(rows)?;
        views.positions[kind.index()].index_put_(&[Some(&views.row_index3), Some(entries)], written)
    }

    /// Keys and values of `layer` for `rows`, `[rows, kv_heads, ring + 1, head_dim]` (views).
    pub fn kv(&self, layer: usize, rows: Rows) -> Result<Option<(&Tensor, &Tensor)>> {
        Ok(self.views(rows)?.kv[layer].as_ref().map(|(k, v)| (k, v)))
    }

    /// Write `k`, `v` (`[rows, kv_heads, T, head_dim]`) of `layer` at ring entries `entries`
    /// (`[rows, 1, T]` int64): `cache[row, h, entries[row, 0, t]] = k[row, h, t]`.
    pub fn write(&mut self, layer: usize, rows: Rows, entries: &Tensor, k: &Tensor, v: &Tensor) -> Result<()> {
        let (Some(l), views) = (&self.layers[layer], self.views(rows)?) else { return Ok(()) };
        let Some((kv_k, kv_v)) = &views.kv[layer] else { return Ok(()) };
        let idx = [Some(&views.row_index3), Some(&l.heads), Some(entries)];
        kv_k.index_put_(&idx, k)?;
        kv_v.index_put_(&idx, v)
    }
}
