//! `Engine`: one model, `max_batch` sequence slots, and the continuous-batching loop.
//!
//! Each slot holds one request: its rings in the KV cache (cache.rs), its sampling state
//! (sampling.rs), and on the device its last token and next position. One turn of the loop runs
//! one decode step for every slot that is decoding and then at most one prompt forward of at most
//! `prefill_chunk` tokens (a token budget, as vLLM's scheduler has), so a long prompt delays the
//! running streams by one chunk a step, never by the whole prompt. The prompt forward reads the
//! next chunk of the oldest unread prompt; when that prompt starts and fits whole, the next unread
//! prompts in admission order that also fit whole join it, as long as the forward's rectangle (the
//! slots from the lowest to the highest, times the longest of those prompts) stays within the budget
//! (`prompt_group`). A burst of short prompts is then read in one forward instead of one a turn.
//! Its rows are left-padded (`padded_prompts`): every row's last token is its prompt's last, and
//! the padding tokens sit at position `context - 1`, later than any prompt query, and write only the
//! rings' never-visible entry, so each row's keys and logits are those of a read alone.
//! A decode step runs the slots `0..b`, where `b` is the smallest
//! bucket (1, 2, 4, ..., max_batch) above the highest decoding slot; new requests take the lowest
//! free slot, so the bucket follows the number of requests. Rows of the bucket that are not
//! decoding run as padding whose writes land in the ring's never-visible entry. So a device sees a
//! few fixed shapes, whatever the positions or the mix of requests.
//!
//! Tokens stay on the device and come back to the host every `read_every` turns (a "read point").
//! There the host cuts each request at its first stop token or its length limit, hands the new
//! tokens to the caller, frees finished slots, and asks the caller for new requests and
//! cancellations (`Io::poll`). A slot that reached its length limit between read points stops
//! decoding at once; one that hit a stop token runs on as padding until the read point and its
//! extra tokens are dropped, so the result does not depend on `read_every`.
//!
//! A request admitted while another with the same prompt is still reading it follows that one
//! instead of reading it again (the `n` choices of one OpenAI request, or identical prompts): when
//! the leader's last chunk is read, the follower's rings get a copy of the prompt's keys and it
//! draws its own first token from the same logits. The copy holds exactly the keys a second read
//! would write.
//!
//! An error while admitting or running requests fails those requests alone, never the loop: a
//! request whose upload or sampling state fails at admission, the slots of a prompt forward that
//! fails, the rows of a decode step that fails, or the slots whose tokens a read point could not
//! bring back end with `Finish::Failed` and the error's text, their slots are freed, and the loop
//! serves the next requests. Only an error in freeing a slot, or from the caller's `Io`, ends it.
//!
//! Design from vLLM's `v1/core/sched/scheduler.py` (continuous batching, chunked prefill
//! interleaved with decodes).

use std::path::Path;
use std::time::Instant;

use crate::error::{Error, Result};
use crate::gemma4::attention::{Fill, Liveness, Positions};
use crate::gemma4::cache::{CacheSize, KvCache, Rows};
use crate::gemma4::config::{Config, LayerType};
use crate::gemma4::model::{Model, Output};
use crate::gemma4::sampling::{Chosen, Sampler, SamplingParams, Stages};
use crate::gemma4::weights::{Checkpoint, Int4Path, Loaded, Weights, emb_quant};
use crate::tensor::{CudaGraph, DType, Tensor};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
    Cancelled,
    /// The request was refused at admission by its own values (`Event::error` says why).
    Error,
    /// The engine failed while admitting or running the request (`Event::error` has the error).
    Failed,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::Cancelled => "cancelled",
            Finish::Error => "error",
            Finish::Failed => "failed",
        }
    }
}

/// One request for the loop.
#[derive(Clone, Debug)]
pub struct Request {
    pub id: u64,
    pub prompt: Vec<i64>,
    pub max_new: i64,
    /// Stop tokens besides the model's eos ids (a stop token is not returned).
    pub stop_ids: Vec<i64>,
    pub params: SamplingParams,
}

/// The log-probabilities of one generated token.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// The most likely tokens, most likely first, as many as the request asked for.
    pub top: Vec<(i64, f32)>,
}

/// Seconds a finished request spent: admission to its first token at a read point, then to the end.
#[derive(Clone, Copy, Debug, Default)]
pub struct Timing {
    pub prompt_s: f64,
    pub decode_s: f64,
}

/// New tokens of one request, and its end once it ended.
#[derive(Clone, Debug)]
pub struct Event {
    pub id: u64,
    pub tokens: Vec<i64>,
    /// One entry per token when the request asked for log-probabilities.
    pub logprobs: Vec<TokenLogprobs>,
    pub finish: Option<Finish>,
    pub error: Option<String>,
    pub timing: Timing,
}

impl Event {
    /// No tokens yet, not ended.
    fn new(id: u64) -> Event {
        Event { id, tokens: Vec::new(), logprobs: Vec::new(), finish: None, error: None, timing: Timing::default() }
    }

    fn end(id: u64, finish: Finish, timing: Timing) -> Event {
        Event { finish: Some(finish), timing, ..Event::new(id) }
    }

    /// Ended with `Finish::Error` or `Finish::Failed`, and why.
    fn end_with_error(id: u64, finish: Finish, timing: Timing, error: String) -> Event {
        Event { error: Some(error), ..Event::end(id, finish, timing) }
    }
}

/// What ran since the last read point.
#[derive(Clone, Debug, Default)]
pub struct StepStats {
    /// Decoding rows of each decode step.
    pub batch_sizes: Vec<usize>,
    /// Prompt tokens read.
    pub prompt_tokens: usize,
    /// Prompts each prompt forward read (more than one: several whole prompts in one forward).
    pub prompt_reads: Vec<usize>,
    /// Wall seconds of those turns (the read point's host sync included).
    pub seconds: f64,
}

/// The caller's side of `Engine::run`.
pub trait Io {
    /// Called at each read point: new requests (at most `free`) and the ids of requests to cancel,
    /// or None to end the loop (every request still running ends "cancelled"). `idle` says that no
    /// request is running, so the call may wait for work.
    fn poll(&mut self, free: usize, idle: bool) -> Result<Option<(Vec<Request>, Vec<u64>)>>;
    /// New tokens and ends, in the order the engine produced them.
    fn emit(&mut self, events: Vec<Event>, stats: &StepStats) -> Result<()>;
}

