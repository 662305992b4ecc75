// The C++ half of the FFI fence: each extern "C" body runs inside PROTECT, so a C++ exception
// becomes an error string for Rust and never unwinds across the ABI (tch-rs torch_api.cpp).
// See aten.h for the contract. Each function is declared once, in aten_ops.h (aten.h expands it with C
// linkage), so a body here whose signature differs from its line there does not compile.
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#ifdef GEMMA_CUDA_GRAPHS
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "aten.h"

struct gt {
  at::Tensor t;
};

// A captured CUDA graph and, while capturing, the side stream it captures on (capture cannot use
// the legacy default stream; PyTorch's torch/cuda/graphs.py `graph` does the same).
struct gg {
#ifdef GEMMA_CUDA_GRAPHS
  at::cuda::CUDAGraph graph;
  std::optional<c10::cuda::CUDAStreamGuard> stream;
#endif
};

namespace {

thread_local std::string pending_error;
thread_local std::string taken_error;
thread_local bool has_error = false;

void set_error(const char *msg) {
  pending_error = msg;
  has_error = true;
}

// ATen's messages carry a C++ backtrace after the first line in some builds; keep the
// message a caller can act on.
#define PROTECT(body)                                                     \
  try {                                                                   \
    body                                                                  \
  } catch (const c10::Error &e) {                                         \
    set_error(e.what_without_backtrace());                                \
  } catch (const std::exception &e) {                                     \
    set_error(e.what());                                                  \
  } catch (...) {                                                         \
    set_error("unknown C++ exception");                                   \
  }

#define RET(expr)                 \
  PROTECT(return box(expr);)      \
  return nullptr;

#define RET_INT(stmt)             \
  PROTECT(stmt; return 0;)        \
  return -1;

gt *box(at::Tensor t) { return new gt{std::move(t)}; }

at::IntArrayRef dims_of(const int64_t *dims, size_t ndim) { return at::IntArrayRef(dims, ndim); }

at::ScalarType st(int dtype) { return static_cast<at::ScalarType>(dtype); }

#ifdef GEMMA_CUDA_GRAPHS
gg *graph_begin(const at::Tensor &like, gg *share) {
  if (!like.device().is_cuda()) throw std::invalid_argument("CUDA graphs need a CUDA device, not " + like.device().str());
  c10::cuda::CUDAGuard device(like.device());
  // Work queued on the default stream must not land in the capture.
  c10::cuda::device_synchronize();
  auto g = std::make_unique<gg>();
  g->stream.emplace(c10::cuda::getStreamFromPool(false, like.device().index()));
  // Thread-local capture: engines on other threads (other devices) keep working meanwhile. With
  // `share`, the graph allocates from that graph's private memory pool (capture_begin's
  // pool=other_graph.pool()), so an engine's step graphs share one pool instead of holding one each.
  at::cuda::MempoolId_t pool = share ? share->graph.pool() : at::cuda::MempoolId_t{0, 0};
  g->graph.capture_begin(pool, cudaStreamCaptureModeThreadLocal);
  return g.release();
}
void graph_end(gg *g) {
  g->graph.capture_end();
  g->stream.reset();
}
void graph_abort(gg *g) {
  try { g->graph.capture_end(); } catch (...) {}
  g->stream.reset();
}
void graph_replay(gg *g) { g->graph.replay(); }
#else
[[noreturn]] void no_graphs() {
  throw std::runtime_error("this gemma_engine was built against a torch without CUDA: no CUDA graphs");
}
gg *graph_begin(const at::Tensor &, gg *) { no_graphs(); }
void graph_end(gg *) { no_graphs(); }
void graph_abort(gg *) {}
void graph_replay(gg *) { no_graphs(); }
#endif

}  // namespace

