//! `Tensor`: an owned `at::Tensor` handle with tch-like method names, freed in `Drop`.
//!
//! Every method is one shim call through `ffi!`, so each failure carries the ATen op name.
//! Design from tch-rs `src/wrappers/tensor.rs`, cut to what the model uses. Only this module and
//! `ffi` contain `unsafe`. Nothing here names a device: new tensors follow a `like` tensor.

use std::ffi::c_void;
use std::ptr::NonNull;

use pyo3::prelude::*;

use crate::error::{Error, Result};
use crate::ffi::{self, CTensor, ffi, ffi_handle};

/// c10::ScalarType codes for the dtypes the engine uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum DType {
    U8 = 0,
    I8 = 1,
    I32 = 3,
    I64 = 4,
    F16 = 5,
    F32 = 6,
    Bool = 11,
    BF16 = 15,
}

impl DType {
    const ALL: [DType; 8] =
        [DType::U8, DType::I8, DType::I32, DType::I64, DType::F16, DType::F32, DType::Bool, DType::BF16];

    /// Bytes per element.
    pub fn size(self) -> i64 {
        match self {
            DType::U8 | DType::I8 | DType::Bool => 1,
            DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 => 8,
        }
    }

    /// The dtype names of `torch` ("float32", "bfloat16", ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::F16 => "float16",
            DType::F32 => "float32",
            DType::Bool => "bool",
            DType::BF16 => "bfloat16",
        }
    }
}

pub struct Tensor(NonNull<CTensor>);

// SAFETY: an at::Tensor is a reference-counted handle with atomic counts; moving the handle to
// another thread is allowed by ATen. The engine is `unsendable`, so this only lets the work
// run on the same OS thread with the GIL released (`py.detach` needs `Send`).
unsafe impl Send for Tensor {}

impl Drop for Tensor {
    fn drop(&mut self) {
        // SAFETY: we own the handle; it is freed exactly once.
        unsafe { ffi::aten_free(self.0.as_ptr()) }
    }
}

/// Wrap a handle returned by a shim call, after `ffi!` has checked the error.
fn wrap(op: &'static str, r: Result<*mut CTensor>) -> Result<Tensor> {
    let p = r?;
    NonNull::new(p)
        .map(Tensor)
        .ok_or_else(|| Error::Internal(format!("{op}: the shim returned no tensor and no error")))
}

/// Check an `int` status returned by an in-place shim call.
fn status(r: Result<i32>) -> Result<()> {
    r.map(|_| ())
}

macro_rules! unary {
    ($($name:ident => $c:ident),* $(,)?) => {$(
        pub fn $name(&self) -> Result<Tensor> {
            wrap(stringify!($name), ffi!(stringify!($name), ffi::$c(self.ptr())))
        }
    )*};
}

macro_rules! binary {
    ($($name:ident => $c:ident),* $(,)?) => {$(
        pub fn $name(&self, other: &Tensor) -> Result<Tensor> {
            wrap(stringify!($name), ffi!(stringify!($name), ffi::$c(self.ptr(), other.ptr())))
        }
    )*};
}

macro_rules! scalar {
    ($($name:ident => $c:ident),* $(,)?) => {$(
        pub fn $name(&self, v: f64) -> Result<Tensor> {
            wrap(stringify!($name), ffi!(stringify!($name), ffi::$c(self.ptr(), v)))
        }
    )*};
}

impl Tensor {
    fn ptr(&self) -> *mut CTensor {
        self.0.as_ptr()
    }

    /// A host (CPU) tensor holding a copy of `data`, interpreted as `dtype` with `shape`.
    pub fn from_bytes(data: &[u8], shape: &[i64], dtype: DType) -> Result<Tensor> {
        wrap(
            "from_bytes",
            ffi!(
                "from_bytes",
                ffi::aten_from_bytes(
                    data.as_ptr() as *const c_void,
                    data.len(),
                    shape.as_ptr(),
                    shape.len(),
                    dtype as i32
                )
            ),
        )
    }

