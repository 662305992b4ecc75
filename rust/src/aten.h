/* C ABI over the few dozen ATen operations the Gemma 4 engine uses.
 *
 * Design: LaurentMazare/tch-rs torch-sys/libtch/torch_api.{h,cpp} (PROTECT), cut down to what
 * the model needs. Every function catches every C++
 * exception and leaves its message for `aten_take_error`; nothing throws across the ABI.
 * A function that fails returns NULL (or 0/-1); Rust checks `aten_take_error` after each call
 * (src/ffi.rs, macro `ffi!`).
 *
 * The functions are listed once, in aten_ops.h; this header expands that list into their prototypes.
 *
 * `gt` is an opaque `at::Tensor*` owned by the caller and released with `aten_free`.
 * Dtypes are c10::ScalarType codes (src/tensor.rs `DType` mirrors them).
 */
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gt gt;
typedef struct gg gg;
typedef struct _object PyObject;

/* Every function's prototype, from the one list (aten_ops.h). */
#define X(ret, name, params) ret name params;
#include "aten_ops.h"
#undef X

#ifdef __cplusplus
}
#endif