/// Where `Engine::inject_fault_for_tests` makes the engine fail one request: its admission (after
/// its checks passed), the prompt forward that reads it, or a decode step that runs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    Admit,
    Prompt,
    Decode,
}

/// What the binding reports from `layout()`.
pub struct Layout {
    pub full_rings: i64,
    pub sliding_rings: i64,
    pub shared_layers: i64,
    pub context: i64,
    pub sliding_window: i64,
    pub max_batch: i64,
    pub kv_bytes_per_slot: i64,
    pub kv_bytes: i64,
}

enum Phase {
    /// Reading the prompt; `done` tokens read so far.
    Prompt {
        done: usize,
    },
    /// Waiting for slot `leader`, which reads the same prompt (module docs).
    Follow {
        leader: usize,
    },
    Decode,
}

struct Slot {
    request: Request,
    prompt: Tensor,
    /// The most tokens this request may generate (max_new, and the context).
    limit: usize,
    phase: Phase,
    /// Tokens drawn on the device (including those not read yet).
    drawn: usize,
    /// Tokens handed to the caller.
    emitted: usize,
    /// Decoding on the device (mirrors `Engine::live`).
    live: bool,
    finished: Option<Finish>,
    admitted: Instant,
    first_token: Option<Instant>,
    /// Admission order, for first-come-first-served prompt reading.
    seq: u64,
}

/// Tokens drawn by one forward, waiting for the next read point.
struct Drawn {
    chosen: Chosen,
    /// The slot behind each row (None: padding).
    rows: Vec<Option<usize>>,
}

pub struct Engine {
    model: Model,
    loaded: Loaded,
    cache: KvCache,
    sampler: Sampler,
    like: Tensor,
    context: i64,
    prefill_chunk: i64,
    max_batch: i64,
    /// Each slot's last drawn token, int64 `[max_batch]`: the next decode step's input.
    next: Tensor,
    /// Each slot's next position, int64 `[max_batch]`.
    positions: Tensor,
    /// Which slots decode, bool `[max_batch]`.
    live: Tensor,
    /// Views of `next`, `positions` and `live` for each bucket (`buckets`), made once at load.
    steps: Vec<StepViews>,
    /// Some on a CUDA device with `Settings::cuda_graphs`.
    graphs: Option<Graphs>,
    /// A failure a test asked for (`inject_fault_for_tests`): where, and which request.
    fault: Option<(Fault, u64)>,
}

/// What decides the ATen calls of a decode step: its bucket, whether it has padding rows, and the
/// sampling stages its rows need. Everything else a step reads is on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct StepKey {
    b: i64,
    padded: bool,
    stages: Stages,
}

/// CUDA graphs of the decode step, one per `StepKey`: a key's first step runs eagerly (the warm-up
/// that makes the cache's views and the libraries' workspaces), its second is captured and then
/// replayed, and later ones replay it. A step reads only tensors that live as long as the engine
/// (weights, the cache and its views, the step views, the sampler's tables) and host values fixed by
/// its key, so replaying it is the same computation as running it (torch.cuda.graph's contract,
/// PyTorch docs "CUDA Graphs"). Prompt chunks run eagerly.
#[derive(Default)]
struct Graphs {
    seen: std::collections::HashSet<StepKey>,
    captured: std::collections::HashMap<StepKey, (CudaGraph, Chosen)>,
}

/// How a decode step runs.
enum Mode {
    Eager,
    Capture,
    Replay,
}

/// A decode step's inputs for slots `0..b`: views of the engine's per-slot tensors.
struct StepViews {
    /// The bucket: slots `0..b`.
    b: i64,
    next: Tensor,
    positions: Tensor,
    /// `positions` as a forward reads them.
    pos: Positions,
    live: Tensor,
    /// `live` as `[b, 1, 1]`.
    live3: Tensor,
}

impl StepViews {
    fn new(b: i64, next: &Tensor, positions: &Tensor, live: &Tensor) -> Result<StepViews> {
        let positions = positions.narrow(0, 0, b)?;
        let live = live.narrow(0, 0, b)?;
        Ok(StepViews {
            b,
            next: next.narrow(0, 0, b)?,
            pos: Positions::new(&positions.unsqueeze(1)?)?,
            positions,
            live3: live.reshape(&[b, 1, 1])?,
            live,
        })
    }
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

/// The decode-step batch sizes: powers of two below `max_batch`, and `max_batch`.
pub fn buckets(max_batch: i64) -> Vec<i64> {
    let mut b: Vec<i64> = std::iter::successors(Some(1i64), |x| Some(x * 2)).take_while(|x| *x < max_batch).collect();
    b.push(max_batch);
    b
}

/// The engine's settings besides the checkpoint.
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    pub context: i64,
    pub dtype: DType,
    pub prefill_chunk: i64,
    pub max_batch: i64,
    /// Capture each decode-step shape as a CUDA graph and replay it (CUDA only; see `Graphs`).
    pub cuda_graphs: bool,
    /// Keep int4 weights packed (`Int4Path::Packed`): Some(true) requires it; None and Some(false)
    /// dequantize at load. Not the default: ATen's int4 kernels round differently from the
    /// dequantized product Transformers computes, enough to change tokens of a small random model.
    pub packed_int4: Option<bool>,
    /// Multiply dense weights with oneDNN (linear.rs): Some(true) requires it (CPU, float32, a
    /// torch with oneDNN); None uses it where it can; Some(false) uses ATen's matmul.
    pub onednn: Option<bool>,
}

impl Settings {
    fn check(&self) -> Result<()> {
        for (name, v) in
            [("context", self.context), ("prefill_chunk", self.prefill_chunk), ("max_batch", self.max_batch)]
        {
            if v < 1 {
                return Err(Error::Input(format!("{name} must be >= 1, got {v}")));
            }
        }
        Ok(())
    }

