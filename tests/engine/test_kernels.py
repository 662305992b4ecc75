"""The engine's own CPU kernels (rust/src/aten.cpp) against the references they replace: its RMSNorm
against Transformers' `Gemma4RMSNorm`, its few-row 16-bit attention against
`scaled_dot_product_attention` computed in float64. Both are reached through `gemma_engine.testing.rms_norm`
and `gemma_engine.testing.attention`, the calls the model makes."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

from gemma_engine import testing

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values of a's dtype lie between a and b (same dtype, finite)."""
    bits = a.element_size() * 8
    ints = {32: torch.int32, 16: torch.int16}[bits]

    def line(x: torch.Tensor) -> torch.Tensor:
        """Sign and magnitude bits to a monotone integer line (-0 and +0 meet at 0)."""
        i = x.view(ints).long()
        magnitude = i & ((1 << (bits - 1)) - 1)
        return torch.where(i < 0, -magnitude, magnitude)

    return (line(a) - line(b)).abs()


def reference_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    norm = Gemma4RMSNorm(x.shape[-1], eps=eps, with_scale=weight is not None)
    if weight is not None:
        norm.weight.data = weight
    with torch.no_grad():
        return norm(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_weight", (True, False))
def test_rms_norm_is_transformers_norm_to_its_last_bits(dtype, with_weight):
    gen = torch.Generator().manual_seed(0)
    # The one-pass kernel's sizes (up to 4,096 values), the composite's past them, a transposed view.
    for x in (
        torch.randn(8, 512, generator=gen).mul(3).to(dtype),
        torch.randn(300, 512, generator=gen).mul(3).to(dtype),
        torch.randn(2, 8, 1, 64, generator=gen).to(dtype),
        torch.randn(64, 6, generator=gen).to(dtype).t(),
    ):
        d = x.shape[-1]
        weight = torch.rand(d, generator=gen).add(0.5).to(dtype) if with_weight else None
        ours = testing.rms_norm(x, weight, 1e-6)
        ref = reference_norm(x, weight, 1e-6)
        assert ours.shape == x.shape and ours.dtype == dtype
        apart = ulps_apart(ours, ref)
        # float32: the two means differ in their last bits (Transformers sums in float32, the engine in
        # double), which moves a result a few ulps; 16 bits round that away but at a tie.
        most = 4 if dtype == torch.float32 else 1
        assert int(apart.max()) <= most, f"{dtype} {tuple(x.shape)}: {int(apart.max())} ulps apart"
        assert float((apart == 0).float().mean()) >= (0.5 if dtype == torch.float32 else 0.99)


def test_rms_norm_of_no_rows_is_empty_and_a_wrong_weight_is_value_error():
    assert testing.rms_norm(torch.zeros(0, 512), torch.ones(512)).shape == (0, 512)
    with pytest.raises(ValueError, match="a weight of 5 values for rows of 512"):
        testing.rms_norm(torch.zeros(2, 512), torch.ones(5))


def reference_attention(q, k, v, mask):
    """SDPA in float64 on the same (rounded) inputs."""
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=1.0,
                                          enable_gqa=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", (1, 4, 16, 17))  # up to 16 query rows: the few-row path in 16 bits
def test_attention_is_float64_sdpa_rounded_once(dtype, t):
    gen = torch.Generator().manual_seed(t)
    rows, heads, kv_heads, keys, d = 3, 8, 2, 37, 64
    q = torch.randn(rows, heads, t, d, generator=gen).to(dtype)
    k = torch.randn(rows, kv_heads, keys, d, generator=gen).mul(0.3).to(dtype)
    v = torch.randn(rows, kv_heads, keys, d, generator=gen).to(dtype)
    # Causal over the last t keys, and row 1 also blind to the first ten (a sliding window).
    key_pos = torch.arange(keys).view(1, 1, 1, keys)
    query_pos = torch.arange(keys - t, keys).view(1, 1, t, 1)
    mask = (key_pos <= query_pos).expand(rows, 1, t, keys).clone()
    mask[1, :, :, :10] = False
    ours = testing.attention(q, k, v, mask)
    assert ours.shape == (rows, heads, t, d) and ours.dtype == dtype
    ref = reference_attention(q, k, v, mask)
    # One rounding to the output dtype, plus float32 arithmetic before it.
    tol = {torch.float32: 1e-5, torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
    torch.testing.assert_close(ours.double(), ref, rtol=tol, atol=tol)


def test_16bit_attention_with_no_visible_key_is_finite_and_leaves_the_other_rows_alone():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 1, 16, generator=gen).bfloat16()
    k = torch.randn(2, 2, 9, 16, generator=gen).bfloat16()
    v = torch.randn(2, 2, 9, 16, generator=gen).bfloat16()
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mask[0] = False  # a padding row: nothing visible
    ours = testing.attention(q, k, v, mask)
    assert bool(torch.isfinite(ours).all())
    torch.testing.assert_close(ours[1:].double(), reference_attention(q[1:], k[1:], v[1:], mask[1:]),
                               rtol=2**-8, atol=2**-8)


def test_attention_with_shapes_that_do_not_fit_is_value_error():
    q, kv = torch.zeros(1, 8, 1, 64).bfloat16(), torch.zeros(1, 3, 5, 64).bfloat16()
    with pytest.raises(ValueError, match="attention"):
        testing.attention(q, kv, kv, torch.ones(1, 1, 1, 5, dtype=torch.bool))
