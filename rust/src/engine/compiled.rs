//! The compiled decode step: its ATen calls recorded once at the dispatcher and replayed through a
//! compiled callable (Inductor on CUDA and the CPU, torch_tpu's `tpu` backend on a TPU), in two halves:
//! the forward per `ForwardKey` (bucket, padding) and the choice of the next tokens per `StepKey` (those
//! and the sampling stages; step.rs `forward` and `choose`). Steps that differ only in their stages share
//! the forward, the heavy graph, so a request whose stages no step has run yet (penalties, a logit bias,
//! log-probabilities, a grammar) costs a compile of its small choice graph while serving, not of a whole
//! model. Prompt chunks are compiled the same way per `ChunkKey` (chunks.rs says what their inputs are),
//! and speculative decoding's verify steps in the same two halves (verify.rs): the forward over the drafts
//! per `VerifyForwardKey`, its checks per `VerifyKey`, the drafts, masks and the forward's results copied
//! into buffers of the forward key's own (`Buffers`).
//!
//! The Rust model stays the one source of the computation. A `Compiler` (the Python side,
//! `gemma_engine.compiling.StepCompiler`, passed in through the bindings) runs the eager step once
//! under PyTorch's dispatcher-level tracing (`torch.fx.experimental.proxy_tensor.make_fx`, a
//! TorchDispatchMode, which sees the calls the C++ shim makes as it sees Python's), turns every
//! tensor the step touched but did not create into an input of the graph, and hands the graph to the
//! device's compiler. A step reads only tensors that live as long as the engine and host values fixed
//! by its key (the contract the CUDA graphs of step.rs already keep), so the graph's inputs are the
//! same tensors at every call and nothing a request wrote is baked into it.
//!
//! Per key: the first step runs eagerly (it makes the lazily built views and buffers, as a CUDA
//! graph's warm-up does), the second is captured (it runs, recorded, and returns its own result), and
//! later ones replay. A capture that fails leaves that key eager for good, with its reason kept
//! (the fallbacks of `Engine::compile_report`) for the caller to log and count; it never fails a request.
//!
//! On CUDA with CUDA graphs on, once a `StepKey`'s forward and choice both replay, the two replays (and
//! the copy of the logits between them) are captured as a CUDA graph of their own (step.rs's `Graphs`:
//! run once, captured, replayed), so a compiled step is one launch as an eager one is. Inductor's own
//! CUDA graphs cannot do it: they skip a graph that mutates an input not known to be static (torch 2.14,
//! `torch/_inductor/cudagraph_utils.py`, `check_for_mutation`), and every KV ring is such an input here.
//! Compiled prompt chunks and verify steps are replayed without a CUDA graph, as their eager runs are.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fmt::Display;
use std::hash::Hash;

use crate::engine::chunks::ChunkKey;
use crate::engine::sampling::{Chosen, Sampler};
use crate::engine::slots::Slots;
use crate::engine::step::{ForwardKey, Graphs, StepKey, choose, forward};
use crate::engine::verify::{self, Checked, Forwarded, Verdict, VerifyForwardKey, VerifyKey};
use crate::error::{Error, Result};
use crate::gemma4::cache::KvCache;
use crate::gemma4::model::Model;
use crate::tensor::Tensor;

/// A replayable compiled step: each call runs the step's device work once and returns its outputs.
pub trait Replay: Send {
    fn call(&self) -> Result<Vec<Tensor>>;
}

/// Records and compiles a step.
pub trait Compiler: Send {
    /// Run `eager` once under dispatcher-level tracing and compile what it recorded. `eager` must be
    /// called exactly once; an error it returns is returned from here unchanged.
    fn capture(&mut self, name: &str, eager: &mut dyn FnMut() -> Result<Vec<Tensor>>) -> Result<Box<dyn Replay>>;

    /// The backend's name, as `/v1/engine` shows it ("inductor", "tpu", ...).
    fn backend(&self) -> String;

    /// Told when a compiled step runs without its CUDA graph (its capture failed), so the hook logs and
    /// counts it as it does a capture of its own that failed.
    fn fell_back(&mut self, step: &str, reason: &str);
}

/// Why a key runs eagerly although compiling is on.
#[derive(Clone, Debug, PartialEq)]
pub struct Fallback {
    pub step: String,
    pub reason: String,
}

/// Per key of one kind (decode steps, prompt chunks): run, captured, or replayed (module docs).
struct Captures<K> {
    seen: HashSet<K>,
    replays: HashMap<K, Box<dyn Replay>>,
    failed: HashSet<K>,
}

impl<K> Default for Captures<K> {
    fn default() -> Self {
        Captures { seen: HashSet::new(), replays: HashMap::new(), failed: HashSet::new() }
    }
}

