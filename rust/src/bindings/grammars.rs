//! `gemma_engine.Grammars`: the token environment of one tokenizer for grammar-constrained sampling
//! (engine/grammar.rs).

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;

use crate::engine::grammar::Grammars;

/// The token environment of one tokenizer for grammar-constrained sampling (see gemma_engine.pyi).
#[pyclass(frozen, module = "gemma_engine", name = "Grammars")]
pub struct PyGrammars {
    pub(super) inner: Arc<Grammars>,
}

#[pymethods]
impl PyGrammars {
    /// Raises:
    ///     ValueError: an unsupported tokenizer, eos ids outside the vocabulary, a tokenizer larger
    ///         than vocab_size. OSError: an unreadable file.
    #[new]
    fn new(py: Python<'_>, tokenizer_json: PathBuf, eos_ids: Vec<i64>, vocab_size: i64) -> PyResult<Self> {
        let inner = py.detach(|| Grammars::load(&tokenizer_json, &eos_ids, vocab_size))?;
        Ok(PyGrammars { inner: Arc::new(inner) })
    }

    /// Raises:
    ///     ValueError: the grammar does not compile, or exceeds a limit (llguidance's message).
    fn check(&self, py: Python<'_>, grammar: &str) -> PyResult<()> {
        py.detach(|| self.inner.compile(grammar).map(|_| ()))?;
        Ok(())
    }

    /// Raises:
    ///     ValueError: the grammar does not compile.
    fn accepts(&self, py: Python<'_>, grammar: &str, ids: Vec<i64>) -> PyResult<bool> {
        Ok(py.detach(|| self.inner.accepts(grammar, &ids))?)
    }

    /// Raises:
    ///     ValueError: the grammar does not compile or refuses one of `ids`.
    fn allowed(&self, py: Python<'_>, grammar: &str, ids: Vec<i64>) -> PyResult<Vec<i64>> {
        Ok(py.detach(|| self.inner.allowed(grammar, &ids))?)
    }
}
