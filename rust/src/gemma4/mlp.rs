//! `Mlp`: `down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))` (M:1061-1077); KV-shared layers of a
//! `use_double_wide_mlp` model are twice as wide (the width comes from `LayerSpec`). The gate and
//! up projections are one matrix product (their weights stacked at load), split into views.

use crate::error::Result;
use crate::gemma4::linear::Linear;
use crate::gemma4::parallel::Split;
use crate::gemma4::scratch::Scratch;
use crate::gemma4::weights::Weights;
use crate::tensor::Tensor;

pub struct Mlp {
    gate_up_proj: Linear,
    /// Row-parallel: this rank's input columns.
    down_proj: Linear,
    intermediate: i64,
    /// Sums the ranks' outputs (None: the caller sums them, with the experts' in one collective).
    reduce: Option<Split>,
}

impl Mlp {
    /// This rank's part (parallel.rs): gate and up column-parallel, down row-parallel; `reduce`: the
    /// output is the sum over the ranks, else this rank's partial sum.
    pub fn load(w: &Weights, prefix: &str, hidden: i64, intermediate: i64, split: &Split, reduce: bool) -> Result<Mlp> {
        let (gate, up) = (format!("{prefix}.gate_proj"), format!("{prefix}.up_proj"));
        let tp = split.tp;
        let rows = tp.rows(intermediate);
        Ok(Mlp {
            gate_up_proj: w.fused_slices(&[(&gate, intermediate, rows), (&up, intermediate, rows)], hidden)?,
            down_proj: w.linear_slice(&format!("{prefix}.down_proj"), hidden, intermediate, tp.cols(intermediate))?,
            intermediate: intermediate / tp.size,
            reduce: reduce.then(|| split.clone()),
        })
    }

    /// `x` `[rows, hidden]`; `scratch` (one-token forwards) takes the gate and up projections.
    pub fn forward(&self, x: &Tensor, scratch: Option<&mut Scratch>) -> Result<Tensor> {
        let i = self.intermediate;
        let [gate, up] = match scratch {
            Some(scratch) => {
                let n = x.size()?[0];
                let b = scratch.get("mlp.gate_up", &[n, i], &[n, 2 * i], |w| w.split(&[i, i], -1))?;
                self.gate_up_proj.forward_into(x, &b.whole)?;
                [b.views[0].shallow_clone()?, b.views[1].shallow_clone()?]
            }
            None => self.gate_up_proj.forward(x)?.split_array(&[i, i], -1)?,
        };
        let out = self.down_proj.forward(&gate.gelu_tanh()?.mul(&up)?)?;
        match &self.reduce {
            Some(split) => split.sum(out),
            None => Ok(out),
        }
    }
}