namespace {
// Gemma 4's RMSNorm (Transformers `Gemma4RMSNorm`): in float32, y = (x * (mean(x^2) + eps)^-0.5) * w,
// rounded once to x's dtype. On the CPU `at::rms_norm` is a composite of eight dispatched kernels
// (aten/src/ATen/native/layer_norm.cpp, `rms_norm_composite`), with a fixed cost of several us a call,
// and a decode step has several norms a layer. `rms_norm_cpu` is the same arithmetic in one pass over
// each row, for inputs of up to `kOnePassNormValues` values: past that the composite's vectorized
// kernels (this file is built for baseline x86-64) catch up, and in bfloat16 overtake it
// (`python -m bench.kernels` times the two at a decode step's shapes). The float32 squares are
// summed in double (on 16 lanes, which the compiler vectorizes), so the mean is the float32 sum's
// correctly rounded value or closer: in bfloat16 the norms then round to Transformers' own (a float32
// sum in another order moved enough of them to change a tiny test model's top-5). The root is
// 1 / sqrt in float32, as ATen computes pow(m, -0.5).
template <typename T>
double sum_of_squares(const T *x, int64_t d) {
  constexpr int64_t kLanes = 16;
  double lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) {
      const float v = static_cast<float>(x[i + j]);
      lanes[j] += static_cast<double>(v * v);
    }
  }
  for (int64_t j = 0; i < d; ++i, ++j) {
    const float v = static_cast<float>(x[i]);
    lanes[j] += static_cast<double>(v * v);
  }
  for (int64_t width = kLanes / 2; width > 0; width /= 2) {
    for (int64_t j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  }
  return lanes[0];
}

constexpr int64_t kOnePassNormValues = 4096;

template <typename T>
void rms_norm_rows(const T *x, const float *w, T *y, int64_t rows, int64_t d, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T *xr = x + r * d;
    T *yr = y + r * d;
    const float mean = static_cast<float>(sum_of_squares(xr, d) / static_cast<double>(d));
    const float inv = 1.0f / std::sqrt(mean + eps);
    if (w) {
      for (int64_t i = 0; i < d; ++i) yr[i] = static_cast<T>(static_cast<float>(xr[i]) * inv * w[i]);
    } else {
      for (int64_t i = 0; i < d; ++i) yr[i] = static_cast<T>(static_cast<float>(xr[i]) * inv);
    }
  }
}

at::Tensor rms_norm_cpu(const at::Tensor &x, const std::optional<at::Tensor> &weight, double eps) {
  const auto xc = x.contiguous();
  const int64_t d = xc.size(-1);
  const auto w = weight ? std::optional<at::Tensor>(weight->to(at::kFloat).contiguous()) : std::nullopt;
  TORCH_CHECK(!w || w->numel() == d, "a weight of ", w ? w->numel() : 0, " values for rows of ", d);
  auto y = at::empty_like(xc);
  if (xc.numel() == 0) return y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "rms_norm_rows", [&] {
    rms_norm_rows<scalar_t>(xc.const_data_ptr<scalar_t>(), w ? w->const_data_ptr<float>() : nullptr,
                            y.mutable_data_ptr<scalar_t>(), xc.numel() / d, d, static_cast<float>(eps));
  });
  return y;
}

// `rms_norm_cpu` as the dispatcher op `gemma::rms_norm`, so a dispatcher-level capture of a step (the compiled
// step, rust/python/gemma_engine/compiling.py) records the call that eager runs, with the same arithmetic, and
// a compiler calls it back as an extern kernel; its Meta kernel gives the output's shape to fake tensors.
// `gemma::grouped_mm` is `at::_grouped_mm` (aten_grouped_mm says why) with a Meta kernel that takes float32.
TORCH_LIBRARY(gemma, m) {
  m.def("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor");
  m.def("grouped_mm(Tensor a, Tensor b, Tensor offs) -> Tensor");
}
TORCH_LIBRARY_IMPL(gemma, CPU, m) {
  m.impl("rms_norm", rms_norm_cpu);
  m.impl("grouped_mm", [](const at::Tensor &a, const at::Tensor &b, const at::Tensor &offs) {
    return at::_grouped_mm(a, b, offs);
  });
}
TORCH_LIBRARY_IMPL(gemma, Meta, m) {
  m.impl("rms_norm", [](const at::Tensor &x, const std::optional<at::Tensor> &, double) {
    return at::empty_like(x, x.options().memory_format(at::MemoryFormat::Contiguous));
  });
  // [S, in] x [G, in, out] -> [S, out]
  m.impl("grouped_mm", [](const at::Tensor &a, const at::Tensor &b, const at::Tensor &) {
    return at::empty({a.size(0), b.size(2)}, a.options());
  });
}

at::Tensor one_pass_rms_norm(const at::Tensor &x, const std::optional<at::Tensor> &weight, double eps) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("gemma::rms_norm", "")
                             .typed<at::Tensor(const at::Tensor &, const std::optional<at::Tensor> &, double)>();
  return op.call(x, weight, eps);
}

// The query rows per sequence up to which 16-bit attention on the CPU runs `few_row_attention`.
constexpr int64_t kFewQueryRows = 16;

