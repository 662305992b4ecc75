//! The audio tower (`Gemma4AudioModel`, M:1899-1982): mel frames to soft tokens, before the embedder
//! (media.rs). Transformers 5.18 `modeling_gemma4.py`, a Conformer (USM):
//!
//! - Subsampling (M:357-412): the features as one channel, two `Conv2d` 3x3 stride 2 pad 1 (no bias),
//!   each followed by a LayerNorm over channels (no bias) and ReLU; the frames' mask zeroes the input
//!   of each conv and is subsampled `mask[:, ::2]` after it. Then (frequency, channel) flattened per
//!   frame and `input_proj_linear`: a quarter of the frames, each a row of `hidden_size`.
//! - Relative positions (M:218-246): sin then cos of the distances `(C + P + F) / 2` down to 0 (`P` for
//!   the default `C = P`, `F = 0`; letters as in the attention below) times `10000^(-i / (H/2 - 1))`; the
//!   timescales in float32 rounded to the compute dtype, as the reference's buffer is (M:1480-1490), the
//!   rest in the compute dtype.
//! - Each layer (M:525-576): a half-step feed-forward, chunked local attention, a light convolution,
//!   another half-step feed-forward, each with clamps at `gradient_clipping` and RMSNorms (eps 1e-6
//!   where the reference leaves the default, `rms_norm_eps` in the convolution module).
//! - Feed-forward (M:415-448): clamp, norm, `ffw_layer_1`, SiLU, `ffw_layer_2`, clamp, norm, times
//!   `residual_weight`, plus the input.
//! - Light convolution (M:451-522): norm, `linear_start`, GLU, a depthwise causal `Conv1d` (left pad
//!   `kernel - 1`), clamp, norm, SiLU, `linear_end`, plus the input.
//! - Attention (M:249-354), in float32: q scaled by `head_dim^-0.5 / ln 2 * softplus(per_dim_scale)`,
//!   k by `ln(1 + e) / ln 2`. Queries in blocks of `C = attention_chunk_size`; each block's keys and
//!   values are the `C + P + F` frames from `P` before it to `F = attention_context_right` after its
//!   end. Logits are `q.k` plus `q.relative_k_proj(position)` rel-shifted (Transformer-XL appendix B),
//!   soft-capped `tanh(x / cap) * cap`, masked to `attention_invalid_logits_value`, softmaxed.
//! - The mask (M:1883-1896, M:1923-1948, M:1962-1971; `create_bidirectional_mask` of masking_utils.py
//!   with the sliding window as its `and_mask_function`): key `kv` is seen by query `q` when `kv` is a
//!   real frame and `0 <= q - kv < P` or `0 < kv - q < F`. Padding frames are masked as keys only:
//!   padded query rows attend as the others do, and are dropped by the caller (the returned mask).
//!   Note `q - kv = P` is in the context but masked (the window is `P` frames including `q` itself).
//! - `output_proj` with its bias (M:1981), summed in float32 and rounded once as `addmm` does.
//!
//! Where the reference rounds once and two ATen ops would round twice in a 16-bit dtype (`F.glu`, a
//! linear with its bias), the engine computes in float32 and rounds once.

use crate::error::{Error, Result};
use crate::gemma4::linear::Linear;
use crate::gemma4::media::{AudioConfig, ClippableLinear};
use crate::gemma4::norm::RmsNorm;
use crate::gemma4::weights::Weights;
use crate::tensor::{DType, Tensor};

/// `Gemma4RMSNorm`'s default eps, which the feed-forward and layer norms keep (M:198, M:423, M:535-537).
const DEFAULT_EPS: f64 = 1e-6;

/// `min(gradient_clipping, torch.finfo(dtype).max)` (M:432, M:515, M:549).
fn clip_bound(gradient_clipping: f64, dtype: DType) -> f64 {
    let max = match dtype {
        DType::F16 => 65504.0,
        DType::BF16 => 3.3895313892515355e38,
        _ => f32::MAX as f64,
    };
    gradient_clipping.min(max)
}

