//! `Mlp`: `down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))` (M:1061-1077); KV-shared layers of a
//! `use_double_wide_mlp` model are twice as wide (the width comes from `LayerSpec`).

use crate::error::Result;
use crate::gemma4::weights::Weights;
use crate::tensor::Tensor;

pub struct Mlp {
    gate_proj: Tensor,
    up_proj: Tensor,
    down_proj: Tensor,
}

impl Mlp {
    pub fn load(w: &Weights, prefix: &str, hidden: i64, intermediate: i64) -> Result<Mlp> {
        Ok(Mlp {
            gate_proj: w.linear(&format!("{prefix}.gate_proj"), intermediate, hidden)?,
            up_proj: w.linear(&format!("{prefix}.up_proj"), intermediate, hidden)?,
            down_proj: w.linear(&format!("{prefix}.down_proj"), hidden, intermediate)?,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gate = x.linear(&self.gate_proj)?.gelu_tanh()?;
        gate.mul(&x.linear(&self.up_proj)?)?.linear(&self.down_proj)
    }
}
