//! Tensor parallelism within one engine: the model's matrices split over `size` shards, as vLLM's
//! `vllm/model_executor/layers/linear.py` splits them (`ColumnParallelLinear`: a shard holds some of
//! the output features; `RowParallelLinear`: some of the input features, its output a partial sum)
//! and as Transformers 5.18 declares Gemma 4's plan (`configuration_gemma4.py`, `base_model_tp_plan`:
//! q/k/v and gate/up column-wise, o_proj and down_proj row-wise, the experts' `gate_up_proj` packed
//! column-wise and `down_proj` row-wise).
//!
//! A shard holds `heads / size` query heads with the KV heads they read (`kv_heads / size` of them, or,
//! with fewer KV heads than shards, the one its query heads share, replicated), `width / size` of every
//! MLP and expert's intermediate features, and `vocab / size` rows of lm_head; it owns the KV rings of
//! its heads (`ShardedCache`). The residual stream, the norms, the embeddings, the per-layer inputs and
//! the router stay whole on the first shard's device. A layer makes two reductions, one after
//! attention's o_proj and one after the MLP (with the experts, one over both branches side by side);
//! the logits' vocabulary slices are put side by side. A reduction is `reduce`: each shard's partial
//! copied to the first shard's device and added there (a no-op copy when the shards share it, the CPU
//! mode the tests run).

use crate::error::{Error, Result};
use crate::gemma4::cache::{CacheSize, KvCache, Rows};
use crate::gemma4::config::{Config, LayerType};
use crate::gemma4::weights::Slice;
use crate::tensor::{DType, Tensor};

/// One shard's place in a tensor-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tp {
    pub rank: i64,
    pub size: i64,
}

impl Tp {
    /// The shards of a group of `size`.
    pub fn group(size: i64) -> Vec<Tp> {
        (0..size).map(|rank| Tp { rank, size }).collect()
    }

    /// This shard's part of `n` features in a column-parallel split (`n` divisible by the size).
    pub fn part(&self, n: i64) -> (i64, i64) {
        let len = n / self.size;
        (self.rank * len, len)
    }

    /// Rows `part(n)` of a matrix (column-parallel: its output features).
    pub fn rows(&self, n: i64) -> Slice {
        let (start, len) = self.part(n);
        if self.size == 1 { Slice::All } else { Slice::Rows(start, len) }
    }

    /// Columns `part(n)` of a matrix (row-parallel: its input features).
    pub fn cols(&self, n: i64) -> Slice {
        let (start, len) = self.part(n);
        if self.size == 1 { Slice::All } else { Slice::Cols(start, len) }
    }

    /// (first KV head, KV heads) of this shard, for `heads` query heads over `kv_heads`: a share of
    /// them, or with fewer KV heads than shards the one this shard's query heads read (GQA maps query
    /// head `h` to KV head `h / (heads / kv_heads)`).
    pub fn kv_heads(&self, heads: i64, kv_heads: i64) -> (i64, i64) {
        if kv_heads >= self.size {
            return self.part(kv_heads);
        }
        let (first_query, _) = self.part(heads);
        (first_query / (heads / kv_heads), 1)
    }
}

/// Which shards of a tensor-parallel group this process holds, and how their partial outputs meet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Split {
    /// Every shard of a group of `size` in this process (`size` 1: no split): partials are copied to the
    /// first shard's device and added there (`reduce`, `gather`).
    InProcess { size: i64 },
    /// Shard `rank` of `size`, one per process: partials meet in `_c10d_functional` collectives over
    /// the process group torch.distributed names `group`, as vLLM's `RowParallelLinear` ends in
    /// `tensor_model_parallel_all_reduce` (`vllm/model_executor/layers/linear.py`).
    Rank { rank: i64, size: i64, group: String },
}

impl Split {
    /// The shards this process holds.
    pub fn shards(&self) -> Vec<Tp> {
        match self {
            Split::InProcess { size } => Tp::group(*size),
            Split::Rank { rank, size, .. } => vec![Tp { rank: *rank, size: *size }],
        }
    }

    /// Shards in the whole group.
    pub fn size(&self) -> i64 {
        match self {
            Split::InProcess { size } | Split::Rank { size, .. } => *size,
        }
    }