    /// Host tensor from i64 values (token ids, slot tables).
    pub fn from_i64(values: &[i64]) -> Result<Tensor> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
        Tensor::from_bytes(&bytes, &[values.len() as i64], DType::I64)
    }

    /// Host tensor from f32 values.
    pub fn from_f32(values: &[f32], shape: &[i64]) -> Result<Tensor> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
        Tensor::from_bytes(&bytes, shape, DType::F32)
    }

    /// A Python `torch.Tensor` as a handle on the same storage.
    pub fn from_python(obj: &Bound<'_, PyAny>) -> Result<Tensor> {
        wrap("from_python", ffi_handle!("from_python", ffi::aten_from_python(obj.as_ptr())))
    }

    /// A `torch.Tensor` on the same storage as `self`.
    pub fn to_python<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let p = ffi_handle!("to_python", ffi::aten_to_python(self.ptr())).map_err(PyErr::from)?;
        // SAFETY: THPVariable_Wrap returns a new reference or NULL (with the error in our shim).
        unsafe { Bound::from_owned_ptr_or_err(py, p) }
    }

    /// Another handle on the same tensor (shares storage).
    pub fn shallow_clone(&self) -> Result<Tensor> {
        wrap("shallow_clone", ffi_handle!("shallow_clone", ffi::aten_shallow_clone(self.ptr())))
    }

    /// Swap the memory of this tensor's storage and `src`'s (aten_ops.h `aten_adopt_storage_`), with no copy.
    pub fn adopt_storage_(&self, src: &Tensor) -> Result<()> {
        status(ffi!("adopt_storage_", ffi::aten_adopt_storage_(self.ptr(), src.ptr())))
    }

    pub fn dim(&self) -> usize {
        ffi_handle!("dim", ffi::aten_dim(self.ptr())).unwrap_or(0) as usize
    }

    pub fn size(&self) -> Result<Vec<i64>> {
        let mut out = vec![0i64; self.dim()];
        status(ffi_handle!("size", ffi::aten_shape(self.ptr(), out.as_mut_ptr(), out.len())))?;
        Ok(out)
    }

    pub fn numel(&self) -> Result<i64> {
        Ok(self.size()?.iter().product())
    }

    /// The device as ATen prints it ("cpu", "cuda:0", ...).
    pub fn device(&self) -> Result<String> {
        let mut buf = [0u8; 128];
        let n = ffi_handle!("device", ffi::aten_device(self.ptr(), buf.as_mut_ptr() as *mut _, buf.len()))?;
        Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
    }

    /// A copy on `like`'s device with `dtype` (always a copy, never an alias).
    pub fn to_like(&self, like: &Tensor, dtype: DType) -> Result<Tensor> {
        wrap("to", ffi!("to", ffi::aten_to(self.ptr(), like.ptr(), dtype as i32)))
    }

    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        wrap("to_dtype", ffi!("to_dtype", ffi::aten_to_dtype(self.ptr(), dtype as i32)))
    }

    /// `full(shape, value)` on `like`'s device.
    pub fn full(shape: &[i64], value: f64, dtype: DType, like: &Tensor) -> Result<Tensor> {
        wrap("full", ffi!("full", ffi::aten_full(shape.as_ptr(), shape.len(), value, dtype as i32, like.ptr())))
    }

    /// `arange(start, end)` on `like`'s device.
    pub fn arange(start: i64, end: i64, dtype: DType, like: &Tensor) -> Result<Tensor> {
        wrap("arange", ffi!("arange", ffi::aten_arange(start, end, dtype as i32, like.ptr())))
    }

    pub fn reshape(&self, shape: &[i64]) -> Result<Tensor> {
        wrap("reshape", ffi!("reshape", ffi::aten_reshape(self.ptr(), shape.as_ptr(), shape.len())))
    }

    pub fn transpose(&self, d0: i64, d1: i64) -> Result<Tensor> {
        wrap("transpose", ffi!("transpose", ffi::aten_transpose(self.ptr(), d0, d1)))
    }

    pub fn unsqueeze(&self, d: i64) -> Result<Tensor> {
        wrap("unsqueeze", ffi!("unsqueeze", ffi::aten_unsqueeze(self.ptr(), d)))
    }

    pub fn narrow(&self, dim: i64, start: i64, len: i64) -> Result<Tensor> {
        wrap("narrow", ffi!("narrow", ffi::aten_narrow(self.ptr(), dim, start, len)))
    }

    pub fn cat(ts: &[&Tensor], dim: i64) -> Result<Tensor> {
        let ptrs: Vec<*mut CTensor> = ts.iter().map(|t| t.ptr()).collect();
        wrap("cat", ffi!("cat", ffi::aten_cat(ptrs.as_ptr(), ptrs.len(), dim)))
    }

    pub fn index_select(&self, dim: i64, index: &Tensor) -> Result<Tensor> {
        wrap("index_select", ffi!("index_select", ffi::aten_index_select(self.ptr(), dim, index.ptr())))
    }

    unary! {
        sum => aten_sum,
        gelu_tanh => aten_gelu_tanh,
        tanh => aten_tanh,
        cos => aten_cos,
        sin => aten_sin,
        relu => aten_relu,
        sigmoid => aten_sigmoid,
        silu => aten_silu,
        softplus => aten_softplus,
    }

    binary! {
        linear => aten_linear,
        matmul => aten_matmul,
        add => aten_add,
        sub => aten_sub,
        mul => aten_mul,
        div => aten_div,
        lt => aten_lt,
        logical_or => aten_logical_or,
        bitwise_xor => aten_bitwise_xor,
        le => aten_le,
        eq => aten_eq,
        gt => aten_gt,
        logical_and => aten_logical_and,
    }

    scalar! {
        mul_scalar => aten_mul_scalar,
        div_scalar => aten_div_scalar,
        gt_scalar => aten_gt_scalar,
        lt_scalar => aten_lt_scalar,
    }

    /// The dims reordered (`Tensor.permute`, a view).
    pub fn permute(&self, dims: &[i64]) -> Result<Tensor> {
        wrap("permute", ffi!("permute", ffi::aten_permute(self.ptr(), dims.as_ptr(), dims.len())))
    }

    /// `before` and `after` entries of `value` added along `dim`.
    pub fn pad_dim(&self, dim: i64, before: i64, after: i64, value: f64) -> Result<Tensor> {
        wrap("pad", ffi!("pad", ffi::aten_pad_dim(self.ptr(), dim, before, after, value)))
    }

    /// `value` where `mask` (bool, broadcast) is true.
    pub fn masked_fill(&self, mask: &Tensor, value: f64) -> Result<Tensor> {
        wrap("masked_fill", ffi!("masked_fill", ffi::aten_masked_fill(self.ptr(), mask.ptr(), value)))
    }

    /// A copy whose entries `index` along `dim` are `src`'s.
    pub fn index_copy(&self, dim: i64, index: &Tensor, src: &Tensor) -> Result<Tensor> {
        wrap("index_copy", ffi!("index_copy", ffi::aten_index_copy(self.ptr(), dim, index.ptr(), src.ptr())))
    }

    /// Whether each entry is one of `values`' (`torch.isin`).
    pub fn isin(&self, values: &Tensor) -> Result<Tensor> {
        wrap("isin", ffi!("isin", ffi::aten_isin(self.ptr(), values.ptr())))
    }

    /// Layer norm over the last dim, no bias.
    pub fn layer_norm(&self, weight: Option<&Tensor>, eps: f64) -> Result<Tensor> {
        let w = weight.map_or(std::ptr::null_mut(), |w| w.ptr());
        wrap("layer_norm", ffi!("layer_norm", ffi::aten_layer_norm(self.ptr(), w, eps)))
    }

    /// 2-d convolution of `[N, C, H, W]` by `w` `[out, C, k, k]`, no bias.
    pub fn conv2d(&self, w: &Tensor, stride: i64, padding: i64) -> Result<Tensor> {
        wrap("conv2d", ffi!("conv2d", ffi::aten_conv2d(self.ptr(), w.ptr(), stride, padding)))
    }

    /// 1-d convolution of `[N, C, L]` by `w` `[out, C / groups, k]`, no bias.
    pub fn conv1d(&self, w: &Tensor, stride: i64, padding: i64, groups: i64) -> Result<Tensor> {
        wrap("conv1d", ffi!("conv1d", ffi::aten_conv1d(self.ptr(), w.ptr(), stride, padding, groups)))
    }

    /// `self * v` for an integer tensor (stays integer; int64 wraps on overflow).
    pub fn mul_int(&self, v: i64) -> Result<Tensor> {
        wrap("mul_int", ffi!("mul_int", ffi::aten_mul_int(self.ptr(), v)))
    }

    /// `self + v` for an integer tensor.
    pub fn add_int(&self, v: i64) -> Result<Tensor> {
        wrap("add_int", ffi!("add_int", ffi::aten_add_int(self.ptr(), v)))
    }

    pub fn clamp(&self, lo: f64, hi: f64) -> Result<Tensor> {
        wrap("clamp", ffi!("clamp", ffi::aten_clamp(self.ptr(), lo, hi)))
    }

    pub fn softmax(&self, dim: i64) -> Result<Tensor> {
        wrap("softmax", ffi!("softmax", ffi::aten_softmax(self.ptr(), dim)))
    }

    pub fn log_softmax(&self, dim: i64) -> Result<Tensor> {
        wrap("log_softmax", ffi!("log_softmax", ffi::aten_log_softmax(self.ptr(), dim)))
    }

    pub fn cumsum(&self, dim: i64) -> Result<Tensor> {
        wrap("cumsum", ffi!("cumsum", ffi::aten_cumsum(self.ptr(), dim)))
    }

    /// Sum over `dim`, which is dropped.
    pub fn sum_dim(&self, dim: i64) -> Result<Tensor> {
        wrap("sum_dim", ffi!("sum_dim", ffi::aten_sum_dim(self.ptr(), dim)))
    }

    /// Integer division by `v`, rounding down.
    pub fn floor_div_int(&self, v: i64) -> Result<Tensor> {
        wrap("floor_divide", ffi!("floor_divide", ffi::aten_floor_divide_int(self.ptr(), v)))
    }

    /// `bins` equal bins over `[lo, hi]` of a floating tensor's values: counts, in its dtype.
    pub fn histc(&self, bins: i64, lo: f64, hi: f64) -> Result<Tensor> {
        wrap("histc", ffi!("histc", ffi::aten_histc(self.ptr(), bins, lo, hi)))
    }

    /// `self` `[S, in]` in groups ending at `offs` (int32, cumulative), group `g` times `b[g]`
    /// (`[G, in, out]`): `[S, out]`, one call for every group.
    pub fn grouped_mm(&self, b: &Tensor, offs: &Tensor) -> Result<Tensor> {
        wrap("grouped_mm", ffi!("grouped_mm", ffi::aten_grouped_mm(self.ptr(), b.ptr(), offs.ptr())))
    }

    pub fn gather(&self, dim: i64, index: &Tensor) -> Result<Tensor> {
        wrap("gather", ffi!("gather", ffi::aten_gather(self.ptr(), dim, index.ptr())))
    }

    /// `self + alpha * other`.
    pub fn add_alpha(&self, other: &Tensor, alpha: f64) -> Result<Tensor> {
        wrap("add", ffi!("add", ffi::aten_add_alpha(self.ptr(), other.ptr(), alpha)))
    }

    /// `self + b * c`.
    pub fn addcmul(&self, b: &Tensor, c: &Tensor) -> Result<Tensor> {
        wrap("addcmul", ffi!("addcmul", ffi::aten_addcmul(self.ptr(), b.ptr(), c.ptr())))
    }

    /// Whether this torch has oneDNN (`onednn_pack`, `onednn_linear`).
    pub fn has_onednn() -> bool {
        // SAFETY: takes nothing, touches nothing.
        unsafe { ffi::aten_has_onednn() == 1 }
    }

    /// Whether this torch's oneDNN computes in bfloat16 on this CPU (`mkldnn::_is_mkldnn_bf16_supported`).
    pub fn has_onednn_bf16() -> bool {
        // SAFETY: takes nothing; reads the CPU's features.
        unsafe { ffi::aten_has_onednn_bf16() == 1 }
    }

    /// `self` (`[rows, n]`) followed by `extra` rows of zeros.
    pub fn pad_rows(&self, extra: i64) -> Result<Tensor> {
        wrap("pad_rows", ffi!("pad_rows", ffi::aten_pad_rows(self.ptr(), extra)))
    }

    /// A float32 or bfloat16 `[out, in]` weight in oneDNN's packed layout, for `onednn_linear` (CPU).
    pub fn onednn_pack(&self) -> Result<Tensor> {
        wrap("onednn_pack", ffi!("onednn_pack", ffi::aten_onednn_pack(self.ptr())))
    }

    /// `self @ w.T` for a weight packed by `onednn_pack`.
    pub fn onednn_linear(&self, packed: &Tensor) -> Result<Tensor> {
        wrap("onednn_linear", ffi!("onednn_linear", ffi::aten_onednn_linear(self.ptr(), packed.ptr())))
    }

    /// `out = self @ w.T`, written into `out` (same shape and dtype).
    pub fn linear_into(&self, w: &Tensor, out: &Tensor) -> Result<()> {
        status(ffi!("linear_out", ffi::aten_linear_out(out.ptr(), self.ptr(), w.ptr())))
    }

    /// `out = self * b`, written into `out`.
    pub fn mul_into(&self, b: &Tensor, out: &Tensor) -> Result<()> {
        status(ffi!("mul_out", ffi::aten_mul_out(out.ptr(), self.ptr(), b.ptr())))
    }

    /// `out = self + b * c`, written into `out`.
    pub fn addcmul_into(&self, b: &Tensor, c: &Tensor, out: &Tensor) -> Result<()> {
        status(ffi!("addcmul_out", ffi::aten_addcmul_out(out.ptr(), self.ptr(), b.ptr(), c.ptr())))
    }

    pub fn roll(&self, shift: i64, dim: i64) -> Result<Tensor> {
        wrap("roll", ffi!("roll", ffi::aten_roll(self.ptr(), shift, dim)))
    }

    /// Views of consecutive pieces of `sizes` along `dim`, in one call.
    pub fn split(&self, sizes: &[i64], dim: i64) -> Result<Vec<Tensor>> {
        let mut out = vec![std::ptr::null_mut(); sizes.len()];
        status(ffi!(
            "split_with_sizes",
            ffi::aten_split(self.ptr(), sizes.as_ptr(), sizes.len(), dim, out.as_mut_ptr())
        ))?;
        out.into_iter().map(|p| wrap("split_with_sizes", Ok(p))).collect()
    }

    /// `split` into exactly `N` parts.
    pub fn split_array<const N: usize>(&self, sizes: &[i64; N], dim: i64) -> Result<[Tensor; N]> {
        <[Tensor; N]>::try_from(self.split(sizes, dim)?)
            .map_err(|_| crate::error::Error::Internal("split gave the wrong number of parts".into()))
    }

    /// `self.select(dim, i)` for every i, in one call.
    pub fn unbind(&self, dim: i64) -> Result<Vec<Tensor>> {
        let n = self.size()?[dim as usize] as usize;
        let mut out = vec![std::ptr::null_mut(); n];
        status(ffi!("unbind", ffi::aten_unbind(self.ptr(), dim, out.as_mut_ptr(), n)))?;
        out.into_iter().map(|p| wrap("unbind", Ok(p))).collect()
    }

    /// ATen's packed int4 layout of `self` (int32 values 0..15, `[out, in]`, on the host) for
    /// `like`'s device.
    pub fn int4_pack(&self, inner_k_tiles: i64, like: &Tensor) -> Result<Tensor> {
        wrap("int4_pack", ffi!("int4_pack", ffi::aten_int4_pack(self.ptr(), inner_k_tiles, like.ptr())))
    }

    /// `self @ dequant(packed).T` by ATen's int4 matmul (`self` bfloat16 `[rows, in]`).
    pub fn int4_mm(&self, packed: &Tensor, group: i64, scales_zeros: &Tensor) -> Result<Tensor> {
        wrap("int4_mm", ffi!("int4_mm", ffi::aten_int4_mm(self.ptr(), packed.ptr(), group, scales_zeros.ptr())))
    }

    /// The element type (None for a type the engine does not use).
    pub fn kind(&self) -> Result<Option<DType>> {
        let code = ffi_handle!("scalar_type", ffi::aten_scalar_type(self.ptr()))?;
        Ok(DType::ALL.into_iter().find(|d| *d as i32 == code))
    }

    /// `self` in `dtype`: the same handle when it already is (no ATen call), else a converted copy.
    pub fn as_dtype(&self, dtype: DType) -> Result<Tensor> {
        if self.kind()? == Some(dtype) { self.shallow_clone() } else { self.to_dtype(dtype) }
    }

    /// A copy with its own storage.
    pub fn copy(&self) -> Result<Tensor> {
        wrap("clone", ffi!("clone", ffi::aten_clone(self.ptr())))
    }

    /// Bytes of the elements (not a copy; views count their whole shape).
    pub fn nbytes(&self) -> Result<i64> {
        ffi_handle!("nbytes", ffi::aten_nbytes(self.ptr()))
    }

    /// Stable sort along the last dim: (values, int64 indices).
    pub fn sort(&self, descending: bool) -> Result<(Tensor, Tensor)> {
        self.pair("sort", |v, i| ffi!("sort", ffi::aten_sort(self.ptr(), descending as i32, v, i)))
    }

    /// The `k` largest along the last dim, largest first: (values, int64 indices).
    pub fn topk(&self, k: i64) -> Result<(Tensor, Tensor)> {
        self.pair("topk", |v, i| ffi!("topk", ffi::aten_topk(self.ptr(), k, v, i)))
    }

    fn pair(
        &self,
        op: &'static str,
        call: impl FnOnce(*mut *mut CTensor, *mut *mut CTensor) -> Result<i32>,
    ) -> Result<(Tensor, Tensor)> {
        let (mut v, mut i) = (std::ptr::null_mut(), std::ptr::null_mut());
        status(call(&mut v, &mut i))?;
        Ok((wrap(op, Ok(v))?, wrap(op, Ok(i))?))
    }

    /// For each row of `self` (sorted ascending), the index of the first entry > that row's `values`.
    pub fn searchsorted_right(&self, values: &Tensor) -> Result<Tensor> {
        wrap("searchsorted", ffi!("searchsorted", ffi::aten_searchsorted_right(self.ptr(), values.ptr())))
    }

    /// `cond ? a : b`, elementwise with broadcasting.
    pub fn where_(cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        wrap("where", ffi!("where", ffi::aten_where(cond.ptr(), a.ptr(), b.ptr())))
    }

    /// `cond ? a : b` for an integer tensor `a` and an integer `b`.
    pub fn where_int(cond: &Tensor, a: &Tensor, b: i64) -> Result<Tensor> {
        wrap("where", ffi!("where", ffi::aten_where_int(cond.ptr(), a.ptr(), b)))
    }

    /// Logical (unsigned) right shift of int64 values.
    pub fn shift_right_logical(&self, bits: i64) -> Result<Tensor> {
        wrap("shift_right", ffi!("shift_right", ffi::aten_shift_right_logical(self.ptr(), bits)))
    }

    /// `self[indices] = values` in place; a `None` index is a full slice (`t[rows, :, slots]`).
    pub fn index_put_(&self, indices: &[Option<&Tensor>], values: &Tensor) -> Result<()> {
        let ptrs: Vec<*mut CTensor> = indices.iter().map(|t| t.map_or(std::ptr::null_mut(), |t| t.ptr())).collect();
        status(ffi!("index_put_", ffi::aten_index_put_(self.ptr(), ptrs.as_ptr(), ptrs.len(), values.ptr())))
    }

    /// `self[indices]`, a copy; a `None` index is a full slice, as in `index_put_`.
    pub fn index(&self, indices: &[Option<&Tensor>]) -> Result<Tensor> {
        let ptrs: Vec<*mut CTensor> = indices.iter().map(|t| t.map_or(std::ptr::null_mut(), |t| t.ptr())).collect();
        wrap("index", ffi!("index", ffi::aten_index(self.ptr(), ptrs.as_ptr(), ptrs.len())))
    }

    /// Copy `src` into `self` in place (broadcasting, casting).
    pub fn copy_(&self, src: &Tensor) -> Result<()> {
        status(ffi!("copy_", ffi::aten_copy_(self.ptr(), src.ptr())))
    }

    pub fn scatter(&self, dim: i64, index: &Tensor, src: &Tensor) -> Result<Tensor> {
        wrap("scatter", ffi!("scatter", ffi::aten_scatter(self.ptr(), dim, index.ptr(), src.ptr())))
    }

    pub fn scatter_add_(&self, dim: i64, index: &Tensor, src: &Tensor) -> Result<()> {
        status(ffi!("scatter_add_", ffi::aten_scatter_add_(self.ptr(), dim, index.ptr(), src.ptr())))
    }

    pub fn remainder(&self, v: i64) -> Result<Tensor> {
        wrap("remainder", ffi!("remainder", ffi::aten_remainder_scalar(self.ptr(), v)))
    }

    /// `at::rms_norm` over the last dim, with an optional weight (one fused kernel where the
    /// backend has one).
    pub fn rms_norm(&self, weight: Option<&Tensor>, eps: f64) -> Result<Tensor> {
        let w = weight.map_or(std::ptr::null_mut(), |w| w.ptr());
        wrap("rms_norm", ffi!("rms_norm", ffi::aten_rms_norm(self.ptr(), w, eps)))
    }

    /// The sum of this tensor over the ranks of torch.distributed's process group `group` (its
    /// `group_name`), as a dispatcher op a capture records (aten.cpp).
    pub fn all_reduce_sum(&self, group: &str) -> Result<Tensor> {
        let group = group_name(group)?;
        wrap("all_reduce", ffi!("all_reduce", ffi::aten_all_reduce_sum(self.ptr(), group.as_ptr())))
    }

    /// The `size` ranks' tensors of torch.distributed's process group `group`, side by side along the last
    /// dimension in rank order (a vocabulary-parallel head's logits), as dispatcher ops a capture records.
    pub fn all_gather_last(&self, size: i64, group: &str) -> Result<Tensor> {
        let group = group_name(group)?;
        wrap("all_gather", ffi!("all_gather", ffi::aten_all_gather_last(self.ptr(), size, group.as_ptr())))
    }

    pub fn argmax(&self, dim: i64, keepdim: bool) -> Result<Tensor> {
        wrap("argmax", ffi!("argmax", ffi::aten_argmax(self.ptr(), dim, keepdim as i32)))
    }

    /// `scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)`.
    pub fn sdpa(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, scale: f64) -> Result<Tensor> {
        wrap(
            "scaled_dot_product_attention",
            ffi!("scaled_dot_product_attention", ffi::aten_sdpa(q.ptr(), k.ptr(), v.ptr(), mask.ptr(), scale)),
        )
    }

    /// The single value of a one-element tensor, as f64 (a host sync).
    pub fn item_f64(&self) -> Result<f64> {
        ffi!("item", ffi::aten_item_double(self.ptr()))
    }

    /// Copy an int64 tensor to the host (a host sync).
    pub fn to_vec_i64(&self) -> Result<Vec<i64>> {
        let n = self.numel()? as usize;
        let mut out = vec![0i64; n];
        let t = self.as_dtype(DType::I64)?;
        status(ffi!("copy_to_host", ffi::aten_copy_to_host(t.ptr(), out.as_mut_ptr() as *mut c_void, n * 8)))?;
        Ok(out)
    }

    /// Overwrite `self` (contiguous, `data.len()` bytes, on any device) with `data`: one copy.
    pub fn write_bytes_(&self, data: &[u8]) -> Result<()> {
        status(ffi!("write_bytes_", ffi::aten_write_bytes_(self.ptr(), data.as_ptr() as *const c_void, data.len())))
    }

    /// Copy a tensor to the host as f32 values (a host sync).
    pub fn to_vec_f32(&self) -> Result<Vec<f32>> {
        let n = self.numel()? as usize;
        let mut out = vec![0f32; n];
        let t = self.as_dtype(DType::F32)?;
        status(ffi!("copy_to_host", ffi::aten_copy_to_host(t.ptr(), out.as_mut_ptr() as *mut c_void, n * 4)))?;
        Ok(out)
    }

    pub fn fill_(&self, v: f64) -> Result<()> {
        status(ffi!("fill_", ffi::aten_fill_(self.ptr(), v)))
    }

    /// Fill with an integer, exactly: an int64 seed must not pass through a double on its way.
    pub fn fill_int_(&self, v: i64) -> Result<()> {
        status(ffi!("fill_", ffi::aten_fill_int_(self.ptr(), v)))
    }

    pub fn add_scalar_(&self, v: f64) -> Result<()> {
        status(ffi!("add_", ffi::aten_add_scalar_(self.ptr(), v)))
    }

    /// `self += other` in place (broadcasting; a bool `other` adds 0 or 1).
    pub fn add_(&self, other: &Tensor) -> Result<()> {
        status(ffi!("add_", ffi::aten_add_(self.ptr(), other.ptr())))
    }

    /// In-place add of an integer (for int64 position counters).
    pub fn add_int_(&self, v: i64) -> Result<()> {
        status(ffi!("add_", ffi::aten_add_int_(self.ptr(), v)))
    }
}

