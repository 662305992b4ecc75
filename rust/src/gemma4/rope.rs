//! `Rope`: cos/sin tables for one layer type, for every position the cache can hold.
//!
//! M:1080-1159 and modeling_rope_utils.py:193-259. `inv_freq[i] = theta^(-2i/d) / factor`; with
//! "proportional" RoPE only the first `int(partial_rotary_factor * d // 2)` frequencies are non-zero
//! (the exponent still divides by the full `d`), so the other dims pass through. Angles are float32;
//! the tables are cast to the compute dtype, as the reference casts cos/sin to the activations'.
//! `rotate_half` pairs dim `i` with dim `i + d/2`.

use crate::error::Result;
use crate::gemma4::config::RopeSpec;
use crate::tensor::{DType, Tensor};

pub struct Rope {
    /// `[positions, d]`
    cos: Tensor,
    sin: Tensor,
    half: i64,
}

/// The inverse frequencies of a layer type with head dim `d`, in float32.
pub fn inv_freq(spec: &RopeSpec, d: i64) -> Vec<f32> {
    let half = (d / 2) as usize;
    let rotated = match spec.partial_rotary_factor {
        None => half,
        Some(p) => ((p * d as f64) / 2.0).floor() as usize,
    };
    (0..half)
        .map(|i| {
            if i < rotated {
                let exponent = (2 * i) as f32 / d as f32;
                (1.0f32 / (spec.theta as f32).powf(exponent)) / spec.factor as f32
            } else {
                0.0
            }
        })
        .collect()
}

impl Rope {
    pub fn new(spec: &RopeSpec, d: i64, positions: i64, like: &Tensor, dtype: DType) -> Result<Rope> {
        let freqs = inv_freq(spec, d);
        let inv = Tensor::from_f32(&freqs, &[1, d / 2])?.to_like(like, DType::F32)?;
        let pos = Tensor::arange(0, positions, DType::F32, like)?.unsqueeze(1)?;
        let angles = pos.mul(&inv)?;
        let emb = Tensor::cat(&[&angles, &angles], 1)?;
        Ok(Rope { cos: emb.cos()?.to_dtype(dtype)?, sin: emb.sin()?.to_dtype(dtype)?, half: d / 2 })
    }

    /// cos and sin at `pos` (`[rows, T]` int64), shaped `[rows, T, 1, d]` to broadcast over heads.
    pub fn at(&self, pos: &Tensor) -> Result<RopeAt> {
        let [rows, t] = pos.size()?[..] else {
            return Err(crate::error::Error::Internal("RoPE positions must be [rows, T]".into()));
        };
        let flat = pos.reshape(&[rows * t])?;
        let d = self.half * 2;
        let pick = |table: &Tensor| table.index_select(0, &flat)?.reshape(&[rows, t, 1, d]);
        Ok(RopeAt { cos: pick(&self.cos)?, sin: pick(&self.sin)?, half: self.half })
    }
}

/// The rotation for one forward's positions.
pub struct RopeAt {
    cos: Tensor,
    sin: Tensor,
    half: i64,
}

impl RopeAt {
    /// `x * cos + rotate_half(x) * sin` for `x` `[rows, T, heads, d]`.
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let x1 = x.narrow(-1, 0, self.half)?;
        let x2 = x.narrow(-1, self.half, self.half)?;
        let rotated = Tensor::cat(&[&x2.mul_scalar(-1.0)?, &x1], -1)?;
        x.mul(&self.cos)?.add(&rotated.mul(&self.sin)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_rope_rotates_every_pair_with_theta_powers() {
        let f = inv_freq(&RopeSpec { theta: 10000.0, partial_rotary_factor: None, factor: 1.0 }, 8);
        let want: Vec<f32> = (0..4).map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / 8.0)).collect();
        assert_eq!(f, want);
    }

    #[test]
    fn proportional_rope_rotates_only_the_first_pairs_with_the_full_dim_exponent() {
        // partial_rotary_factor 0.25 of d = 16: int(0.25 * 16 / 2) = 2 pairs rotate, exponent over 16.
        let f = inv_freq(&RopeSpec { theta: 1e6, partial_rotary_factor: Some(0.25), factor: 1.0 }, 16);
        assert_eq!(f.len(), 8);
        assert_eq!(f[0], 1.0);
        assert_eq!(f[1], 1.0 / 1e6f32.powf(2.0 / 16.0));
        assert!(f[2..].iter().all(|x| *x == 0.0));
    }
}
