//! The module's free functions: the engine's sampler and kernels on given tensors (for tests against
//! Transformers), the boot's smoke test, the ATen call counter, the limits and the build record.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::{PySamplingParams, tensor_arg};
use crate::engine::request::LIMITS;
use crate::engine::sampling::{self, Sampler};
use crate::engine::speculative::{Method, Speculative};
use crate::engine::tuning::Costs;
use crate::error::Error;
use crate::tensor::{DType, Tensor, no_grad};

/// Per row of `sample`: the parameters, the prompt ids, the ids generated so far, the draw index.
type SampleRow = (Py<PySamplingParams>, Vec<i64>, Vec<i64>, i64);

/// The engine's sampler on given logits (see gemma_engine.pyi): for tests against Transformers'
/// processors.
#[pyfunction]
pub(super) fn sample<'py>(
    py: Python<'py>,
    logits: &Bound<'py, PyAny>,
    rows: Vec<SampleRow>,
) -> PyResult<(Vec<i64>, Bound<'py, PyAny>)> {
    let logits = tensor_arg(logits, "logits")?;
    let size = logits.size()?;
    let [n, vocab] = size[..] else {
        return Err(PyValueError::new_err(format!("logits must be [rows, vocab], got {size:?}")));
    };
    if rows.len() as i64 != n {
        return Err(PyValueError::new_err(format!("{} rows of parameters for {n} rows of logits", rows.len())));
    }
    let (tokens, probs) = no_grad(|| {
        let mut sampler = Sampler::new(n, vocab, &logits)?;
        for (i, (params, prompt, output, step)) in rows.iter().enumerate() {
            let params = params.get();
            params.inner.check(vocab)?;
            let p = Tensor::from_i64(prompt)?.to_like(&logits, DType::I64)?;
            sampler.assign(i as i64, &params.inner, &p, false)?;
            if !output.is_empty() {
                sampler.record(i as i64, &Tensor::from_i64(output)?.to_like(&logits, DType::I64)?)?;
            }
            sampler.set_step(i as i64, *step)?;
        }
        let chosen = sampler.choose(&logits, 0, n)?;
        let host = Tensor::from_i64(&[0])?;
        Ok((chosen.tokens.to_vec_i64()?, sampler.distribution(&logits, 0, n)?.to_like(&host, DType::F32)?))
    })?;
    Ok((tokens, probs.to_python(py)?))
}

/// Swap the memory of `dst`'s storage and `src`'s (see gemma_engine.pyi): a compiled step's new KV rings become the
/// engine's own without a copy.
#[pyfunction]
pub(super) fn adopt_storage_(dst: &Bound<'_, PyAny>, src: &Bound<'_, PyAny>) -> PyResult<()> {
    let (dst, src) = (tensor_arg(dst, "dst")?, tensor_arg(src, "src")?);
    Ok(dst.adopt_storage_(&src)?)
}

/// The engine's uniform numbers for (seed, step) pairs, computed on the host's ATen (for tests).
#[pyfunction]
pub(super) fn uniform(seeds: Vec<i64>, steps: Vec<i64>) -> PyResult<Vec<f32>> {
    if seeds.len() != steps.len() {
        return Err(PyValueError::new_err("seeds and steps must have the same length"));
    }
    Ok(no_grad(|| sampling::uniform(&Tensor::from_i64(&seeds)?, &Tensor::from_i64(&steps)?)?.to_vec_f32())?)
}

/// Computes sum(ones(8, 64) @ ones(64, 8)) on `like`'s device.
///
/// Returns:
///     {"value": 4096.0, "device": "<device of the result>"}
/// Raises:
///     RuntimeError: the device failed the computation.
#[pyfunction]
pub(super) fn smoke<'py>(py: Python<'py>, like: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyDict>> {
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
pub(super) fn matmul_sum(a: &Bound<'_, PyAny>, b: &Bound<'_, PyAny>) -> PyResult<f64> {
    let (a, b) = (tensor_arg(a, "a")?, tensor_arg(b, "b")?);
    let r = no_grad(|| a.matmul(&b)?.sum()?.item_f64());
    // A shape mismatch is the caller's mistake: ValueError with ATen's own message.
    r.map_err(|e| input_error("matmul_sum", e))
}

/// Add `value` to `t` in place from Rust: proves tensors share storage.
#[pyfunction]
pub(super) fn add_(t: &Bound<'_, PyAny>, value: f64) -> PyResult<()> {
    let t = tensor_arg(t, "t")?;
    no_grad(|| t.add_scalar_(value))?;
    Ok(())
}

/// The engine's RMSNorm over the last dim of `x` (norm.rs; one pass a row on the CPU, aten.cpp), for
/// tests against Transformers' `Gemma4RMSNorm`.
#[pyfunction]
#[pyo3(signature = (x, weight=None, eps=1e-6))]
pub(super) fn rms_norm<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    weight: Option<&Bound<'py, PyAny>>,
    eps: f64,
) -> PyResult<Bound<'py, PyAny>> {
    let x = tensor_arg(x, "x")?;
    let weight = weight.map(|w| tensor_arg(w, "weight")).transpose()?;
    let y = no_grad(|| x.rms_norm(weight.as_ref(), eps)).map_err(|e| input_error("rms_norm", e))?;
    y.to_python(py)
}

