//! The Rust half of the FFI fence: declarations of the C shim (aten.h) and the `ffi!` macro that
//! pairs every unsafe call with its error check (tch-rs `src/wrappers/utils.rs`, `unsafe_torch_err!`).
//!
//! Only this module and `tensor` contain `unsafe`.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};

use pyo3::ffi::PyObject;

/// An `at::Tensor*` owned by a `tensor::Tensor`.
#[repr(C)]
pub struct CTensor {
    _private: [u8; 0],
}

pub type T = *mut CTensor;

/// An `at::cuda::CUDAGraph` owned by a `tensor::CudaGraph`.
#[repr(C)]
pub struct CGraph {
    _private: [u8; 0],
}

unsafe extern "C" {
    pub fn aten_take_error() -> *const c_char;
    pub fn aten_no_grad_enter() -> *mut c_void;
    pub fn aten_no_grad_exit(guard: *mut c_void);

    pub fn aten_free(t: T);
    pub fn aten_from_python(obj: *mut PyObject) -> T;
    pub fn aten_to_python(t: T) -> *mut PyObject;
    pub fn aten_from_bytes(data: *const c_void, nbytes: usize, dims: *const i64, ndim: usize, dtype: c_int) -> T;
    pub fn aten_copy_to_host(t: T, dst: *mut c_void, nbytes: usize) -> c_int;
    pub fn aten_shallow_clone(t: T) -> T;

    pub fn aten_dim(t: T) -> i64;
    pub fn aten_shape(t: T, out: *mut i64, cap: usize) -> c_int;
    pub fn aten_device(t: T, buf: *mut c_char, cap: usize) -> usize;

    pub fn aten_to(t: T, like: T, dtype: c_int) -> T;
    pub fn aten_to_dtype(t: T, dtype: c_int) -> T;
    pub fn aten_full(dims: *const i64, ndim: usize, value: f64, dtype: c_int, like: T) -> T;
    pub fn aten_arange(start: i64, end: i64, dtype: c_int, like: T) -> T;

    pub fn aten_reshape(t: T, dims: *const i64, ndim: usize) -> T;
    pub fn aten_transpose(t: T, d0: i64, d1: i64) -> T;
    pub fn aten_unsqueeze(t: T, d: i64) -> T;
    pub fn aten_narrow(t: T, dim: i64, start: i64, len: i64) -> T;
    pub fn aten_cat(ts: *const T, n: usize, dim: i64) -> T;
    pub fn aten_index_select(t: T, dim: i64, index: T) -> T;

    pub fn aten_linear(x: T, w: T) -> T;
    pub fn aten_linear_out(out: T, x: T, w: T) -> c_int;
    pub fn aten_mul_out(out: T, a: T, b: T) -> c_int;
    pub fn aten_addcmul_out(out: T, a: T, b: T, c: T) -> c_int;
    pub fn aten_matmul(a: T, b: T) -> T;
    pub fn aten_add(a: T, b: T) -> T;
    pub fn aten_mul(a: T, b: T) -> T;
    pub fn aten_mul_scalar(a: T, v: f64) -> T;
    pub fn aten_div_scalar(a: T, v: f64) -> T;
    pub fn aten_remainder_scalar(a: T, v: i64) -> T;
    pub fn aten_sum(a: T) -> T;
    pub fn aten_item_double(a: T) -> f64;
    pub fn aten_gelu_tanh(a: T) -> T;
    pub fn aten_tanh(a: T) -> T;
    pub fn aten_cos(a: T) -> T;
    pub fn aten_sin(a: T) -> T;
    pub fn aten_rms_norm(x: T, weight: T, eps: f64) -> T;
    pub fn aten_argmax(a: T, dim: i64, keepdim: c_int) -> T;
    pub fn aten_sub(a: T, b: T) -> T;
    pub fn aten_div(a: T, b: T) -> T;
    pub fn aten_mul_int(a: T, v: i64) -> T;
    pub fn aten_add_int(a: T, v: i64) -> T;
    pub fn aten_clamp(a: T, lo: f64, hi: f64) -> T;
    pub fn aten_softmax(a: T, dim: i64) -> T;
    pub fn aten_log_softmax(a: T, dim: i64) -> T;
    pub fn aten_cumsum(a: T, dim: i64) -> T;
    pub fn aten_gather(t: T, dim: i64, index: T) -> T;
    pub fn aten_add_alpha(a: T, b: T, alpha: f64) -> T;
    pub fn aten_add_(a: T, b: T) -> c_int;
    pub fn aten_addcmul(a: T, b: T, c: T) -> T;
    pub fn aten_roll(a: T, shift: i64, dim: i64) -> T;
    pub fn aten_split(t: T, sizes: *const i64, n: usize, dim: i64, out: *mut T) -> c_int;
    pub fn aten_unbind(t: T, dim: i64, out: *mut T, n: usize) -> c_int;
    pub fn aten_int4_pack(w: T, inner_k_tiles: i64, like: T) -> T;
    pub fn aten_int4_mm(x: T, packed: T, group: i64, scales_zeros: T) -> T;
    pub fn aten_has_onednn() -> c_int;
    pub fn aten_pad_rows(x: T, extra: i64) -> T;
    pub fn aten_onednn_pack(w: T) -> T;
    pub fn aten_onednn_linear(x: T, packed: T) -> T;
    pub fn aten_nbytes(t: T) -> i64;
    pub fn aten_graph_begin(like: T, share: *mut CGraph) -> *mut CGraph;
    pub fn aten_graph_end(g: *mut CGraph) -> c_int;
    pub fn aten_graph_abort(g: *mut CGraph);
    pub fn aten_graph_replay(g: *mut CGraph) -> c_int;
    pub fn aten_graph_free(g: *mut CGraph);
    pub fn aten_cuda_graphs_built() -> c_int;
    pub fn aten_clone(t: T) -> T;
    pub fn aten_scalar_type(t: T) -> c_int;
    pub fn aten_sort(a: T, descending: c_int, values: *mut T, indices: *mut T) -> c_int;
    pub fn aten_topk(a: T, k: i64, values: *mut T, indices: *mut T) -> c_int;
    pub fn aten_searchsorted_right(sorted: T, values: T) -> T;
    pub fn aten_where(cond: T, a: T, b: T) -> T;
    pub fn aten_where_int(cond: T, a: T, b: i64) -> T;
    pub fn aten_bitwise_xor(a: T, b: T) -> T;
    pub fn aten_shift_right_logical(a: T, bits: i64) -> T;

    pub fn aten_le(a: T, b: T) -> T;
    pub fn aten_gt(a: T, b: T) -> T;
    pub fn aten_gt_scalar(a: T, v: f64) -> T;
    pub fn aten_lt_scalar(a: T, v: f64) -> T;
    pub fn aten_lt(a: T, b: T) -> T;
    pub fn aten_logical_or(a: T, b: T) -> T;
    pub fn aten_logical_and(a: T, b: T) -> T;
    pub fn aten_sdpa(q: T, k: T, v: T, mask: T, scale: f64) -> T;

    pub fn aten_index_put_(t: T, indices: *const T, n: usize, values: T) -> c_int;
    pub fn aten_copy_(dst: T, src: T) -> c_int;
    pub fn aten_scatter_add_(t: T, dim: i64, index: T, src: T) -> c_int;
    pub fn aten_scatter(t: T, dim: i64, index: T, src: T) -> T;
    pub fn aten_fill_(t: T, v: f64) -> c_int;
    pub fn aten_fill_int_(t: T, v: i64) -> c_int;
    pub fn aten_add_scalar_(t: T, v: f64) -> c_int;
    pub fn aten_add_int_(t: T, v: i64) -> c_int;
}

