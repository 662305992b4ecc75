//! The media front end: `Encoder` turns pixels and audio features into soft tokens, rows of the text
//! model's hidden size that replace the placeholder tokens' embeddings (engine/media.rs places them).
//!
//! Gemma4Model (M:2161-2440) runs a tower and then `Gemma4MultimodalEmbedder` (M:2053-2077): an
//! RMSNorm without weight and a projection to the text hidden size. The vision tower is
//! vision.rs, the audio tower audio.rs; both use `ClippableLinear` (M:165-193). Their configs are the
//! `vision_config` and `audio_config` of a `Gemma4Config` (configuration_gemma4.py). The towers load
//! from the hub layout (`model.vision_tower.*`, `model.embed_vision.*`, `model.audio_tower.*`,
//! `model.embed_audio.*`), dense or W4A16 (dequantized at load, as Transformers does).

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::gemma4::audio::AudioTower;
use crate::gemma4::config::{Config, MediaIds, get, read_json};
use crate::gemma4::linear::Linear;
use crate::gemma4::norm::RmsNorm;
use crate::gemma4::vision::VisionTower;
use crate::gemma4::weights::Weights;
use crate::tensor::{DType, Tensor};

fn int_or(m: &Map<String, Value>, section: &str, key: &str, default: i64) -> Result<i64> {
    match get(m, key) {
        None => Ok(default),
        Some(v) => {
            v.as_i64().ok_or_else(|| Error::config(format!("{section}.{key}"), format!("must be an integer, got {v}")))
        }
    }
}

fn float_or(m: &Map<String, Value>, section: &str, key: &str, default: f64) -> Result<f64> {
    match get(m, key) {
        None => Ok(default),
        Some(v) => {
            v.as_f64().ok_or_else(|| Error::config(format!("{section}.{key}"), format!("must be a number, got {v}")))
        }
    }
}

fn bool_or(m: &Map<String, Value>, section: &str, key: &str, default: bool) -> Result<bool> {
    match get(m, key) {
        None => Ok(default),
        Some(v) => v
            .as_bool()
            .ok_or_else(|| Error::config(format!("{section}.{key}"), format!("must be true or false, got {v}"))),
    }
}

fn str_or<'a>(m: &'a Map<String, Value>, key: &str, default: &'a str) -> &'a str {
    get(m, key).and_then(|v| v.as_str()).unwrap_or(default)
}

/// `Gemma4VisionConfig` (configuration_gemma4.py), defaults as there.
#[derive(Clone, Debug)]
pub struct VisionConfig {
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_layers: usize,
    pub num_heads: i64,
    pub num_kv_heads: i64,
    pub head_dim: i64,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub pooling_kernel_size: i64,
    pub patch_size: i64,
    pub position_embedding_size: i64,
    pub use_clipped_linears: bool,
    pub standardize: bool,
}

