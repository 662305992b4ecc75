//! PyO3 bindings: the only module that sees Python objects.
//!
//! `#[pymodule]` is a registry; `Engine` is a thin `#[pyclass(unsendable)]` wrapper. Inputs are
//! extracted under the GIL, then the work runs in `py.detach` (tokenizers' `encode_batch`), where
//! the engine checks them before any model code runs; the callbacks re-attach. One `From<Error> for PyErr` picks the
//! exception class. README.md lists each Python crossing.

mod compiler;
mod encoder;
mod functions;
mod grammars;

use std::collections::HashMap;
use std::path::PathBuf;

use pyo3::exceptions::{PyOSError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::engine::media::Media;
use crate::engine::request::{Event, Io, Request, StepStats, TokenLogprobs};
use crate::engine::sampling::SamplingParams;
use crate::engine::speculative::Speculative;
use crate::engine::{self, Rank, Settings, parse_dtype};
use crate::error::Error;
use crate::tensor::{Tensor, no_grad};

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        match e {
            Error::Config { .. } | Error::Weight { .. } | Error::Input(_) | Error::Format { .. } => {
                PyValueError::new_err(e.to_string())
            }
            Error::Io { .. } => PyOSError::new_err(e.to_string()),
            Error::Torch { .. } | Error::Internal(_) | Error::Callback(_) => PyRuntimeError::new_err(e.to_string()),
        }
    }
}

/// A `torch.Tensor` argument as a handle on the same storage; TypeError for anything else.
fn tensor_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Tensor> {
    let torch_tensor = obj.py().import("torch")?.getattr("Tensor")?;
    if !obj.is_instance(&torch_tensor)? {
        return Err(PyTypeError::new_err(format!("{what} must be a torch.Tensor, got {}", obj.get_type().name()?)));
    }
    Ok(Tensor::from_python(obj)?)
}

/// `media` arguments, (start, soft tokens, key) triples (see gemma_engine.pyi `Request`).
fn media_arg(media: &[(usize, Bound<'_, PyAny>, u64)]) -> PyResult<Vec<Media>> {
    media.iter().map(|(start, t, key)| Ok(Media::new(*start, tensor_arg(t, "media")?, *key)?)).collect()
}

/// How one request chooses its tokens (see gemma_engine.pyi).
#[pyclass(frozen, module = "gemma_engine", name = "SamplingParams")]
pub struct PySamplingParams {
    inner: SamplingParams,
}

#[pymethods]
impl PySamplingParams {
    /// Raises:
    ///     ValueError: a value out of range, named (the vocabulary is checked at admission).
    #[new]
    #[pyo3(signature = (temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, presence_penalty=0.0,
                        frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=None, logprobs=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        temperature: f64,
        top_k: i64,
        top_p: f64,
        min_p: f64,
        seed: i64,
        presence_penalty: f64,
        frequency_penalty: f64,
        repetition_penalty: f64,
        logit_bias: Option<HashMap<i64, f64>>,
        logprobs: Option<i64>,
    ) -> PyResult<Self> {
        let mut bias: Vec<(i64, f64)> = logit_bias.unwrap_or_default().into_iter().collect();
        bias.sort_by_key(|(id, _)| *id);
        let inner = SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            seed,
            presence_penalty,
            frequency_penalty,
            repetition_penalty,
            logit_bias: bias,
            logprobs,
        };
        inner.check(i64::MAX)?;
        Ok(PySamplingParams { inner })
    }

    fn __repr__(&self) -> String {
        format!("{:?}", self.inner)
    }

    /// Pickled as its constructor's arguments.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTuple>)> {
        let p = &slf.get().inner;
        let bias: HashMap<i64, f64> = p.logit_bias.iter().copied().collect();
        let penalties = (p.presence_penalty, p.frequency_penalty, p.repetition_penalty);
        let (presence, frequency, repetition) = penalties;
        let args =
            (p.temperature, p.top_k, p.top_p, p.min_p, p.seed, presence, frequency, repetition, bias, p.logprobs);
        Ok((slf.get_type().into_any(), args.into_pyobject(slf.py())?))
    }
}

/// One request for `Engine.run`.
#[pyclass(frozen, module = "gemma_engine", name = "Request")]
pub struct PyRequest {
    inner: Request,
}