/// A CUDA graph of one fixed-shape piece of work (`CudaGraph::capture`), replayed with one call.
pub struct CudaGraph(NonNull<ffi::CGraph>);

// SAFETY: as for `Tensor`: the engine is `unsendable`; this only lets the handle move with it.
unsafe impl Send for CudaGraph {}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        // SAFETY: we own the graph; it is freed exactly once.
        unsafe { ffi::aten_graph_free(self.0.as_ptr()) }
    }
}

impl CudaGraph {
    /// Whether this build can capture (the shim was built against a torch with CUDA).
    pub fn available() -> bool {
        // SAFETY: takes nothing, touches nothing.
        unsafe { ffi::aten_cuda_graphs_built() == 1 }
    }

    /// Capture the device work of `f` on `like`'s CUDA device (nothing runs: `replay` runs it).
    /// Tensors `f` creates live in the graph's memory and hold its results after each replay, until
    /// the next replay of a graph that shares its memory (`share`: allocate from that graph's pool;
    /// safe for graphs that never run at the same time and whose outputs are copied out after each
    /// replay).
    pub fn capture<R>(
        like: &Tensor,
        share: Option<&CudaGraph>,
        f: impl FnOnce() -> Result<R>,
    ) -> Result<(CudaGraph, R)> {
        let share = share.map_or(std::ptr::null_mut(), |g| g.0.as_ptr());
        let g = ffi_handle!("graph_begin", ffi::aten_graph_begin(like.ptr(), share))?;
        let g = NonNull::new(g).map(CudaGraph).ok_or_else(|| Error::Internal("graph_begin returned nothing".into()))?;
        match f() {
            Ok(out) => {
                status(ffi_handle!("graph_end", ffi::aten_graph_end(g.0.as_ptr())))?;
                Ok((g, out))
            }
            Err(e) => {
                // SAFETY: a live graph whose capture is under way; abort ends it and reports nothing.
                unsafe { ffi::aten_graph_abort(g.0.as_ptr()) };
                Err(e)
            }
        }
    }

    /// Run the captured work once: one call, however many ATen calls it captured.
    pub fn replay(&self) -> Result<()> {
        status(ffi!("graph_replay", ffi::aten_graph_replay(self.0.as_ptr())))
    }
}

/// A process group's name as the shim takes it.
fn group_name(group: &str) -> Result<std::ffi::CString> {
    std::ffi::CString::new(group).map_err(|_| Error::Input(format!("a process group name holds a NUL: {group:?}")))
}

/// Autograd off for the guard's lifetime on this thread (`at::NoGradGuard`).
pub struct NoGrad(*mut c_void);

impl NoGrad {
    pub fn new() -> Result<NoGrad> {
        ffi_handle!("no_grad", ffi::aten_no_grad_enter()).map(NoGrad)
    }
}

impl Drop for NoGrad {
    fn drop(&mut self) {
        // SAFETY: the guard came from aten_no_grad_enter and is freed once, on the same thread.
        unsafe { ffi::aten_no_grad_exit(self.0) }
    }
}

/// Run `f` with autograd off.
pub fn no_grad<R>(f: impl FnOnce() -> Result<R>) -> Result<R> {
    let _g = NoGrad::new()?;
    f()
}