    /// This process's rank, when it is one of a group of processes.
    pub fn rank(&self) -> Option<i64> {
        match self {
            Split::InProcess { .. } => None,
            Split::Rank { rank, .. } => Some(*rank),
        }
    }

    /// The sum of every shard's partial output (`partials`: this process's), on `leader`'s device
    /// (`local`: every shard of this process is there).
    pub fn sum(&self, partials: Vec<Tensor>, leader: &Tensor, local: bool) -> Result<Tensor> {
        match self {
            Split::InProcess { .. } => reduce(partials, leader, local),
            Split::Rank { group, .. } => one(partials)?.all_reduce_sum(group),
        }
    }

    /// Every shard's slice of the last dim side by side (the logits' vocabulary), on `leader`'s device.
    pub fn gather(&self, slices: Vec<Tensor>, leader: &Tensor, local: bool) -> Result<Tensor> {
        match self {
            Split::InProcess { .. } => gather(slices, leader, local),
            Split::Rank { group, size, .. } => one(slices)?.all_gather_last(*size, group),
        }
    }
}

/// The one part a process of a `Split::Rank` holds.
fn one(parts: Vec<Tensor>) -> Result<Tensor> {
    match <[Tensor; 1]>::try_from(parts) {
        Ok([p]) => Ok(p),
        Err(parts) => Err(Error::Internal(format!("a rank holds one shard, got {}", parts.len()))),
    }
}

/// Refuse a tensor-parallel size the model's shapes do not split into, naming the numbers.
pub fn check_divisible(cfg: &Config, size: i64) -> Result<()> {
    let key = "tensor_parallel_size";
    if !(1..=64).contains(&size) {
        return Err(Error::config(key, format!("must be in 1..=64, got {size}")));
    }
    let mut need = vec![("num_attention_heads", cfg.num_heads), ("vocab_size", cfg.vocab_size)];
    need.extend(cfg.layers.iter().map(|l| ("intermediate_size", l.intermediate_size)));
    if let Some(m) = &cfg.moe {
        need.push(("moe_intermediate_size", m.intermediate_size));
    }
    for (what, n) in need {
        if n % size != 0 {
            return Err(Error::config(key, format!("{size} does not divide {what} ({n})")));
        }
    }
    for (i, l) in cfg.layers.iter().enumerate() {
        let kv = l.num_kv_heads;
        if kv % size != 0 && size % kv != 0 {
            return Err(Error::config(
                key,
                format!("{size} does not divide layer {i}'s {kv} KV heads, nor is it a multiple of them"),
            ));
        }
    }
    Ok(())
}

/// The config one shard's KV rings follow (cache.rs reads each layer's KV heads): the shard's.
fn shard_config(cfg: &Config, tp: Tp) -> Config {
    let mut shard = cfg.clone();
    for l in &mut shard.layers {
        l.num_kv_heads = tp.kv_heads(cfg.num_heads, l.num_kv_heads).1;
    }
    shard
}

/// Whether every shard is on the first one's device (the reductions then copy nothing).
pub fn on_one_device(likes: &[Tensor]) -> Result<bool> {
    let first = likes.first().map(Tensor::device).transpose()?;
    Ok(likes.iter().map(Tensor::device).collect::<Result<Vec<_>>>()?.iter().all(|d| Some(d) == first.as_ref()))
}

/// `x` on `leader`'s device; `local`: it is there already.
fn to_leader(x: Tensor, leader: &Tensor, local: bool) -> Result<Tensor> {
    if local { Ok(x) } else { x.to_like(leader, x.kind()?.unwrap_or(DType::F32)) }
}

/// The sum of the shards' partial outputs, on `leader`'s device (`local`: every shard is there). One
/// shard's output is the sum, with no call.
fn reduce(partials: Vec<Tensor>, leader: &Tensor, local: bool) -> Result<Tensor> {
    let mut parts = partials.into_iter();
    let first = parts.next().ok_or_else(|| Error::Internal("a reduction over no shards".into()))?;
    let mut sum = to_leader(first, leader, local)?;
    for p in parts {
        sum = sum.add(&to_leader(p, leader, local)?)?;
    }
    Ok(sum)
}