#[pymethods]
impl PyRequest {
    #[new]
    #[pyo3(signature = (id, ids, max_new, stop_ids=Vec::new(), sampling=None, grammar=None, prompt_logprobs=None,
                        cache_salt=None, cache_boundary=None, media=Vec::new(), next_turn=None, speculative=true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        id: u64,
        ids: Vec<i64>,
        max_new: i64,
        stop_ids: Vec<i64>,
        sampling: Option<Py<PySamplingParams>>,
        grammar: Option<String>,
        prompt_logprobs: Option<i64>,
        cache_salt: Option<String>,
        cache_boundary: Option<usize>,
        media: Vec<(usize, Bound<'_, PyAny>, u64)>,
        next_turn: Option<usize>,
        speculative: bool,
    ) -> PyResult<Self> {
        let params = sampling.map(|s| s.get().inner.clone()).unwrap_or_default();
        let media = media_arg(&media)?;
        let inner = Request {
            id,
            prompt: ids,
            max_new,
            stop_ids,
            params,
            grammar,
            prompt_logprobs,
            cache_salt,
            cache_boundary,
            next_turn,
            media,
            speculate: speculative,
        };
        Ok(PyRequest { inner })
    }

    #[getter]
    fn id(&self) -> u64 {
        self.inner.id
    }

    #[getter]
    fn ids(&self) -> Vec<i64> {
        self.inner.prompt.clone()
    }

    #[getter]
    fn max_new(&self) -> i64 {
        self.inner.max_new
    }

    #[getter]
    fn cache_salt(&self) -> Option<String> {
        self.inner.cache_salt.clone()
    }

    #[getter]
    fn cache_boundary(&self) -> Option<usize> {
        self.inner.cache_boundary
    }

    #[getter]
    fn next_turn(&self) -> Option<usize> {
        self.inner.next_turn
    }

    /// Pickled as its constructor's arguments (gemma_engine.distributed hands requests to the other ranks).
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTuple>)> {
        let py = slf.py();
        let r = &slf.get().inner;
        let sampling = Py::new(py, PySamplingParams { inner: r.params.clone() })?;
        let media =
            r.media.iter().map(|m| Ok((m.start, m.embeds()?.to_python(py)?, m.key))).collect::<PyResult<Vec<_>>>()?;
        let args = (
            r.id,
            r.prompt.clone(),
            r.max_new,
            r.stop_ids.clone(),
            sampling,
            r.grammar.clone(),
            r.prompt_logprobs,
            r.cache_salt.clone(),
            r.cache_boundary,
            media,
            r.next_turn,
            r.speculate,
        )
            .into_pyobject(py)?;
        Ok((slf.get_type().into_any(), args))
    }
}

/// Log-probabilities as Python sees them: per token, (logprob, [(token id, logprob), ...]).
type PyLogprobs = Vec<(f32, Vec<(i64, f32)>)>;

/// New tokens of one request, and its end once it ended (see gemma_engine.pyi).
#[pyclass(frozen, get_all, module = "gemma_engine", name = "Event")]
pub struct PyEvent {
    id: u64,
    tokens: Vec<i64>,
    /// Per token: (logprob, [(token id, logprob), ...]); empty unless the request asked.
    logprobs: PyLogprobs,
    /// Per prompt position 1..n, when the request asked: (logprob, [(token id, logprob), ...]).
    prompt_logprobs: Option<PyLogprobs>,
    finish: Option<&'static str>,
    error: Option<String>,
    prompt_s: f64,
    decode_s: f64,
    cached_tokens: usize,
}

fn logprob_pairs(l: Vec<TokenLogprobs>) -> PyLogprobs {
    l.into_iter().map(|l| (l.logprob, l.top)).collect()
}

impl From<Event> for PyEvent {
    fn from(e: Event) -> Self {
        PyEvent {
            id: e.id,
            tokens: e.tokens,
            logprobs: logprob_pairs(e.logprobs),
            prompt_logprobs: e.prompt_logprobs.map(logprob_pairs),
            finish: e.finish.map(|f| f.as_str()),
            error: e.error,
            prompt_s: e.timing.prompt_s,
            decode_s: e.timing.decode_s,
            cached_tokens: e.cached_tokens,
        }
    }
}

#[pymethods]
impl PyEvent {
    fn __repr__(&self) -> String {
        format!("Event(id={}, tokens={:?}, finish={:?}, error={:?})", self.id, self.tokens, self.finish, self.error)
    }
}