/// Map a checkpoint file read-only.
pub fn map_readonly(file: &std::fs::File) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: the map is undefined behaviour only if another process truncates or rewrites the
    // file while it is mapped; checkpoints are read-only inputs for the engine's lifetime.
    unsafe { memmap2::Mmap::map(file) }
}

/// The message the shim left for the last failed call on this thread, if any.
pub fn take_error() -> Option<String> {
    // SAFETY: the shim returns NULL or a NUL-terminated thread-local string that stays valid
    // until the next call to aten_take_error on this thread; we copy it out at once.
    unsafe {
        let p = aten_take_error();
        if p.is_null() { None } else { Some(CStr::from_ptr(p).to_string_lossy().into_owned()) }
    }
}

/// Shim calls that ran an ATen operator, on every thread, since the process started (`aten_calls`).
static ATEN_CALLS: AtomicU64 = AtomicU64::new(0);

/// Count one ATen operator call (the `ffi!` macro does this for every call it makes).
pub fn count_call() {
    ATEN_CALLS.fetch_add(1, Ordering::Relaxed);
}

/// ATen operator calls made through the shim so far: a device-independent measure of a step's
/// host-side work, since every call pays the device's fixed per-op cost (a kernel launch on CUDA,
/// a dispatch through torch_tpu on TPU). Handle copies and metadata reads (`ffi_handle!`) are not
/// counted: they reach no operator.
pub fn aten_calls() -> u64 {
    ATEN_CALLS.load(Ordering::Relaxed)
}

/// Run one shim call that runs an ATen operator: count it, and turn a pending shim error into
/// `Error::Torch { op, .. }`.
///
/// `ffi!("linear", aten_linear(x, w))` evaluates to `Result<returned value>`.
macro_rules! ffi {
    ($op:expr, $call:expr) => {{
        $crate::ffi::count_call();
        $crate::ffi::ffi_handle!($op, $call)
    }};
}
pub(crate) use ffi;

/// `ffi!` for shim calls that reach no ATen operator (handle copies, sizes, the device name, the
/// Python crossing): checked the same way, not counted.
macro_rules! ffi_handle {
    ($op:expr, $call:expr) => {{
        // SAFETY: every shim function takes live handles (borrowed from `Tensor`s that outlive
        // the call) and catches all C++ exceptions (aten.cpp PROTECT).
        #[allow(unused_unsafe)]
        let out = unsafe { $call };
        match $crate::ffi::take_error() {
            Some(msg) => Err($crate::error::Error::Torch { op: $op, msg }),
            None => Ok(out),
        }
    }};
}
pub(crate) use ffi_handle;
