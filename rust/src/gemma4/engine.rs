//! `Engine`: one model, one ring cache, and the greedy decode loop.
//!
//! The prompt is read in chunks of `prefill_chunk` tokens. Each decode step feeds the previous
//! argmax (still on the device) at a device-side position counter, so a step issues the same
//! ATen calls with the same shapes at every position and never waits for the host. Tokens come
//! back every `read_every` steps; a stop token found in a batch ends the decode there (the steps
//! run past it are discarded), so the result does not depend on `read_every` or `prefill_chunk`.
//! Design from the seed rig (`generate(ids, max_new, read_every)`, Colab article Step 4).

use std::path::Path;
use std::time::Instant;

use crate::error::{Error, Result};
use crate::gemma4::cache::Cache;
use crate::gemma4::config::{Config, LayerType};
use crate::gemma4::model::Model;
use crate::gemma4::weights::{Checkpoint, Weights, emb_quant};
use crate::tensor::{DType, Tensor};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
    Cancelled,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::Cancelled => "cancelled",
        }
    }
}

pub struct Decoded {
    pub tokens: Vec<i64>,
    pub finish: Finish,
    pub read_s: f64,
    pub decode_s: f64,
}

/// What the binding reports from `layout()`.
pub struct Layout {
    pub full_rings: i64,
    pub sliding_rings: i64,
    pub shared_layers: i64,
    pub context: i64,
    pub sliding_window: i64,
}

pub struct Engine {
    model: Model,
    cache: Cache,
    like: Tensor,
    context: i64,
    prefill_chunk: i64,
}

/// Parse a compute dtype name.
pub fn parse_dtype(name: &str) -> Result<DType> {
    match name {
        "float32" => Ok(DType::F32),
        "bfloat16" => Ok(DType::BF16),
        "float16" => Ok(DType::F16),
        other => Err(Error::Input(format!("dtype must be float32, bfloat16 or float16, got {other:?}"))),
    }
}

impl Engine {
    /// Load `model_dir` (and the vocabulary tables of `emb_dir`) onto `like`'s device.
    pub fn load(
        model_dir: &Path,
        emb_dir: Option<&Path>,
        like: Tensor,
        context: i64,
        dtype: DType,
        prefill_chunk: i64,
    ) -> Result<Engine> {
        if context < 1 {
            return Err(Error::Input(format!("context must be >= 1, got {context}")));
        }
        if prefill_chunk < 1 {
            return Err(Error::Input(format!("prefill_chunk must be >= 1, got {prefill_chunk}")));
        }
        let cfg = Config::load(model_dir)?;
        let main = Checkpoint::open(model_dir, cfg.quant.clone())?;
        let emb = match emb_dir {
            Some(d) => Some(Checkpoint::open(d, emb_quant(d, cfg.quant.clone())?)?),
            None => None,
        };
        let weights = Weights::new(main, emb, like.shallow_clone()?, dtype);
        let model = Model::load(cfg, &weights, context)?;
        let cache = Cache::new(&model.cfg, context, &like, dtype)?;
        Ok(Engine { model, cache, like, context, prefill_chunk })
    }

    pub fn config(&self) -> &Config {
        &self.model.cfg
    }

    pub fn context(&self) -> i64 {
        self.context
    }

    pub fn dtype(&self) -> DType {
        self.model.dtype()
    }

    pub fn device(&self) -> Result<String> {
        self.like.device()
    }

    pub fn layout(&self) -> Layout {
        let cfg = &self.model.cfg;
        Layout {
            full_rings: self.cache.count(LayerType::Full, cfg),
            sliding_rings: self.cache.count(LayerType::Sliding, cfg),
            shared_layers: cfg.layers.iter().filter(|l| l.kv_source.is_some()).count() as i64,
            context: self.context,
            sliding_window: cfg.sliding_window,
        }
    }