/// A host index or mask on `like`'s device (`dtype` I64 or Bool).
fn device_i64(values: &[i64], shape: &[i64], dtype: DType, like: &Tensor) -> Result<Tensor> {
    Tensor::from_i64(values)?.to_like(like, dtype)?.reshape(shape)
}

/// `x[:, ::2]` of a `[n, len]` mask (M:379-380).
fn every_other(mask: &Tensor, len: i64) -> Result<Tensor> {
    let index: Vec<i64> = (0..len).step_by(2).collect();
    mask.index_select(1, &device_i64(&index, &[index.len() as i64], DType::I64, mask)?)
}

/// `Gemma4AudioSubSampleConvProjectionLayer` (M:357-382).
struct SubsampleLayer {
    /// `[out, in, 3, 3]`.
    conv: Tensor,
    /// LayerNorm weight `[out]`.
    norm: Tensor,
    eps: f64,
}

impl SubsampleLayer {
    fn load(w: &Weights, name: &str, out: i64, inp: i64, eps: f64) -> Result<SubsampleLayer> {
        Ok(SubsampleLayer {
            conv: w.vector(&format!("{name}.conv.weight"), &[out, inp, 3, 3], w.dtype)?,
            norm: w.vector(&format!("{name}.norm.weight"), &[out], w.dtype)?,
            eps,
        })
    }

    /// `x` `[n, in, T, F]` (compute dtype), `mask` bool `[n, T]` → (`[n, out, ceil(T/2), ceil(F/2)]`,
    /// mask `[n, ceil(T/2)]`).
    fn forward(&self, x: &Tensor, mask: &Tensor, dtype: DType) -> Result<(Tensor, Tensor)> {
        let size = x.size()?;
        let (n, frames) = (size[0], size[2]);
        let keep = mask.to_dtype(dtype)?.reshape(&[n, 1, frames, 1])?;
        let conv = x.mul(&keep)?.conv2d(&self.conv, 2, 1)?;
        let out = conv.size()?;
        let normed = conv.permute(&[0, 2, 3, 1])?.layer_norm(Some(&self.norm), self.eps)?;
        // `.contiguous()` before the ReLU (M:377), so that the next conv sees the reference's layout:
        // flattening the permuted dims copies, the second reshape is a view.
        let normed = normed.permute(&[0, 3, 1, 2])?.reshape(&[n, -1])?.reshape(&out)?;
        Ok((normed.relu()?, every_other(mask, frames)?))
    }
}

/// `Gemma4AudioSubSampleConvProjection` (M:385-412).
struct Subsample {
    layers: [SubsampleLayer; 2],
    input_proj: Linear,
    /// `input_proj_linear`'s input width: `(channels[0] / 4) * channels[1]` (M:398).
    proj_in: i64,
    dtype: DType,
}

impl Subsample {
    fn load(w: &Weights, cfg: &AudioConfig) -> Result<Subsample> {
        let p = "audio_tower.subsample_conv_projection";
        let [c0, c1] = cfg.conv_channels;
        let proj_in = (c0 / 4) * c1;
        Ok(Subsample {
            layers: [
                SubsampleLayer::load(w, &format!("{p}.layer0"), c0, 1, cfg.rms_norm_eps)?,
                SubsampleLayer::load(w, &format!("{p}.layer1"), c1, c0, cfg.rms_norm_eps)?,
            ],
            input_proj: w.linear(&format!("{p}.input_proj_linear"), cfg.hidden_size, proj_in)?,
            proj_in,
            dtype: w.dtype,
        })
    }

    /// `features` `[n, T, mel]`, `mask` `[n, T]` → (`[n * t, H]`, mask `[n, t]`, t).
    fn forward(&self, features: &Tensor, mask: &Tensor) -> Result<(Tensor, Tensor, i64)> {
        let (x, mask) = self.layers[0].forward(&features.unsqueeze(1)?, mask, self.dtype)?;
        let (x, mask) = self.layers[1].forward(&x, &mask, self.dtype)?;
        let size = x.size()?;
        let (n, t) = (size[0], size[2]);
        let rows = x.permute(&[0, 2, 3, 1])?.reshape(&[n * t, size[1] * size[3]])?;
        Ok((self.input_proj.forward(&rows)?, mask, t))
    }
}