/// The shards' slices of the last dim side by side, on `leader`'s device (the logits' vocabulary).
fn gather(slices: Vec<Tensor>, leader: &Tensor, local: bool) -> Result<Tensor> {
    if slices.len() == 1 {
        return slices.into_iter().next().ok_or_else(|| Error::Internal("no slices".into()));
    }
    let moved = slices.into_iter().map(|s| to_leader(s, leader, local)).collect::<Result<Vec<_>>>()?;
    Tensor::cat(&moved.iter().collect::<Vec<_>>(), -1)
}

/// One KV cache per shard (each holds its shard's KV heads); the engine's slot operations apply to all.
pub struct ShardedCache {
    pub shards: Vec<KvCache>,
}

impl ShardedCache {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: &Config,
        context: i64,
        max_batch: i64,
        likes: &[Tensor],
        split: &Split,
        dtype: DType,
        snapshots: bool,
        chunk_row: bool,
    ) -> Result<ShardedCache> {
        let shards = split
            .shards()
            .iter()
            .zip(likes)
            .map(|(tp, like)| {
                KvCache::new(&shard_config(cfg, *tp), context, max_batch, like, dtype, snapshots, chunk_row)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ShardedCache { shards })
    }

    /// One shard's cache geometry (every shard's is the same).
    pub fn size_per_shard(
        cfg: &Config,
        size: i64,
        context: i64,
        max_batch: i64,
        dtype: DType,
        snaps: bool,
        chunk_row: bool,
    ) -> CacheSize {
        CacheSize::of(&shard_config(cfg, Tp { rank: 0, size }), context, max_batch, dtype, snaps, chunk_row)
    }

    /// The row of rings where compiled prompt chunks run (`KvCache::chunk_row`), when there is one.
    pub fn chunk_row(&self) -> Option<i64> {
        self.shards[0].chunk_row()
    }

    pub fn copy_rings(&mut self, from: i64, to: i64) -> Result<()> {
        self.shards.iter_mut().try_for_each(|c| c.copy_rings(from, to))
    }

    pub fn ring(&self, kind: LayerType) -> i64 {
        self.shards[0].ring(kind)
    }

    pub fn own_rings(&self, kind: LayerType, cfg: &Config) -> i64 {
        self.shards[0].own_rings(kind, cfg)
    }

    pub fn prepare(&mut self, rows: Rows) -> Result<()> {
        self.shards.iter_mut().try_for_each(|c| c.prepare(rows))
    }

    pub fn copy_slot(&mut self, from: i64, to: i64) -> Result<()> {
        self.shards.iter_mut().try_for_each(|c| c.copy_slot(from, to))
    }

    pub fn snapshot(&mut self, slot: i64, mark: i64) -> Result<()> {
        self.shards.iter_mut().try_for_each(|c| c.snapshot(slot, mark))
    }

    pub fn restore(&mut self, slot: i64, mark: i64) -> Result<()> {
        self.shards.iter_mut().try_for_each(|c| c.restore(slot, mark))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_heads_are_shared_out_or_replicated_to_the_shards_whose_queries_read_them() {
        // 8 query heads over 4 KV heads: two shards hold two each, four one each.
        assert_eq!(Tp { rank: 1, size: 2 }.kv_heads(8, 4), (2, 2));
        assert_eq!(Tp { rank: 3, size: 4 }.kv_heads(8, 4), (3, 1));
        // Over 2 KV heads, 4 shards: queries 0-1, 2-3 read head 0; 4-5, 6-7 head 1.
        let heads: Vec<_> = Tp::group(4).iter().map(|tp| tp.kv_heads(8, 2)).collect();
        assert_eq!(heads, vec![(0, 1), (0, 1), (1, 1), (1, 1)]);
        // One KV head: every shard holds it.
        assert!(Tp::group(8).iter().all(|tp| tp.kv_heads(16, 1) == (0, 1)));
    }

    #[test]
    fn slices_are_whole_for_one_shard() {
        assert_eq!(Tp { rank: 0, size: 1 }.rows(10), Slice::All);
        assert_eq!(Tp { rank: 2, size: 4 }.rows(16), Slice::Rows(8, 4));
        assert_eq!(Tp { rank: 1, size: 2 }.cols(16), Slice::Cols(8, 8));
    }
}