impl<K: Copy + Eq + Hash + Display> Captures<K> {
    /// A step of `key`: its replay, whose outputs `from` makes into an `R`; or, while it has none, its first run
    /// (eager), its second (captured with `compiler`, `outputs` naming what the graph returns), or any of a key
    /// whose capture failed (eager, the failure kept in `fallbacks` once). `rerun`: whether a step that tracing
    /// stopped part way may run again from the start (its writes so far are ones the run repeats).
    #[allow(clippy::too_many_arguments)]
    fn run<R>(
        &mut self,
        compiler: &mut dyn Compiler,
        fallbacks: &mut Vec<Fallback>,
        key: K,
        mut eager: impl FnMut() -> Result<R>,
        outputs: impl Fn(&R) -> Result<Vec<Tensor>>,
        from: impl FnOnce(Vec<Tensor>) -> Result<R>,
        rerun: bool,
    ) -> Result<R> {
        if let Some(replay) = self.replays.get(&key) {
            return from(replay.call()?);
        }
        if self.seen.insert(key) || self.failed.contains(&key) {
            return eager();
        }
        let mut ran: Option<Result<R>> = None;
        let captured = compiler.capture(&key.to_string(), &mut || {
            let result = eager();
            let out = match &result {
                Ok(r) => Ok(outputs(r)?),
                Err(e) => Err(Error::Internal(e.to_string())),
            };
            ran = Some(result);
            out
        });
        match (captured, ran) {
            // The step itself failed: the same error an eager step would give.
            (_, Some(Err(e))) => Err(e),
            (Ok(replay), Some(Ok(r))) => {
                self.replays.insert(key, replay);
                Ok(r)
            }
            (Err(e), ran) => {
                self.failed.insert(key);
                fallbacks.push(Fallback { step: key.to_string(), reason: e.to_string() });
                match ran {
                    Some(r) => r,
                    // Tracing stopped the step part way. A forward's or chunk's writes so far (its positions'
                    // keys) are the ones the eager run repeats; a choice's or verify check's moves come last
                    // (sampler, then slots), after a check's put-back, which writes the same when repeated;
                    // so running it again is the step. A verify forward's writes are not: it saved
                    // sliding-ring entries it has since overwritten (verify.rs).
                    None if rerun => eager(),
                    None => Err(Error::Internal(format!("tracing stopped {key} part way: {e}"))),
                }
            }
            (Ok(_), None) => Err(Error::Internal(format!("the compiler never ran step {key}"))),
        }
    }
}

pub struct Compiled {
    compiler: Box<dyn Compiler>,
    /// Decode steps' forwards, per bucket and padding (step.rs `forward`).
    forwards: Captures<ForwardKey>,
    /// Decode steps' choices, per `StepKey` (step.rs `choose`): they read the forward's logits from
    /// `logits_in`.
    choices: Captures<StepKey>,
    /// Per decode bucket, the buffer a step's choice reads its logits from: each forward's fresh output is
    /// copied in.
    logits_in: Buffers<i64>,
    chunks: Captures<ChunkKey>,
    /// Verify steps' forwards, per `VerifyForwardKey` (verify.rs `forward`).
    verify_forwards: Captures<VerifyForwardKey>,
    /// Verify steps' checks, per `VerifyKey` (verify.rs `check`).
    verify_checks: Captures<VerifyKey>,
    /// Per chunk bucket, the int64 buffer its graph reads its ids and positions from (chunks.rs).
    pub(super) chunk_inputs: HashMap<i64, Tensor>,
    /// Per verify forward key, the buffers its forward and checks read their inputs from: the drafts, offers
    /// and masks (`Checked`), then the forward's logits and saved entries (`Forwarded`), in that order.
    verify_inputs: Buffers<(VerifyForwardKey, usize)>,
    /// Keys whose replay could not be captured as a CUDA graph: replayed without one.
    ungraphed: HashSet<StepKey>,
    fallbacks: Vec<Fallback>,
    /// Some where the eager path has CUDA graphs: the compiled replays captured as CUDA graphs.
    graphs: Option<Graphs>,
    /// Replay captured keys (true) or run every step as an engine without a compiler does (false).
    pub(super) active: bool,
    /// Buckets whose steps run as without a compiler while `active` (`--compile auto` measured them faster so).
    pub(super) eager_buckets: BTreeSet<i64>,
}

/// What a decode step reads and writes (step.rs `step`).
pub(super) struct StepParts<'a> {
    pub(super) model: &'a mut Model,
    pub(super) cache: &'a mut KvCache,
    pub(super) sampler: &'a mut Sampler,
    pub(super) slots: &'a mut Slots,
}