/// `Gemma4AudioFeedForward` (M:415-448).
struct FeedForward {
    ffw: [ClippableLinear; 2],
    /// pre, post.
    norms: [RmsNorm; 2],
    residual_weight: f64,
    clip: f64,
}

impl FeedForward {
    fn load(w: &Weights, cfg: &AudioConfig, p: &str) -> Result<FeedForward> {
        let (h, c) = (cfg.hidden_size, cfg.use_clipped_linears);
        let norm = |name: &str| RmsNorm::load(w, &format!("{p}.{name}"), h, DEFAULT_EPS);
        Ok(FeedForward {
            ffw: [
                ClippableLinear::load(w, &format!("{p}.ffw_layer_1"), 4 * h, h, c)?,
                ClippableLinear::load(w, &format!("{p}.ffw_layer_2"), h, 4 * h, c)?,
            ],
            norms: [norm("pre_layer_norm")?, norm("post_layer_norm")?],
            residual_weight: cfg.residual_weight,
            clip: clip_bound(cfg.gradient_clipping, w.dtype),
        })
    }

    /// `x` `[rows, H]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let normed = self.norms[0].forward(&x.clamp(-self.clip, self.clip)?)?;
        let inner = self.ffw[1].forward(&self.ffw[0].forward(&normed)?.silu()?)?;
        let out = self.norms[1].forward(&inner.clamp(-self.clip, self.clip)?)?;
        out.mul_scalar(self.residual_weight)?.add(x)
    }
}

/// `Gemma4AudioLightConv1d` with its `Gemma4AudioCausalConv1d` (M:451-522).
struct LightConv {
    linear_start: ClippableLinear,
    linear_end: ClippableLinear,
    /// Depthwise `[H, 1, kernel]`.
    conv: Tensor,
    /// pre, conv.
    norms: [RmsNorm; 2],
    clip: f64,
    dtype: DType,
}

impl LightConv {
    fn load(w: &Weights, cfg: &AudioConfig, p: &str) -> Result<LightConv> {
        let (h, c) = (cfg.hidden_size, cfg.use_clipped_linears);
        let norm = |name: &str| RmsNorm::load(w, &format!("{p}.{name}"), h, cfg.rms_norm_eps);
        Ok(LightConv {
            linear_start: ClippableLinear::load(w, &format!("{p}.linear_start"), 2 * h, h, c)?,
            linear_end: ClippableLinear::load(w, &format!("{p}.linear_end"), h, h, c)?,
            conv: w.vector(&format!("{p}.depthwise_conv1d.weight"), &[h, 1, cfg.conv_kernel_size], w.dtype)?,
            norms: [norm("pre_layer_norm")?, norm("conv_norm")?],
            clip: clip_bound(cfg.gradient_clipping, w.dtype),
            dtype: w.dtype,
        })
    }

    /// `x` `[n * t, H]`.
    fn forward(&self, x: &Tensor, n: i64, t: i64) -> Result<Tensor> {
        let size = self.conv.size()?;
        let (h, kernel) = (size[0], size[2]);
        let [a, b] = self.linear_start.forward(&self.norms[0].forward(x)?)?.split_array(&[h, h], -1)?;
        // `F.glu` computes `a * sigmoid(b)` in float32 and rounds once.
        let gated = a.as_dtype(DType::F32)?.mul(&b.as_dtype(DType::F32)?.sigmoid()?)?.as_dtype(self.dtype)?;
        let channels = gated.reshape(&[n, t, h])?.transpose(1, 2)?.pad_dim(2, kernel - 1, 0, 0.0)?;
        let conv = channels.conv1d(&self.conv, 1, 0, h)?.transpose(1, 2)?.reshape(&[n * t, h])?;
        let normed = self.norms[1].forward(&conv.clamp(-self.clip, self.clip)?)?;
        self.linear_end.forward(&normed.silu()?)?.add(x)
    }
}

