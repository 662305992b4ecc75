//! `Rope`: cos/sin tables for one layer type, for every position the cache can hold.
//!
//! M:1080-1159 and modeling_rope_utils.py:193-259. `inv_freq[i] = theta^(-2i/d) / factor`; with
//! "proportional" RoPE only the first `int(partial_rotary_factor * d // 2)` frequencies are non-zero
//! (the exponent still divides by the full `d`), so the other dims pass through. Angles are float32;
//! the tables are cast to the compute dtype, as the reference casts cos/sin to the activations'.
//! `rotate_half` pairs dim `i` with dim `i + d/2`: `rotate_half(x) = cat(-x2, x1)` is
//! `roll(x, d/2) * sign` with `sign = [-1] * d/2 + [1] * d/2`, so the sine table is stored with that
//! sign folded in and a rotation is three ATen calls in float32, `addcmul(x * cos, roll(x), sin_signed)`,
//! and four in 16-bit dtypes, `x * cos + roll(x) * sin_signed`, where `addcmul`'s single rounding of
//! the sum would differ from the reference's.

use crate::error::Result;
use crate::gemma4::attention::Positions;
use crate::gemma4::config::RopeSpec;
use crate::tensor::{DType, Tensor};

pub struct Rope {
    /// `[positions, 1, 1, d]`: one index_select gives a decode step's `[rows, 1, 1, d]`.
    cos: Tensor,
    /// `sin * sign` (see the module docs), `[positions, 1, 1, d]`.
    sin_signed: Tensor,
    half: i64,
    /// Whether `apply` may use `addcmul` (float32; module docs).
    fused: bool,
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
        let sin = emb.sin()?;
        let sin_signed = Tensor::cat(&[&sin.narrow(1, 0, d / 2)?.mul_scalar(-1.0)?, &sin.narrow(1, d / 2, d / 2)?], 1)?;
        let table = |t: &Tensor| t.to_dtype(dtype)?.reshape(&[positions, 1, 1, d]);
        let fused = dtype == DType::F32;
        Ok(Rope { cos: table(&emb.cos()?)?, sin_signed: table(&sin_signed)?, half: d / 2, fused })
    }

    /// cos and sin at `pos`, shaped `[rows, 1, T, d]` to broadcast over the heads of
    /// `[rows, heads, T, d]`.
    pub fn at(&self, pos: &Positions) -> Result<RopeAt> {
        let (rows, t, d) = (pos.rows, pos.t, self.half * 2);
        let pick = |table: &Tensor| {
            let picked = table.index_select(0, &pos.flat)?; // [rows * T, 1, 1, d]
            if t == 1 { Ok(picked) } else { picked.reshape(&[rows, 1, t, d]) }
        };
        Ok(RopeAt { cos: pick(&self.cos)?, sin_signed: pick(&self.sin_signed)?, half: self.half, fused: self.fused })
    }
}

/// The rotation for one forward's positions.
pub struct RopeAt {
    cos: Tensor,
    sin_signed: Tensor,
    half: i64,
    fused: bool,
}

impl RopeAt {
    /// `x * cos + rotate_half(x) * sin` for `x` `[rows, heads, T, d]`.
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let rolled = x.roll(self.half, -1)?;
        if self.fused {
            return x.mul(&self.cos)?.addcmul(&rolled, &self.sin_signed);
        }
        x.mul(&self.cos)?.add(&rolled.mul(&self.sin_signed)?)
    }

    /// `apply(x)` written into `out` (which may be `x`: the products are made before the write).
    pub fn apply_into(&self, x: &Tensor, out: &Tensor) -> Result<()> {
        if self.fused {
            return x.mul(&self.cos)?.addcmul_into(&x.roll(self.half, -1)?, &self.sin_signed, out);
        }
        out.copy_(&self.apply(x)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rotation_is_rotate_half_as_transformers_writes_it() {
        // d = 4, positions 0..3: x * cos + cat(-x2, x1) * sin, spelled out on the host.
        let spec = RopeSpec { theta: 10000.0, partial_rotary_factor: None, factor: 1.0 };
        let like = Tensor::from_f32(&[0.0], &[1]).unwrap();
        let rope = Rope::new(&spec, 4, 3, &like, DType::F32).unwrap();
        let x: Vec<f32> = vec![0.5, -1.0, 2.0, 0.25];
        let pos = Positions::new(&Tensor::from_i64(&[2]).unwrap().reshape(&[1, 1]).unwrap()).unwrap();
        let xt = Tensor::from_f32(&x, &[1, 1, 1, 4]).unwrap();
        let got = rope.at(&pos).unwrap().apply(&xt).unwrap().to_vec_f32().unwrap();
        let f = inv_freq(&spec, 4);
        let (c, s): (Vec<f32>, Vec<f32>) = (0..4).map(|i| ((2.0 * f[i % 2]).cos(), (2.0 * f[i % 2]).sin())).unzip();
        let rot = [-x[2], -x[3], x[0], x[1]];
        for i in 0..4 {
            let want = x[i] * c[i] + rot[i] * s[i];
            assert!((got[i] - want).abs() < 1e-6, "dim {i}: {} vs {want}", got[i]);
        }
    }

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