/// What `Engine::compile_report` tells.
pub struct CompileReport {
    pub backend: String,
    pub active: bool,
    pub captured: usize,
    pub eager_buckets: Vec<i64>,
    pub fallbacks: Vec<Fallback>,
}

impl Compiled {
    pub(super) fn new(compiler: Box<dyn Compiler>, graphs: Option<Graphs>) -> Compiled {
        Compiled {
            compiler,
            graphs,
            forwards: Captures::default(),
            choices: Captures::default(),
            logits_in: Buffers::default(),
            chunks: Captures::default(),
            verify_forwards: Captures::default(),
            verify_checks: Captures::default(),
            chunk_inputs: HashMap::new(),
            verify_inputs: Buffers::default(),
            ungraphed: HashSet::new(),
            fallbacks: Vec::new(),
            active: true,
            eager_buckets: BTreeSet::new(),
        }
    }

    /// Whether a step of `bucket` slots replays compiled steps (else it runs as without a compiler).
    pub(super) fn replays(&self, bucket: i64) -> bool {
        self.active && !self.eager_buckets.contains(&bucket)
    }

    pub(super) fn report(&self) -> CompileReport {
        CompileReport {
            backend: self.backend(),
            active: self.active,
            captured: self.captured(),
            eager_buckets: self.eager_buckets.iter().copied().collect(),
            fallbacks: self.fallbacks.clone(),
        }
    }

    /// The decode step of `key` over `parts` (step.rs `step`): its forward (per `ForwardKey`) and then its
    /// choice (per `StepKey`), each run, captured, or replayed on its own, so a step whose sampling stages are
    /// new replays the compiled forward of its bucket and compiles only its choice. Once both halves replay,
    /// the two replays are one CUDA graph on `like`'s device where there are graphs (module docs).
    pub(super) fn step(&mut self, key: StepKey, like: &Tensor, parts: StepParts<'_>) -> Result<Chosen> {
        let logprobs = key.stages.logprobs.is_some();
        let replays = (self.forwards.replays.get(&key.forward()), self.choices.replays.get(&key));
        if let ((Some(forward), Some(choice)), Some(logits)) = (replays, self.logits_in.get(&key.b)) {
            let run = || {
                logits.copy_(&only(forward.call()?)?)?;
                from_outputs(choice.call()?, logprobs)
            };
            let Some(graphs) = self.graphs.as_mut().filter(|_| !self.ungraphed.contains(&key)) else {
                return run();
            };
            let capturing = graphs.will_capture(&key);
            return match graphs.step(key, like, run) {
                // Nothing ran while capturing (a capture records, the device does nothing), so running the
                // replays without a graph is the step.
                Err(e) if capturing => {
                    let fallback = Fallback { step: format!("{key} (CUDA graph)"), reason: e.to_string() };
                    self.compiler.fell_back(&fallback.step, &fallback.reason);
                    self.fallbacks.push(fallback);
                    self.ungraphed.insert(key);
                    run()
                }
                chosen => chosen,
            };
        }
        let StepParts { model, cache, sampler, slots } = parts;
        let Compiled { compiler, forwards, choices, logits_in, fallbacks, .. } = self;
        let fresh = forwards.run(
            compiler.as_mut(),
            fallbacks,
            key.forward(),
            || forward(model, cache, slots, key.forward()),
            |t| Ok(vec![t.shallow_clone()?]),
            only,
            true,
        )?;
        let logits = logits_in.put(key.b, &fresh)?;
        choices.run(
            compiler.as_mut(),
            fallbacks,
            key,
            || choose(sampler, slots, &logits, key),
            to_outputs,
            |out| from_outputs(out, logprobs),
            true,
        )
    }

    /// The prompt chunk of `key`, whose device work `eager` does (chunks.rs): run, captured, or replayed.
    pub(super) fn chunk(&mut self, key: ChunkKey, eager: impl FnMut() -> Result<Vec<Tensor>>) -> Result<Vec<Tensor>> {
        let Compiled { compiler, chunks, fallbacks, .. } = self;
        let outputs = |out: &Vec<Tensor>| out.iter().map(Tensor::shallow_clone).collect();
        chunks.run(compiler.as_mut(), fallbacks, key, eager, outputs, Ok, true)
    }

