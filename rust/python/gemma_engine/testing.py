"""The engine's internals reached from Python for tests and benchmarks (see testing.pyi beside this file):
ATen round trips (`matmul_sum`, `add_`), the kernels the model calls (`rms_norm`, `attention`), the sampler on
given logits (`sample`, `uniform`), the collectives tensor parallelism takes (`all_reduce_sum`,
`all_gather_last`) and the shim's operator count (`aten_calls`). Not part of the serving API: the package's
`__all__` leaves them out.
"""

from ._native import (
    add_,
    all_gather_last,
    all_reduce_sum,
    aten_calls,
    attention,
    matmul_sum,
    rms_norm,
    sample,
    uniform,
)

__all__ = [
    "add_",
    "all_gather_last",
    "all_reduce_sum",
    "aten_calls",
    "attention",
    "matmul_sum",
    "rms_norm",
    "sample",
    "uniform",
]
