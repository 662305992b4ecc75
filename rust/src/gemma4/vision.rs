//! The vision tower (`Gemma4VisionModel`, M:1985-2050): patches to pooled soft tokens, before the
//! embedder (media.rs).
//!
//! - Patch embedder (M:579-620): `input_proj(2 * (pixels - 0.5))` plus the sum of a learned x and a
//!   learned y position row (`position_embedding_table` `[2, S, H]`); zero for padding patches.
//! - Encoder layers (M:946-1002): a bidirectional attention over the image's real patches with
//!   q/k norms, a v norm without weight, 2-D axial RoPE and scaling 1.0 (M:865-943), then a gated
//!   GELU MLP; four norms around them, as the text layers have.
//! - 2-D RoPE (M:685-747, M:820-862): each head's first half rotates by the patch's x position, its
//!   second half by its y position, each half as ordinary rotate-half RoPE over `head_dim / 4`
//!   frequencies `theta^(-2i / (head_dim / 2))`.
//! - Pooler (M:623-680): padding zeroed, then each output token is the mean of a `k x k` block of
//!   patches by position (`k` = `pooling_kernel_size`), in float32, times `sqrt(hidden)`; output rows
//!   no patch falls in are dropped. Then `(x - std_bias) * std_scale` in float32 when `standardize`
//!   (M:2044-2047), and the compute dtype.
//!
//! Patch positions come from the image processor on the host, so the pooling weights are made there.

use crate::error::{Error, Result};
use crate::gemma4::media::{ClippableLinear, VisionConfig};
use crate::gemma4::norm::RmsNorm;
use crate::gemma4::weights::Weights;
use crate::tensor::{DType, Tensor};

struct VisionLayer {
    qkv: [ClippableLinear; 3],
    o_proj: ClippableLinear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    v_norm: RmsNorm,
    mlp: [ClippableLinear; 3],
    /// input, post-attention, pre-feedforward, post-feedforward.
    norms: [RmsNorm; 4],
}

impl VisionLayer {
    fn load(w: &Weights, cfg: &VisionConfig, i: usize) -> Result<VisionLayer> {
        let p = format!("vision_tower.encoder.layers.{i}");
        let (h, d, c) = (cfg.hidden_size, cfg.head_dim, cfg.use_clipped_linears);
        let (q, kv) = (cfg.num_heads * d, cfg.num_kv_heads * d);
        let lin = |name: &str, out: i64, inp: i64| ClippableLinear::load(w, &format!("{p}.{name}"), out, inp, c);
        let norm = |name: &str, dim: i64| RmsNorm::load(w, &format!("{p}.{name}"), dim, cfg.rms_norm_eps);
        let m = cfg.intermediate_size;
        Ok(VisionLayer {
            qkv: [lin("self_attn.q_proj", q, h)?, lin("self_attn.k_proj", kv, h)?, lin("self_attn.v_proj", kv, h)?],
            o_proj: lin("self_attn.o_proj", h, q)?,
            q_norm: norm("self_attn.q_norm", d)?,
            k_norm: norm("self_attn.k_norm", d)?,
            v_norm: RmsNorm::no_scale(cfg.rms_norm_eps),
            mlp: [lin("mlp.gate_proj", m, h)?, lin("mlp.up_proj", m, h)?, lin("mlp.down_proj", h, m)?],
            norms: [
                norm("input_layernorm", h)?,
                norm("post_attention_layernorm", h)?,
                norm("pre_feedforward_layernorm", h)?,
                norm("post_feedforward_layernorm", h)?,
            ],
        })
    }

