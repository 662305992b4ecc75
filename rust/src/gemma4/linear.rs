//! `Linear`: `x @ w.T` for a weight `[out, in]` (no bias: Gemma 4 has none), dense or int4.
//!
//! An int4 weight stays packed on the device and runs through ATen's int4 matmul
//! (`_weight_int4pack_mm` on CUDA, `_weight_int4pack_mm_for_cpu` on the CPU), which dequantizes a
//! tile at a time in its registers: a quarter of the bytes a bfloat16 weight reads per token. The
//! kernels take bfloat16 activations `[rows, in]`, so the model keeps its hidden states 2-d.
//!
//! On the CPU in float32 (and in bfloat16 where torch's oneDNN computes it on this CPU:
//! `Kernels::onednn`, weights.rs), a dense weight is packed once into oneDNN's layout and multiplied by
//! oneDNN (`Tensor::onednn_linear`), as PyTorch's own compiler does for a frozen CPU model
//! (torch._inductor's mkldnn weight packing). For the few rows of a decode step that is much faster
//! than ATen's default CPU matmul (bench/engine.py prints both). oneDNN makes a kernel for each input
//! shape it sees and keeps it (its primitive cache), with memory that adds up: 200 prompt lengths
//! grew a process by 700 MB. So its inputs are padded to a few row counts (`onednn_rows`).

use crate::error::Result;
use crate::tensor::Tensor;

pub enum Linear {
    Dense(Tensor),
    Int4 {
        /// ATen's packed layout for the device (`Tensor::int4_pack`).
        packed: Tensor,
        /// bfloat16 `[in / group, out, 2]`: each group's scale and zero.
        scales_zeros: Tensor,
        group: i64,
    },
    /// A float32 or bfloat16 weight in oneDNN's packed layout (`Tensor::onednn_pack`).
    OneDnn(Tensor),
}

impl Linear {
    /// `x` `[rows, in]` → `[rows, out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Linear::Dense(w) => x.linear(w),
            Linear::Int4 { packed, scales_zeros, group } => x.int4_mm(packed, *group, scales_zeros),
            Linear::OneDnn(packed) => {
                let rows = x.size()?[0];
                match onednn_rows(rows) - rows {
                    0 => x.onednn_linear(packed),
                    extra => x.pad_rows(extra)?.onednn_linear(packed)?.narrow(0, 0, rows),
                }
            }
        }
    }

    /// `forward`, written into `out` `[rows, out]`.
    pub fn forward_into(&self, x: &Tensor, out: &Tensor) -> Result<()> {
        match self {
            Linear::Dense(w) => x.linear_into(w, out),
            // The int4 and oneDNN kernels have no `_out` form.
            Linear::Int4 { .. } | Linear::OneDnn(_) => out.copy_(&self.forward(x)?),
        }
    }

    /// The tensors it holds on the device.
    pub fn tensors(&self) -> Vec<&Tensor> {
        match self {
            Linear::Dense(w) => vec![w],
            Linear::Int4 { packed, scales_zeros, .. } => vec![packed, scales_zeros],
            Linear::OneDnn(packed) => vec![packed],
        }
    }
}

/// The rows oneDNN multiplies for `rows` input rows: up to 16 as they are (every decode bucket of up to
/// 16 slots, short prompts), 32 or 64, then the next multiple of 64. A prompt forward of up to 256
/// tokens so runs on one of 21 shapes, with at most 63 padding rows once past 64.
fn onednn_rows(rows: i64) -> i64 {
    match rows {
        ..=16 => rows,
        17..=64 => (rows as u64).next_power_of_two() as i64,
        _ => (rows + 63) / 64 * 64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn onednn_sees_few_row_counts() {
        let shapes = |top: i64| (1..=top).map(onednn_rows).collect::<std::collections::BTreeSet<i64>>().len();
        assert_eq!(shapes(256), 16 + 2 + 3); // 1..=16, 32, 64, then 128, 192, 256
        for rows in 1..=1024 {
            let r = onednn_rows(rows);
            assert!(r >= rows && r < 2 * rows.max(16) && (rows <= 64 || r - rows < 64), "{rows} -> {r}");
        }
    }
}
