//! The engine's `Compiler` over a Python object (`gemma_engine.compiling.StepCompiler`): the engine
//! hands it the eager step as a Python callable; it records the step at the dispatcher, compiles it,
//! and returns a zero-argument callable that replays it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyCFunction, PyDict, PyList, PyTuple};

use crate::engine::compiled::{CompileReport, Compiler, Replay};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// `hook(name, run) -> replay`, with `hook.backend_name` its backend's name and `hook.fell_back(step, reason)`.
pub struct PyCompiler {
    pub hook: Py<PyAny>,
}

/// The engine's compiler for a Python hook.
pub fn boxed(hook: Py<PyAny>) -> Box<dyn Compiler> {
    Box::new(PyCompiler { hook })
}

/// `Engine.compile_report()`'s dict: backend, active, captured, eager_buckets, fallbacks as (step, reason) pairs.
pub fn report(py: Python<'_>, r: CompileReport) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("backend", r.backend)?;
    d.set_item("active", r.active)?;
    d.set_item("captured", r.captured)?;
    d.set_item("eager_buckets", r.eager_buckets)?;
    d.set_item("fallbacks", r.fallbacks.into_iter().map(|f| (f.step, f.reason)).collect::<Vec<_>>())?;
    Ok(d)
}

struct PyReplay(Py<PyAny>);

type Eager = dyn FnMut() -> Result<Vec<Tensor>>;

/// The eager step, reachable from Python only while `capture` runs (`alive`).
struct EagerPtr(*mut Eager);

// SAFETY: the pointer is used only on the thread that made it (the engine's, inside `capture`, where
// the hook calls `run` synchronously); `alive` turns false before the closure it points to ends.
unsafe impl Send for EagerPtr {}
// SAFETY: as for Send: one thread, while `alive`.
unsafe impl Sync for EagerPtr {}

impl EagerPtr {
    /// SAFETY: only while the capture that made it runs, on its thread.
    #[allow(clippy::mut_from_ref)]
    unsafe fn eager(&self) -> &mut Eager {
        // SAFETY: the caller's contract.
        unsafe { &mut *self.0 }
    }
}

fn callback(e: impl std::fmt::Display) -> Error {
    Error::Callback(e.to_string())
}

fn tensors(list: &Bound<'_, PyAny>) -> Result<Vec<Tensor>> {
    let list = list.cast::<PyList>().map_err(|e| callback(format!("a compiled step must return a list: {e}")))?;
    list.iter().map(|t| Tensor::from_python(&t)).collect()
}

impl Compiler for PyCompiler {
    fn capture(&mut self, name: &str, eager: &mut dyn FnMut() -> Result<Vec<Tensor>>) -> Result<Box<dyn Replay>> {
        let alive = Arc::new(AtomicBool::new(true));
        let short: *mut (dyn FnMut() -> Result<Vec<Tensor>> + '_) = eager;
        // SAFETY: only the lifetime is erased; `alive` guards every use (see EagerPtr).
        let ptr = EagerPtr(unsafe {
            std::mem::transmute::<*mut (dyn FnMut() -> Result<Vec<Tensor>> + '_), *mut Eager>(short)
        });
        let guard = alive.clone();
        let replay = Python::attach(|py| -> PyResult<Py<PyAny>> {
            let run = PyCFunction::new_closure(py, None, None, move |args: &Bound<'_, PyTuple>, _kwargs| {
                if !guard.load(Ordering::SeqCst) {
                    return Err(PyRuntimeError::new_err("a captured step's eager run was called after its capture"));
                }
                // SAFETY: `capture` is still on the stack (guard), on this thread.
                let eager = unsafe { ptr.eager() };
                let out = eager().map_err(PyErr::from)?;
                let py = args.py();
                let list = out.iter().map(|t| t.to_python(py)).collect::<PyResult<Vec<_>>>()?;
                Ok(PyList::new(py, list)?.unbind())
            })?;
            self.hook.call1(py, (name, run))
        });
        alive.store(false, Ordering::SeqCst);
        Ok(Box::new(PyReplay(replay.map_err(callback)?)))
    }

    fn backend(&self) -> String {
        Python::attach(|py| {
            self.hook
                .getattr(py, "backend_name")
                .and_then(|b| b.extract::<String>(py))
                .unwrap_or_else(|e| format!("<{e}>"))
        })
    }

    fn fell_back(&mut self, step: &str, reason: &str) {
        // A hook without `fell_back` (or one that raises) is not told; compile_report() lists the fallback.
        let _ = Python::attach(|py| self.hook.call_method1(py, "fell_back", (step, reason)));
    }
}

impl Replay for PyReplay {
    fn call(&self) -> Result<Vec<Tensor>> {
        Python::attach(|py| tensors(self.0.call0(py).map_err(callback)?.bind(py)))
    }
}
