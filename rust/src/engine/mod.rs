//! The runtime: `Engine` runs one model (`crate::gemma4`) over `max_batch` sequence slots in a
//! continuous-batching loop. The model says how one forward is computed; this module says which
//! requests run and when (as mistral.rs keeps `mistralrs-core/src/engine/`, `scheduler/` and
//! `sampler.rs` apart from `models/`).
//!
//! Files: `settings` (what a caller sets and reads), `request` (the API types, `LIMITS`), `slots` (the
//! slots, host and device), `lifecycle` (admitting, placing and ending a request), `schedule` (which
//! prompts a forward reads), `prompts` (reading them), `step` (the decode step and its CUDA graphs), `read_point`,
//! `sampling` (the next-token choice on the device), `grammar` (grammar-constrained requests),
//! `prompt_logprobs` (scoring the prompt while it is read), `speculative` (drafts checked in one forward: prompt
//! lookup's, or with `drafter` an MTP assistant's), `one_request` (`Engine::decode`), `faults` (the fault hook for
//! tests).
//!
//! Each slot holds one request: its rings in the KV cache (gemma4/cache.rs), its sampling state
//! (sampling.rs), and on the device its last token and next position (slots.rs). One turn of the
//! loop runs one decode step for every slot that is decoding and then at most one prompt forward of
//! at most `prefill_chunk` tokens (a token budget, as vLLM's scheduler has), so a long prompt
//! delays the running streams by one chunk a step, never by the whole prompt. The prompt forward
//! reads the next chunk of the oldest unread prompt; when that prompt starts and fits whole, the
//! next unread prompts in admission order that also fit whole join it, as long as the forward's
//! rectangle (the slots from the lowest to the highest, times the longest of those prompts) stays
//! within the budget (`schedule::prompt_group`). A burst of short prompts is then read in one
//! forward instead of one a turn. Its rows are left-padded (`schedule::padded_prompts`): every
//! row's last token is its prompt's last, and the padding tokens sit at position `context - 1`,
//! later than any prompt query, and write only the rings' never-visible entry, so each row's keys
//! and logits are those of a read alone. A decode step runs the slots `0..b`, where `b` is the
//! smallest bucket (1, 2, 4, ..., max_batch) above the highest decoding slot; new requests take the
//! lowest free slot, so the bucket follows the number of requests. Rows of the bucket that are not
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
//! A grammar-constrained request (`grammar.rs`) has its own matcher; before each decode step the
//! host writes the allowed sets of the constrained slots into the sampler's mask rows
//! (`Engine::constrain`) and uploads them in one copy, and the sampler masks those rows first
//! (`sampling.rs`). A mask needs the slot's previous token on the host, so while a constrained slot
//! decodes every turn ends in a read point, whatever `read_every` is.
//!
//! With prefix caching (`Settings::prefix_caching`, prefix.rs) a finished request's slot keeps its
//! rings and the tokens it wrote, and a new request goes to the free slot holding its longest valid
//! prefix (copied to another free slot when it does not continue that slot's history) and reads only
//! the rest of its prompt, as a later chunk. The sliding rings are snapshotted at each prompt's end
//! and at the boundary a request marks (its chunks end there, so it is read alone rather than in a
//! group), so a request can resume there too.
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

mod chunks;
mod columns;
pub mod compiled;
mod drafter;
mod faults;
pub mod grammar;
mod lifecycle;
pub mod media;
pub mod memory;
pub mod one_request;
mod prefix;
mod prompt_logprobs;
mod prompts;
mod read_point;
pub mod request;
pub mod sampling;
mod schedule;
pub mod settings;
mod slots;
pub mod speculative;
mod step;
pub mod tuning;
mod verify;

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use rayon::prelude::*;

