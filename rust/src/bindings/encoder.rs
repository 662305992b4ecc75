//! `Encoder`, the media towers of a checkpoint, for Python (the server's media front end).

use std::path::PathBuf;

use pyo3::prelude::*;

use super::tensor_arg;
use crate::engine::parse_dtype;
use crate::tensor::{Tensor, no_grad};

/// The media towers of one checkpoint (see gemma_engine.pyi): images and audio to soft tokens.
///
/// Only the thread that built it may call it (PyO3 checks; another thread gets PanicException).
#[pyclass(unsendable, module = "gemma_engine")]
pub struct Encoder {
    inner: crate::gemma4::media::Encoder,
}

#[pymethods]
impl Encoder {
    /// Load the towers `model_dir`'s config.json declares (none for a text-only checkpoint).
    ///
    /// Raises:
    ///     ValueError: a bad tower config or a missing or misshapen tower tensor (named). OSError: an
    ///         unreadable file.
    #[new]
    #[pyo3(signature = (model_dir, like=None, dtype="bfloat16"))]
    fn new(py: Python<'_>, model_dir: PathBuf, like: Option<&Bound<'_, PyAny>>, dtype: &str) -> PyResult<Encoder> {
        let dtype = parse_dtype(dtype)?;
        let like = match like {
            Some(t) => tensor_arg(t, "like")?,
            None => Tensor::from_i64(&[0])?,
        };
        let inner = py.detach(|| no_grad(|| crate::gemma4::media::Encoder::load(&model_dir, like, dtype)))?;
        Ok(Encoder { inner })
    }

    /// The inputs this checkpoint takes besides text: a subset of ["image", "audio"].
    #[getter]
    fn modalities(&self) -> Vec<&'static str> {
        self.inner.modalities()
    }

    /// The text model's hidden size: the width of every soft token.
    #[getter]
    fn hidden_size(&self) -> i64 {
        self.inner.text_hidden
    }

    #[getter]
    fn image_token_id(&self) -> i64 {
        self.inner.cfg.ids.image
    }

    #[getter]
    fn audio_token_id(&self) -> i64 {
        self.inner.cfg.ids.audio
    }

    #[getter]
    fn boi_token_id(&self) -> i64 {
        self.inner.cfg.ids.boi
    }

    #[getter]
    fn eoi_token_id(&self) -> i64 {
        self.inner.cfg.ids.eoi
    }

    #[getter]
    fn boa_token_id(&self) -> i64 {
        self.inner.cfg.ids.boa
    }

    #[getter]
    fn eoa_token_id(&self) -> i64 {
        self.inner.cfg.ids.eoa
    }

    /// Soft tokens of images (see gemma_engine.pyi): one `[soft_i, hidden_size]` tensor per image.
    ///
    /// Raises:
    ///     ValueError: no vision tower, or inputs of the wrong shape (named).
    fn image<'py>(
        &mut self,
        py: Python<'py>,
        pixel_values: &Bound<'py, PyAny>,
        position_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let (pixels, positions) =
            (tensor_arg(pixel_values, "pixel_values")?, tensor_arg(position_ids, "position_ids")?);
        let inner = &mut self.inner;
        let out = py.detach(move || no_grad(|| inner.image(&pixels, &positions)))?;
        out.iter().map(|t| t.to_python(py)).collect()
    }

    /// Soft tokens of audio clips (see gemma_engine.pyi): one `[soft_i, hidden_size]` tensor per clip.
    ///
    /// Raises:
    ///     ValueError: no audio tower, or inputs of the wrong shape (named).
    fn audio<'py>(
        &mut self,
        py: Python<'py>,
        features: &Bound<'py, PyAny>,
        mask: &Bound<'py, PyAny>,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let (features, mask) = (tensor_arg(features, "features")?, tensor_arg(mask, "mask")?);
        let inner = &mut self.inner;
        let out = py.detach(move || no_grad(|| inner.audio(&features, &mask)))?;
        out.iter().map(|t| t.to_python(py)).collect()
    }
}
