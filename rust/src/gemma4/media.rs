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

use serde::Deserialize;
use serde_json::Value;

use crate::error::{Error, Result};
use crate::gemma4::audio::AudioTower;
use crate::gemma4::config::{Config, read_json};
use crate::gemma4::config_json::{GELU_TANH, MediaIds, RawRoot, gelu_tanh, parse, within};
use crate::gemma4::linear::Linear;
use crate::gemma4::norm::RmsNorm;
use crate::gemma4::vision::VisionTower;
use crate::gemma4::weights::Weights;
use crate::tensor::{DType, Tensor};

/// `Gemma4VisionConfig` (configuration_gemma4.py, C:273-289): a `vision_config` read by serde, each absent key
/// Transformers' default (`Default`).
#[derive(Clone, Debug, Deserialize)]
#[serde(default)]
pub struct VisionConfig {
    pub hidden_size: i64,
    pub intermediate_size: i64,
    #[serde(rename = "num_hidden_layers")]
    pub num_layers: usize,
    #[serde(rename = "num_attention_heads")]
    pub num_heads: i64,
    #[serde(rename = "num_key_value_heads")]
    pub num_kv_heads: i64,
    pub head_dim: i64,
    /// Checked at parse: gelu_pytorch_tanh is the one the tower computes.
    pub hidden_activation: String,
    pub rms_norm_eps: f64,
    pub rope_parameters: VisionRope,
    pub pooling_kernel_size: i64,
    pub patch_size: i64,
    pub position_embedding_size: i64,
    pub use_clipped_linears: bool,
    pub standardize: bool,
}

impl Default for VisionConfig {
    fn default() -> Self {
        VisionConfig {
            hidden_size: 768,
            intermediate_size: 3072,
            num_layers: 16,
            num_heads: 12,
            num_kv_heads: 12,
            head_dim: 64,
            hidden_activation: gelu_tanh(),
            rms_norm_eps: 1e-6,
            rope_parameters: VisionRope::default(),
            pooling_kernel_size: 3,
            patch_size: 16,
            position_embedding_size: 10 * 1024,
            use_clipped_linears: false,
            standardize: false,
        }
    }
}

/// The vision tower's 2-D RoPE: `Gemma4VisionConfig.default_rope_type` "axial" and `default_theta` 100.0
/// (C:270-271).
#[derive(Clone, Debug, Deserialize)]
#[serde(default)]
pub struct VisionRope {
    pub rope_type: String,
    pub rope_theta: f64,
}

impl Default for VisionRope {
    fn default() -> Self {
        VisionRope { rope_type: "axial".into(), rope_theta: 100.0 }
    }
}

impl VisionConfig {
    /// A `vision_config` value, read and checked; an error names the key under `vision_config`.
    pub fn from_json(v: &Value) -> Result<VisionConfig> {
        parse(v).and_then(|c: VisionConfig| c.checked()).map_err(within("vision_config"))
    }

    fn checked(self) -> Result<VisionConfig> {
        if self.hidden_activation != GELU_TANH {
            let act = &self.hidden_activation;
            return Err(Error::config("hidden_activation", format!("{act:?} is not supported ({GELU_TANH})")));
        }
        if self.rope_parameters.rope_type != "axial" {
            let t = &self.rope_parameters.rope_type;
            return Err(Error::config("rope_parameters.rope_type", format!("{t:?} is not supported (axial)")));
        }
        if self.num_heads < 1 || self.num_kv_heads < 1 || self.num_heads % self.num_kv_heads != 0 {
            return Err(Error::config(
                "num_key_value_heads",
                format!("must divide num_attention_heads ({}), got {}", self.num_heads, self.num_kv_heads),
            ));
        }
        if self.head_dim % 4 != 0 {
            return Err(Error::config(
                "head_dim",
                format!("must be a multiple of 4 (2-D RoPE), got {}", self.head_dim),
            ));
        }
        Ok(self)
    }
}