impl VisionConfig {
    fn parse(m: &Map<String, Value>) -> Result<VisionConfig> {
        let s = "vision_config";
        let act = str_or(m, "hidden_activation", "gelu_pytorch_tanh");
        if act != "gelu_pytorch_tanh" {
            return Err(Error::config(
                format!("{s}.hidden_activation"),
                format!("{act:?} is not supported (gelu_pytorch_tanh)"),
            ));
        }
        let rope = get(m, "rope_parameters").and_then(|v| v.as_object());
        let rope_type = rope.and_then(|r| r.get("rope_type")).and_then(|v| v.as_str()).unwrap_or("axial");
        if rope_type != "axial" {
            return Err(Error::config(
                format!("{s}.rope_parameters.rope_type"),
                format!("{rope_type:?} is not supported (axial)"),
            ));
        }
        let rope_theta = rope.and_then(|r| r.get("rope_theta")).and_then(|v| v.as_f64()).unwrap_or(100.0);
        let hidden_size = int_or(m, s, "hidden_size", 768)?;
        let num_heads = int_or(m, s, "num_attention_heads", 12)?;
        let cfg = VisionConfig {
            hidden_size,
            intermediate_size: int_or(m, s, "intermediate_size", 3072)?,
            num_layers: int_or(m, s, "num_hidden_layers", 16)? as usize,
            num_heads,
            num_kv_heads: int_or(m, s, "num_key_value_heads", 12)?,
            head_dim: int_or(m, s, "head_dim", 64)?,
            rms_norm_eps: float_or(m, s, "rms_norm_eps", 1e-6)?,
            rope_theta,
            pooling_kernel_size: int_or(m, s, "pooling_kernel_size", 3)?,
            patch_size: int_or(m, s, "patch_size", 16)?,
            position_embedding_size: int_or(m, s, "position_embedding_size", 10 * 1024)?,
            use_clipped_linears: bool_or(m, s, "use_clipped_linears", false)?,
            standardize: bool_or(m, s, "standardize", false)?,
        };
        if cfg.num_heads < 1 || cfg.num_kv_heads < 1 || cfg.num_heads % cfg.num_kv_heads != 0 {
            return Err(Error::config(
                format!("{s}.num_key_value_heads"),
                format!("must divide num_attention_heads ({}), got {}", cfg.num_heads, cfg.num_kv_heads),
            ));
        }
        if cfg.head_dim % 4 != 0 {
            return Err(Error::config(
                format!("{s}.head_dim"),
                format!("must be a multiple of 4 (2-D RoPE), got {}", cfg.head_dim),
            ));
        }
        Ok(cfg)
    }
}

/// `Gemma4AudioConfig` (configuration_gemma4.py), defaults as there.
#[derive(Clone, Debug)]
pub struct AudioConfig {
    pub hidden_size: i64,
    pub num_layers: usize,
    pub num_heads: i64,
    /// `subsampling_conv_channels`: the two convolutions' output channels.
    pub conv_channels: [i64; 2],
    pub conv_kernel_size: i64,
    pub residual_weight: f64,
    pub attention_chunk_size: i64,
    pub attention_context_left: i64,
    pub attention_context_right: i64,
    pub attention_logit_cap: f64,
    pub attention_invalid_logits_value: f64,
    pub use_clipped_linears: bool,
    pub rms_norm_eps: f64,
    pub gradient_clipping: f64,
    pub output_proj_dims: i64,
}

impl AudioConfig {
    fn parse(m: &Map<String, Value>) -> Result<AudioConfig> {
        let s = "audio_config";
        let act = str_or(m, "hidden_act", "silu");
        if act != "silu" {
            return Err(Error::config(format!("{s}.hidden_act"), format!("{act:?} is not supported (silu)")));
        }
        let channels = match get(m, "subsampling_conv_channels") {
            None => [128, 32],
            Some(v) => match v.as_array().map(|a| a.iter().filter_map(|x| x.as_i64()).collect::<Vec<_>>()).as_deref() {
                Some(&[a, b]) => [a, b],
                _ => {
                    return Err(Error::config(
                        format!("{s}.subsampling_conv_channels"),
                        format!("must be two integers, got {v}"),
                    ));
                }
            },
        };
        Ok(AudioConfig {
            hidden_size: int_or(m, s, "hidden_size", 1024)?,
            num_layers: int_or(m, s, "num_hidden_layers", 12)? as usize,
            num_heads: int_or(m, s, "num_attention_heads", 8)?,
            conv_channels: channels,
            conv_kernel_size: int_or(m, s, "conv_kernel_size", 5)?,
            residual_weight: float_or(m, s, "residual_weight", 0.5)?,
            attention_chunk_size: int_or(m, s, "attention_chunk_size", 12)?,
            attention_context_left: int_or(m, s, "attention_context_left", 13)?,
            attention_context_right: int_or(m, s, "attention_context_right", 0)?,
            attention_logit_cap: float_or(m, s, "attention_logit_cap", 50.0)?,
            attention_invalid_logits_value: float_or(m, s, "attention_invalid_logits_value", -1.0e9)?,
            use_clipped_linears: bool_or(m, s, "use_clipped_linears", true)?,
            rms_norm_eps: float_or(m, s, "rms_norm_eps", 1e-6)?,
            gradient_clipping: float_or(m, s, "gradient_clipping", 1e10)?,
            output_proj_dims: int_or(m, s, "output_proj_dims", 1536)?,
        })
    }
}