    /// Whether dense weights go through oneDNN on `device` (ATen's device string).
    fn onednn(&self, device: &str) -> Result<bool> {
        let why_not = if !device.starts_with("cpu") {
            Some(format!("oneDNN linears run on the CPU; the device is {device}"))
        } else if self.dtype != DType::F32 {
            Some(format!("oneDNN linears compute in float32; dtype is {}", self.dtype.name()))
        } else if !Tensor::has_onednn() {
            Some("this torch was built without oneDNN (torch.backends.mkldnn.is_available() is False)".into())
        } else {
            None
        };
        match (self.onednn, why_not) {
            (Some(false), _) | (None, Some(_)) => Ok(false),
            (_, None) => Ok(true),
            (Some(true), Some(why)) => Err(Error::Input(why)),
        }
    }

    /// How int4 weights reach `device` (ATen's device string).
    fn int4_path(&self, device: &str) -> Result<Int4Path> {
        let kernels = device.starts_with("cpu") || device.starts_with("cuda");
        let bf16 = self.dtype == DType::BF16;
        match self.packed_int4 {
            None | Some(false) => Ok(Int4Path::Dequantized),
            Some(true) if !bf16 => Err(Error::Input(format!(
                "packed int4 weights compute in bfloat16 (ATen's int4 kernels take bfloat16 activations); dtype is {}",
                self.dtype.name()
            ))),
            Some(true) if !kernels => Err(Error::Input(format!(
                "packed int4 weights need ATen's int4 kernels (CPU or CUDA); the device is {device}"
            ))),
            Some(true) => Ok(Int4Path::Packed),
        }
    }
}

/// What the loader put on the device (`Engine::weights`).
#[derive(Clone, Debug)]
pub struct WeightsInfo {
    /// "packed", "dequantized", "mixed" (some int4 weights did not fit the kernels' layout) or
    /// "none" (no int4 weights).
    pub int4: &'static str,
    pub bytes: i64,
    /// "onednn" or "aten": what multiplies the dense weights (`Settings::onednn`).
    pub linear: &'static str,
}

impl Engine {
    /// Load `model_dir` (and the vocabulary tables of `emb_dir`) onto `like`'s device. `fits` sees
    /// the KV cache's size once the weights are on the device and before the cache is allocated;
    /// it refuses a cache that cannot fit.
    pub fn load(
        model_dir: &Path,
        emb_dir: Option<&Path>,
        like: Tensor,
        settings: Settings,
        fits: impl FnOnce(&CacheSize) -> Result<()>,
    ) -> Result<Engine> {
        settings.check()?;
        let cfg = Config::load(model_dir)?;
        let main = Checkpoint::open(model_dir, cfg.quant.clone())?;
        let emb = match emb_dir {
            Some(d) => Some(Checkpoint::open(d, emb_quant(d, cfg.quant.clone())?)?),
            None => None,
        };
        let device = like.device()?;
        let (int4, onednn) = (settings.int4_path(&device)?, settings.onednn(&device)?);
        let weights = Weights::new(main, emb, like.shallow_clone()?, settings.dtype, int4, onednn);
        let model = Model::load(cfg, &weights, settings.context)?;
        let loaded = weights.loaded();
        let b = settings.max_batch;
        fits(&CacheSize::of(&model.cfg, settings.context, b, settings.dtype))?;
        let cache = KvCache::new(&model.cfg, settings.context, b, &like, settings.dtype)?;
        let sampler = Sampler::new(b, model.cfg.vocab_size, &like)?;
        let next = Tensor::full(&[b], 0.0, DType::I64, &like)?;
        let positions = Tensor::full(&[b], 0.0, DType::I64, &like)?;
        let live = Tensor::full(&[b], 0.0, DType::Bool, &like)?;
        let steps =
            buckets(b).iter().map(|n| StepViews::new(*n, &next, &positions, &live)).collect::<Result<Vec<_>>>()?;
        let graphs = (settings.cuda_graphs && like.device()?.starts_with("cuda") && CudaGraph::available())
            .then(Graphs::default);
        Ok(Engine {
            graphs,
            fault: None,
            loaded,
            next,
            positions,
            live,
            steps,
            model,
            cache,
            sampler,
            like,
            context: settings.context,
            prefill_chunk: settings.prefill_chunk,
            max_batch: b,
        })
    }

    pub fn config(&self) -> &Config {
        &self.model.cfg
    }

    pub fn context(&self) -> i64 {
        self.context
    }

    pub fn max_batch(&self) -> i64 {
        self.max_batch
    }

    pub fn dtype(&self) -> DType {
        self.model.dtype()
    }

    pub fn device(&self) -> Result<String> {
        self.like.device()
    }

    pub fn weights(&self) -> WeightsInfo {
        let l = self.loaded;
        let int4 = match (l.packed, l.dequantized) {
            (0, 0) => "none",
            (_, 0) => "packed",
            (0, _) => "dequantized",
            _ => "mixed",
        };
        WeightsInfo { int4, bytes: l.bytes, linear: if l.onednn { "onednn" } else { "aten" } }
    }

    /// ATen calls each layer made in the last forward (a decode step after `decode`).
    pub fn layer_calls(&self) -> Vec<u64> {
        self.model.layer_calls()
    }

    pub fn layout(&self) -> Layout {
        let cfg = &self.model.cfg;
        let size = CacheSize::of(cfg, self.context, self.max_batch, self.model.dtype());
        Layout {
            full_rings: self.cache.own_rings(LayerType::Full, cfg),
            sliding_rings: self.cache.own_rings(LayerType::Sliding, cfg),
            shared_layers: cfg.layers.iter().filter(|l| l.kv_source.is_some()).count() as i64,
            context: self.context,
            sliding_window: cfg.sliding_window,
            max_batch: self.max_batch,
            kv_bytes_per_slot: size.bytes_per_slot,
            kv_bytes: size.total(),
        }
    }

    /// The checks on a prompt that a caller can fail, before any model code runs.
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

    /// Every check on a request, before it takes a slot.
    pub fn check_request(&self, r: &Request) -> Result<()> {
        if r.max_new < 1 {
            return Err(Error::Input(format!("max_new must be >= 1, got {}", r.max_new)));
        }
        r.params.check(self.model.cfg.vocab_size)?;
        self.check_prompt(&r.prompt)
    }