    /// `x` `[n * P, H]`; `rope` (cos, sin) `[n, P, 1, d]`; `mask` bool `[n, 1, 1, P]` (true: a real patch).
    fn forward(
        &self,
        x: &Tensor,
        cfg: &VisionConfig,
        shape: (i64, i64),
        rope: &(Tensor, Tensor),
        mask: &Tensor,
    ) -> Result<Tensor> {
        let (n, p) = shape;
        let d = cfg.head_dim;
        let heads = |t: Tensor, count: i64| t.reshape(&[n, p, count, d]);
        let normed = self.norms[0].forward(x)?;
        let q = rotate(&self.q_norm.forward(&heads(self.qkv[0].forward(&normed)?, cfg.num_heads)?)?, rope, d)?;
        let k = rotate(&self.k_norm.forward(&heads(self.qkv[1].forward(&normed)?, cfg.num_kv_heads)?)?, rope, d)?;
        let v = self.v_norm.forward(&heads(self.qkv[2].forward(&normed)?, cfg.num_kv_heads)?)?;
        let [q, k, v] = [q, k, v].map(|t| t.transpose(1, 2));
        let attended = Tensor::sdpa(&q?, &k?, &v?, mask, 1.0)?.transpose(1, 2)?.reshape(&[n * p, cfg.num_heads * d])?;
        let x = x.add(&self.norms[1].forward(&self.o_proj.forward(&attended)?)?)?;
        let normed = self.norms[2].forward(&x)?;
        let gated = self.mlp[0].forward(&normed)?.gelu_tanh()?.mul(&self.mlp[1].forward(&normed)?)?;
        x.add(&self.norms[3].forward(&self.mlp[2].forward(&gated)?)?)
    }
}

/// `x * cos + rotate_half(x) * sin` on each half of the head dim (`apply_multidimensional_rope`, M:820-862):
/// `x` `[n, P, heads, d]`, cos and sin `[n, P, 1, d]`.
fn rotate(x: &Tensor, rope: &(Tensor, Tensor), d: i64) -> Result<Tensor> {
    let (half, quarter) = (d / 2, d / 4);
    let parts = x.split(&[half, half], -1)?;
    let rotated = parts
        .iter()
        .map(|part| {
            let [a, b] = part.split_array(&[quarter, quarter], -1)?;
            Tensor::cat(&[&b.mul_scalar(-1.0)?, &a], -1)
        })
        .collect::<Result<Vec<_>>>()?;
    let rotated = Tensor::cat(&rotated.iter().collect::<Vec<_>>(), -1)?;
    x.mul(&rope.0)?.add(&rotated.mul(&rope.1)?)
}

pub struct VisionTower {
    cfg: VisionConfig,
    input_proj: crate::gemma4::linear::Linear,
    /// `[2, S, H]`: x rows, then y rows.
    position_table: Tensor,
    layers: Vec<VisionLayer>,
    /// `inv_freq` `[d / 4]`, float32.
    inv_freq: Tensor,
    /// (std_bias, std_scale), float32, when `standardize`.
    standardize: Option<(Tensor, Tensor)>,
    dtype: DType,
}

impl VisionTower {
    /// Load `vision_tower.*` of `w` (names relative to `model.`).
    pub fn load(w: &Weights, cfg: &VisionConfig) -> Result<VisionTower> {
        let (h, p) = (cfg.hidden_size, cfg.patch_size);
        let spatial = cfg.head_dim / 2;
        let inv_freq: Vec<f32> = (0..spatial / 2)
            .map(|i| (1.0 / cfg.rope_parameters.rope_theta.powf((2 * i) as f64 / spatial as f64)) as f32)
            .collect();
        let standardize = if cfg.standardize {
            let v = |name: &str| w.vector(&format!("vision_tower.{name}"), &[h], DType::F32);
            Some((v("std_bias")?, v("std_scale")?))
        } else {
            None
        };
        Ok(VisionTower {
            input_proj: w.linear("vision_tower.patch_embedder.input_proj", h, 3 * p * p)?,
            position_table: w.vector(
                "vision_tower.patch_embedder.position_embedding_table",
                &[2, cfg.position_embedding_size, h],
                w.dtype,
            )?,
            layers: (0..cfg.num_layers).map(|i| VisionLayer::load(w, cfg, i)).collect::<Result<_>>()?,
            inv_freq: Tensor::from_f32(&inv_freq, &[spatial / 2])?.to_like(&w.like, DType::F32)?,
            standardize,
            dtype: w.dtype,
            cfg: cfg.clone(),
        })
    }