/// The sum of `t` over the ranks of torch.distributed's process group `group_name` (as
/// `torch.distributed.group.WORLD.group_name`), called from Rust through the dispatcher op
/// `_c10d_functional.all_reduce` (aten.cpp): the collective path tensor parallelism across processes takes,
/// which a dispatcher-level capture records. For tests of that path.
///
/// Raises:
///     ValueError: no process group of that name, or a tensor its backend cannot reduce (torch's message).
#[pyfunction]
pub(super) fn all_reduce_sum<'py>(
    py: Python<'py>,
    t: &Bound<'py, PyAny>,
    group_name: &str,
) -> PyResult<Bound<'py, PyAny>> {
    let t = tensor_arg(t, "t")?;
    let y = no_grad(|| t.all_reduce_sum(group_name)).map_err(|e| input_error("all_reduce_sum", e))?;
    y.to_python(py)
}

/// The ranks' `t` of torch.distributed's process group `group_name` (of `size` ranks) side by side along the
/// last dimension, in rank order (how a vocabulary-parallel head joins its logits), called from Rust through
/// the dispatcher op `_c10d_functional.all_gather_into_tensor`. For tests of that path.
///
/// Raises:
///     ValueError: no process group of that name, a size that is not the group's, or a tensor its backend
///         cannot gather (torch's message).
#[pyfunction]
pub(super) fn all_gather_last<'py>(
    py: Python<'py>,
    t: &Bound<'py, PyAny>,
    size: i64,
    group_name: &str,
) -> PyResult<Bound<'py, PyAny>> {
    let t = tensor_arg(t, "t")?;
    let y = no_grad(|| t.all_gather_last(size, group_name)).map_err(|e| input_error("all_gather_last", e))?;
    y.to_python(py)
}

/// The engine's attention, `softmax(q k^T * scale + mask) v` with grouped KV heads (attention.rs;
/// the few-row 16-bit CPU path in aten.cpp), for tests against `scaled_dot_product_attention`.
#[pyfunction]
#[pyo3(signature = (q, k, v, mask, scale=1.0))]
pub(super) fn attention<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    mask: &Bound<'py, PyAny>,
    scale: f64,
) -> PyResult<Bound<'py, PyAny>> {
    let (q, k, v) = (tensor_arg(q, "q")?, tensor_arg(k, "k")?, tensor_arg(v, "v")?);
    let mask = tensor_arg(mask, "mask")?;
    let y = no_grad(|| Tensor::sdpa(&q, &k, &v, &mask, scale)).map_err(|e| input_error("attention", e))?;
    y.to_python(py)
}

/// ATen's complaint about arguments a caller passed, as ValueError naming the function.
pub(super) fn input_error(what: &str, e: Error) -> PyErr {
    match e {
        Error::Torch { msg, .. } => Error::Input(format!("{what}: {msg}")),
        other => other,
    }
    .into()
}

/// ATen operator calls the engine has made in this process, on every thread.
#[pyfunction]
pub(super) fn aten_calls() -> u64 {
    crate::ffi::aten_calls()
}

/// `request::LIMITS` as {name: int}, for the server's schema and the tests.
pub(super) fn limits(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    for (name, value) in LIMITS.entries() {
        d.set_item(name, value)?;
    }
    Ok(d)
}

/// What built this module.
pub(super) fn build_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("torch", env!("GEMMA_BUILD_TORCH"))?;
    d.set_item("rustc", env!("GEMMA_BUILD_RUSTC"))?;
    d.set_item("python", env!("GEMMA_BUILD_PYTHON"))?;
    d.set_item("crate", env!("CARGO_PKG_VERSION"))?;
    d.set_item("cuda_graphs", env!("GEMMA_BUILD_CUDA_GRAPHS") == "true")?;
    Ok(d)
}

/// The `Engine.speculative` dict of `s`.
pub(super) fn speculative_dict<'py>(py: Python<'py>, s: &Speculative) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("method", s.method_name())?;
    let model = match &s.method {
        Method::Mtp(dir) => Some(dir.display().to_string()),
        Method::Ngram => None,
    };
    d.set_item("speculative_model", model)?;
    for (k, v) in s.named() {
        d.set_item(k, v)?;
    }
    d.set_item("speculative_max_bucket", s.max_bucket)?;
    Ok(d)
}

/// The `Engine.speculation_costs` dict of `c`.
pub(super) fn costs_dict<'py>(py: Python<'py>, c: &Costs) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("bucket", c.bucket)?;
    d.set_item("plain_s", c.plain_s)?;
    d.set_item("verify_s", c.verify_s)?;
    d.set_item("drafts", c.drafts)?;
    Ok(d)
}
