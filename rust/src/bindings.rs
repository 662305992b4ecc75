//! PyO3 bindings: the only module that sees Python objects.
//!
//! `#[pymodule]` is a registry; `Engine` is a thin `#[pyclass(unsendable)]` wrapper. Inputs are
//! extracted and checked under the GIL, then the work runs in `py.detach` (tokenizers'
//! `encode_batch`); the decode callback re-attaches. One `From<Error> for PyErr` picks the
//! exception class. Design from the seed rig's bindings.rs (PYO3.md lists each crossing).

use std::path::PathBuf;

use pyo3::exceptions::{PyOSError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::error::Error;
use crate::gemma4::engine::{self, parse_dtype};
use crate::tensor::{DType, Tensor, no_grad};

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        match e {
            Error::Config { .. } | Error::Weight { .. } | Error::Input(_) | Error::Format { .. } => {
                PyValueError::new_err(e.to_string())
            }
            Error::Io { .. } => PyOSError::new_err(e.to_string()),
            Error::Torch { .. } => PyRuntimeError::new_err(e.to_string()),
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

/// One Gemma 4 text model and one fixed-shape ring KV cache (see gemma_engine.pyi).
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
    /// Args:
    ///     model_dir: dense bf16/f32 or compressed-tensors W4A16 checkpoint.
    ///     emb_dir: optional directory with int4 embed_tokens / embed_tokens_per_layer tables.
    ///     like: a tensor on the target device; weights and cache follow it. Default: the host.
    ///     context: ring size of full-attention layers (prompt + generated tokens).
    ///     dtype: compute dtype, "float32", "bfloat16" or "float16".
    ///     prefill_chunk: prompt tokens read per forward.
    /// Raises:
    ///     ValueError: bad config key, missing or misshapen tensor (named, with the expected
    ///         shape), bad dtype, context < 1, prefill_chunk < 1.
    #[new]
    #[pyo3(signature = (model_dir, emb_dir=None, like=None, context=8192, dtype="bfloat16", prefill_chunk=256))]
    fn new(
        py: Python<'_>,
        model_dir: PathBuf,
        emb_dir: Option<PathBuf>,
        like: Option<&Bound<'_, PyAny>>,
        context: i64,
        dtype: &str,
        prefill_chunk: i64,
    ) -> PyResult<Engine> {
        let dtype = parse_dtype(dtype)?;
        let like = match like {
            Some(t) => tensor_arg(t, "like")?,
            None => Tensor::from_i64(&[0])?,
        };
        let inner = py.detach(|| {
            no_grad(|| engine::Engine::load(&model_dir, emb_dir.as_deref(), like, context, dtype, prefill_chunk))
        })?;
        Ok(Engine { inner })
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
    fn dtype(&self) -> &'static str {
        self.inner.dtype().name()
    }

    #[getter]
    fn device(&self) -> PyResult<String> {
        Ok(self.inner.device()?)
    }

    /// {"full_rings", "sliding_rings", "shared_layers", "context", "sliding_window"}.
    fn layout<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let l = self.inner.layout();
        let d = PyDict::new(py);
        d.set_item("full_rings", l.full_rings)?;
        d.set_item("sliding_rings", l.sliding_rings)?;
        d.set_item("shared_layers", l.shared_layers)?;
        d.set_item("context", l.context)?;
        d.set_item("sliding_window", l.sliding_window)?;
        Ok(d)
    }

    /// Greedy decode from a fresh cache.
    ///
    /// Args:
    ///     ids: prompt token ids.
    ///     max_new: most tokens to generate.
    ///     stop_ids: extra stop tokens besides eos_ids (the stop token is not returned).
    ///     read_every: steps between host reads; on_tokens gets batches of this size.
    ///     on_tokens: called with each batch; a falsy return cancels.
    /// Returns:
    ///     (tokens, finish, read_s, decode_s), finish "stop" | "length" | "cancelled".
    /// Raises:
    ///     ValueError: empty prompt, max_new < 1, read_every < 1, a prompt of `context` tokens
    ///         or more, a token id outside [0, vocab_size).
    ///     Exception: whatever on_tokens raised.
    #[pyo3(signature = (ids, max_new, stop_ids=Vec::new(), read_every=1, on_tokens=None))]
    fn decode(
        &mut self,
        py: Python<'_>,
        ids: Vec<i64>,
        max_new: i64,
        stop_ids: Vec<i64>,
        read_every: i64,
        on_tokens: Option<Py<PyAny>>,
    ) -> PyResult<(Vec<i64>, &'static str, f64, f64)> {
        self.inner.check_request(&ids, max_new, read_every)?;
        let mut failed: Option<PyErr> = None;
        let inner = &mut self.inner;
        let done = py.detach(|| {
            no_grad(|| {
                inner.decode(&ids, max_new, &stop_ids, read_every, |batch| {
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
        Ok((d.tokens, d.finish.as_str(), d.read_s, d.decode_s))
    }

    /// float32 [vocab_size] logits (after softcap) for the token after `ids`, from a fresh
    /// cache, on the host. For parity checks.
    ///
    /// Raises:
    ///     ValueError: as for decode.
    fn logits<'py>(&mut self, py: Python<'py>, ids: Vec<i64>) -> PyResult<Bound<'py, PyAny>> {
        self.inner.check_prompt(&ids)?;
        let inner = &mut self.inner;
        let t = py.detach(|| no_grad(|| inner.logits(&ids)))?;
        t.to_python(py)
    }
}

/// Computes sum(ones(8, 64) @ ones(64, 8)) on `like`'s device.
///
/// Returns:
///     {"value": 4096.0, "device": "<device of the result>"}
/// Raises:
///     RuntimeError: the device failed the computation.
#[pyfunction]
fn smoke<'py>(py: Python<'py>, like: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyDict>> {
    let like = tensor_arg(like, "like")?;
    let (value, device) = no_grad(|| {
        let a = Tensor::full(&[8, 64], 1.0, DType::F32, &like)?;
        let b = Tensor::full(&[64, 8], 1.0, DType::F32, &like)?;
        let s = a.matmul(&b)?.sum()?;
        Ok((s.item_f64()?, s.device()?))
    })?;
    let d = PyDict::new(py);
    d.set_item("value", value)?;
    d.set_item("device", device)?;
    Ok(d)
}

/// sum(a @ b) computed by ATen from Rust; a and b cross without copies.
///
/// Raises:
///     ValueError: the shapes do not multiply (ATen's message, with both shapes).
#[pyfunction]
fn matmul_sum(a: &Bound<'_, PyAny>, b: &Bound<'_, PyAny>) -> PyResult<f64> {
    let (a, b) = (tensor_arg(a, "a")?, tensor_arg(b, "b")?);
    let r = no_grad(|| a.matmul(&b)?.sum()?.item_f64());
    // A shape mismatch is the caller's mistake: ValueError with ATen's own message.
    r.map_err(|e| match e {
        Error::Torch { msg, .. } => Error::Input(format!("matmul_sum: {msg}")),
        other => other,
    })
    .map_err(PyErr::from)
}

/// Add `value` to `t` in place from Rust: proves tensors share storage.
#[pyfunction]
fn add_(t: &Bound<'_, PyAny>, value: f64) -> PyResult<()> {
    let t = tensor_arg(t, "t")?;
    no_grad(|| t.add_scalar_(value))?;
    Ok(())
}

/// What built this module.
fn build_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("torch", env!("GEMMA_BUILD_TORCH"))?;
    d.set_item("rustc", env!("GEMMA_BUILD_RUSTC"))?;
    d.set_item("python", env!("GEMMA_BUILD_PYTHON"))?;
    d.set_item("crate", env!("CARGO_PKG_VERSION"))?;
    Ok(d)
}

#[pymodule]
#[pyo3(name = "_native")]
fn gemma_engine_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("BUILD", build_info(m.py())?)?;
    m.add_function(wrap_pyfunction!(smoke, m)?)?;
    m.add_function(wrap_pyfunction!(matmul_sum, m)?)?;
    m.add_function(wrap_pyfunction!(add_, m)?)?;
    m.add_class::<Engine>()?;
    Ok(())
}