    /// Pooled soft tokens before the embedder, one `[soft_i, H]` per image: `pixels` `[n, P, 3 p^2]`
    /// float32 in [0, 1] and `positions` `[n, P, 2]` int64 on the device, `host_positions` the same on
    /// the host.
    pub fn forward(&self, pixels: &Tensor, positions: &Tensor, host_positions: &Tensor) -> Result<Vec<Tensor>> {
        let size = pixels.size()?;
        let (n, p, h) = (size[0], size[1], self.cfg.hidden_size);
        let pos = host_positions.to_vec_i64()?;
        self.check(&size, &pos)?;
        // A padding patch is (-1, -1) (M:2032).
        let flags = |padding: bool| -> Result<Tensor> {
            let v: Vec<i64> = pos.chunks(2).map(|xy| ((xy[0] == -1 && xy[1] == -1) == padding) as i64).collect();
            Tensor::from_i64(&v)?.to_like(pixels, DType::Bool)?.reshape(&[n, p])
        };
        let (real, padding) = (flags(false)?, flags(true)?);
        let mut x = self.embed(pixels, &pos, &padding, n * p)?;
        let rope = self.rope(positions, n, p)?;
        let mask = real.reshape(&[n, 1, 1, p])?;
        for layer in &self.layers {
            x = layer.forward(&x, &self.cfg, (n, p), &rope, &mask)?;
        }
        let x = x.reshape(&[n, p, h])?.masked_fill(&padding.unsqueeze(2)?, 0.0)?;
        self.pool(&x, &pos, n, p)
    }

    /// Shapes and positions a processor would make: `[n, P, 3 p^2]`, P a multiple of k^2, positions inside the table.
    fn check(&self, size: &[i64], pos: &[i64]) -> Result<()> {
        let (p, k2) = (self.cfg.patch_size, self.cfg.pooling_kernel_size.pow(2));
        if size.len() != 3 || size[2] != 3 * p * p || size[1] % k2 != 0 || size[1] == 0 {
            return Err(Error::Input(format!(
                "pixel_values must be [images, patches, {}] with patches a multiple of {k2}, got {size:?}",
                3 * p * p
            )));
        }
        if pos.len() as i64 != size[0] * size[1] * 2 {
            return Err(Error::Input(format!("position_ids must be [{}, {}, 2]", size[0], size[1])));
        }
        let limit = self.cfg.position_embedding_size;
        if let Some(bad) = pos.iter().find(|&&v| v < -1 || v >= limit) {
            return Err(Error::Input(format!(
                "a patch position is {bad}; positions must be in [0, {limit}) or -1 for padding"
            )));
        }
        Ok(())
    }

    /// The patch embedder (module docs): `[n * P, H]` from float32 `pixels`, scaled before the cast to
    /// the compute dtype as the reference does.
    fn embed(&self, pixels: &Tensor, pos: &[i64], padding: &Tensor, rows: i64) -> Result<Tensor> {
        let centred = pixels.to_dtype(DType::F32)?.copy()?;
        centred.add_scalar_(-0.5)?;
        let scaled = centred.mul_scalar(2.0)?.to_dtype(self.dtype)?.reshape(&[rows, -1])?;
        let projected = self.input_proj.forward(&scaled)?;
        let axis = |a: usize| -> Result<Tensor> {
            let v: Vec<i64> = pos.chunks(2).map(|xy| xy[a].max(0)).collect();
            Tensor::from_i64(&v)?.to_like(pixels, DType::I64)
        };
        let table = self.position_table.unbind(0)?;
        let (xs, ys) = (table[0].index_select(0, &axis(0)?)?, table[1].index_select(0, &axis(1)?)?);
        let position = xs.add(&ys)?.masked_fill(&padding.reshape(&[rows, 1])?, 0.0)?;
        projected.add(&position)
    }

