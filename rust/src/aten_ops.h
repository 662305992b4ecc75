/* The shim's functions, listed once: `X(return type, name, (parameters))` per function.
 *
 * An X-macro list (no include guard; the includer defines X). aten.h expands it into the C
 * prototypes that aten.cpp's bodies are compiled against: with C linkage there are no overloads, so a
 * body whose signature differs from its line here is a compile error ("conflicting declaration of C
 * function"). build.rs reads the same lines and writes the Rust `extern "C"` block that src/ffi.rs
 * includes, so the Rust declarations cannot drift from these either. tch-rs generates its bindings
 * for the same reason (torch-sys/libtch/torch_api_generated.h and src/wrappers/tensor_generated.rs,
 * both from one op list).
 *
 * Types build.rs knows: gt * (a tensor handle), gt ** and gt *const * (arrays of handles), gg *,
 * PyObject *, void, void *, const void *, const char *, char *, int, int64_t, int64_t *,
 * const int64_t *, size_t, double. See aten.h for the contract every function keeps.
 */

/* Errors and guards. */
X(const char *, aten_take_error, (void))
X(void *, aten_no_grad_enter, (void))
X(void, aten_no_grad_exit, (void *guard))

/* Lifetime, Python crossing, host bytes. */
X(void, aten_free, (gt *t))
X(gt *, aten_from_python, (PyObject *obj))
X(PyObject *, aten_to_python, (gt *t))
X(gt *, aten_from_bytes, (const void *data, size_t nbytes, const int64_t *dims, size_t ndim, int dtype))
X(int, aten_copy_to_host, (gt *t, void *dst, size_t nbytes))
/* Copy `nbytes` host bytes into `t` (contiguous, exactly `nbytes` long, on any device): one copy. */
X(int, aten_write_bytes_, (gt *t, const void *data, size_t nbytes))
X(gt *, aten_shallow_clone, (gt *t))
/* Swap the memory of `dst`'s storage and `src`'s (same shape, dtype and device, each the whole of its storage):
 * every tensor that views `dst`'s storage then reads what `src` held, with no copy. */
X(int, aten_adopt_storage_, (gt *dst, gt *src))

/* Metadata. */
X(int64_t, aten_dim, (gt *t))
X(int, aten_shape, (gt *t, int64_t *out, size_t cap))
X(size_t, aten_device, (gt *t, char *buf, size_t cap))

/* Creation and movement; `like` names the device. */
X(gt *, aten_to, (gt *t, gt *like, int dtype))
X(gt *, aten_to_dtype, (gt *t, int dtype))
X(gt *, aten_full, (const int64_t *dims, size_t ndim, double value, int dtype, gt *like))
X(gt *, aten_arange, (int64_t start, int64_t end, int dtype, gt *like))

/* Shapes. */
X(gt *, aten_reshape, (gt *t, const int64_t *dims, size_t ndim))
X(gt *, aten_transpose, (gt *t, int64_t d0, int64_t d1))
X(gt *, aten_unsqueeze, (gt *t, int64_t d))
X(gt *, aten_narrow, (gt *t, int64_t dim, int64_t start, int64_t len))
X(gt *, aten_cat, (gt *const *ts, size_t n, int64_t dim))
X(gt *, aten_index_select, (gt *t, int64_t dim, gt *index))

/* Arithmetic. */
X(gt *, aten_linear, (gt *x, gt *w))
/* The `_out` forms write into `out` (a buffer made once) and return 0, or -1 with an error. */
X(int, aten_linear_out, (gt *out, gt *x, gt *w))
X(int, aten_mul_out, (gt *out, gt *a, gt *b))
X(int, aten_addcmul_out, (gt *out, gt *a, gt *b, gt *c))
X(gt *, aten_matmul, (gt *a, gt *b))
X(gt *, aten_add, (gt *a, gt *b))
X(gt *, aten_mul, (gt *a, gt *b))
X(gt *, aten_mul_scalar, (gt *a, double v))
X(gt *, aten_div_scalar, (gt *a, double v))
X(gt *, aten_remainder_scalar, (gt *a, int64_t v))
X(gt *, aten_sum, (gt *a))
/* Sum over `dim`, the dim dropped. */
X(gt *, aten_sum_dim, (gt *a, int64_t dim))
/* Integer division rounding down (`torch.div(a, v, rounding_mode="floor")`). */
X(gt *, aten_floor_divide_int, (gt *a, int64_t v))
/* `bins` equal bins over [lo, hi] of a floating tensor's values (`torch.histc`). */
X(gt *, aten_histc, (gt *a, int64_t bins, double lo, double hi))
/* Grouped matrix product: `a` [S, in] rows grouped by `offs` (int32 [G], cumulative ends), group g
   times `b[g]` ([G, in, out], any strides): [S, out] (`torch._grouped_mm`). */