    /// float32 next-token logits after `ids`, read into slot 0 from empty, on the host as a tensor.
    pub fn logits(&mut self, ids: &[i64]) -> Result<Tensor> {
        self.check_prompt(ids)?;
        let prompt = Tensor::from_i64(ids)?.to_like(&self.like, DType::I64)?;
        let mut done = 0;
        loop {
            let (logits, read) = self.prompt_chunk(0, &prompt, ids.len(), done)?;
            done += read;
            if let Some(l) = logits {
                // A tensor built from host bytes lives on the host: it names where the logits go.
                let host = Tensor::from_i64(&[0])?;
                return l.reshape(&[self.model.cfg.vocab_size])?.to_like(&host, DType::F32);
            }
        }
    }

    /// Read the next chunk of `slot`'s prompt (`prompt`, `n` tokens, `done` read). Returns the
    /// last position's logits `[1, vocab]` once the whole prompt is read, and the tokens read.
    fn prompt_chunk(&mut self, slot: i64, prompt: &Tensor, n: usize, done: usize) -> Result<(Option<Tensor>, usize)> {
        let end = (done + self.prefill_chunk as usize).min(n);
        let t = (end - done) as i64;
        let ids = prompt.narrow(0, done as i64, t)?;
        let pos = Positions::chunk(done as i64, end as i64, &self.like)?;
        let fill = if done == 0 { Fill::Empty } else { Fill::Partial };
        let output = if end == n { Output::Logits } else { Output::Nothing };
        let rows = Rows::one(slot);
        let logits = self.model.forward(&mut self.cache, rows, &ids, &pos, &Liveness::AllLive, fill, output)?;
        Ok((logits, end - done))
    }

    /// Run the continuous-batching loop until `io.poll` returns None. See the module docs.
    pub fn run(&mut self, io: &mut impl Io, read_every: i64) -> Result<()> {
        if read_every < 1 {
            return Err(Error::Input(format!("read_every must be >= 1, got {read_every}")));
        }
        // Every slot starts free, on the device too: a run that ended on an error (a callback's
        // exception) leaves its slots marked live, and a decode step would run such a row as live
        // (writing its cache and moving its draw index) while a new request reads its prompt there.
        self.live.fill_(0.0)?;
        let mut slots: Vec<Option<Slot>> = (0..self.max_batch).map(|_| None).collect();
        let mut drawn: Vec<Drawn> = Vec::new();
        let mut seq = 0u64;
        let mut stats = StepStats::default();
        let mut since = Instant::now();
        let mut failed: Vec<Event> = Vec::new();
        loop {
            let mut events = std::mem::take(&mut failed);
            match self.read_point(&mut slots, &mut drawn) {
                Ok(read) => events.extend(read),
                Err(e) => {
                    let busy: Vec<usize> = (0..slots.len()).filter(|s| slots[*s].is_some()).collect();
                    events.extend(self.fail(&mut slots, busy, &e)?);
                }
            }
            stats.seconds = since.elapsed().as_secs_f64();
            if !events.is_empty() || !stats.batch_sizes.is_empty() || stats.prompt_tokens > 0 {
                io.emit(events, &stats)?;
            }
            let free = slots.iter().filter(|s| s.is_none()).count();
            let Some((new, cancels)) = io.poll(free, free == slots.len())? else {
                let ends = self.cancel(&mut slots, |_| true)?;
                return io.emit(ends, &StepStats::default());
            };
            let mut events = self.cancel(&mut slots, |id| cancels.contains(&id))?;
            for request in new {
                if let Some(refused) = self.admit(&mut slots, request, &mut seq)? {
                    events.push(refused);
                }
            }
            if !events.is_empty() {
                io.emit(events, &StepStats::default())?;
            }
            stats = StepStats::default();
            since = Instant::now();
            for _ in 0..read_every {
                if !self.turn(&mut slots, &mut drawn, &mut stats, &mut failed)? {
                    break;
                }
            }
        }
    }

    /// Put `r` in the lowest free slot, or say why it cannot run.
    fn admit(&mut self, slots: &mut [Option<Slot>], r: Request, seq: &mut u64) -> Result<Option<Event>> {
        let refuse =
            |r: &Request, msg: String| Ok(Some(Event::end_with_error(r.id, Finish::Error, Timing::default(), msg)));
        if let Err(e) = self.check_request(&r) {
            return refuse(&r, e.to_string());
        }
        let Some(s) = slots.iter().position(|s| s.is_none()) else {
            return refuse(&r, format!("all {} slots are busy", self.max_batch));
        };
        let prompt = match self.place(s, &r) {
            Ok(prompt) => prompt,
            Err(e) => return Ok(Some(Event::end_with_error(r.id, Finish::Failed, Timing::default(), e.to_string()))),
        };
        let reading_it = |x: &Option<Slot>| {
            x.as_ref().is_some_and(|x| matches!(x.phase, Phase::Prompt { .. }) && x.request.prompt == r.prompt)
        };
        let phase = match slots.iter().position(reading_it) {
            Some(leader) => Phase::Follow { leader },
            None => Phase::Prompt { done: 0 },
        };
        let room = (self.context - r.prompt.len() as i64) as usize;
        *seq += 1;
        slots[s] = Some(Slot {
            limit: (r.max_new as usize).min(room),
            request: r,
            prompt,
            phase,
            drawn: 0,
            emitted: 0,
            live: false,
            finished: None,
            admitted: Instant::now(),
            first_token: None,
            seq: *seq,
        });
        Ok(None)
    }

    /// Upload `r`'s prompt and give slot `s` its sampling state; the slot is still free, so an error
    /// here leaves nothing to undo (the next `assign` rewrites the whole row).
    fn place(&mut self, s: usize, r: &Request) -> Result<Tensor> {
        if self.fault == Some((Fault::Admit, r.id)) {
            return Err(self.take_fault());
        }
        let prompt = Tensor::from_i64(&r.prompt)?.to_like(&self.like, DType::I64)?;
        self.sampler.assign(s as i64, &r.params, &prompt)?;
        Ok(prompt)
    }