use crate::engine::compiled::{CompileReport, Compiled, Compiler, StepParts};
use crate::engine::grammar::{Constraint, Grammars};
use crate::engine::prefix::PrefixCache;
use crate::engine::prompt_logprobs::Piece;
use crate::engine::read_point::Drawn;
use crate::engine::request::{Event, Io, Request, StepStats};
use crate::engine::sampling::Sampler;
use crate::engine::schedule::{followers, prompt_group, unread};
use crate::engine::slots::Slots;
use crate::engine::step::{Graphs, StepKey, step};
use crate::error::{Error, Result};
use crate::gemma4::attention::{Fill, Liveness, Positions};
use crate::gemma4::cache::{CacheSize, KvCache, Rows};
use crate::gemma4::config::{Config, LayerType};
use crate::gemma4::model::{Injection, Model, Output};
use crate::gemma4::parallel::{Split, check_divisible, shard_config};
use crate::gemma4::weights::{Loaded, Weights};
use crate::tensor::{CudaGraph, DType, Tensor};

pub use faults::Fault;
pub use settings::{Layout, Rank, Settings, WeightsInfo, parse_dtype};

pub struct Engine {
    model: Model,
    loaded: Loaded,
    /// Why dense weights are not on oneDNN, where they are not (`WeightsInfo::linear_note`).
    linear_note: Option<String>,
    cache: KvCache,
    /// The cache's geometry and bytes (`layout`), fixed at load.
    cache_size: CacheSize,
    sampler: Sampler,
    like: Tensor,
    context: i64,
    prefill_chunk: i64,
    max_batch: i64,
    /// The sequence slots, on the host and the device.
    slots: Slots,
    /// Tokens drawn since the last read point.
    drawn: Vec<Drawn>,
    /// What ran since the last read point.
    stats: StepStats,
    /// Ends of requests decided in a turn (their forward or grammar failed, or their prompt was
    /// read with max_new 0), emitted at the next read point.
    ended: Vec<Event>,
    /// Some on a CUDA device with `Settings::cuda_graphs`.
    graphs: Option<Graphs>,
    /// Some with a compiler (`with_compiler`): decode steps captured and compiled (compiled.rs).
    compiled: Option<Compiled>,
    /// A failure a test asked for (`inject_fault_for_tests`): where, and which request. None in serving,
    /// where the one cost of the hook is a test of this field per admission, decode step and prompt read
    /// (faults.rs).
    fault: Option<(Fault, u64)>,
    /// The token environment grammar-constrained requests compile against (`with_grammars`).
    grammars: Option<Arc<Grammars>>,
    /// What each free slot's rings hold, with `Settings::prefix_caching`.
    prefix: Option<PrefixCache>,
    /// A decode step ran since the last read point.
    stepped: bool,
    /// Speculative decoding (speculative.rs), when on.
    speculative: Option<speculative::Speculative>,
    /// With `speculative_method="mtp"`, the assistant drafter and the target states it reads (drafter.rs).
    drafter: Option<drafter::Drafter>,
}

