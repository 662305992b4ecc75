//! The audio tower (`Gemma4AudioModel`, M:1899-1983): being written.

use crate::error::{Error, Result};
use crate::gemma4::media::AudioConfig;
use crate::gemma4::weights::Weights;
use crate::tensor::Tensor;

pub struct AudioTower {
    cfg: AudioConfig,
}

impl AudioTower {
    /// Load `audio_tower.*` of `w` (names relative to `model.`).
    pub fn load(_w: &Weights, cfg: &AudioConfig) -> Result<AudioTower> {
        Ok(AudioTower { cfg: cfg.clone() })
    }

    /// `features` `[n, frames, mel]` (compute dtype) and `mask` bool `[n, frames]` (true: real frame) →
    /// (`[n, t, output_proj_dims]` after `output_proj`, bool `[n, t]` true for valid soft tokens).
    pub fn forward(&self, _features: &Tensor, _mask: &Tensor) -> Result<(Tensor, Tensor)> {
        Err(Error::Internal(format!("the audio tower ({} layers) is not written yet", self.cfg.num_layers)))
    }
}