/// What a config.json says about media: the towers' configs and the media token ids (`Gemma4Config`).
#[derive(Clone, Debug)]
pub struct MediaConfig {
    pub vision: Option<VisionConfig>,
    pub audio: Option<AudioConfig>,
    pub ids: MediaIds,
}

impl MediaConfig {
    pub fn from_json(root: &Value) -> Result<MediaConfig> {
        let root = root.as_object().ok_or_else(|| Error::config("(top level)", "must be a JSON object"))?;
        let section = |key: &str| -> Result<Option<&Map<String, Value>>> {
            match get(root, key) {
                None => Ok(None),
                Some(v) => v.as_object().map(Some).ok_or_else(|| Error::config(key, "must be an object")),
            }
        };
        Ok(MediaConfig {
            vision: section("vision_config")?.map(VisionConfig::parse).transpose()?,
            audio: section("audio_config")?.map(AudioConfig::parse).transpose()?,
            ids: MediaIds::from_root(root)?,
        })
    }
}

/// `Gemma4ClippableLinear` (M:165-193): a linear whose input and output are clamped to bounds the
/// checkpoint stores (`input_min`, `input_max`, `output_min`, `output_max`) when the tower uses them.
pub struct ClippableLinear {
    linear: Linear,
    /// (input_min, input_max, output_min, output_max).
    clip: Option<[f64; 4]>,
}

impl ClippableLinear {
    /// `name` without `.linear.weight`; `clipped` is the tower's `use_clipped_linears`.
    pub fn load(w: &Weights, name: &str, out: i64, inp: i64, clipped: bool) -> Result<ClippableLinear> {
        let linear = w.linear(&format!("{name}.linear"), out, inp)?;
        let clip = if clipped {
            let bound = |b: &str| w.vector(&format!("{name}.{b}"), &[], DType::F32)?.item_f64();
            Some([bound("input_min")?, bound("input_max")?, bound("output_min")?, bound("output_max")?])
        } else {
            None
        };
        Ok(ClippableLinear { linear, clip })
    }

    /// `x` `[rows, in]` → `[rows, out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self.clip {
            None => self.linear.forward(x),
            Some([lo, hi, out_lo, out_hi]) => self.linear.forward(&x.clamp(lo, hi)?)?.clamp(out_lo, out_hi),
        }
    }
}

/// `Gemma4MultimodalEmbedder` (M:2053-2077): RMSNorm without weight, then a projection to the text
/// model's hidden size.
pub struct Embedder {
    norm: RmsNorm,
    projection: Linear,
}

impl Embedder {
    /// `name` is `embed_vision` or `embed_audio`; `inp` the tower's output width.
    pub fn load(w: &Weights, name: &str, inp: i64, text_hidden: i64, eps: f64) -> Result<Embedder> {
        Ok(Embedder {
            norm: RmsNorm::no_scale(eps),
            projection: w.linear(&format!("{name}.embedding_projection"), text_hidden, inp)?,
        })
    }

    /// `x` `[rows, inp]` → `[rows, text_hidden]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.projection.forward(&self.norm.forward(x)?)
    }
}

/// The towers of one checkpoint and their embedders, on one device in one dtype.
pub struct Encoder {
    pub cfg: MediaConfig,
    pub text_hidden: i64,
    vision: Option<(VisionTower, Embedder)>,
    audio: Option<(AudioTower, Embedder)>,
    like: Tensor,
    dtype: DType,
}