X(gt *, aten_grouped_mm, (gt *a, gt *b, gt *offs))
X(double, aten_item_double, (gt *a))
X(gt *, aten_gelu_tanh, (gt *a))
X(gt *, aten_tanh, (gt *a))
X(gt *, aten_cos, (gt *a))
X(gt *, aten_sin, (gt *a))
X(gt *, aten_rms_norm, (gt *x, gt *weight, double eps))
/* The sum of `t` over the ranks of torch.distributed's process group named `group`: a new tensor. */
X(gt *, aten_all_reduce_sum, (gt *t, const char *group))
/* The ranks' `t` of the group (`size` ranks) side by side along the last dimension, rank order: a new tensor. */
X(gt *, aten_all_gather_last, (gt *t, int64_t size, const char *group))
X(gt *, aten_argmax, (gt *a, int64_t dim, int keepdim))
X(gt *, aten_sub, (gt *a, gt *b))
X(gt *, aten_div, (gt *a, gt *b))
X(gt *, aten_mul_int, (gt *a, int64_t v))
X(gt *, aten_add_int, (gt *a, int64_t v))
X(gt *, aten_clamp, (gt *a, double lo, double hi))
X(gt *, aten_softmax, (gt *a, int64_t dim))
X(gt *, aten_log_softmax, (gt *a, int64_t dim))
X(gt *, aten_cumsum, (gt *a, int64_t dim))
X(gt *, aten_gather, (gt *t, int64_t dim, gt *index))
/* `a + alpha * b`. */
X(gt *, aten_add_alpha, (gt *a, gt *b, double alpha))
/* `a += b` in place. */
X(int, aten_add_, (gt *a, gt *b))
/* `a + b * c`. */
X(gt *, aten_addcmul, (gt *a, gt *b, gt *c))
X(gt *, aten_roll, (gt *a, int64_t shift, int64_t dim))
/* `n` pieces of `sizes[i]` along `dim` (views), written to `out[0..n]`. */
X(int, aten_split, (gt *t, const int64_t *sizes, size_t n, int64_t dim, gt **out))
/* `n` views `t.select(dim, i)`, written to `out[0..n]`; n must equal t.size(dim). */
X(int, aten_unbind, (gt *t, int64_t dim, gt **out, size_t n))
/* int4 weights kept packed: `w` holds int32 values 0..15 (`[out, in]`, the stored value is v - 8) on
   the host; the result is the packed layout of ATen's int4 matmul for `like`'s device (CPU:
   _convert_weight_to_int4pack_for_cpu; CUDA: _convert_weight_to_int4pack of two values a byte). */
X(gt *, aten_int4_pack, (gt *w, int64_t inner_k_tiles, gt *like))
/* `x @ dequant(packed).T`, x bfloat16 `[rows, in]`; scales_zeros bfloat16 `[in / group, out, 2]`. */
X(gt *, aten_int4_mm, (gt *x, gt *packed, int64_t group, gt *scales_zeros))
/* oneDNN's linear on the CPU over a weight packed once: ATen's `mkldnn::_reorder_linear_weight` and
   `mkldnn::_linear_pointwise` ops (registered in PyTorch's aten/src/ATen/native/mkldnn/Linear.cpp;
   the kernels torch._inductor emits for a frozen CPU model). has_onednn is 1 when this torch was
   built with oneDNN; has_onednn_bf16 is 1 when its oneDNN also computes in bfloat16 on this CPU
   (`mkldnn::_is_mkldnn_bf16_supported`, PyTorch's aten/src/ATen/native/mkldnn/Utils.h
   mkldnn_bf16_device_check: AVX-512 with BF16 or the core subsets oneDNN converts with). pack takes a
   float32 or bfloat16 `[out, in]` weight; linear computes `x @ w.T` for x `[rows, in]` of that dtype. */
X(int, aten_has_onednn, (void))
X(int, aten_has_onednn_bf16, (void))
/* x `[rows, n]` followed by `extra` rows of zeros. */
X(gt *, aten_pad_rows, (gt *x, int64_t extra))
X(gt *, aten_onednn_pack, (gt *w))
X(gt *, aten_onednn_linear, (gt *x, gt *packed))
/* The c10::ScalarType code. */
X(int, aten_scalar_type, (gt *t))
/* CUDA graphs (at::cuda::CUDAGraph), when the shim was built against a torch with CUDA
   (aten_cuda_graphs_built() == 1; otherwise begin and replay fail with a message). begin syncs the
   device and starts capturing this thread's work on a side stream of `like`'s device; end stops and
   instantiates; abort stops a capture that failed (no error); replay runs the graph on the current
   stream; free releases it. `share` (or NULL) is a graph whose memory pool the new one allocates from. */