/// `Engine.run`'s callbacks. A Python exception is kept in `failed` and ends the loop.
struct PyIo {
    poll: Py<PyAny>,
    on_events: Py<PyAny>,
    failed: Option<PyErr>,
}

impl PyIo {
    fn fail(&mut self, e: PyErr) -> Error {
        let msg = e.to_string();
        self.failed = Some(e);
        Error::Callback(msg)
    }
}

impl Io for PyIo {
    fn poll(&mut self, free: usize, idle: bool) -> crate::error::Result<Option<(Vec<Request>, Vec<u64>)>> {
        let got = Python::attach(|py| -> PyResult<Option<(Vec<Request>, Vec<u64>)>> {
            let r = self.poll.call1(py, (free, idle))?;
            if r.is_none(py) {
                return Ok(None);
            }
            let (reqs, cancels): (Vec<Py<PyRequest>>, Vec<u64>) = r.extract(py)?;
            Ok(Some((reqs.iter().map(|r| r.get().inner.clone()).collect(), cancels)))
        });
        got.map_err(|e| self.fail(e))
    }

    fn emit(&mut self, events: Vec<Event>, stats: &StepStats) -> crate::error::Result<()> {
        let done = Python::attach(|py| -> PyResult<()> {
            let list = PyList::empty(py);
            for e in events {
                list.append(Py::new(py, PyEvent::from(e))?)?;
            }
            let s = PyDict::new(py);
            s.set_item("batch_sizes", stats.batch_sizes.clone())?;
            s.set_item("prompt_tokens", stats.prompt_tokens)?;
            s.set_item("prompt_reads", stats.prompt_reads.clone())?;
            s.set_item("seconds", stats.seconds)?;
            s.set_item("mask_seconds", stats.mask_seconds)?;
            s.set_item("cache_queries", stats.cache_queries)?;
            s.set_item("cache_hits", stats.cache_hits)?;
            s.set_item("spec_drafts", stats.spec_drafts)?;
            s.set_item("spec_draft_tokens", stats.spec_draft_tokens)?;
            s.set_item("spec_accepted_tokens", stats.spec_accepted_tokens)?;
            s.set_item("spec_accepted_per_position", stats.spec_accepted_per_position.clone())?;
            self.on_events.call1(py, (list, s))?;
            Ok(())
        });
        done.map_err(|e| self.fail(e))
    }
}

/// Free bytes on `like`'s device, as `gemma_engine._free_bytes` reports them (None: unknown).
fn free_bytes(like: &Py<PyAny>) -> crate::error::Result<Option<i64>> {
    Python::attach(|py| -> PyResult<Option<i64>> {
        py.import("gemma_engine")?.getattr("_free_bytes")?.call1((like.bind(py),))?.extract()
    })
    .map_err(|e| Error::Internal(format!("cannot read the device's free memory: {e}")))
}

/// One Gemma 4 text model, `max_batch` sequence slots and their KV cache (see gemma_engine.pyi).
///
/// Only the thread that built it may call it (PyO3 checks; another thread gets PanicException).
#[pyclass(unsendable, module = "gemma_engine")]
pub struct Engine {
    inner: engine::Engine,
}