impl Engine {
    /// Load `model_dir` (and the vocabulary tables of `emb_dir`) onto `like`'s device: the whole model, or
    /// with `Settings::rank` this rank's shard of it (gemma4/parallel.rs). `free` reads the bytes free on
    /// `like`'s device (None: unknown, nothing is checked): before the weights are loaded they must fit it,
    /// and after, the KV cache what is left (memory.rs).
    pub fn load(
        model_dir: &Path,
        emb_dir: Option<&Path>,
        like: Tensor,
        settings: Settings,
        free: impl Fn() -> Result<Option<i64>>,
    ) -> Result<Engine> {
        settings.check()?;
        let cfg = Config::load(model_dir)?;
        let n = settings.tensor_parallel_size;
        check_divisible(&cfg, n)?;
        let device = like.device()?;
        let split = match &settings.rank {
            None => Split::whole(),
            Some(r) => Split::rank(r.rank, n, r.group.clone()),
        };
        // Opening reads the files' headers only: the weights are checked before any is loaded.
        let (dtype, kernels) = (settings.dtype, settings.kernels());
        let weights = Weights::open(model_dir, emb_dir, cfg.quant.clone(), like.shallow_clone()?, dtype, kernels)?;
        memory::check_weights(&weights.estimate(), n, free()?)?;
        let model = Model::load(cfg, &weights, split.clone(), settings.context)?;
        let drafter = drafter::Drafter::of(&settings, &model, &like)?;
        let mut loaded = weights.loaded();
        loaded.bytes += drafter.as_ref().map_or(Ok(0), |d| d.bytes())?;
        let linear_note = if loaded.onednn { None } else { settings.kernels().onednn_note(settings.dtype, &device) };
        let b = settings.max_batch;
        let caching = settings.prefix_caching;
        let (context, row) = (settings.context, settings.chunk_row);
        let shard = shard_config(&model.cfg, split.tp);
        let cache_size = CacheSize::of(&shard, context, b, dtype, caching, row);
        memory::check_cache(&cache_size, context, free()?)?;
        let cache = KvCache::new(&shard, context, b, &like, dtype, caching, row)?;
        let sampler = Sampler::new(b, model.cfg.vocab_size, &like)?;
        let slots = Slots::new(b, model.cfg.vocab_size, &like)?;
        let prefix = caching.then(|| PrefixCache::new(b as usize, cache.ring(LayerType::Sliding) as usize));
        let graphs =
            (settings.cuda_graphs && device.starts_with("cuda") && CudaGraph::available()).then(Graphs::default);
        Ok(Engine {
            graphs,
            compiled: None,
            fault: None,
            grammars: None,
            prefix,
            stepped: false,
            speculative: settings.speculative.clone(),
            drafter,
            loaded,
            linear_note,
            slots,
            drawn: Vec::new(),
            stats: StepStats::default(),
            ended: Vec::new(),
            model,
            cache,
            cache_size,
            sampler,
            like,
            context: settings.context,
            prefill_chunk: settings.prefill_chunk,
            max_batch: b,
        })
    }

    /// Serve grammar-constrained requests over `grammars`, whose vocabulary must be the model's.
    pub fn with_grammars(mut self, grammars: Option<Arc<Grammars>>) -> Result<Engine> {
        if let Some(g) = &grammars {
            let v = self.model.cfg.vocab_size;
            if g.vocab_size() as i64 != v {
                return Err(Error::Input(format!(
                    "grammars cover {} tokens, the model's vocab_size is {v}",
                    g.vocab_size()
                )));
            }
        }
        self.grammars = grammars;
        Ok(self)
    }

    /// Capture and compile each decode step's shape with `compiler` (compiled.rs). Where the eager path
    /// has CUDA graphs, each compiled step is captured as one too (graphs of its own).
    pub fn with_compiler(mut self, compiler: Option<Box<dyn Compiler>>) -> Engine {
        let graphs = self.graphs.is_some();
        self.compiled = compiler.map(|c| Compiled::new(c, graphs.then(Graphs::default)));
        self
    }

    /// Forget what every slot's rings hold (vLLM's `reset_prefix_cache`): later requests find no hit and take
    /// the lowest free slots. Between runs only (`run` holds the engine).
    pub fn reset_prefix_cache(&mut self) {
        if let Some(p) = self.prefix.as_mut() {
            for s in 0..self.max_batch as usize {
                p.drop_history(s);
            }
        }
    }

    /// Replay compiled steps (true), or run steps as an engine without a compiler does, capturing nothing
    /// (false): every step, or with `bucket` the steps of that bucket alone (the way a caller times both
    /// and keeps the faster per bucket). An error without a compiler or for a bucket the engine lacks.
    pub fn use_compiled(&mut self, on: bool, bucket: Option<i64>) -> Result<()> {
        let buckets = self.buckets();
        let c = self.compiled.as_mut().ok_or_else(|| Error::Input("this engine has no compiler".into()))?;
        match bucket {
            None => c.active = on,
            Some(b) if !buckets.contains(&b) => {
                return Err(Error::Input(format!("bucket {b} is not one of this engine's buckets {buckets:?}")));
            }
            Some(b) if on => {
                c.eager_buckets.remove(&b);
            }
            Some(b) => {
                c.eager_buckets.insert(b);
            }
        }
        Ok(())
    }