// softmax(q k^T * scale, masked) v for 16-bit q, k, v on the CPU with few query rows, in float32:
// ATen's CPU flash attention takes several times as long in bfloat16 (`python -m bench.kernels`).
// The same arithmetic as its float32-accumulating kernel
// (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp): products and softmax in float32, the output
// rounded once. q `[rows, heads, T, d]`, k and v `[rows, kv_heads, keys, d]` (query head h reads KV head
// h / (heads / kv_heads), as `enable_gqa`), mask bool `[rows or 1, 1, T, keys]`. A masked score is the
// lowest float, not -inf, so a query that sees no key (a padding row's) comes out finite.
at::Tensor few_row_attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &mask,
                             double scale) {
  const int64_t rows = q.size(0), heads = q.size(1), t = q.size(2), d = q.size(3);
  const int64_t kv_heads = k.size(1), keys = k.size(2), group = heads / kv_heads;
  // [rows, heads, T, d] -> [rows, kv_heads, group * T, d]: head h = kv * group + j.
  auto scores = at::matmul(q.reshape({rows, kv_heads, group * t, d}).to(at::kFloat), k.to(at::kFloat).transpose(-1, -2));
  if (scale != 1.0) scores.mul_(scale);
  scores.view({rows, kv_heads, group, t, keys})
      .masked_fill_(mask.unsqueeze(2).logical_not(), std::numeric_limits<float>::lowest());
  auto out = at::matmul(scores.softmax(-1), v.to(at::kFloat));
  return out.to(q.scalar_type()).view({rows, heads, t, v.size(3)});
}
}  // namespace