impl Encoder {
    /// Load the towers `model_dir`'s config.json declares (none for a text-only checkpoint).
    pub fn load(model_dir: &Path, like: Tensor, dtype: DType) -> Result<Encoder> {
        let root = read_json(&model_dir.join("config.json"))?;
        let cfg = MediaConfig::from_json(&root)?;
        let text_cfg = Config::from_json(&root)?;
        let h = text_cfg.hidden_size;
        let w = Weights::open_media(model_dir, text_cfg.quant.clone(), like.shallow_clone()?, dtype)?;
        let vision = match &cfg.vision {
            Some(v) => {
                Some((VisionTower::load(&w, v)?, Embedder::load(&w, "embed_vision", v.hidden_size, h, v.rms_norm_eps)?))
            }
            None => None,
        };
        let audio = match &cfg.audio {
            Some(a) => {
                let tower = AudioTower::load(&w, a)?;
                Some((tower, Embedder::load(&w, "embed_audio", a.output_proj_dims, h, a.rms_norm_eps)?))
            }
            None => None,
        };
        Ok(Encoder { cfg, text_hidden: h, vision, audio, like, dtype })
    }

    /// The modalities this checkpoint takes: "image", "audio".
    pub fn modalities(&self) -> Vec<&'static str> {
        let mut m = Vec::new();
        if self.vision.is_some() {
            m.push("image");
        }
        if self.audio.is_some() {
            m.push("audio");
        }
        m
    }

    /// Soft tokens of images: `pixel_values` `[n, patches, 3 * patch^2]` in [0, 1] and
    /// `position_ids` `[n, patches, 2]` (x, y; padding patches -1), as Gemma4ImageProcessor makes them.
    /// One `[soft_i, text_hidden]` tensor per image, in the compute dtype on the encoder's device.
    pub fn image(&self, pixel_values: &Tensor, position_ids: &Tensor) -> Result<Vec<Tensor>> {
        let (tower, embedder) = self
            .vision
            .as_ref()
            .ok_or_else(|| Error::Input("this checkpoint has no vision tower: it does not take images".into()))?;
        let pixels = pixel_values.to_like(&self.like, DType::F32)?;
        let positions = position_ids.to_like(&self.like, DType::I64)?;
        let host_positions = position_ids.to_dtype(DType::I64)?;
        let features = tower.forward(&pixels, &positions, &host_positions)?;
        features.iter().map(|f| embedder.forward(f)).collect()
    }

    /// Soft tokens of audio clips: `features` `[n, frames, mel]` and `mask` `[n, frames]` (true: a real
    /// frame), as Gemma4AudioFeatureExtractor makes them. One `[soft_i, text_hidden]` tensor per clip (its
    /// valid soft tokens), in the compute dtype on the encoder's device.
    pub fn audio(&self, features: &Tensor, mask: &Tensor) -> Result<Vec<Tensor>> {
        let (tower, embedder) = self
            .audio
            .as_ref()
            .ok_or_else(|| Error::Input("this checkpoint has no audio tower: it does not take audio".into()))?;
        let features = features.to_like(&self.like, self.dtype)?;
        let mask = mask.to_like(&self.like, DType::Bool)?;
        let (hidden, out_mask) = tower.forward(&features, &mask)?;
        let size = hidden.size()?;
        let (n, t, d) = (size[0], size[1], size[2]);
        let projected = embedder.forward(&hidden.reshape(&[n * t, d])?)?.reshape(&[n, t, self.text_hidden])?;
        let valid = out_mask.to_like(&Tensor::from_i64(&[0])?, DType::I64)?.to_vec_i64()?;
        (0..n)
            .map(|i| {
                let rows: Vec<i64> = (0..t).filter(|&j| valid[(i * t + j) as usize] != 0).collect();
                let index = Tensor::from_i64(&rows)?.to_like(&self.like, DType::I64)?;
                projected.narrow(0, i, 1)?.reshape(&[t, self.text_hidden])?.index_select(0, &index)
            })
            .collect()
    }
}