    /// (cos, sin) `[n, P, 1, d]` in the compute dtype (module docs).
    fn rope(&self, positions: &Tensor, n: i64, p: i64) -> Result<(Tensor, Tensor)> {
        let q = self.cfg.head_dim / 4;
        let freqs = positions.to_dtype(DType::F32)?.unsqueeze(3)?.mul(&self.inv_freq.reshape(&[1, 1, 1, q])?)?;
        let layout = |t: Tensor| -> Result<Tensor> {
            let [x, y] = t.split_array(&[1, 1], 2)?;
            let (x, y) = (x.reshape(&[n, p, q])?, y.reshape(&[n, p, q])?);
            Tensor::cat(&[&x, &x, &y, &y], -1)?.to_dtype(self.dtype)?.reshape(&[n, p, 1, 4 * q])
        };
        Ok((layout(freqs.cos()?)?, layout(freqs.sin()?)?))
    }

    /// The pooler and standardisation (module docs): one `[soft_i, H]` per image.
    fn pool(&self, x: &Tensor, pos: &[i64], n: i64, p: i64) -> Result<Vec<Tensor>> {
        let k = self.cfg.pooling_kernel_size;
        let length = p / (k * k);
        let mut out = Vec::with_capacity(n as usize);
        for i in 0..n {
            let (weights, kept) = pooling_weights(&pos[(i * p * 2) as usize..((i + 1) * p * 2) as usize], k, length);
            let w = Tensor::from_f32(&weights, &[length, p])?.to_like(x, DType::F32)?;
            let pooled = w.matmul(&x.narrow(0, i, 1)?.reshape(&[p, self.cfg.hidden_size])?.to_dtype(DType::F32)?)?;
            let pooled =
                pooled.to_dtype(self.dtype)?.to_dtype(DType::F32)?.mul_scalar((self.cfg.hidden_size as f64).sqrt())?;
            let index = Tensor::from_i64(&kept)?.to_like(x, DType::I64)?;
            let pooled = pooled.index_select(0, &index)?;
            let pooled = match &self.standardize {
                Some((bias, scale)) => pooled.sub(bias)?.mul(scale)?,
                None => pooled,
            };
            out.push(pooled.to_dtype(self.dtype)?);
        }
        Ok(out)
    }
}

/// `_avg_pool_by_positions` (M:640-665) for one image: the `[length, P]` float32 weights (1 / k^2 where
/// patch j falls in output cell i) and the output cells some patch falls in. Padding patches (-1)
/// count as position (0, 0), as the reference clamps them; their states are zero.
fn pooling_weights(pos: &[i64], k: i64, length: i64) -> (Vec<f32>, Vec<i64>) {
    let p = pos.len() / 2;
    let max_x = pos.chunks(2).map(|xy| xy[0].max(0)).max().unwrap_or(0) + 1;
    let mut weights = vec![0f32; length as usize * p];
    let mut hit = vec![false; length as usize];
    for (j, xy) in pos.chunks(2).enumerate() {
        let cell = xy[0].max(0) / k + (max_x / k) * (xy[1].max(0) / k);
        if (0..length).contains(&cell) {
            weights[cell as usize * p + j] = 1.0 / (k * k) as f32;
            hit[cell as usize] = true;
        }
    }
    let kept = (0..length).filter(|&c| hit[c as usize]).collect();
    (weights, kept)
}

#[cfg(test)]
mod tests {
    use super::pooling_weights;

    #[test]
    fn pools_two_by_two_blocks_by_position_and_drops_cells_no_patch_reaches() {
        // A 4 x 2 grid of patches (x 0..4, y 0..2) and two padding patches; k = 2, 3 output cells.
        let mut pos: Vec<i64> = (0..2).flat_map(|y| (0..4).flat_map(move |x| [x, y])).collect();
        pos.extend([-1, -1, -1, -1]);
        let (w, kept) = pooling_weights(&pos, 2, 3);
        assert_eq!(kept, vec![0, 1]);
        let row = |c: usize| &w[c * 10..(c + 1) * 10];
        assert_eq!(row(0), &[0.25, 0.25, 0.0, 0.0, 0.25, 0.25, 0.0, 0.0, 0.25, 0.25]);
        assert_eq!(row(1), &[0.0, 0.0, 0.25, 0.25, 0.0, 0.0, 0.25, 0.25, 0.0, 0.0]);
    }
}