extern "C" {

gg *aten_graph_begin(gt *like, gg *share) {
  PROTECT(return graph_begin(like->t, share);)
  return nullptr;
}
int aten_graph_end(gg *g) { RET_INT(graph_end(g)) }
void aten_graph_abort(gg *g) { graph_abort(g); }
int aten_graph_replay(gg *g) { RET_INT(graph_replay(g)) }
void aten_graph_free(gg *g) { delete g; }
int aten_cuda_graphs_built(void) {
#ifdef GEMMA_CUDA_GRAPHS
  return 1;
#else
  return 0;
#endif
}
gt *aten_clone(gt *t) { RET(t->t.clone()) }


const char *aten_take_error(void) {
  if (!has_error) return nullptr;
  has_error = false;
  taken_error = std::move(pending_error);
  pending_error.clear();
  return taken_error.c_str();
}

void *aten_no_grad_enter(void) {
  PROTECT(return new at::NoGradGuard();)
  return nullptr;
}

void aten_no_grad_exit(void *guard) { delete static_cast<at::NoGradGuard *>(guard); }

void aten_free(gt *t) { delete t; }

gt *aten_from_python(PyObject *obj) {
  PROTECT(
      if (!THPVariable_Check(obj)) { throw std::invalid_argument("expected a torch.Tensor"); }
      return box(THPVariable_Unpack(obj));)
  return nullptr;
}

PyObject *aten_to_python(gt *t) {
  PROTECT(return THPVariable_Wrap(t->t);)
  return nullptr;
}

gt *aten_from_bytes(const void *data, size_t nbytes, const int64_t *dims, size_t ndim, int dtype) {
  PROTECT(
      at::Tensor out = at::empty(dims_of(dims, ndim), at::TensorOptions().dtype(st(dtype)));
      if (static_cast<size_t>(out.nbytes()) != nbytes) {
        throw std::invalid_argument("byte count " + std::to_string(nbytes) + " does not match shape " +
                                    c10::str(out.sizes()) + " of " + c10::toString(st(dtype)));
      }
      // Copy: safetensors data in a memory map is not guaranteed aligned for the dtype.
      std::memcpy(out.data_ptr(), data, nbytes);
      return box(out);)
  return nullptr;
}

int aten_copy_to_host(gt *t, void *dst, size_t nbytes) {
  RET_INT(
      at::Tensor h = t->t.to(at::kCPU).contiguous();
      if (static_cast<size_t>(h.nbytes()) != nbytes) { throw std::invalid_argument("host buffer size mismatch"); }
      std::memcpy(dst, h.data_ptr(), nbytes))
}

// from_blob wraps the caller's bytes without copying; copy_ is then the one copy (to the device, or
// within the host), finished before this returns (not non_blocking), so the bytes may go away after.
int aten_write_bytes_(gt *t, const void *data, size_t nbytes) {
  RET_INT(
      if (!t->t.is_contiguous() || static_cast<size_t>(t->t.nbytes()) != nbytes) {
        throw std::invalid_argument("write_bytes_: " + std::to_string(nbytes) + " bytes for a tensor of " +
                                    std::to_string(t->t.nbytes()) + (t->t.is_contiguous() ? "" : ", not contiguous"));
      }
      at::Tensor src = at::from_blob(const_cast<void *>(data), t->t.sizes(), at::TensorOptions().dtype(t->t.scalar_type()));
      t->t.copy_(src))
}

gt *aten_shallow_clone(gt *t) { RET(t->t) }

int aten_adopt_storage_(gt *dst, gt *src) {
  RET_INT(
      const at::Tensor &d = dst->t; const at::Tensor &s = src->t;
      c10::StorageImpl *into = d.storage().unsafeGetStorageImpl();
      c10::StorageImpl *from = s.storage().unsafeGetStorageImpl();
      if (into == from) return 0;
      auto whole = [](const at::Tensor &t) {
        return t.is_contiguous() && t.storage_offset() == 0 && t.nbytes() == t.storage().nbytes();
      };
      if (d.sizes() != s.sizes() || d.dtype() != s.dtype() || d.device() != s.device()) {
        throw std::invalid_argument(c10::str(s.sizes(), " ", s.dtype(), " on ", s.device()) +
                                    " is not " + c10::str(d.sizes(), " ", d.dtype(), " on ", d.device()));
      }
      if (!whole(d) || !whole(s)) throw std::invalid_argument("a tensor is not all of its storage");
      // The old memory goes to src's storage, freed with it (on a TPU: the buffer the program was donated).
      at::DataPtr old = into->set_data_ptr(std::move(from->mutable_data_ptr()));
      from->set_data_ptr_noswap(std::move(old));)
}

int64_t aten_dim(gt *t) { return t->t.dim(); }

int aten_shape(gt *t, int64_t *out, size_t cap) {
  RET_INT(
      auto s = t->t.sizes();
      if (s.size() > cap) { throw std::invalid_argument("shape buffer too small"); }
      for (size_t i = 0; i < s.size(); ++i) out[i] = s[i])
}


size_t aten_device(gt *t, char *buf, size_t cap) {
  PROTECT(
      std::string s = t->t.device().str();
      size_t n = s.size() < cap ? s.size() : cap;
      std::memcpy(buf, s.data(), n);
      return n;)
  return 0;
}

// copy=true: a weight built from host bytes must not alias them when it stays on the host.
gt *aten_to(gt *t, gt *like, int dtype) {
  RET(t->t.to(like->t.device(), dtype < 0 ? t->t.scalar_type() : st(dtype), false, true))
}

gt *aten_to_dtype(gt *t, int dtype) { RET(t->t.to(st(dtype))) }

gt *aten_full(const int64_t *dims, size_t ndim, double value, int dtype, gt *like) {
  RET(at::full(dims_of(dims, ndim), value, like->t.options().dtype(st(dtype))))
}

gt *aten_arange(int64_t start, int64_t end, int dtype, gt *like) {
  RET(at::arange(start, end, like->t.options().dtype(st(dtype))))
}

gt *aten_reshape(gt *t, const int64_t *dims, size_t ndim) { RET(t->t.reshape(dims_of(dims, ndim))) }
gt *aten_transpose(gt *t, int64_t d0, int64_t d1) { RET(t->t.transpose(d0, d1)) }
gt *aten_unsqueeze(gt *t, int64_t d) { RET(t->t.unsqueeze(d)) }
gt *aten_narrow(gt *t, int64_t dim, int64_t start, int64_t len) { RET(t->t.narrow(dim, start, len)) }

gt *aten_cat(gt *const *ts, size_t n, int64_t dim) {
  PROTECT(
      std::vector<at::Tensor> v;
      v.reserve(n);
      for (size_t i = 0; i < n; ++i) v.push_back(ts[i]->t);
      return box(at::cat(v, dim));)
  return nullptr;
}

gt *aten_index_select(gt *t, int64_t dim, gt *index) { RET(t->t.index_select(dim, index->t)) }

gt *aten_linear(gt *x, gt *w) { RET(at::linear(x->t, w->t)) }
int aten_linear_out(gt *out, gt *x, gt *w) { RET_INT(at::linear_out(out->t, x->t, w->t)) }
int aten_mul_out(gt *out, gt *a, gt *b) { RET_INT(at::mul_out(out->t, a->t, b->t)) }
int aten_addcmul_out(gt *out, gt *a, gt *b, gt *c) { RET_INT(at::addcmul_out(out->t, a->t, b->t, c->t)) }
gt *aten_matmul(gt *a, gt *b) { RET(at::matmul(a->t, b->t)) }
gt *aten_add(gt *a, gt *b) { RET(a->t + b->t) }
gt *aten_mul(gt *a, gt *b) { RET(a->t * b->t) }
gt *aten_mul_scalar(gt *a, double v) { RET(a->t * v) }
gt *aten_div_scalar(gt *a, double v) { RET(a->t / v) }
gt *aten_remainder_scalar(gt *a, int64_t v) { RET(at::remainder(a->t, v)) }
gt *aten_sum(gt *a) { RET(a->t.sum()) }
gt *aten_sum_dim(gt *a, int64_t dim) { RET(a->t.sum(dim)) }
gt *aten_floor_divide_int(gt *a, int64_t v) { RET(at::div(a->t, v, "floor")) }
gt *aten_histc(gt *a, int64_t bins, double lo, double hi) { RET(at::histc(a->t, bins, lo, hi)) }
// `at::_grouped_mm` through `gemma::grouped_mm` where its 2-D x 3-D form runs in float32 on the CPU: ATen's
// CPU kernel takes float32, but torch 2.14's Meta kernel for `_grouped_mm` refuses it
// (torch/_meta_registrations.py `_meta_grouped_mm_common`), which would stop a capture's fake-tensor pass.
gt *aten_grouped_mm(gt *a, gt *b, gt *offs) {
  PROTECT(
      if (a->t.device().is_cpu() && a->t.scalar_type() == at::kFloat && a->t.dim() == 2 && b->t.dim() == 3) {
        static const auto op = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("gemma::grouped_mm", "")
                                   .typed<at::Tensor(const at::Tensor &, const at::Tensor &, const at::Tensor &)>();
        return box(op.call(a->t, b->t, offs->t));
      } return box(at::_grouped_mm(a->t, b->t, offs->t));)
  return nullptr;
}

double aten_item_double(gt *a) {
  PROTECT(return a->t.item<double>();)
  return 0.0;
}

gt *aten_gelu_tanh(gt *a) { RET(at::gelu(a->t, "tanh")) }
gt *aten_tanh(gt *a) { RET(at::tanh(a->t)) }
gt *aten_cos(gt *a) { RET(at::cos(a->t)) }
gt *aten_sin(gt *a) { RET(at::sin(a->t)) }

// weight may be NULL (a norm without scale).
gt *aten_rms_norm(gt *x, gt *weight, double eps) {
  PROTECT(
      std::optional<at::Tensor> w;
      if (weight) w = weight->t;
      const auto &xt = x->t;
      if (xt.device().is_cpu() && at::isFloatingType(xt.scalar_type()) && xt.dim() > 0 &&
          xt.numel() <= kOnePassNormValues) {
        return box(one_pass_rms_norm(xt, w, eps));
      }
      return box(at::rms_norm(xt, {xt.size(-1)}, w, eps));)
  return nullptr;
}

// Collectives go through the dispatcher's functional collectives (`_c10d_functional::all_reduce`,
// `all_gather_into_tensor`, then `wait_tensor`; torch 2.14 torch/csrc/distributed/c10d/Functional.cpp), the ops
// torch.distributed's functional API (torch/distributed/_functional_collectives.py) calls: a dispatcher-level
// capture of a step records them, and Inductor and torch_tpu lower them inside a compiled graph. Called boxed:
// the group's schema type changed from `str` to `Any` across releases.
//
// A functional collective `op` called boxed on `stack`, then waited on: its result.
at::Tensor collective(const c10::OperatorHandle &op, c10::Stack stack) {
  static const auto wait = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("_c10d_functional::wait_tensor", "")
                               .typed<at::Tensor(const at::Tensor &)>();
  op.callBoxed(&stack);
  return wait.call(stack.at(0).toTensor());
}
at::Tensor all_reduce_sum(const at::Tensor &t, const char *group) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("_c10d_functional::all_reduce", "");
  return collective(op, {t, std::string("sum"), std::string(group)});
}
gt *aten_all_reduce_sum(gt *t, const char *group) { RET(all_reduce_sum(t->t, group)) }