    /// The checks on a request that a caller can fail, before any model code runs.
    pub fn check_prompt(&self, ids: &[i64]) -> Result<()> {
        if ids.is_empty() {
            return Err(Error::Input("the prompt is empty".into()));
        }
        if ids.len() as i64 >= self.context {
            return Err(Error::Input(format!(
                "the prompt has {} tokens; the context holds {} (prompt and generated tokens together), so at most {}",
                ids.len(),
                self.context,
                self.context - 1
            )));
        }
        let v = self.model.cfg.vocab_size;
        if let Some((i, id)) = ids.iter().enumerate().find(|(_, id)| **id < 0 || **id >= v) {
            return Err(Error::Input(format!("token id {id} at position {i} is outside the vocabulary [0, {v})")));
        }
        Ok(())
    }

    pub fn check_request(&self, ids: &[i64], max_new: i64, read_every: i64) -> Result<()> {
        if max_new < 1 {
            return Err(Error::Input(format!("max_new must be >= 1, got {max_new}")));
        }
        if read_every < 1 {
            return Err(Error::Input(format!("read_every must be >= 1, got {read_every}")));
        }
        self.check_prompt(ids)
    }

    /// Read the prompt from a fresh cache; the last token's logits `[vocab]`.
    fn prefill(&self, ids: &[i64]) -> Result<Tensor> {
        self.cache.reset()?;
        let n = ids.len();
        let chunk = self.prefill_chunk as usize;
        let mut start = 0;
        let mut logits = None;
        while start < n {
            let end = (start + chunk).min(n);
            let t = (end - start) as i64;
            let ids_t = Tensor::from_i64(&ids[start..end])?.to_like(&self.like, DType::I64)?;
            let pos = Tensor::arange(start as i64, end as i64, DType::I64, &self.like)?;
            logits = self.model.forward(&ids_t, &pos, t, start == 0, &self.cache, end == n)?;
            start = end;
        }
        logits.ok_or_else(|| Error::Input("the prompt is empty".into()))
    }

    /// float32 next-token logits after `ids`, on the host as a tensor.
    pub fn logits(&mut self, ids: &[i64]) -> Result<Tensor> {
        self.check_prompt(ids)?;
        // A tensor built from host bytes lives on the host: it names where the logits go.
        let host = Tensor::from_i64(&[0])?;
        self.prefill(ids)?.to_like(&host, DType::F32)
    }

    /// Greedy decode; see the module docs. `on_tokens` gets each non-empty batch and returns
    /// false to cancel.
    pub fn decode(
        &mut self,
        ids: &[i64],
        max_new: i64,
        stop_ids: &[i64],
        read_every: i64,
        mut on_tokens: impl FnMut(&[i64]) -> bool,
    ) -> Result<Decoded> {
        self.check_request(ids, max_new, read_every)?;
        let limit = max_new.min(self.context - ids.len() as i64) as usize;
        let is_stop = |t: &i64| self.model.cfg.eos_ids.contains(t) || stop_ids.contains(t);

        let t0 = Instant::now();
        let mut next = self.prefill(ids)?.argmax(-1, true)?;
        // One host read so read_s covers the prompt's device work, not just its launch.
        next.to_vec_i64()?;
        let read_s = t0.elapsed().as_secs_f64();

        let t1 = Instant::now();
        let pos = Tensor::full(&[1], ids.len() as f64, DType::I64, &self.like)?;
        let mut pending = vec![next.shallow_clone()?];
        let mut produced = 1usize;
        let mut tokens = Vec::with_capacity(limit);
        let finish = loop {
            while pending.len() < read_every as usize && produced < limit {
                let logits = self.model.forward(&next, &pos, 1, false, &self.cache, true)?;
                next = logits.ok_or_else(|| Error::Input("no logits".into()))?.argmax(-1, true)?;
                pos.add_int_(1)?;
                pending.push(next.shallow_clone()?);
                produced += 1;
            }
            let refs: Vec<&Tensor> = pending.iter().collect();
            let batch = Tensor::cat(&refs, 0)?.to_vec_i64()?;
            pending.clear();
            let cut = batch.iter().position(is_stop);
            let keep = &batch[..cut.unwrap_or(batch.len())];
            tokens.extend_from_slice(keep);
            if !keep.is_empty() && !on_tokens(keep) {
                break Finish::Cancelled;
            }
            if cut.is_some() {
                break Finish::Stop;
            }
            if produced >= limit {
                break Finish::Length;
            }
        };
        Ok(Decoded { tokens, finish, read_s, decode_s: t1.elapsed().as_secs_f64() })
    }
}