#[pymethods]
impl Engine {
    /// Load a checkpoint directory (config.json + *.safetensors).
    ///
    /// Raises:
    ///     ValueError: bad config key, missing or misshapen tensor (named, with the expected
    ///         shape), bad dtype, context/prefill_chunk/max_batch < 1, a KV cache that does not fit.
    #[new]
    #[pyo3(signature = (model_dir, emb_dir=None, like=None, context=8192, dtype="bfloat16", prefill_chunk=256,
                        max_batch=1, packed_int4=None, cuda_graphs=true, onednn=None, grammars=None,
                        prefix_caching=true, tensor_parallel_size=1, compiler=None,
                        tensor_parallel_rank=None, tensor_parallel_group=None, speculative_method=None,
                        num_speculative_tokens=None, prompt_lookup_min=1, prompt_lookup_max=4,
                        speculative_max_batch=1, speculative_model=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        model_dir: PathBuf,
        emb_dir: Option<PathBuf>,
        like: Option<&Bound<'_, PyAny>>,
        context: i64,
        dtype: &str,
        prefill_chunk: i64,
        max_batch: i64,
        packed_int4: Option<bool>,
        cuda_graphs: bool,
        onednn: Option<bool>,
        grammars: Option<Py<grammars::PyGrammars>>,
        prefix_caching: bool,
        tensor_parallel_size: i64,
        compiler: Option<Py<PyAny>>,
        tensor_parallel_rank: Option<i64>,
        tensor_parallel_group: Option<String>,
        speculative_method: Option<&str>,
        num_speculative_tokens: Option<i64>,
        prompt_lookup_min: i64,
        prompt_lookup_max: i64,
        speculative_max_batch: i64,
        speculative_model: Option<PathBuf>,
    ) -> PyResult<Engine> {
        let (lookup, tokens) = ((prompt_lookup_min, prompt_lookup_max), num_speculative_tokens);
        let speculative =
            Speculative::from_args(speculative_method, tokens, lookup, speculative_max_batch, speculative_model)?;
        let grammars = grammars.map(|g| g.get().inner.clone());
        let dtype = parse_dtype(dtype)?;
        let settings = Settings {
            context,
            dtype,
            prefill_chunk,
            max_batch,
            packed_int4,
            cuda_graphs,
            onednn,
            prefix_caching,
            tensor_parallel_size,
            rank: match (tensor_parallel_rank, tensor_parallel_group) {
                (None, None) => None,
                (Some(rank), Some(group)) => Some(Rank { rank, group }),
                _ => {
                    return Err(PyValueError::new_err(
                        "tensor_parallel_rank and tensor_parallel_group are given together, or neither",
                    ));
                }
            },
            chunk_row: compiler.is_some(),
            speculative,
        };
        let (like, like_py) = match like {
            Some(t) => (tensor_arg(t, "like")?, t.clone().unbind()),
            None => {
                let t = Tensor::from_i64(&[0])?;
                let p = t.to_python(py)?.unbind();
                (t, p)
            }
        };
        let inner = py.detach(|| {
            no_grad(|| {
                engine::Engine::load(&model_dir, emb_dir.as_deref(), like, settings, || free_bytes(&like_py))?
                    .with_grammars(grammars)
            })
        })?;
        Ok(Engine { inner: inner.with_compiler(compiler.map(compiler::boxed)) })
    }

    #[getter]
    fn eos_ids(&self) -> Vec<i64> {
        self.inner.config().eos_ids.clone()
    }

    #[getter]
    fn vocab_size(&self) -> i64 {
        self.inner.config().vocab_size
    }

    #[getter]
    fn context(&self) -> i64 {
        self.inner.context()
    }

    #[getter]
    fn max_batch(&self) -> i64 {
        self.inner.max_batch()
    }

    /// The decode-step batch sizes: powers of two below max_batch, then max_batch.
    #[getter]
    fn buckets(&self) -> Vec<i64> {
        self.inner.buckets()
    }

    /// The lengths compiled prompt chunks run at: powers of two from 16 below prefill_chunk, then
    /// prefill_chunk; empty for an engine made without a compiler.
    #[getter]
    fn chunk_buckets(&self) -> Vec<i64> {
        self.inner.chunk_buckets()
    }

    #[getter]
    fn dtype(&self) -> &'static str {
        self.inner.dtype().name()
    }

    #[getter]
    fn device(&self) -> PyResult<String> {
        Ok(self.inner.device()?)
    }

    /// {"int4": "packed" | "dequantized" | "mixed" | "none", "bytes": weight bytes on the device,
    /// "linear": "onednn" | "aten", "linear_note": why not oneDNN, or None}.
    fn weights<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let w = self.inner.weights();
        let d = PyDict::new(py);
        d.set_item("int4", w.int4)?;
        d.set_item("bytes", w.bytes)?;
        d.set_item("linear", w.linear)?;
        d.set_item("linear_note", w.linear_note)?;
        Ok(d)
    }

    /// CUDA graphs of decode steps captured so far (0 off CUDA).
    #[getter]
    fn captured_steps(&self) -> usize {
        self.inner.captured_steps()
    }

    /// Forget every slot's cached prefix (vLLM's reset_prefix_cache): the next requests take the lowest
    /// free slots.
    fn reset_prefix_cache(&mut self) {
        self.inner.reset_prefix_cache();
    }

    /// Replay compiled decode steps (True) or run them as an engine without a compiler does, capturing
    /// nothing (False): every bucket's, or with `bucket` that bucket's alone.
    ///
    /// Raises:
    ///     ValueError: the engine was made without a compiler, or has no such bucket.
    #[pyo3(signature = (on, bucket=None))]
    fn use_compiled(&mut self, on: bool, bucket: Option<i64>) -> PyResult<()> {
        Ok(self.inner.use_compiled(on, bucket)?)
    }

    /// {"backend", "active", "captured", "eager_buckets", "fallbacks": [(step, reason)]}, or None without a
    /// compiler.
    fn compile_report<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        self.inner.compile_report().map(|r| compiler::report(py, r)).transpose()
    }

    /// ATen calls each layer made in the last forward.
    #[getter]
    fn layer_calls(&self) -> Vec<u64> {
        self.inner.layer_calls()
    }

    /// Speculative decoding, when on: {"method": "ngram" or "mtp", "speculative_model" (the drafter's
    /// directory, or None), "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
    /// "speculative_max_batch", "speculative_max_bucket"}; None when off.
    #[getter]
    fn speculative<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        self.inner.speculative().map(|s| functions::speculative_dict(py, s)).transpose()
    }

    /// {"bucket", "plain_s", "verify_s", "drafts"}: a plain and a verify step with `batch` requests decoding.
    #[pyo3(signature = (batch, turns=8))]
    fn speculation_costs<'py>(&mut self, py: Python<'py>, batch: usize, turns: usize) -> PyResult<Bound<'py, PyDict>> {
        let inner = &mut self.inner;
        let costs = py.detach(|| no_grad(|| inner.speculation_costs(batch, turns)))?;
        functions::costs_dict(py, &costs)
    }

    /// The most turns `speculation_costs` can time in this engine's context (0: not one).
    #[getter]
    fn speculation_turns(&self) -> usize {
        self.inner.speculation_turns()
    }

    /// Capture the verify steps of the decode bucket `prompts` fill, with `sampling`'s stages; whether every step
    /// ran with the rows it was meant to.
    #[pyo3(signature = (prompts, sampling=None))]
    fn compile_verify(
        &mut self,
        py: Python<'_>,
        prompts: Vec<Vec<i64>>,
        sampling: Option<Py<PySamplingParams>>,
    ) -> PyResult<bool> {
        let params = sampling.map(|s| s.get().inner.clone()).unwrap_or_default();
        let inner = &mut self.inner;
        Ok(py.detach(|| no_grad(|| inner.compile_verify(&prompts, params)))?)
    }

    fn set_speculative_max_bucket(&mut self, n: i64) -> PyResult<()> {
        Ok(self.inner.set_speculative_max_bucket(n)?)
    }

    /// {"full_rings", "sliding_rings", "shared_layers", "context", "sliding_window", "max_batch",
    /// "kv_bytes_per_slot", "kv_bytes", "prefix_caching", "snapshot_bytes_per_slot", "tensor_parallel_size",
    /// "tensor_parallel_rank"}.
    fn layout<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let l = self.inner.layout();
        let d = PyDict::new(py);
        d.set_item("full_rings", l.full_rings)?;
        d.set_item("sliding_rings", l.sliding_rings)?;
        d.set_item("shared_layers", l.shared_layers)?;
        d.set_item("context", l.context)?;
        d.set_item("sliding_window", l.sliding_window)?;
        d.set_item("max_batch", l.max_batch)?;
        d.set_item("kv_bytes_per_slot", l.kv_bytes_per_slot)?;
        d.set_item("kv_bytes", l.kv_bytes)?;
        d.set_item("prefix_caching", l.prefix_caching)?;
        d.set_item("snapshot_bytes_per_slot", l.snapshot_bytes_per_slot)?;
        d.set_item("tensor_parallel_size", l.tensor_parallel_size)?;
        d.set_item("tensor_parallel_rank", l.tensor_parallel_rank)?;
        Ok(d)
    }

    /// One request alone through the batching loop (see gemma_engine.pyi).
    #[pyo3(signature = (ids, max_new, stop_ids=Vec::new(), read_every=1, on_tokens=None, sampling=None))]
    #[allow(clippy::too_many_arguments)]
    fn decode(
        &mut self,
        py: Python<'_>,
        ids: Vec<i64>,
        max_new: i64,
        stop_ids: Vec<i64>,
        read_every: i64,
        on_tokens: Option<Py<PyAny>>,
        sampling: Option<Py<PySamplingParams>>,
    ) -> PyResult<(Vec<i64>, &'static str, f64, f64)> {
        let params = sampling.map(|s| s.get().inner.clone()).unwrap_or_default();
        let request = Request {
            id: 0,
            prompt: ids,
            max_new,
            stop_ids,
            params,
            grammar: None,
            prompt_logprobs: None,
            cache_salt: None,
            cache_boundary: None,
            next_turn: None,
            media: Vec::new(),
            speculate: true,
        };
        let mut failed: Option<PyErr> = None;
        let inner = &mut self.inner;
        let done = py.detach(|| {
            no_grad(|| {
                inner.decode(request, read_every, |batch| {
                    let Some(cb) = &on_tokens else { return true };
                    Python::attach(|py| {
                        let call = PyList::new(py, batch).and_then(|l| cb.call1(py, (l,)));
                        match call.and_then(|r| r.is_truthy(py)) {
                            Ok(go_on) => go_on,
                            Err(e) => {
                                failed = Some(e);
                                false
                            }
                        }
                    })
                })
            })
        });
        if let Some(e) = failed {
            return Err(e);
        }
        let d = done?;
        Ok((d.tokens, d.finish.as_str(), d.timing.prompt_s, d.timing.decode_s))
    }

    /// The continuous-batching loop (see gemma_engine.pyi).
    #[pyo3(signature = (poll, on_events, read_every=1))]
    fn run(&mut self, py: Python<'_>, poll: Py<PyAny>, on_events: Py<PyAny>, read_every: i64) -> PyResult<()> {
        let mut io = PyIo { poll, on_events, failed: None };
        let inner = &mut self.inner;
        let done = py.detach(|| no_grad(|| inner.run(&mut io, read_every)));
        if let Some(e) = io.failed.take() {
            return Err(e);
        }
        Ok(done?)
    }

    /// Make the engine fail request `id` once, at "admit", "prompt" or "decode" (see gemma_engine.pyi):
    /// for tests of what one failed request leaves behind.
    ///
    /// Raises:
    ///     ValueError: `at` is none of those.
    fn inject_fault_for_tests(&mut self, at: &str, id: u64) -> PyResult<()> {
        let at = match at {
            "admit" => engine::Fault::Admit,
            "prompt" => engine::Fault::Prompt,
            "decode" => engine::Fault::Decode,
            other => return Err(PyValueError::new_err(format!("at must be admit, prompt or decode, got {other:?}"))),
        };
        self.inner.inject_fault_for_tests(at, id);
        Ok(())
    }

    /// float32 [vocab_size] logits (after softcap) for the token after `ids` (with `media` as in
    /// Request), read into slot 0 from empty, on the host. For parity checks.
    ///
    /// Raises:
    ///     ValueError: as for decode, and media that break Request's rules.
    #[pyo3(signature = (ids, media=Vec::new()))]
    fn logits<'py>(
        &mut self,
        py: Python<'py>,
        ids: Vec<i64>,
        media: Vec<(usize, Bound<'py, PyAny>, u64)>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let media = media_arg(&media)?;
        let inner = &mut self.inner;
        let t = py.detach(move || no_grad(|| inner.logits(&ids, &media)))?;
        t.to_python(py)
    }
}