// `all_gather_into_tensor` stacks the ranks' tensors along dim 0; a vocabulary-parallel head needs them along
// the last: [size * rows, ..., v] -> [size, rows, ..., v] -> moved to [rows, ..., size, v] -> [rows, ..., size * v].
at::Tensor all_gather_last(const at::Tensor &t, int64_t size, const char *group) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("_c10d_functional::all_gather_into_tensor", "");
  auto stacked = collective(op, {t.contiguous(), size, std::string(group)});
  std::vector<int64_t> split{size};
  split.insert(split.end(), t.sizes().begin(), t.sizes().end());
  std::vector<int64_t> joined(t.sizes().begin(), t.sizes().end());
  joined.back() *= size;
  return stacked.view(split).movedim(0, -2).reshape(joined);
}
gt *aten_all_gather_last(gt *t, int64_t size, const char *group) { RET(all_gather_last(t->t, size, group)) }
gt *aten_argmax(gt *a, int64_t dim, int keepdim) { RET(at::argmax(a->t, dim, keepdim != 0)) }

gt *aten_sub(gt *a, gt *b) { RET(a->t - b->t) }
gt *aten_div(gt *a, gt *b) { RET(a->t / b->t) }
gt *aten_mul_int(gt *a, int64_t v) { RET(a->t * v) }
gt *aten_add_int(gt *a, int64_t v) { RET(a->t + v) }
// Integer bounds for an integer tensor: double bounds would promote the result to floating point.
gt *aten_clamp(gt *a, double lo, double hi) {
  PROTECT(
      if (at::isIntegralType(a->t.scalar_type(), /*includeBool=*/false)) {
        return box(at::clamp(a->t, static_cast<int64_t>(lo), static_cast<int64_t>(hi)));
      }
      return box(at::clamp(a->t, lo, hi));)
  return nullptr;
}
gt *aten_softmax(gt *a, int64_t dim) { RET(at::softmax(a->t, dim)) }
gt *aten_log_softmax(gt *a, int64_t dim) { RET(at::log_softmax(a->t, dim)) }
gt *aten_cumsum(gt *a, int64_t dim) { RET(at::cumsum(a->t, dim)) }
gt *aten_gather(gt *t, int64_t dim, gt *index) { RET(at::gather(t->t, dim, index->t)) }