X(gg *, aten_graph_begin, (gt *like, gg *share))
X(int, aten_graph_end, (gg *g))
X(void, aten_graph_abort, (gg *g))
X(int, aten_graph_replay, (gg *g))
X(void, aten_graph_free, (gg *g))
X(int, aten_cuda_graphs_built, (void))
X(gt *, aten_clone, (gt *t))
/* Bytes of the tensor's elements. */
X(int64_t, aten_nbytes, (gt *t))
/* Sorted values and indices along the last dim; `stable` keeps equal values in index order. */
X(int, aten_sort, (gt *a, int descending, gt **values, gt **indices))
X(int, aten_topk, (gt *a, int64_t k, gt **values, gt **indices))
/* Index of the first entry of each row of `sorted` that is > the row's value (right=True). */
X(gt *, aten_searchsorted_right, (gt *sorted, gt *values))
X(gt *, aten_where, (gt *cond, gt *a, gt *b))
X(gt *, aten_where_int, (gt *cond, gt *a, int64_t b))
X(gt *, aten_bitwise_xor, (gt *a, gt *b))
/* Logical (unsigned) right shift of int64 values by `bits` (0 < bits < 64). */
X(gt *, aten_shift_right_logical, (gt *a, int64_t bits))

/* The media towers' ops (gemma4/vision.rs, gemma4/audio.rs). */
X(gt *, aten_permute, (gt *t, const int64_t *dims, size_t ndim))
X(gt *, aten_relu, (gt *a))
X(gt *, aten_sigmoid, (gt *a))
X(gt *, aten_silu, (gt *a))
X(gt *, aten_softplus, (gt *a))
/* `t` with `before` and `after` entries of `value` added along `dim` (`F.pad` on one dim). */
X(gt *, aten_pad_dim, (gt *t, int64_t dim, int64_t before, int64_t after, double value))
/* `t` where `mask` is false, `value` where it is true (`masked_fill`). */
X(gt *, aten_masked_fill, (gt *t, gt *mask, double value))
/* A copy of `t` whose entries `index` along `dim` are `src`'s rows (`index_copy`). */
X(gt *, aten_index_copy, (gt *t, int64_t dim, gt *index, gt *src))
/* Whether each entry of `t` is one of `values`' (`torch.isin`). */
X(gt *, aten_isin, (gt *t, gt *values))
/* Layer norm over the last dim with an optional weight (NULL: none) and no bias. */
X(gt *, aten_layer_norm, (gt *x, gt *weight, double eps))
/* Convolutions without bias: `x` [N, C, H, W] (conv2d) or [N, C, L] (conv1d), `groups` channel groups. */
X(gt *, aten_conv2d, (gt *x, gt *w, int64_t stride, int64_t padding))
X(gt *, aten_conv1d, (gt *x, gt *w, int64_t stride, int64_t padding, int64_t groups))

/* Comparisons and masks. */
X(gt *, aten_le, (gt *a, gt *b))
X(gt *, aten_eq, (gt *a, gt *b))
X(gt *, aten_gt, (gt *a, gt *b))
X(gt *, aten_gt_scalar, (gt *a, double v))
X(gt *, aten_lt_scalar, (gt *a, double v))
X(gt *, aten_lt, (gt *a, gt *b))
X(gt *, aten_logical_or, (gt *a, gt *b))
X(gt *, aten_logical_and, (gt *a, gt *b))
X(gt *, aten_sdpa, (gt *q, gt *k, gt *v, gt *mask, double scale))

/* In place. `indices` of aten_index_put_ may hold NULL for a full slice (`t[rows, :, slots]`). */
X(int, aten_index_put_, (gt *t, gt *const *indices, size_t n, gt *values))
/* `t[indices]` (advanced indexing, a copy); NULL entries as in aten_index_put_. */
X(gt *, aten_index, (gt *t, gt *const *indices, size_t n))
X(int, aten_copy_, (gt *dst, gt *src))
X(int, aten_scatter_add_, (gt *t, int64_t dim, gt *index, gt *src))
X(gt *, aten_scatter, (gt *t, int64_t dim, gt *index, gt *src))
X(int, aten_fill_, (gt *t, double v))
/* An integer fill: exact for every int64 (a double holds 53 bits and rounds 2^63 - 1 up to 2^63). */
X(int, aten_fill_int_, (gt *t, int64_t v))
X(int, aten_add_scalar_, (gt *t, double v))
X(int, aten_add_int_, (gt *t, int64_t v))