/// The block geometry of the chunked attention (M:249-303): `num_blocks` blocks of `chunk` queries,
/// each with `context` keys starting `past` frames before the block.
struct Blocks {
    n: i64,
    t: i64,
    chunk: i64,
    past: i64,
    future: i64,
    context: i64,
    num_blocks: i64,
    /// int64 `[num_blocks * context]`: the frame of each block's key `j`, plus `past` (the index into
    /// frames padded by `past` before them).
    context_index: Tensor,
}

impl Blocks {
    fn new(cfg: &AudioConfig, n: i64, t: i64, like: &Tensor) -> Result<Blocks> {
        let (chunk, past, future) =
            (cfg.attention_chunk_size, cfg.attention_context_left - 1, cfg.attention_context_right);
        let context = chunk + past + future;
        let num_blocks = (t + chunk - 1) / chunk;
        let index: Vec<i64> = (0..num_blocks).flat_map(|b| (0..context).map(move |j| b * chunk + j)).collect();
        let context_index = device_i64(&index, &[num_blocks * context], DType::I64, like)?;
        Ok(Blocks { n, t, chunk, past, future, context, num_blocks, context_index })
    }

    /// `_convert_to_block` (M:278-284): `[n, t, heads, d]` → `[n, blocks, chunk, heads, d]`.
    fn queries(&self, x: &Tensor, heads: i64, d: i64) -> Result<Tensor> {
        let padded = x.pad_dim(1, 0, self.num_blocks * self.chunk - self.t, 0.0)?;
        padded.reshape(&[self.n, self.num_blocks, self.chunk, heads, d])
    }

    /// `_extract_block_context` (M:286-294): `[n, t, heads, d]` → `[n, blocks, context, heads, d]`.
    fn context(&self, x: &Tensor, heads: i64, d: i64) -> Result<Tensor> {
        let padded = x.pad_dim(1, self.past, self.future + self.chunk - 1, 0.0)?;
        padded.index_select(1, &self.context_index)?.reshape(&[self.n, self.num_blocks, self.context, heads, d])
    }

    /// `_rel_shift` (M:296-303): `[n, heads, blocks, chunk, positions]` → `[n, heads, blocks, chunk, context]`.
    fn rel_shift(&self, x: &Tensor, heads: i64) -> Result<Tensor> {
        let positions = x.size()?[4];
        let (c, w) = (self.chunk, self.context);
        let padded =
            x.pad_dim(4, 0, w + 1 - positions, 0.0)?.reshape(&[self.n, heads, self.num_blocks, c * (w + 1)])?;
        padded.narrow(3, 0, c * w)?.reshape(&[self.n, heads, self.num_blocks, c, w])
    }

    /// The blocked attention mask (module docs; M:1923-1948): bool `[n, 1, blocks, chunk, context]`, true
    /// where query `q` sees key `kv`. `mask` bool `[n, t]`: the real frames.
    fn mask(&self, mask: &Tensor, right: i64) -> Result<Tensor> {
        let (c, w, nb) = (self.chunk, self.context, self.num_blocks);
        let keys = mask.pad_dim(1, self.past, self.future + c, 0.0)?.index_select(1, &self.context_index)?;
        let keys = keys.reshape(&[self.n, 1, nb, 1, w])?;
        let mut window = Vec::with_capacity((nb * c * w) as usize);
        for b in 0..nb {
            for i in 0..c {
                for j in 0..w {
                    let q = b * c + i;
                    let dist = i + self.past - j;
                    let near = (0..self.past).contains(&dist) || (dist < 0 && -dist < right);
                    window.push((q < self.t && near) as i64);
                }
            }
        }
        let window = device_i64(&window, &[1, 1, nb, c, w], DType::Bool, mask)?;
        keys.logical_and(&window)
    }
}