gt *aten_add_alpha(gt *a, gt *b, double alpha) { RET(at::add(a->t, b->t, alpha)) }
int aten_add_(gt *a, gt *b) { RET_INT(a->t.add_(b->t)) }
gt *aten_addcmul(gt *a, gt *b, gt *c) { RET(at::addcmul(a->t, b->t, c->t)) }
gt *aten_roll(gt *a, int64_t shift, int64_t dim) { RET(at::roll(a->t, {shift}, {dim})) }

int aten_split(gt *t, const int64_t *sizes, size_t n, int64_t dim, gt **out) {
  RET_INT(
      auto parts = t->t.split_with_sizes(at::IntArrayRef(sizes, n), dim);
      for (size_t i = 0; i < n; ++i) out[i] = box(parts[i]))
}

int aten_unbind(gt *t, int64_t dim, gt **out, size_t n) {
  RET_INT(
      auto parts = t->t.unbind(dim);
      if (parts.size() != n) { throw std::invalid_argument("unbind: wrong number of outputs"); }
      for (size_t i = 0; i < n; ++i) out[i] = box(parts[i]))
}

// Layouts from PyTorch's own tests of these kernels (test/test_linalg.py, `_group_quantize_tensor`
// and `test__int4_mm`): the CPU packer takes the int32 values, the CUDA one two values a byte, the
// even column in the high nibble.
gt *aten_int4_pack(gt *w, int64_t inner_k_tiles, gt *like) {
  PROTECT(
      const at::Tensor &v = w->t;
      if (like->t.device().is_cpu()) {
        return box(at::_convert_weight_to_int4pack_for_cpu(v.to(at::kInt).contiguous(), inner_k_tiles));
      }
      using namespace at::indexing;
      at::Tensor even = v.index({Slice(), Slice(0, None, 2)});
      at::Tensor odd = v.index({Slice(), Slice(1, None, 2)});
      at::Tensor bytes = at::bitwise_or(at::bitwise_left_shift(even, 4), odd).to(at::kByte);
      return box(at::_convert_weight_to_int4pack(bytes.to(like->t.device()), inner_k_tiles));)
  return nullptr;
}

gt *aten_int4_mm(gt *x, gt *packed, int64_t group, gt *scales_zeros) {
  PROTECT(
      if (x->t.device().is_cpu()) {
        return box(at::_weight_int4pack_mm_for_cpu(x->t, packed->t, group, scales_zeros->t));
      }
      return box(at::_weight_int4pack_mm(x->t, packed->t, group, scales_zeros->t));)
  return nullptr;
}