    /// Whether this engine has a compiler and replays its compiled steps (`use_compiled`).
    pub(super) fn compiles(&self) -> bool {
        self.compiled.as_ref().is_some_and(|c| c.active)
    }

    /// The compiled path's state (`CompileReport`); None without a compiler.
    pub fn compile_report(&self) -> Option<CompileReport> {
        self.compiled.as_ref().map(Compiled::report)
    }

    pub fn config(&self) -> &Config {
        &self.model.cfg
    }

    /// Speculative decoding's settings, when on.
    pub fn speculative(&self) -> Option<&speculative::Speculative> {
        self.speculative.as_ref()
    }

    pub fn context(&self) -> i64 {
        self.context
    }

    pub fn max_batch(&self) -> i64 {
        self.max_batch
    }

    /// The decode-step batch sizes (step.rs `buckets`).
    pub fn buckets(&self) -> Vec<i64> {
        step::buckets(self.max_batch)
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
        let linear = if l.onednn { "onednn" } else { "aten" };
        WeightsInfo { int4, bytes: l.bytes, linear, linear_note: self.linear_note.clone() }
    }

    /// ATen calls each layer made in the last forward (a decode step after `decode`).
    pub fn layer_calls(&self) -> Vec<u64> {
        self.model.layer_calls().to_vec()
    }

    /// The CUDA graphs captured so far, of eager and compiled steps (0 off CUDA).
    pub fn captured_steps(&self) -> usize {
        self.graphs.as_ref().map_or(0, |g| g.captured()) + self.compiled.as_ref().map_or(0, |c| c.cuda_graphs())
    }

