//! `RmsNorm` as Gemma 4 computes it (M:197-215): `x * (mean(x^2) + eps)^-0.5` in float32, times
//! the weight used as-is (not `1 + w` as in Gemma 1-3), rounded once to the input dtype. `v_norm`
//! has no weight. `at::rms_norm` does exactly this in one kernel on accelerators (the composite
//! HF spells out is eight kernels per norm, and a decode step has eight norms per layer); it
//! computes in float32 for 16-bit inputs and differs from the reference's `pow(-0.5)` only in the
//! last bit of a float32 `rsqrt`. On the CPU, where `at::rms_norm` is that composite, the shim does
//! the same arithmetic in one pass a row for a decode step's small inputs (aten.cpp `rms_norm_cpu`;
//! tests/engine/test_kernels.py holds it to Transformers' norm).

use crate::error::Result;
use crate::gemma4::weights::Weights;
use crate::tensor::Tensor;

pub struct RmsNorm {
    /// In the compute dtype (exact: checkpoint norms are bf16 or f32; the kernel reads it in float32).
    weight: Option<Tensor>,
    eps: f64,
}

impl RmsNorm {
    pub fn load(w: &Weights, name: &str, dim: i64, eps: f64) -> Result<RmsNorm> {
        Ok(RmsNorm::new(w.vector(&format!("{name}.weight"), &[dim], w.dtype)?, eps))
    }

    pub fn new(weight: Tensor, eps: f64) -> RmsNorm {
        RmsNorm { weight: Some(weight), eps }
    }

    /// The same norm with its weight (and eps) changed: `weight * s`, and `eps`. A norm of `c * x`
    /// with eps `e` equals a norm of `x` with eps `e / c^2`, which lets a caller drop a scalar
    /// multiply in front of a norm.
    pub fn rescaled(&self, s: f64, eps: f64) -> Result<RmsNorm> {
        let weight = self.weight.as_ref().map(|w| w.mul_scalar(s)).transpose()?;
        Ok(RmsNorm { weight, eps })
    }

    pub fn no_scale(eps: f64) -> RmsNorm {
        RmsNorm { weight: None, eps }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.rms_norm(self.weight.as_ref(), self.eps)
    }
}