    /// End the requests in the slots `which` as failed by `e`, and free their slots.
    fn fail(
        &mut self,
        slots: &mut [Option<Slot>],
        which: impl IntoIterator<Item = usize>,
        e: &Error,
    ) -> Result<Vec<Event>> {
        let mut events = Vec::new();
        for s in which {
            if slots[s].is_some() {
                let slot = self.free(slots, s)?;
                events.push(Event::end_with_error(slot.request.id, Finish::Failed, timing(&slot), e.to_string()));
            }
        }
        Ok(events)
    }

    /// Make the engine fail request `id` at `at` (once): the one way a test can produce a device
    /// error on demand, to show that it fails that request alone.
    pub fn inject_fault_for_tests(&mut self, at: Fault, id: u64) {
        self.fault = Some((at, id));
    }

    /// An error when a fault is injected at `at` for a request in one of the slots `which` (the fault is
    /// then used up). Without an injected fault it looks at nothing.
    fn injected(&mut self, at: Fault, slots: &[Option<Slot>], which: impl IntoIterator<Item = usize>) -> Result<()> {
        let Some((where_, id)) = self.fault else { return Ok(()) };
        if where_ == at && which.into_iter().any(|s| slots[s].as_ref().is_some_and(|slot| slot.request.id == id)) {
            return Err(self.take_fault());
        }
        Ok(())
    }

    /// The injected fault as the error it stands for, used up.
    fn take_fault(&mut self) -> Error {
        match self.fault.take() {
            Some((at, id)) => Error::Internal(format!("a fault injected for tests ({at:?}, request {id})")),
            None => Error::Internal("no fault was injected".into()),
        }
    }

    /// End the requests whose ids `which` picks as "cancelled" and free their slots.
    fn cancel(&mut self, slots: &mut [Option<Slot>], which: impl Fn(u64) -> bool) -> Result<Vec<Event>> {
        let mut events = Vec::new();
        for s in 0..slots.len() {
            if slots[s].as_ref().is_some_and(|slot| which(slot.request.id)) {
                let slot = self.free(slots, s)?;
                events.push(Event::end(slot.request.id, Finish::Cancelled, timing(&slot)));
            }
        }
        Ok(events)
    }

    fn free(&mut self, slots: &mut [Option<Slot>], s: usize) -> Result<Slot> {
        let slot = slots[s].take().ok_or_else(|| Error::Internal(format!("slot {s} is already free")))?;
        // A leader that goes before its prompt is read hands the reading to its oldest follower.
        if let Some((&heir, rest)) = followers(slots, s).split_first() {
            let phases = rest.iter().map(|i| (*i, Phase::Follow { leader: heir }));
            for (i, phase) in phases.chain([(heir, Phase::Prompt { done: 0 })]) {
                if let Some(x) = slots[i].as_mut() {
                    x.phase = phase;
                }
            }
        }
        if slot.live {
            self.live.narrow(0, s as i64, 1)?.fill_(0.0)?;
        }
        self.sampler.release(s as i64);
        Ok(slot)
    }

