//! Tensor parallelism: the model's matrices split over `size` ranks, a process per device, as vLLM's
//! `vllm/model_executor/layers/linear.py` splits them (`ColumnParallelLinear`: a rank holds some of
//! the output features; `RowParallelLinear`: some of the input features, its output a partial sum that
//! an all-reduce completes) and as Transformers 5.18 declares Gemma 4's plan (`configuration_gemma4.py`,
//! `base_model_tp_plan`: q/k/v and gate/up column-wise, o_proj and down_proj row-wise, the experts'
//! `gate_up_proj` packed column-wise and `down_proj` row-wise).
//!
//! A rank holds `heads / size` query heads with the KV heads they read (`kv_heads / size` of them, or,
//! with fewer KV heads than ranks, the one its query heads share, replicated) and their KV rings,
//! `width / size` of every MLP and expert's intermediate features, and `vocab / size` rows of lm_head.
//! The residual stream, the norms, the embeddings, the per-layer inputs and the router are whole on
//! every rank, which computes them alike. The row-parallel blocks end in `Split::sum` (an all-reduce:
//! after attention's o_proj, after the MLP; in an MoE layer one over both branches side by side, as
//! vLLM's MoE layers defer theirs with `reduce_results=False`), and the vocabulary-parallel head in
//! `Split::gather` (an all-gather of the logits' vocabulary slices). Both are `_c10d_functional`
//! dispatcher ops called from Rust (tensor.rs), so a captured step records them. At size 1 they are no
//! calls at all.

use crate::error::{Error, Result};
use crate::gemma4::config::Config;
use crate::gemma4::weights::Slice;
use crate::tensor::Tensor;

/// One shard's place in a tensor-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tp {
    pub rank: i64,
    pub size: i64,
}

impl Tp {
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

/// The shard this process holds and the process group where the shards' partial outputs meet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Split {
    pub tp: Tp,
    /// The torch.distributed process group of the ranks, by its `group_name` (None: a rank of one).
    group: Option<String>,
}

impl Split {
    /// The whole model in one process.
    pub fn whole() -> Split {
        Split { tp: Tp { rank: 0, size: 1 }, group: None }
    }

    /// Rank `rank` of `size`, whose collectives run over the process group torch.distributed names `group`.
    pub fn rank(rank: i64, size: i64, group: String) -> Split {
        Split { tp: Tp { rank, size }, group: Some(group) }
    }

    /// Ranks in the group.
    pub fn size(&self) -> i64 {
        self.tp.size
    }

    /// This process's rank, when it is one of a group of processes.
    pub fn rank_in_group(&self) -> Option<i64> {
        self.group.as_ref().map(|_| self.tp.rank)
    }

    /// The group, when there is more than this rank to meet.
    fn others(&self) -> Option<&str> {
        self.group.as_deref().filter(|_| self.tp.size > 1)
    }

    /// The sum of every rank's `partial` (an all-reduce; a rank alone holds the sum).
    pub fn sum(&self, partial: Tensor) -> Result<Tensor> {
        match self.others() {
            Some(group) => partial.all_reduce_sum(group),
            None => Ok(partial),
        }
    }

    /// The sums over the ranks of two partial outputs `[.., h]` each, in one collective: side by side, summed,
    /// split again (a rank alone: the parts as they are).
    pub fn sum_pair(&self, a: Tensor, b: Tensor) -> Result<[Tensor; 2]> {
        if self.others().is_none() {
            return Ok([a, b]);
        }
        let h = *a.size()?.last().ok_or_else(|| Error::Internal("a 0-d partial output".into()))?;
        self.sum(Tensor::cat(&[&a, &b], -1)?)?.split_array(&[h, h], -1)
    }

    /// Every rank's `slice` of the last dim side by side (the logits' vocabulary; an all-gather).
    pub fn gather(&self, slice: Tensor) -> Result<Tensor> {
        match self.others() {
            Some(group) => slice.all_gather_last(self.tp.size, group),
            None => Ok(slice),
        }
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

/// The config a rank's KV rings follow (cache.rs reads each layer's KV heads): its share of them.
pub fn shard_config(cfg: &Config, tp: Tp) -> Config {
    let mut shard = cfg.clone();
    for l in &mut shard.layers {
        l.num_kv_heads = tp.kv_heads(cfg.num_heads, l.num_kv_heads).1;
    }
    shard
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(size: i64) -> Vec<Tp> {
        (0..size).map(|rank| Tp { rank, size }).collect()
    }

    #[test]
    fn kv_heads_are_shared_out_or_replicated_to_the_shards_whose_queries_read_them() {
        // 8 query heads over 4 KV heads: two shards hold two each, four one each.
        assert_eq!(Tp { rank: 1, size: 2 }.kv_heads(8, 4), (2, 2));
        assert_eq!(Tp { rank: 3, size: 4 }.kv_heads(8, 4), (3, 1));
        // Over 2 KV heads, 4 shards: queries 0-1, 2-3 read head 0; 4-5, 6-7 head 1.
        let heads: Vec<_> = group(4).iter().map(|tp| tp.kv_heads(8, 2)).collect();
        assert_eq!(heads, vec![(0, 1), (0, 1), (1, 1), (1, 1)]);
        // One KV head: every shard holds it.
        assert!(group(8).iter().all(|tp| tp.kv_heads(16, 1) == (0, 1)));
    }

    #[test]
    fn slices_are_whole_for_one_shard() {
        assert_eq!(Tp { rank: 0, size: 1 }.rows(10), Slice::All);
        assert_eq!(Tp { rank: 2, size: 4 }.rows(16), Slice::Rows(8, 4));
        assert_eq!(Tp { rank: 1, size: 2 }.cols(16), Slice::Cols(8, 8));
    }
}
