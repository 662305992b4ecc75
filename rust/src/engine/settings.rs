//! What a caller sets and reads of an `Engine`: its settings, the compute dtype's name, the layout of its
//! cache and what its loader put on the device.

use crate::engine::speculative::Speculative;
use crate::error::{Error, Result};
use crate::gemma4::weights::Kernels;
use crate::tensor::DType;

/// What the binding reports from `layout()`.
pub struct Layout {
    pub full_rings: i64,
    pub sliding_rings: i64,
    pub shared_layers: i64,
    pub context: i64,
    pub sliding_window: i64,
    pub max_batch: i64,
    pub kv_bytes_per_slot: i64,
    pub kv_bytes: i64,
    pub prefix_caching: bool,
    pub snapshot_bytes_per_slot: i64,
    /// Ranks the model is split over (the byte counts are this process's).
    pub tensor_parallel_size: i64,
    /// The shard this process holds when it is one rank of a group of processes.
    pub tensor_parallel_rank: Option<i64>,
}

/// Parse a compute dtype name.
pub fn parse_dtype(name: &str) -> Result<DType> {
    match name {
        "float32" => Ok(DType::F32),
        "bfloat16" => Ok(DType::BF16),
        "float16" => Ok(DType::F16),
        other => Err(Error::Input(format!("dtype must be float32, bfloat16 or float16, got {other:?}"))),
    }
}

/// One process's place in a tensor-parallel group of processes (`Settings::rank`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rank {
    /// 0 to `tensor_parallel_size - 1`: the shard this process holds.
    pub rank: i64,
    /// The torch.distributed process group the ranks' collectives run over, by its `group_name`.
    pub group: String,
}

/// The engine's settings besides the checkpoint.
#[derive(Clone, Debug)]
pub struct Settings {
    pub context: i64,
    pub dtype: DType,
    pub prefill_chunk: i64,
    pub max_batch: i64,
    /// Capture each decode-step shape as a CUDA graph and replay it (CUDA only; see `step::Graphs`).
    pub cuda_graphs: bool,
    /// `Kernels::packed_int4` (the loader decides, gemma4/weights.rs).
    pub packed_int4: Option<bool>,
    /// `Kernels::onednn` (the loader decides, gemma4/weights.rs).
    pub onednn: Option<bool>,
    /// Reuse the keys of earlier requests (prefix.rs); the cache then holds each slot's snapshots.
    pub prefix_caching: bool,
    /// Ranks the model is split over (gemma4/parallel.rs), a process each; 1 for none.
    pub tensor_parallel_size: i64,
    /// This process's place among them (required above 1): it holds shard `rank` of
    /// `tensor_parallel_size`, and its layers' partial outputs meet the other ranks' in collectives.
    pub rank: Option<Rank>,
    /// Hold one more row of rings, where compiled prompt chunks run (engine/chunks.rs): set for an
    /// engine that gets a compiler.
    pub chunk_row: bool,
    /// Speculative decoding by prompt lookup (engine/speculative.rs); None: off.
    pub speculative: Option<Speculative>,
}

impl Settings {
    pub(super) fn check(&self) -> Result<()> {
        for (name, v) in
            [("context", self.context), ("prefill_chunk", self.prefill_chunk), ("max_batch", self.max_batch)]
        {
            if v < 1 {
                return Err(Error::Input(format!("{name} must be >= 1, got {v}")));
            }
        }
        if let Some(s) = &self.speculative {
            s.check()?;
        }
        let n = self.tensor_parallel_size;
        match &self.rank {
            Some(r) if !(0..n).contains(&r.rank) => {
                return Err(Error::Input(format!("tensor_parallel_rank must be in 0..{n}, got {}", r.rank)));
            }
            None if n > 1 => {
                return Err(Error::Input(format!(
                    "tensor_parallel_size {n} runs a process per shard: give each its tensor_parallel_rank and \
                     tensor_parallel_group (gemma_engine.distributed.start starts them)"
                )));
            }
            _ => {}
        }
        Ok(())
    }

    pub(super) fn kernels(&self) -> Kernels {
        Kernels { packed_int4: self.packed_int4, onednn: self.onednn }
    }
}

/// What the loader put on the device (`Engine::weights`).
#[derive(Clone, Debug)]
pub struct WeightsInfo {
    /// "packed", "dequantized", "mixed" (some int4 weights did not fit the kernels' layout) or
    /// "none" (no int4 weights).
    pub int4: &'static str,
    pub bytes: i64,
    /// "onednn" or "aten": what multiplies the dense weights (`Settings::onednn`).
    pub linear: &'static str,
    /// With "aten": why not oneDNN (another device or dtype, asked for, or, in bfloat16, a CPU whose
    /// oneDNN has no bfloat16 support).
    pub linear_note: Option<String>,
}