    /// One turn: a decode step of every decoding slot, then a chunk of the oldest unread prompt
    /// (a slot whose prompt ends here draws its first token now and decodes from the next turn).
    /// Returns false when there was nothing to do. Requests whose forward failed end in `failed`.
    fn turn(
        &mut self,
        slots: &mut [Option<Slot>],
        drawn: &mut Vec<Drawn>,
        stats: &mut StepStats,
        failed: &mut Vec<Event>,
    ) -> Result<bool> {
        let top = slots.iter().rposition(|s| s.as_ref().is_some_and(|s| s.live));
        if let Some(top) = top {
            let b = self.steps.iter().map(|s| s.b).find(|b| *b > top as i64).unwrap_or(self.max_batch);
            let rows: Vec<Option<usize>> =
                (0..b as usize).map(|i| slots[i].as_ref().filter(|s| s.live).map(|_| i)).collect();
            stats.batch_sizes.push(rows.iter().flatten().count());
            let step = self.injected(Fault::Decode, slots, rows.iter().flatten().copied());
            if let Err(e) = step.and_then(|_| self.decode_step(b, &rows, drawn)) {
                failed.extend(self.fail(slots, rows.iter().flatten().copied(), &e)?);
                return Ok(true);
            }
            for i in rows.iter().flatten() {
                let slot = slots[*i].as_mut().ok_or_else(|| Error::Internal(format!("slot {i} vanished")))?;
                slot.drawn += 1;
                if slot.drawn >= slot.limit {
                    slot.live = false;
                    self.live.narrow(0, *i as i64, 1)?.fill_(0.0)?;
                }
            }
        }
        let reading: Vec<Unread> = slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let s = s.as_ref()?;
                let Phase::Prompt { done } = s.phase else { return None };
                Some(Unread { seq: s.seq, slot: i, done, len: s.request.prompt.len() })
            })
            .collect();
        let group = prompt_group(reading, self.prefill_chunk as usize);
        if group.is_empty() {
            return Ok(top.is_some());
        }
        let read = self.injected(Fault::Prompt, slots, group.iter().copied()).and_then(|_| match group[..] {
            [s] => self.read_prompt(slots, s, drawn),
            _ => self.read_prompts(slots, &group, drawn),
        });
        match read {
            Ok(read) => {
                stats.prompt_tokens += read;
                stats.prompt_reads.push(group.len());
            }
            Err(e) => failed.extend(self.fail(slots, group, &e)?),
        }
        Ok(true)
    }

    /// Read one chunk of slot `s`'s prompt; after the last chunk, draw its first token and start
    /// it decoding. Returns the prompt tokens read.
    fn read_prompt(&mut self, slots: &mut [Option<Slot>], s: usize, drawn: &mut Vec<Drawn>) -> Result<usize> {
        let slot = slots[s].as_mut().ok_or_else(|| Error::Internal(format!("slot {s} is free")))?;
        let Phase::Prompt { done } = slot.phase else { return Err(Error::Internal("slot is not reading".into())) };
        let n = slot.request.prompt.len();
        let prompt = slot.prompt.shallow_clone()?;
        let (logits, read) = self.prompt_chunk(s as i64, &prompt, n, done)?;
        slot.phase = Phase::Prompt { done: done + read };
        if let Some(logits) = logits {
            self.prompt_done(slots, s, &logits, drawn)?;
        }
        Ok(read)
    }

    /// Read the whole prompts of the slots `group` (`prompt_group`) in one forward over the slots
    /// from the lowest to the highest, left-padded (`padded_prompts`, module docs), and start each
    /// decoding. Returns the prompt tokens read.
    fn read_prompts(&mut self, slots: &mut [Option<Slot>], group: &[usize], drawn: &mut Vec<Drawn>) -> Result<usize> {
        let (Some(&lo), Some(&hi)) = (group.iter().min(), group.iter().max()) else {
            return Err(Error::Internal("an empty prompt group".into()));
        };
        let prompts: Vec<Option<&[i64]>> = (lo..=hi)
            .map(|i| slots[i].as_ref().filter(|_| group.contains(&i)).map(|s| s.request.prompt.as_slice()))
            .collect();
        let read = prompts.iter().flatten().map(|p| p.len()).sum();
        let t = prompts.iter().flatten().map(|p| p.len()).max().unwrap_or(0) as i64;
        let padded = padded_prompts(&prompts, t as usize, self.context - 1);
        let rows = Rows { start: lo as i64, len: (hi - lo + 1) as i64 };
        let device = |v: &[i64], dtype: DType| Tensor::from_i64(v)?.to_like(&self.like, dtype);
        let ids = device(&padded.ids, DType::I64)?;
        let pos = Positions::new(&device(&padded.positions, DType::I64)?.reshape(&[rows.len, t])?)?;
        let live = Liveness::Padding(device(&padded.live, DType::Bool)?.reshape(&[rows.len, 1, t])?);
        let logits = self
            .model
            .forward(&mut self.cache, rows, &ids, &pos, &live, Fill::Empty, Output::Logits)?
            .ok_or_else(|| Error::Internal("a prompt forward returned no logits".into()))?;
        for &s in group {
            let row = logits.narrow(0, (s - lo) as i64, 1)?;
            self.prompt_done(slots, s, &row, drawn)?;
        }
        Ok(read)
    }

    /// Slot `s` has read its whole prompt, and `logits` `[1, vocab]` follow it: start it and its
    /// followers decoding.
    fn prompt_done(
        &mut self,
        slots: &mut [Option<Slot>],
        s: usize,
        logits: &Tensor,
        drawn: &mut Vec<Drawn>,
    ) -> Result<()> {
        let n = slots[s].as_ref().map_or(0, |slot| slot.request.prompt.len()) as i64;
        self.start_decoding(slots, s, logits, drawn)?;
        for f in followers(slots, s) {
            self.cache.copy_prompt(Rows::one(s as i64), Rows::one(f as i64), n)?;
            self.start_decoding(slots, f, logits, drawn)?;
        }
        Ok(())
    }

    /// Slot `s` has its prompt's keys in its rings and `logits` `[1, vocab]` after it: draw its first
    /// token and start it decoding.
    fn start_decoding(
        &mut self,
        slots: &mut [Option<Slot>],
        s: usize,
        logits: &Tensor,
        drawn: &mut Vec<Drawn>,
    ) -> Result<()> {
        let slot = slots[s].as_mut().ok_or_else(|| Error::Internal(format!("slot {s} is free")))?;
        let si = s as i64;
        let chosen = self.sampler.choose(logits, si, 1)?;
        self.sampler.advance(&chosen.tokens, si, 1, None)?;
        self.next.narrow(0, si, 1)?.copy_(&chosen.tokens)?;
        self.positions.narrow(0, si, 1)?.fill_(slot.request.prompt.len() as f64)?;
        slot.phase = Phase::Decode;
        slot.drawn = 1;
        if slot.limit > 1 {
            slot.live = true;
            self.live.narrow(0, si, 1)?.fill_(1.0)?;
        }
        drawn.push(Drawn { chosen, rows: vec![Some(s)] });
        Ok(())
    }

    /// One decode step of slots `0..b`; `rows[i]` is Some for the decoding ones.
    fn decode_step(&mut self, b: i64, rows: &[Option<usize>], drawn: &mut Vec<Drawn>) -> Result<()> {
        let padded = rows.iter().any(|r| r.is_none());
        let key = StepKey { b, padded, stages: self.sampler.stages(0, b) };
        let mode = match self.graphs.as_mut() {
            None => Mode::Eager,
            Some(g) => {
                if g.seen.insert(key) {
                    Mode::Eager
                } else if g.captured.contains_key(&key) {
                    Mode::Replay
                } else {
                    Mode::Capture
                }
            }
        };
        let chosen = match mode {
            Mode::Eager => self.step(b, padded)?,
            Mode::Capture => {
                self.capture(key)?;
                self.replay(key)?
            }
            Mode::Replay => self.replay(key)?,
        };
        drawn.push(Drawn { chosen, rows: rows.to_vec() });
        Ok(())
    }

    /// Capture the decode step of `key` (nothing runs until `replay`). Every step graph allocates
    /// from the first one's memory pool: they run one at a time, and each one's outputs are copied
    /// out right after its replay.
    fn capture(&mut self, key: StepKey) -> Result<()> {
        let like = self.like.shallow_clone()?;
        let mut graphs = self.graphs.take().ok_or_else(|| Error::Internal("no graphs to capture into".into()))?;
        let captured = {
            let share = graphs.captured.values().next().map(|(g, _)| g);
            CudaGraph::capture(&like, share, || self.step(key.b, key.padded))
        };
        let result = captured.map(|graph_and_out| {
            graphs.captured.insert(key, graph_and_out);
        });
        self.graphs = Some(graphs);
        result
    }

    /// Replay the captured step of `key`; returns a copy of what it chose.
    fn replay(&self, key: StepKey) -> Result<Chosen> {
        let (graph, out) = self
            .graphs
            .as_ref()
            .and_then(|g| g.captured.get(&key))
            .ok_or_else(|| Error::Internal("a captured step vanished".into()))?;
        graph.replay()?;
        out.copy()
    }

    /// The CUDA graphs captured so far (0 off CUDA).
    pub fn captured_steps(&self) -> usize {
        self.graphs.as_ref().map_or(0, |g| g.captured.len())
    }

    /// The device work of one decode step of slots `0..b`: the forward, the choice, and the moves of
    /// each slot's next token, position and sampling state. Returns what it chose.
    fn step(&mut self, b: i64, padded: bool) -> Result<Chosen> {
        let all = Rows::first(b);
        let step = self
            .steps
            .iter()
            .find(|s| s.b == b)
            .ok_or_else(|| Error::Internal(format!("{b} is not a decode bucket")))?;
        let live = if padded { Liveness::Padding(step.live3.shallow_clone()?) } else { Liveness::AllLive };
        let logits = self
            .model
            .forward(&mut self.cache, all, &step.next, &step.pos, &live, Fill::Partial, Output::Logits)?
            .ok_or_else(|| Error::Internal("a decode step returned no logits".into()))?;
        let chosen = self.sampler.choose(&logits, 0, b)?;
        step.next.copy_(&chosen.tokens)?;
        // Only decoding rows move on; padding rows keep their position and sampling state.
        if padded {
            self.sampler.advance(&chosen.tokens, 0, b, Some(&step.live))?;
            step.positions.add_(&step.live)?;
        } else {
            self.sampler.advance(&chosen.tokens, 0, b, None)?;
            step.positions.add_int_(1)?;
        }
        Ok(chosen)
    }

    /// Bring the drawn tokens to the host, cut each request at its end, free finished slots.
    fn read_point(&mut self, slots: &mut [Option<Slot>], drawn: &mut Vec<Drawn>) -> Result<Vec<Event>> {
        if drawn.is_empty() {
            return Ok(Vec::new());
        }
        let batch: Vec<Drawn> = std::mem::take(drawn);
        let refs: Vec<&Tensor> = batch.iter().map(|d| &d.chosen.tokens).collect();
        let tokens = if refs.len() == 1 { refs[0].to_vec_i64()? } else { Tensor::cat(&refs, 0)?.to_vec_i64()? };
        let now = Instant::now();
        let mut events: Vec<Option<Event>> = (0..slots.len()).map(|_| None).collect();
        let mut at = 0;
        for d in &batch {
            let lp = match &d.chosen.logprobs {
                Some((chosen, ids, lps)) => {
                    let k = ids.size()?[1] as usize;
                    Some((chosen.to_vec_f32()?, ids.to_vec_i64()?, lps.to_vec_f32()?, k))
                }
                None => None,
            };
            for (row, s) in d.rows.iter().enumerate() {
                let token = tokens[at + row];
                let Some(s) = *s else { continue };
                let Some(slot) = slots[s].as_mut() else { continue };
                if slot.finished.is_some() {
                    continue;
                }
                let ev = events[s].get_or_insert_with(|| Event::new(slot.request.id));
                if self.model.cfg.eos_ids.contains(&token) || slot.request.stop_ids.contains(&token) {
                    slot.finished = Some(Finish::Stop);
                    continue;
                }
                ev.tokens.push(token);
                if let (Some(want), Some((chosen, ids, lps, k))) = (slot.request.params.logprobs, &lp) {
                    let base = row * k;
                    let top = (0..(want as usize).min(*k)).map(|j| (ids[base + j], lps[base + j])).collect();
                    ev.logprobs.push(TokenLogprobs { logprob: chosen[row], top });
                }
                slot.first_token.get_or_insert(now);
                slot.emitted += 1;
                if slot.emitted >= slot.limit {
                    slot.finished = Some(Finish::Length);
                }
            }
            at += d.rows.len();
        }
        let mut out = Vec::new();
        for (s, ev) in events.into_iter().enumerate() {
            let Some(mut ev) = ev else { continue };
            if let Some(finish) = slots[s].as_ref().and_then(|slot| slot.finished) {
                let slot = self.free(slots, s)?;
                ev.finish = Some(finish);
                ev.timing = timing(&slot);
            }
            out.push(ev);
        }
        Ok(out)
    }
}