/// `Gemma4AudioAttention` (M:249-354).
struct Attention {
    /// q, k, v.
    qkv: [ClippableLinear; 3],
    post: ClippableLinear,
    relative_k_proj: Linear,
    /// `softplus(per_dim_scale)` `[head_dim]`, in the compute dtype as the reference computes it.
    per_dim_scale: Tensor,
    heads: i64,
    head_dim: i64,
    /// `attention_logit_cap` and `attention_invalid_logits_value`, 0-d float32 on the device.
    cap: Tensor,
    invalid: Tensor,
    dtype: DType,
}

impl Attention {
    fn load(w: &Weights, cfg: &AudioConfig, p: &str) -> Result<Attention> {
        let (h, c) = (cfg.hidden_size, cfg.use_clipped_linears);
        let head_dim = h / cfg.num_heads;
        let lin = |name: &str| ClippableLinear::load(w, &format!("{p}.{name}"), h, h, c);
        Ok(Attention {
            qkv: [lin("q_proj")?, lin("k_proj")?, lin("v_proj")?],
            post: lin("post")?,
            relative_k_proj: w.linear(&format!("{p}.relative_k_proj"), h, h)?,
            per_dim_scale: w.vector(&format!("{p}.per_dim_scale"), &[head_dim], w.dtype)?.softplus()?,
            heads: cfg.num_heads,
            head_dim,
            cap: Tensor::full(&[], cfg.attention_logit_cap, DType::F32, &w.like)?,
            invalid: Tensor::full(&[], cfg.attention_invalid_logits_value, DType::F32, &w.like)?,
            dtype: w.dtype,
        })
    }

    /// `x` `[n * t, H]`, `positions` from `positions` (compute dtype), `mask` from `Blocks::mask`.
    fn forward(&self, x: &Tensor, positions: &Tensor, blocks: &Blocks, mask: &Tensor) -> Result<Tensor> {
        let (n, t, heads, d) = (blocks.n, blocks.t, self.heads, self.head_dim);
        let q_scale = (d as f64).powf(-0.5) / std::f64::consts::LN_2;
        let k_scale = (1.0 + std::f64::consts::E).ln() / std::f64::consts::LN_2;
        let project = |i: usize| self.qkv[i].forward(x)?.to_dtype(DType::F32)?.reshape(&[n, t, heads, d]);
        let q = project(0)?.mul_scalar(q_scale)?.mul(&self.per_dim_scale)?;
        let k = project(1)?.mul_scalar(k_scale)?;
        let (q, k, v) =
            (blocks.queries(&q, heads, d)?, blocks.context(&k, heads, d)?, blocks.context(&project(2)?, heads, d)?);
        let relative = self.relative_k_proj.forward(positions)?.reshape(&[-1, heads, d])?.to_dtype(DType::F32)?;
        let queries = q.permute(&[0, 3, 1, 2, 4])?;
        let ac = queries.matmul(&k.permute(&[0, 3, 1, 4, 2])?)?;
        let flat = queries.reshape(&[n, heads, -1, d])?;
        let bd =
            flat.matmul(&relative.permute(&[1, 2, 0])?)?.reshape(&[n, heads, blocks.num_blocks, blocks.chunk, -1])?;
        let logits = ac.add(&blocks.rel_shift(&bd, heads)?)?.div(&self.cap)?.tanh()?.mul(&self.cap)?;
        let probs = Tensor::where_(mask, &logits, &self.invalid)?.softmax(-1)?;
        let out = probs.matmul(&v.permute(&[0, 3, 1, 2, 4])?)?.permute(&[0, 2, 3, 1, 4])?;
        let out = out.reshape(&[n, blocks.num_blocks * blocks.chunk, heads * d])?.narrow(1, 0, t)?;
        self.post.forward(&out.to_dtype(self.dtype)?.reshape(&[n * t, heads * d])?)
    }
}

/// `Gemma4AudioLayer` (M:525-576).
struct AudioLayer {
    feed_forward: [FeedForward; 2],
    attention: Attention,
    light_conv: LightConv,
    /// pre-attention, post-attention, out.
    norms: [RmsNorm; 3],
    clip: f64,
}