/// `Gemma4AudioConfig` (configuration_gemma4.py, C:55-75): an `audio_config` read by serde, each absent key
/// Transformers' default (`Default`).
#[derive(Clone, Debug, Deserialize)]
#[serde(default)]
pub struct AudioConfig {
    pub hidden_size: i64,
    #[serde(rename = "num_hidden_layers")]
    pub num_layers: usize,
    #[serde(rename = "num_attention_heads")]
    pub num_heads: i64,
    /// Checked at parse: silu is the one the tower computes.
    pub hidden_act: String,
    /// `subsampling_conv_channels`: the two convolutions' output channels.
    #[serde(rename = "subsampling_conv_channels")]
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

impl Default for AudioConfig {
    fn default() -> Self {
        AudioConfig {
            hidden_size: 1024,
            num_layers: 12,
            num_heads: 8,
            hidden_act: "silu".into(),
            conv_channels: [128, 32],
            conv_kernel_size: 5,
            residual_weight: 0.5,
            attention_chunk_size: 12,
            attention_context_left: 13,
            attention_context_right: 0,
            attention_logit_cap: 50.0,
            attention_invalid_logits_value: -1.0e9,
            use_clipped_linears: true,
            rms_norm_eps: 1e-6,
            gradient_clipping: 1e10,
            output_proj_dims: 1536,
        }
    }
}

impl AudioConfig {
    /// An `audio_config` value, read and checked; an error names the key under `audio_config`.
    pub fn from_json(v: &Value) -> Result<AudioConfig> {
        parse(v).and_then(|c: AudioConfig| c.checked()).map_err(within("audio_config"))
    }

    fn checked(self) -> Result<AudioConfig> {
        if self.hidden_act != "silu" {
            let act = &self.hidden_act;
            return Err(Error::config("hidden_act", format!("{act:?} is not supported (silu)")));
        }
        Ok(self)
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
        let raw: RawRoot = parse(root)?;
        Ok(MediaConfig {
            vision: raw.vision_config.as_ref().map(VisionConfig::from_json).transpose()?,
            audio: raw.audio_config.as_ref().map(AudioConfig::from_json).transpose()?,
            ids: parse(root)?,
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_wrong_type_in_a_tower_config_is_an_error_naming_its_path() {
        let root = json!({"vision_config": {"rope_parameters": {"rope_theta": "100"}}});
        let err = MediaConfig::from_json(&root).unwrap_err().to_string();
        assert_eq!(err, "config.json: vision_config.rope_parameters.rope_theta: must be a number, got string \"100\"");
        let root = json!({"audio_config": {"subsampling_conv_channels": [128]}});
        let err = MediaConfig::from_json(&root).unwrap_err().to_string();
        assert!(err.starts_with("config.json: audio_config.subsampling_conv_channels: "), "{err}");
        let err = MediaConfig::from_json(&json!({"vision_config": {"head_dim": 6}})).unwrap_err().to_string();
        assert!(err.contains("vision_config.head_dim: must be a multiple of 4"), "{err}");
    }

    #[test]
    fn absent_tower_keys_take_transformers_defaults() {
        // Transformers 5.18 configuration_gemma4.py, Gemma4VisionConfig and Gemma4AudioConfig.
        let cfg = MediaConfig::from_json(&json!({"vision_config": {}, "audio_config": {}})).unwrap();
        let v = cfg.vision.unwrap();
        assert_eq!(
            [v.hidden_size, v.intermediate_size, v.num_layers as i64, v.num_heads, v.num_kv_heads, v.head_dim],
            [768, 3072, 16, 12, 12, 64]
        );
        assert_eq!([v.pooling_kernel_size, v.patch_size, v.position_embedding_size], [3, 16, 10240]);
        assert_eq!(
            (v.rms_norm_eps, v.rope_parameters.rope_theta, v.rope_parameters.rope_type.as_str()),
            (1e-6, 100.0, "axial")
        );
        assert!(!v.use_clipped_linears && !v.standardize && v.hidden_activation == "gelu_pytorch_tanh");
        let a = cfg.audio.unwrap();
        assert_eq!([a.hidden_size, a.num_layers as i64, a.num_heads, a.conv_kernel_size], [1024, 12, 8, 5]);
        assert_eq!(a.conv_channels, [128, 32]);
        assert_eq!([a.attention_chunk_size, a.attention_context_left, a.attention_context_right], [12, 13, 0]);
        assert_eq!(
            [
                a.residual_weight,
                a.attention_logit_cap,
                a.attention_invalid_logits_value,
                a.rms_norm_eps,
                a.gradient_clipping
            ],
            [0.5, 50.0, -1.0e9, 1e-6, 1e10]
        );
        assert!(a.use_clipped_linears && a.hidden_act == "silu" && a.output_proj_dims == 1536);
    }
}