#[pymodule]
#[pyo3(name = "_native")]
fn gemma_engine_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    use functions::{
        add_, adopt_storage_, all_gather_last, all_reduce_sum, aten_calls, attention, build_info, limits, matmul_sum,
        rms_norm, sample, smoke, uniform,
    };
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("BUILD", build_info(m.py())?)?;
    m.add("LIMITS", limits(m.py())?)?;
    m.add_function(wrap_pyfunction!(smoke, m)?)?;
    m.add_function(wrap_pyfunction!(matmul_sum, m)?)?;
    m.add_function(wrap_pyfunction!(add_, m)?)?;
    m.add_function(wrap_pyfunction!(sample, m)?)?;
    m.add_function(wrap_pyfunction!(uniform, m)?)?;
    m.add_function(wrap_pyfunction!(adopt_storage_, m)?)?;
    m.add_function(wrap_pyfunction!(aten_calls, m)?)?;
    m.add_function(wrap_pyfunction!(rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(attention, m)?)?;
    m.add_function(wrap_pyfunction!(all_reduce_sum, m)?)?;
    m.add_function(wrap_pyfunction!(all_gather_last, m)?)?;
    m.add_class::<Engine>()?;
    m.add_class::<encoder::Encoder>()?;
    m.add_class::<PySamplingParams>()?;
    m.add_class::<PyRequest>()?;
    m.add_class::<grammars::PyGrammars>()?;
    m.add_class::<PyEvent>()?;
    Ok(())
}