impl AudioLayer {
    fn load(w: &Weights, cfg: &AudioConfig, i: usize) -> Result<AudioLayer> {
        let p = format!("audio_tower.layers.{i}");
        let norm = |name: &str| RmsNorm::load(w, &format!("{p}.{name}"), cfg.hidden_size, DEFAULT_EPS);
        Ok(AudioLayer {
            feed_forward: [
                FeedForward::load(w, cfg, &format!("{p}.feed_forward1"))?,
                FeedForward::load(w, cfg, &format!("{p}.feed_forward2"))?,
            ],
            attention: Attention::load(w, cfg, &format!("{p}.self_attn"))?,
            light_conv: LightConv::load(w, cfg, &format!("{p}.lconv1d"))?,
            norms: [norm("norm_pre_attn")?, norm("norm_post_attn")?, norm("norm_out")?],
            clip: clip_bound(cfg.gradient_clipping, w.dtype),
        })
    }

    /// `x` `[n * t, H]`.
    fn forward(&self, x: &Tensor, positions: &Tensor, blocks: &Blocks, mask: &Tensor) -> Result<Tensor> {
        let clip = |t: &Tensor| t.clamp(-self.clip, self.clip);
        let x = self.feed_forward[0].forward(x)?;
        let attended = self.attention.forward(&self.norms[0].forward(&clip(&x)?)?, positions, blocks, mask)?;
        let x = self.norms[1].forward(&clip(&attended)?)?.add(&x)?;
        let x = self.light_conv.forward(&x, blocks.n, blocks.t)?;
        let x = self.feed_forward[1].forward(&x)?;
        self.norms[2].forward(&clip(&x)?)
    }
}

/// `output_proj`, an `nn.Linear` with bias (M:1919, M:1981): `addmm` sums the product and the bias before it
/// rounds, so the weights are kept in float32 and the sum is rounded once to the compute dtype.
struct OutputProj {
    /// float32 `[out, H]` and `[out]`.
    weight: Tensor,
    bias: Tensor,
    dtype: DType,
}

impl OutputProj {
    fn load(w: &Weights, cfg: &AudioConfig) -> Result<OutputProj> {
        let (out, name) = (cfg.output_proj_dims, "audio_tower.output_proj");
        // Media weights load dense (int4 dequantized: `Weights::open_media`).
        let weight = match w.linear(name, out, cfg.hidden_size)? {
            Linear::Dense(t) => t.to_dtype(DType::F32)?,
            _ => return Err(Error::Internal(format!("{name}: a media linear loaded other than dense"))),
        };
        let bias = w.vector(&format!("{name}.bias"), &[out], DType::F32)?;
        Ok(OutputProj { weight, bias, dtype: w.dtype })
    }

    /// `x` `[rows, H]` → `[rows, out]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.as_dtype(DType::F32)?.linear(&self.weight)?.add(&self.bias)?.as_dtype(self.dtype)
    }
}

pub struct AudioTower {
    cfg: AudioConfig,
    subsample: Subsample,
    layers: Vec<AudioLayer>,
    output_proj: OutputProj,
    /// The relative position embeddings `[context / 2 + 1, H]` in the compute dtype (module docs).
    positions: Tensor,
}

impl AudioTower {
    /// Load `audio_tower.*` of `w` (names relative to `model.`).
    pub fn load(w: &Weights, cfg: &AudioConfig) -> Result<AudioTower> {
        let h = cfg.hidden_size;
        if cfg.num_heads < 1 || h % cfg.num_heads != 0 {
            return Err(Error::config(
                "audio_config.num_attention_heads",
                format!("must divide hidden_size ({h}), got {}", cfg.num_heads),
            ));
        }
        let windows = [
            ("attention_chunk_size", cfg.attention_chunk_size, 1),
            ("attention_context_left", cfg.attention_context_left, 1),
            ("attention_context_right", cfg.attention_context_right, 0),
        ];
        if let Some((key, v, least)) = windows.into_iter().find(|&(_, v, least)| v < least) {
            return Err(Error::config(format!("audio_config.{key}"), format!("must be at least {least}, got {v}")));
        }
        Ok(AudioTower {
            subsample: Subsample::load(w, cfg)?,
            layers: (0..cfg.num_layers).map(|i| AudioLayer::load(w, cfg, i)).collect::<Result<_>>()?,
            output_proj: OutputProj::load(w, cfg)?,
            positions: positions(cfg, &w.like, w.dtype)?,
            cfg: cfg.clone(),
        })
    }