int aten_scalar_type(gt *t) { return static_cast<int>(t->t.scalar_type()); }
// The oneDNN ops are a library's (namespace mkldnn), with no at:: function: they are called boxed,
// through the dispatcher, which checks the arguments against their schemas. Each op is looked up once
// (the lookup takes the dispatcher's lock), not on every call of a decode step.
namespace {
const c10::OperatorHandle &reorder_linear_weight() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_reorder_linear_weight", "");
  return op;
}

const c10::OperatorHandle &linear_pointwise() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  return op;
}

const c10::OperatorHandle &is_mkldnn_bf16_supported() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_is_mkldnn_bf16_supported", "");
  return op;
}

// The op's first result.
c10::IValue call_boxed(const c10::OperatorHandle &op, std::vector<c10::IValue> args) {
  op.callBoxed(&args);
  return std::move(args.at(0));
}
}  // namespace

int aten_has_onednn(void) { return at::hasMKLDNN() ? 1 : 0; }

int aten_has_onednn_bf16(void) {
  if (!at::hasMKLDNN()) return 0;
  try {
    return call_boxed(is_mkldnn_bf16_supported(), {}).toBool() ? 1 : 0;
  } catch (...) {
    return 0;  // a torch without the op: treat as no bfloat16 oneDNN
  }
}

gt *aten_pad_rows(gt *x, int64_t extra) { RET(at::constant_pad_nd(x->t, {0, 0, 0, extra})) }

gt *aten_onednn_pack(gt *w) { RET(call_boxed(reorder_linear_weight(), {w->t, c10::IValue()}).toTensor()) }

gt *aten_onednn_linear(gt *x, gt *packed) {
  // mkldnn::_linear_pointwise(X, W, B?, attr, scalars, algorithm?): no bias, no fused activation, so
  // no scalars (an empty Scalar?[], made once; the op only reads it).
  static const c10::IValue no_scalars(c10::impl::GenericList(c10::OptionalType::create(c10::NumberType::get())));
  RET(call_boxed(linear_pointwise(),
                 {x->t, packed->t, c10::IValue(), c10::IValue(std::string("none")), no_scalars, c10::IValue()})
          .toTensor())
}

int64_t aten_nbytes(gt *t) { return static_cast<int64_t>(t->t.nbytes()); }

int aten_sort(gt *a, int descending, gt **values, gt **indices) {
  RET_INT(
      auto r = at::sort(a->t, /*stable=*/true, /*dim=*/-1, descending != 0);
      *values = box(std::get<0>(r)); *indices = box(std::get<1>(r)))
}

int aten_topk(gt *a, int64_t k, gt **values, gt **indices) {
  RET_INT(
      auto r = at::topk(a->t, k, -1, /*largest=*/true, /*sorted=*/true);
      *values = box(std::get<0>(r)); *indices = box(std::get<1>(r)))
}

gt *aten_searchsorted_right(gt *sorted, gt *values) {
  RET(at::searchsorted(sorted->t, values->t, /*out_int32=*/false, /*right=*/true))
}

gt *aten_where(gt *cond, gt *a, gt *b) { RET(at::where(cond->t, a->t, b->t)) }
gt *aten_where_int(gt *cond, gt *a, int64_t b) { RET(at::where(cond->t, a->t, at::Scalar(b))) }
gt *aten_bitwise_xor(gt *a, gt *b) { RET(at::bitwise_xor(a->t, b->t)) }

// ATen's >> on int64 is arithmetic; masking off the copied sign bits makes it logical.
gt *aten_shift_right_logical(gt *a, int64_t bits) {
  RET(at::bitwise_and(at::bitwise_right_shift(a->t, bits),
                      static_cast<int64_t>((~uint64_t{0}) >> bits)))
}

gt *aten_le(gt *a, gt *b) { RET(a->t.le(b->t)) }
gt *aten_eq(gt *a, gt *b) { RET(a->t.eq(b->t)) }
gt *aten_gt(gt *a, gt *b) { RET(a->t.gt(b->t)) }
gt *aten_gt_scalar(gt *a, double v) { RET(a->t.gt(v)) }
gt *aten_lt_scalar(gt *a, double v) { RET(a->t.lt(v)) }
gt *aten_lt(gt *a, gt *b) { RET(a->t.lt(b->t)) }
gt *aten_logical_or(gt *a, gt *b) { RET(a->t.logical_or(b->t)) }
gt *aten_logical_and(gt *a, gt *b) { RET(a->t.logical_and(b->t)) }