/// A slot still reading its prompt: admission order, slot, tokens read, prompt length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Unread {
    seq: u64,
    slot: usize,
    done: usize,
    len: usize,
}

/// The slots the next prompt forward reads (module docs): the oldest unread prompt, and, when it
/// starts and fits `budget` tokens whole, the next unread ones in admission order while each starts,
/// and the forward's rectangle (the slots from the lowest to the highest, times the longest prompt)
/// stays within `budget`. Several slots are read whole; one alone may be read in chunks.
fn prompt_group(mut reading: Vec<Unread>, budget: usize) -> Vec<usize> {
    reading.sort();
    let Some(first) = reading.first().copied() else { return Vec::new() };
    let mut group = vec![first.slot];
    if first.done > 0 || first.len > budget {
        return group;
    }
    let (mut lo, mut hi, mut longest) = (first.slot, first.slot, first.len);
    for u in &reading[1..] {
        let (l, h, t) = (lo.min(u.slot), hi.max(u.slot), longest.max(u.len));
        if u.done > 0 || (h - l + 1) * t > budget {
            break;
        }
        group.push(u.slot);
        (lo, hi, longest) = (l, h, t);
    }
    group
}

/// A prompt forward's inputs on the host, `[rows, t]` flattened: token ids, positions, and 1 where
/// a token is real.
#[derive(Debug, PartialEq)]
struct Padded {
    ids: Vec<i64>,
    positions: Vec<i64>,
    live: Vec<i64>,
}

/// Each row's prompt (None: a slot in the range that reads nothing) at the right end of `t`
/// columns; the columns before it hold token 0 at position `pad_pos`, not live (module docs).
fn padded_prompts(prompts: &[Option<&[i64]>], t: usize, pad_pos: i64) -> Padded {
    let mut out = Padded { ids: Vec::new(), positions: Vec::new(), live: Vec::new() };
    for p in prompts {
        let p = p.unwrap_or(&[]);
        let pad = t - p.len();
        out.ids.extend(std::iter::repeat_n(0, pad).chain(p.iter().copied()));
        out.positions.extend(std::iter::repeat_n(pad_pos, pad).chain(0..p.len() as i64));
        out.live.extend(std::iter::repeat_n(0, pad).chain(std::iter::repeat_n(1, p.len())));
    }
    out
}