    /// `features` `[n, frames, mel]` (compute dtype, on the device) and `mask` bool `[n, frames]` (true: real frame) ->
    /// (`[n, t, output_proj_dims]` after `output_proj` (with its bias), bool `[n, t]` true for valid soft tokens).
    pub fn forward(&self, features: &Tensor, mask: &Tensor) -> Result<(Tensor, Tensor)> {
        self.check(&features.size()?, &mask.size()?)?;
        let (x, mask, t) = self.subsample.forward(features, mask)?;
        let n = mask.size()?[0];
        let blocks = Blocks::new(&self.cfg, n, t, &mask)?;
        let attention_mask = blocks.mask(&mask, self.cfg.attention_context_right)?;
        let mut x = x;
        for layer in &self.layers {
            x = layer.forward(&x, &self.positions, &blocks, &attention_mask)?;
        }
        let out = self.output_proj.forward(&x)?;
        Ok((out.reshape(&[n, t, self.cfg.output_proj_dims])?, mask))
    }

    /// Shapes the feature extractor makes: `[n, frames, mel]` with `(ceil(ceil(mel / 2) / 2)) * channels[1]`
    /// the projection's input width, and a `[n, frames]` mask.
    fn check(&self, features: &[i64], mask: &[i64]) -> Result<()> {
        let bins = |mel: i64| ((mel + 1) / 2 + 1) / 2;
        let ok = features.len() == 3
            && features[0] > 0
            && features[1] > 0
            && bins(features[2]) * self.cfg.conv_channels[1] == self.subsample.proj_in
            && mask == &features[..2];
        if ok {
            return Ok(());
        }
        Err(Error::Input(format!(
            "audio features must be [clips, frames, mel] with frames >= 1 and mel giving {} values a frame after two \
             stride-2 convolutions, and the mask [clips, frames]; got features {features:?} and mask {mask:?}",
            self.subsample.proj_in
        )))
    }
}

/// `Gemma4AudioRelPositionalEncoding` (M:218-246): `[D + 1, H]`, row `r` the distance `D - r` for
/// `D = context / 2`, in `dtype`. The timescales' exponents in float32 as the reference's, their `exp` in
/// f64 rounded to float32 (torch's float32 `exp` may differ in the last bit: one of 32 timescales for
/// `H = 64`), then rounded to `dtype`, as the reference's buffer is (M:1480-1490); the products and sin/cos
/// in `dtype`, as the reference's are.
fn positions(cfg: &AudioConfig, like: &Tensor, dtype: DType) -> Result<Tensor> {
    let context = cfg.attention_chunk_size + cfg.attention_context_left - 1 + cfg.attention_context_right;
    let count = cfg.hidden_size / 2;
    let increment = (10000f64).ln() / ((count - 1).max(1) as f64);
    let step = -increment as f32;
    let inv: Vec<f32> = (0..count).map(|i| ((i as f32 * step) as f64).exp() as f32).collect();
    let inv = Tensor::from_f32(&inv, &[1, count])?.to_like(like, dtype)?;
    let last = context / 2;
    let distances: Vec<f32> = (0..=last).rev().map(|p| p as f32).collect();
    let distances = Tensor::from_f32(&distances, &[last + 1, 1])?.to_like(like, dtype)?;
    let scaled = distances.mul(&inv)?;
    Tensor::cat(&[&scaled.sin()?, &scaled.cos()?], -1)
}