gt *aten_sdpa(gt *q, gt *k, gt *v, gt *mask, double scale) {
  PROTECT(
      const auto &qt = q->t;
      const bool few_16bit = qt.device().is_cpu() && qt.dim() == 4 && qt.size(2) <= kFewQueryRows &&
                             (qt.scalar_type() == at::kBFloat16 || qt.scalar_type() == at::kHalf) &&
                             k->t.dim() == 4 && qt.size(1) % k->t.size(1) == 0 && mask->t.scalar_type() == at::kBool;
      if (few_16bit) return box(few_row_attention(qt, k->t, v->t, mask->t, scale));
      return box(at::scaled_dot_product_attention(qt, k->t, v->t, mask->t, 0.0, false, scale, true));)
  return nullptr;
}

namespace {
c10::List<std::optional<at::Tensor>> index_list(gt *const *indices, size_t n) {
  c10::List<std::optional<at::Tensor>> list;
  list.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    list.push_back(indices[i] ? std::optional<at::Tensor>(indices[i]->t) : std::nullopt);
  }
  return list;
}
}  // namespace

int aten_index_put_(gt *t, gt *const *indices, size_t n, gt *values) {
  RET_INT(t->t.index_put_(index_list(indices, n), values->t))
}
gt *aten_index(gt *t, gt *const *indices, size_t n) { RET(at::index(t->t, index_list(indices, n))) }
int aten_copy_(gt *dst, gt *src) { RET_INT(dst->t.copy_(src->t)) }
int aten_scatter_add_(gt *t, int64_t dim, gt *index, gt *src) { RET_INT(t->t.scatter_add_(dim, index->t, src->t)) }

gt *aten_scatter(gt *t, int64_t dim, gt *index, gt *src) { RET(t->t.scatter(dim, index->t, src->t)) }

int aten_fill_(gt *t, double v) { RET_INT(t->t.fill_(v)) }
int aten_fill_int_(gt *t, int64_t v) { RET_INT(t->t.fill_(v)) }
int aten_add_scalar_(gt *t, double v) { RET_INT(t->t.add_(v)) }
int aten_add_int_(gt *t, int64_t v) { RET_INT(t->t.add_(v)) }

/* The media towers' ops. */
gt *aten_permute(gt *t, const int64_t *dims, size_t ndim) { RET(t->t.permute(at::IntArrayRef(dims, ndim))) }
gt *aten_relu(gt *a) { RET(at::relu(a->t)) }
gt *aten_sigmoid(gt *a) { RET(at::sigmoid(a->t)) }
gt *aten_silu(gt *a) { RET(at::silu(a->t)) }
gt *aten_softplus(gt *a) { RET(at::softplus(a->t)) }
gt *aten_pad_dim(gt *t, int64_t dim, int64_t before, int64_t after, double value) {
  PROTECT(
      auto d = dim < 0 ? dim + t->t.dim() : dim;
      std::vector<int64_t> pad(2 * (t->t.dim() - d), 0);
      pad[pad.size() - 2] = before;
      pad[pad.size() - 1] = after;
      return box(at::constant_pad_nd(t->t, pad, value));)
  return nullptr;
}
gt *aten_masked_fill(gt *t, gt *mask, double value) { RET(t->t.masked_fill(mask->t, value)) }
gt *aten_index_copy(gt *t, int64_t dim, gt *index, gt *src) { RET(t->t.index_copy(dim, index->t, src->t)) }
gt *aten_isin(gt *t, gt *values) { RET(at::isin(t->t, values->t)) }
gt *aten_layer_norm(gt *x, gt *weight, double eps) {
  PROTECT(
      std::optional<at::Tensor> w;
      if (weight) w = weight->t;
      return box(at::layer_norm(x->t, {x->t.size(-1)}, w, std::nullopt, eps));)
  return nullptr;
}
gt *aten_conv2d(gt *x, gt *w, int64_t stride, int64_t padding) {
  RET(at::conv2d(x->t, w->t, std::nullopt, {stride, stride}, {padding, padding}))
}
gt *aten_conv1d(gt *x, gt *w, int64_t stride, int64_t padding, int64_t groups) {
  RET(at::conv1d(x->t, w->t, std::nullopt, {stride}, {padding}, {1}, groups))
}

}  // extern "C"