    /// The verify step of `key` over `parts` with `inputs` (verify.rs `verify`) in a context of `context`
    /// positions: its forward (per `VerifyForwardKey`) and then its checks (per `VerifyKey`), each run, captured
    /// or replayed on its own, reading `inputs` and the forward's results from the forward key's buffers, so a
    /// step whose sampling stages are new replays its compiled forward and compiles only its checks.
    pub(super) fn verify(
        &mut self,
        key: VerifyKey,
        parts: StepParts<'_>,
        inputs: Checked,
        context: i64,
    ) -> Result<Verdict> {
        let StepParts { model, cache, sampler, slots } = parts;
        let Compiled { compiler, verify_forwards, verify_checks, verify_inputs, fallbacks, .. } = self;
        let fkey = key.forward();
        let mut put = |i: usize, t: &Tensor| verify_inputs.put((fkey, i), t);
        let inputs = Checked {
            draft: put(0, &inputs.draft)?,
            offered: put(1, &inputs.offered)?,
            masks: inputs.masks.map(|m| put(2, &m)).transpose()?,
        };
        let fresh = verify_forwards.run(
            compiler.as_mut(),
            fallbacks,
            fkey,
            || verify::forward(model, cache, slots, &inputs, fkey, context),
            Forwarded::outputs,
            |out| Forwarded::from_outputs(out, fkey),
            false,
        )?;
        let forwarded = Forwarded {
            logits: put(3, &fresh.logits)?,
            saved: fresh.saved.iter().enumerate().map(|(i, t)| put(4 + i, t)).collect::<Result<_>>()?,
            hidden: None,
        };
        let verdict = verify_checks.run(
            compiler.as_mut(),
            fallbacks,
            key,
            || verify::check(cache, sampler, slots, &inputs, &forwarded, key, context),
            Verdict::outputs,
            |out| Verdict::from_outputs(out, key),
            true,
        )?;
        Ok(Verdict { hidden: fresh.hidden, ..verdict })
    }

    /// Decode steps, prompt chunks and verify steps captured and compiled so far.
    pub fn captured(&self) -> usize {
        let (f, c) = (self.forwards.replays.len(), self.choices.replays.len());
        let (vf, vc) = (self.verify_forwards.replays.len(), self.verify_checks.replays.len());
        f + c + self.chunks.replays.len() + vf + vc
    }

    /// Compiled replays captured as CUDA graphs so far (0 off CUDA).
    pub fn cuda_graphs(&self) -> usize {
        self.graphs.as_ref().map_or(0, |g| g.captured())
    }

    pub fn backend(&self) -> String {
        self.compiler.backend()
    }
}

/// Per key, a buffer a graph reads what changes at every call from: a tensor made fresh each step (on the host or
/// by another graph) cannot be a graph's input, which is read at every replay.
struct Buffers<K>(HashMap<K, Tensor>);

impl<K> Default for Buffers<K> {
    fn default() -> Self {
        Buffers(HashMap::new())
    }
}

impl<K: Eq + Hash> Buffers<K> {
    /// `key`'s buffer, once made.
    fn get(&self, key: &K) -> Option<&Tensor> {
        self.0.get(key)
    }

    /// `t`'s values in `key`'s buffer, which is made from them the first time.
    fn put(&mut self, key: K, t: &Tensor) -> Result<Tensor> {
        if let Some(buffer) = self.get(&key) {
            buffer.copy_(t)?;
            return buffer.shallow_clone();
        }
        let buffer = t.copy()?;
        self.0.insert(key, buffer.shallow_clone()?);
        Ok(buffer)
    }
}

/// The one tensor a forward's graph returns: its logits.
fn only(mut out: Vec<Tensor>) -> Result<Tensor> {
    match (out.pop(), out.is_empty()) {
        (Some(t), true) => Ok(t),
        _ => Err(Error::Internal("a compiled forward did not return one tensor".into())),
    }
}

/// `Chosen` as a graph's outputs: the tokens, then the three log-probability tensors when asked.
pub(super) fn to_outputs(c: &Chosen) -> Result<Vec<Tensor>> {
    let mut out = vec![c.tokens.shallow_clone()?];
    if let Some((a, b, d)) = &c.logprobs {
        out.extend([a.shallow_clone()?, b.shallow_clone()?, d.shallow_clone()?]);
    }
    Ok(out)
}

/// `to_outputs` back.
pub(super) fn from_outputs(mut out: Vec<Tensor>, logprobs: bool) -> Result<Chosen> {
    let want = if logprobs { 4 } else { 1 };
    if out.len() != want {
        return Err(Error::Internal(format!("a compiled step returned {} tensors, expected {want}", out.len())));
    }
    let logprobs = if logprobs {
        let d = out.pop();
        let b = out.pop();
        let a = out.pop();
        a.zip(b).zip(d).map(|((a, b), d)| (a, b, d))
    } else {
        None
    };
    let tokens = out.pop().ok_or_else(|| Error::Internal("a compiled step returned no tokens".into()))?;
    Ok(Chosen { tokens, logprobs })
}