    pub fn layout(&self) -> Layout {
        let cfg = &self.model.cfg;
        let (split, size) = (self.model.split(), &self.cache_size);
        Layout {
            full_rings: self.cache.own_rings(LayerType::Full, cfg),
            sliding_rings: self.cache.own_rings(LayerType::Sliding, cfg),
            shared_layers: cfg.layers.iter().filter(|l| l.kv_source.is_some()).count() as i64,
            context: self.context,
            sliding_window: cfg.sliding_window,
            max_batch: self.max_batch,
            kv_bytes_per_slot: size.bytes_per_slot,
            kv_bytes: size.total(),
            prefix_caching: self.prefix.is_some(),
            snapshot_bytes_per_slot: size.snapshot_bytes_per_slot,
            tensor_parallel_size: split.size(),
            tensor_parallel_rank: split.rank_in_group(),
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

    /// Every check on a request, before it takes a slot: its own values and limits
    /// (`Request::check`, `request::LIMITS`), then its prompt against this model.
    pub fn check_request(&self, r: &Request) -> Result<()> {
        r.check(self.model.cfg.vocab_size)?;
        if r.grammar.is_some() && self.grammars.is_none() {
            return Err(Error::Input("grammar: this engine was built without grammars (Engine(grammars=...))".into()));
        }
        self.check_input(&r.prompt, &r.media)
    }

    /// The checks on prompt `ids` and its `media` against this model: `check_prompt`, then media.rs
    /// `check`.
    fn check_input(&self, ids: &[i64], media: &[media::Media]) -> Result<()> {
        self.check_prompt(ids)?;
        let cfg = &self.model.cfg;
        media::check(media, ids, cfg.hidden_size, &cfg.media_token_ids)
    }

    /// `r`'s grammar compiled, when it has one (`check_request` has seen that there are grammars).
    fn compile(&self, r: &Request) -> Result<Option<Constraint>> {
        match (&r.grammar, &self.grammars) {
            (Some(text), Some(g)) => g.compile(text).map(Some),
            _ => Ok(None),
        }
    }

    /// float32 next-token logits after `ids` with soft tokens `media` (engine/media.rs), read into slot
    /// 0 from empty, on the host as a tensor. Slot 0's rings are overwritten, so what the prefix cache
    /// knew of them is dropped.
    pub fn logits(&mut self, ids: &[i64], media: &[media::Media]) -> Result<Tensor> {
        self.check_input(ids, media)?;
        let prompt = self.upload(ids, media)?;
        if let Some(p) = self.prefix.as_mut() {
            p.drop_history(0);
        }
        let mut done = 0;
        loop {
            let (end, inject) = self.next_chunk(ids.len(), done, None, &prompt.media)?;
            let (logits, read, _) = self.prompt_chunk(0, &prompt.ids, ids, done, end, None, inject.as_ref())?;
            done += read;
            if let Some(l) = logits {
                // A tensor built from host bytes lives on the host: it names where the logits go.
                let host = Tensor::from_i64(&[0])?;
                return l.reshape(&[self.model.cfg.vocab_size])?.to_like(&host, DType::F32);
            }
        }
    }

    /// The next chunk of an `n`-token prompt read from `done`: where it ends (`prefill_chunk` tokens on,
    /// or the prompt's end, or `boundary` (the next snapshot mark, prefix.rs) when it lies ahead; never
    /// inside an item of `media` read both ways, media.rs `chunk_end`) and the soft tokens of `media`
    /// (the device copies) it places (media.rs `injection`).
    fn next_chunk(
        &self,
        n: usize,
        done: usize,
        boundary: Option<usize>,
        media: &[media::Media],
    ) -> Result<(usize, Option<Injection>)> {
        let end = (done + self.prefill_chunk as usize).min(n);
        let end = media::chunk_end(media, done, boundary.filter(|b| *b > done).map_or(end, |b| end.min(b)))?;
        let shape = [1, (end - done) as i64];
        Ok((end, media::injection(&[(media, done, end, 0)], shape, &self.like)?))
    }

    /// Read positions `done..end` of `slot`'s prompt (`prompt` on the device, `ids_host` on the host),
    /// with the soft tokens `inject` places in them. Returns the last position's logits `[1, vocab]` once
    /// the whole prompt is read, the tokens read, and the chunk's scored rows when `prompt_k` is Some
    /// (`prompt_logprobs`).
    #[allow(clippy::too_many_arguments)]
    fn prompt_chunk(
        &mut self,
        slot: i64,
        prompt: &Tensor,
        ids_host: &[i64],
        done: usize,
        end: usize,
        prompt_k: Option<i64>,
        inject: Option<&Injection>,
    ) -> Result<(Option<Tensor>, usize, Option<Piece>)> {
        let n = ids_host.len();
        if self.compiles_chunk(inject.is_some(), prompt_k.is_some()) {
            let logits = self.compiled_chunk(slot, ids_host, done, end)?;
            return Ok(((end == n).then_some(logits), end - done, None));
        }
        let t = (end - done) as i64;
        let ids = prompt.narrow(0, done as i64, t)?;
        let pos = Positions::chunk(done as i64, end as i64, self.cache.ring(LayerType::Sliding), &self.like)?;
        let fill = if done == 0 { Fill::Empty } else { Fill::Partial };
        let rows = Rows::one(slot);
        let Some(k) = prompt_k else {
            let output = if end == n { Output::Logits } else { Output::Nothing };
            let logits =
                self.model.forward(&mut self.cache, rows, &ids, &pos, &Liveness::AllLive, fill, output, inject)?;
            return Ok((logits, end - done, None));
        };
        let hidden = self
            .model
            .forward(&mut self.cache, rows, &ids, &pos, &Liveness::AllLive, fill, Output::Hidden, inject)?
            .ok_or_else(|| Error::Internal("a prompt forward returned no hidden states".into()))?;
        let piece = prompt_logprobs::compute(&self.model, &hidden, &prompt_logprobs::chunk(ids_host, done, end), k)?;
        let logits = if end == n { Some(self.model.head(&self.model.last_rows(&hidden, 1, t)?)?) } else { None };
        Ok((logits, end - done, piece))
    }

    /// The most prompt log-probabilities asked for by slot `s` or the slots that follow it.
    fn prompt_k(&self, s: usize) -> Option<i64> {
        let all = self.slots.all();
        std::iter::once(s).chain(followers(all, s)).filter_map(|i| self.slots.get(i)?.request.prompt_logprobs).max()
    }

    /// Run the continuous-batching loop until `io.poll` returns None. See the module docs.
    pub fn run(&mut self, io: &mut impl Io, read_every: i64) -> Result<()> {
        if read_every < 1 {
            return Err(Error::Input(format!("read_every must be >= 1, got {read_every}")));
        }
        // A run that ended on an error left its busy slots' rings half written.
        for s in self.slots.busy() {
            if let Some(p) = self.prefix.as_mut() {
                p.drop_history(s);
            }
        }
        self.slots.reset()?;
        self.drawn.clear();
        self.ended.clear();
        self.stats = StepStats::default();
        let mut since = Instant::now();
        loop {
            let mut events = std::mem::take(&mut self.ended);
            match self.read_point() {
                Ok(read) => events.extend(read),
                Err(e) => events.extend(self.fail(self.slots.busy(), &e)?),
            }
            self.stats.seconds = since.elapsed().as_secs_f64();
            let st = &self.stats;
            if !events.is_empty() || !st.batch_sizes.is_empty() || st.prompt_tokens > 0 || st.cache_queries > 0 {
                io.emit(events, st)?;
            }
            let free = self.slots.free_count();
            let Some((new, cancels)) = io.poll(free, free == self.slots.len())? else {
                let ends = self.cancel(|_| true)?;
                return io.emit(ends, &StepStats::default());
            };
            let mut events = self.cancel(|id| cancels.contains(&id))?;
            // Admissions count their prompt tokens (and hits) into the stats of the turns that follow.
            self.stats = StepStats::default();
            for request in new {
                if let Some(refused) = self.admit(request)? {
                    events.push(refused);
                }
            }
            if !events.is_empty() {
                io.emit(events, &StepStats::default())?;
            }
            since = Instant::now();
            for _ in 0..read_every {
                // A constrained slot's next mask needs the token it just drew, and a batch that may
                // speculate drafts from it (module docs).
                if !self.turn()? || self.slots.constrained_decoding() || self.may_speculate() {
                    break;
                }
            }
        }
    }

    /// One turn: a decode step of every decoding slot, then a chunk of the oldest unread prompt
    /// (a slot whose prompt ends here draws its first token now and decodes from the next turn).
    /// Returns false when there was nothing to do. Requests whose forward failed end in `failed`.
    fn turn(&mut self) -> Result<bool> {
        if let Some(top) = self.slots.top_live() {
            let rows = self.slots.rows(self.slots.bucket(top));
            self.constrain(&rows.into_iter().flatten().collect::<Vec<_>>())?;
        }
        let top = self.slots.top_live();
        if let Some(top) = top {
            let b = self.slots.bucket(top);
            let rows = self.slots.rows(b);
            let decoding: Vec<usize> = rows.iter().flatten().copied().collect();
            self.stats.batch_sizes.push(decoding.len());
            let drafts = self.drafts(b, &rows);
            // A verify step's tokens are counted at the read point, where the host learns how many.
            let verifies = drafts.is_some();
            let step = self.injected(Fault::Decode, &decoding).and_then(|_| match drafts {
                Some(d) => self.verify_step(b, &rows, d),
                None => self.decode_step(b, &rows),
            });
            if let Err(e) = step {
                let ends = self.fail(decoding, &e)?;
                self.ended.extend(ends);
                return Ok(true);
            }
            if !verifies {
                self.slots.count_step(&decoding)?;
            }
        }
        let group = prompt_group(unread(self.slots.all()), self.prefill_chunk as usize);
        if group.is_empty() {
            return Ok(top.is_some());
        }
        let read = self.injected(Fault::Prompt, &group).and_then(|_| match group[..] {
            [s] => self.read_prompt(s),
            _ => self.read_prompts(&group),
        });
        match read {
            Ok(read) => {
                self.stats.prompt_tokens += read;
                self.stats.prompt_reads.push(group.len());
            }
            Err(e) => {
                let ends = self.fail(group, &e)?;
                self.ended.extend(ends);
            }
        }
        Ok(true)
    }

    /// Whether the decoding slots may speculate at their next step (speculative.rs).
    fn may_speculate(&self) -> bool {
        self.slots.top_live().is_some_and(|top| self.speculates(&self.slots.rows(self.slots.bucket(top))))
    }

    /// One decode step of slots `0..b`; `rows[i]` is Some for the decoding ones.
    fn decode_step(&mut self, b: i64, rows: &[Option<usize>]) -> Result<()> {
        // Right after a read point the host knows which rows decode; after a step it does not: a row
        // may have stopped on the device (slots.rs).
        let padded = rows.iter().any(|r| r.is_none()) || self.stepped;
        let key = StepKey { b, padded, stages: self.sampler.stages(0, b) };
        if key.stages.grammar {
            // Outside the step (and its CUDA graph): the graph reads the device buffer this fills.
            self.sampler.upload_masks(0, b)?;
        }
        self.drafter.iter_mut().for_each(|d| d.forget(rows));
        let Engine { model, cache, sampler, slots, graphs, compiled, like, .. } = self;
        let chosen = match (compiled.as_mut().filter(|c| c.replays(b)), graphs) {
            (Some(c), _) => c.step(key, like, StepParts { model, cache, sampler, slots })?,
            (None, Some(g)) => g.step(key, like, || step(model, cache, sampler, slots, key))?,
            (None, None) => step(model, cache, sampler, slots, key)?,
        };
        self.drawn.push(Drawn { chosen, rows: rows.to_vec(), verified: None });
        self.stepped = true;
        Ok(())
    }

    /// Write the allowed sets of the grammar-constrained slots among `which` into the sampler's host
    /// mask rows, one slot a rayon task (each slot's matcher and row are its own). A slot whose
    /// grammar fails ends "failed" with the grammar's message, alone.
    fn constrain(&mut self, which: &[usize]) -> Result<()> {
        let started = Instant::now();
        let failed: Vec<(usize, Error)> = {
            let Engine { slots, sampler, .. } = self;
            let m = sampler.mask_bytes();
            let n = slots.len() as i64;
            let mut rows: Vec<Option<&mut [u8]>> = sampler.mask_rows_mut(0, n).chunks_mut(m).map(Some).collect();
            let mut work: Vec<(usize, &mut Constraint, &mut [u8])> = Vec::new();
            for (s, g) in slots.constraints_mut(which) {
                let row = rows[s].take().ok_or_else(|| Error::Internal(format!("no mask row for slot {s}")))?;
                work.push((s, g, row));
            }
            if work.is_empty() {
                return Ok(());
            }
            work.into_par_iter().filter_map(|(s, g, row)| g.mask_into(row).err().map(|e| (s, e))).collect()
        };
        self.stats.mask_seconds += started.elapsed().as_secs_f64();
        for (s, e) in failed {
            let ends = self.fail([s], &e)?;
            self.ended.extend(ends);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            prefix_caching: true,
            tensor_parallel_size: 1,
            rank: None,
            chunk_row: false,
            speculative: None,
        };
        assert!(s.check().unwrap_err().to_string().contains("max_batch"));
        assert!(Settings { max_batch: 2, ..s.clone() }.check().is_ok());
        let rank = Some(Rank { rank: 2, group: "0".into() });
        let err = Settings { max_batch: 2, tensor_parallel_size: 2, rank, ..s }.check().unwrap_err();
        assert!(err.to_string().contains("tensor_parallel_rank must be in 0..2, got 2"), "{err}");
    }
}