/// The slots that follow slot `leader` (`Phase::Follow`), oldest first.
fn followers(slots: &[Option<Slot>], leader: usize) -> Vec<usize> {
    let mut found: Vec<(u64, usize)> = slots
        .iter()
        .enumerate()
        .filter_map(|(i, x)| x.as_ref().map(|x| (x, i)))
        .filter(|(x, _)| matches!(x.phase, Phase::Follow { leader: l } if l == leader))
        .map(|(x, i)| (x.seq, i))
        .collect();
    found.sort();
    found.into_iter().map(|(_, i)| i).collect()
}

fn timing(slot: &Slot) -> Timing {
    let now = Instant::now();
    match slot.first_token {
        Some(first) => {
            Timing { prompt_s: (first - slot.admitted).as_secs_f64(), decode_s: (now - first).as_secs_f64() }
        }
        None => Timing { prompt_s: (now - slot.admitted).as_secs_f64(), decode_s: 0.0 },
    }
}

/// `Engine::decode`'s side of the loop: one request, its tokens handed to `on_tokens`.
struct One<F: FnMut(&[i64]) -> bool> {
    request: Option<Request>,
    id: u64,
    on_tokens: F,
    tokens: Vec<i64>,
    finish: Option<Finish>,
    error: Option<String>,
    cancel: bool,
    timing: Timing,
}

impl<F: FnMut(&[i64]) -> bool> Io for One<F> {
    fn poll(&mut self, _free: usize, _idle: bool) -> Result<Option<(Vec<Request>, Vec<u64>)>> {
        if self.finish.is_some() {
            return Ok(None);
        }
        let cancels = if self.cancel { vec![self.id] } else { Vec::new() };
        Ok(Some((self.request.take().into_iter().collect(), cancels)))
    }

    fn emit(&mut self, events: Vec<Event>, _stats: &StepStats) -> Result<()> {
        for e in events {
            self.tokens.extend_from_slice(&e.tokens);
            if !e.tokens.is_empty() && !self.cancel && !(self.on_tokens)(&e.tokens) {
                self.cancel = true;
            }
            if let Some(f) = e.finish {
                self.finish = Some(if self.cancel { Finish::Cancelled } else { f });
                self.error = e.error;
                self.timing = e.timing;
            }
        }
        Ok(())
    }
}

/// The result of `Engine::decode`.
pub struct Decoded {
    pub tokens: Vec<i64>,
    pub finish: Finish,
    pub timing: Timing,
}

impl Engine {
    /// One request through the loop alone; `on_tokens` gets each non-empty batch and returns false
    /// to cancel.
    pub fn decode(
        &mut self,
        request: Request,
        read_every: i64,
        on_tokens: impl FnMut(&[i64]) -> bool,
    ) -> Result<Decoded> {
        self.check_request(&request)?;
        let mut one = One {
            id: request.id,
            request: Some(request),
            on_tokens,
            tokens: Vec::new(),
            finish: None,
            error: None,
            cancel: false,
            timing: Timing::default(),
        };
        self.run(&mut one, read_every)?;
        match (one.finish, one.error) {
            (Some(Finish::Error), Some(e)) => Err(Error::Input(e)),
            (Some(Finish::Failed), e) => Err(Error::Internal(e.unwrap_or_default())),
            (Some(finish), _) => Ok(Decoded { tokens: one.tokens, finish, timing: one.timing }),
            (None, _) => Err(Error::Internal("the loop ended without finishing the request".into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_powers_of_two_below_max_batch_then_max_batch() {
        assert_eq!(buckets(1), vec![1]);
        assert_eq!(buckets(8), vec![1, 2, 4, 8]);
        assert_eq!(buckets(6), vec![1, 2, 4, 6]);
    }

    fn unread(seq: u64, slot: usize, done: usize, len: usize) -> Unread {
        Unread { seq, slot, done, len }
    }

    #[test]
    fn short_prompts_that_fit_the_budget_are_read_together_in_admission_order() {
        // Slots 0..4 hold prompts of 10, 20, 5 and 30 tokens, admitted in order 3, 0, 1, 2.
        let burst = vec![unread(2, 1, 0, 20), unread(1, 0, 0, 10), unread(4, 3, 0, 30), unread(3, 2, 0, 5)];
        assert_eq!(prompt_group(burst.clone(), 256), vec![0, 1, 2, 3]);
        // 3 rows x 20 = 60 fit; adding slot 3 makes 4 x 30 = 120.
        assert_eq!(prompt_group(burst.clone(), 100), vec![0, 1, 2]);
        // The oldest alone when it does not fit whole, or is already part read.
        assert_eq!(prompt_group(burst, 9), vec![0]);
        assert_eq!(prompt_group(vec![unread(1, 0, 8, 20), unread(2, 1, 0, 4)], 256), vec![0]);
        // A gap in the slots counts as padding rows: slots 0 and 3 make a 4-row rectangle.
        assert_eq!(prompt_group(vec![unread(1, 0, 0, 10), unread(2, 3, 0, 10)], 39), vec![0]);
        assert_eq!(prompt_group(vec![unread(1, 0, 0, 10), unread(2, 3, 0, 10)], 40), vec![0, 3]);
        assert_eq!(prompt_group(Vec::new(), 256), Vec::<usize>::new());
    }

    #[test]
    fn padded_prompts_sit_at_the_right_end_of_their_rows() {
        let p = padded_prompts(&[Some(&[5, 6][..]), None, Some(&[7, 8, 9][..])], 3, 99);
        assert_eq!(p.ids, vec![0, 5, 6, 0, 0, 0, 7, 8, 9]);
        assert_eq!(p.positions, vec![99, 0, 1, 99, 99, 99, 0, 1, 2]);
        assert_eq!(p.live, vec![0, 1, 1, 0, 0, 0, 1, 1, 1]);
    }

    #[test]
    fn settings_below_one_name_the_setting() {
        let s = Settings {
            context: 8,
            dtype: DType::F32,
            prefill_chunk: 4,
            max_batch: 0,
            packed_int4: None,
            cuda_graphs: true,
            onednn: None,
        };
        assert!(s.check().unwrap_err().to_string().contains("max_batch"));
        assert!(Settings { max_batch: 2, ..s }.check().is_ok());
    }
}
