"""The numba scalar helpers of ``attngrad.kernels.numeric``: exact dtype conversions and exp32.

* ``widen`` over all 65536 bit patterns of float16 and bfloat16 equals torch's ``.to(float32)``
  (nan: nan of the same sign), through both float16 routes (F16C and the integer fallback);
* ``narrow`` equals torch's ``.to(dtype)`` (round half to even) on random, boundary and special values
  (nan: any nan; torch's bfloat16 rounding returns +nan for every nan);
* ``exp32``: relative error against float64 exp, the flush-to-zero and overflow points, nan/inf;
* ``exp2_32``: relative error against float64 2**t, exact 2**0, the clamps, nan/inf;
* ``exp_nonpositive``: relative error against float64 exp, the degree-5 bound for float32 results and the degree-4
  one for bfloat16/float16 ones, and exact 1, 0 and nan;
* ``narrow_ftz`` equals ``narrow`` except that bfloat16 results below 2**-126 may flush to zero;
  ``narrow_finite`` equals ``narrow`` on every value but nan, ``narrow_fast`` on every value but nan and (where
  ``narrow_ftz`` flushes) subnormals;
* ``fmaximum`` propagates nan (the reduction the softmax kernel relies on); ``fmax_any_nan`` finds the max;
* ``prefetch`` / ``prefetch_l2`` compile to hints that change nothing; ``prefetch_bytes`` emits the level asked for;
* ``copy_row`` copies exactly the requested bytes, streamed or not, at every alignment of both ends;
* ``select_bits`` expands 16 bits at every bit offset of a byte to ``value`` / 0 and writes nothing else;
* ``unowned`` views an array with its shape and strides (reads and writes reach the array);
* ``flush_denormals`` makes a subnormal product 0 until ``restore_float_mode`` (x86), which restores it.
"""

from __future__ import annotations

import math
import platform

import numpy as np
import pytest
import torch
from numba import njit, prange

from attngrad.kernels.numeric import (FASTMATH, FLOAT16_GRID_LIMIT, HAS_AVX512_BF16, NO_POSITIVE, STREAM_MIN_BYTES,
                                      _f16_to_f32, _f32_to_f16, aligned_empty, copy_row, exp2_32, exp_nonpositive,
                                      exp32, exp_for, float16_grid, flush_denormals, fmax_any_nan, fmaximum, narrow,
                                      narrow_fast, narrow_finite, narrow_ftz, prefetch, prefetch_bytes, prefetch_l2,
                                      restore_float_mode, select_bits, smallest_positive, stream_fence, streams,
                                      track_smallest_positive, transpose_matrix, unowned, widen)
from attngrad.kernels.tensor_view import kernel_view

LOW_DTYPES = [torch.float16, torch.bfloat16]


@njit
def _widen_all(a):
    out = np.empty(a.size, dtype=np.float32)
    for i in range(a.size):
        out[i] = widen(a[i])
    return out


@njit
def _narrow_all(v, like):
    for i in range(v.size):
        like[i] = narrow(v[i], like)


@njit
def _f16_fallback_widen(a):
    out = np.empty(a.size, dtype=np.float32)
    for i in range(a.size):
        out[i] = _f16_to_f32(a[i])
    return out


@njit
def _f16_fallback_narrow(v):
    out = np.empty(v.size, dtype=np.int16)
    for i in range(v.size):
        out[i] = _f32_to_f16(v[i])
    return out


@njit(fastmath=FASTMATH)  # as the kernels compile it: the add and subtract must survive fast-math
def _float16_grid_all(v):
    out = np.empty_like(v)
    for i in range(v.size):
        out[i] = float16_grid(v[i])
    return out


@njit
def _exp_all(v):
    out = np.empty_like(v)
    for i in range(v.size):
        out[i] = exp32(v[i])
    return out


@njit(fastmath=FASTMATH)  # as the kernels compile it (FMA contraction)
def _exp2_all(v):
    out = np.empty_like(v)
    for i in range(v.size):
        out[i] = exp2_32(v[i])
    return out


@njit(fastmath=FASTMATH)
def _exp_like_all(v, like, nonpositive):
    """exp_nonpositive(v, like) when ``nonpositive``, else exp_for(v, like), elementwise."""
    out = np.empty_like(v)
    for i in range(v.size):
        out[i] = exp_nonpositive(v[i], like) if nonpositive else exp_for(v[i], like)
    return out


@njit
def _narrow_ftz_all(v, like):
    for i in range(v.size):
        like[i] = narrow_ftz(v[i], like)


@njit
def _narrow_finite_all(v, like, fast):
    for i in range(v.size):
        like[i] = narrow_fast(v[i], like) if fast else narrow_finite(v[i], like)


@njit
def _max_all(v, nan_aware=True):
    top = np.float32(-np.inf)
    for i in range(v.size):
        top = fmaximum(top, v[i]) if nan_aware else fmax_any_nan(top, v[i])
    return top


def all_patterns(dtype) -> torch.Tensor:
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)


def assert_same_floats(got: torch.Tensor, want: torch.Tensor, nan_sign: bool = True) -> None:
    """Bit-identical, except that a nan only has to be a nan (of the same sign when ``nan_sign``)."""
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    if nan_sign:
        assert torch.equal(torch.signbit(got[nan]), torch.signbit(want[nan]))
    bits = {4: torch.int32, 2: torch.int16}[got.element_size()]
    assert torch.equal(got[~nan].view(bits), want[~nan].view(bits))


def narrow_inputs() -> torch.Tensor:
    """Random float32 of every magnitude plus the rounding boundaries of float16 and bfloat16."""
    g = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-2**31, 2**31 - 1, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32)
    values = [random_bits.view(torch.float32), torch.randn(1 << 16, generator=g) * 1000]
    for dtype in LOW_DTYPES:  # every value of the format, its midpoints to the next, and +-1 ulp of fp32
        exact = all_patterns(dtype).float()
        exact = exact[exact.isfinite()]
        mid = ((exact.double()[:-1] + exact.double()[1:]) / 2).float()
        values += [exact, mid, torch.nextafter(mid, torch.tensor(math.inf)),
                   torch.nextafter(mid, torch.tensor(-math.inf))]
    special = [0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, 65504.0, 65519.99, 65520.0, 3.4e38, 1e-45,
               5.96e-8, 2.98e-8, 2.99e-8, 6.1e-5, 1.18e-38]
    values.append(torch.tensor(special + [-v for v in special]))
    return torch.cat(values)


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_widen_is_exact_on_every_bit_pattern(dtype):
    x = all_patterns(dtype)
    assert_same_floats(torch.from_numpy(_widen_all(kernel_view(x))), x.float())


def test_float16_integer_fallback_widens_like_f16c():
    x = all_patterns(torch.float16)
    assert_same_floats(torch.from_numpy(_f16_fallback_widen(kernel_view(x))), x.float())


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_narrow_rounds_like_torch(dtype):
    v = narrow_inputs()
    out = torch.empty(v.shape, dtype=dtype)
    _narrow_all(v.numpy(), kernel_view(out))
    assert_same_floats(out, v.to(dtype), nan_sign=False)  # torch's bf16 rounding drops a nan's sign


def test_float16_integer_fallback_narrows_like_torch():
    v = narrow_inputs()
    got = torch.from_numpy(_f16_fallback_narrow(v.numpy())).view(torch.float16)
    assert_same_floats(got, v.to(torch.float16), nan_sign=False)


def test_float16_grid_rounds_like_the_float16_conversion_below_its_limit():
    v = narrow_inputs()
    got = torch.from_numpy(_float16_grid_all(v.numpy()))
    inside = ~(v.abs() >= FLOAT16_GRID_LIMIT) | v.isinf()  # nans and infinities included
    # + 0.0 turns -0.0 into +0.0: the grid's zeros may carry either sign
    assert_same_floats(got[inside] + 0.0, v[inside].to(torch.float16).float() + 0.0, nan_sign=False)
    # float16 overflows from the limit on; below 2**115 the grid stays finite there, at least as large as the limit
    over = ~inside & (v.abs() < 2.0**115)
    assert got[over].isfinite().all() and (got[over].abs() >= FLOAT16_GRID_LIMIT).all()
    assert torch.equal(torch.signbit(got[over]), torch.signbit(v[over]))


def test_narrow_float32_is_identity():
    v = narrow_inputs()
    out = torch.empty_like(v)
    _narrow_all(v.numpy(), out.numpy())
    assert_same_floats(out, v)


def test_exp32_relative_error():
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.empty(1 << 20).uniform_(-87.3, 88.72, generator=g), torch.randn(1 << 16, generator=g),
                   torch.linspace(-1, 1, 20001)])
    got = torch.from_numpy(_exp_all(x.numpy())).double()
    rel = ((got - x.double().exp()) / x.double().exp()).abs()
    assert rel.max().item() < 5e-7


def test_exp32_special_values_and_range_ends():
    x = torch.tensor([math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, 88.7212, 88.7228, 88.723, 89.0, 1e4,
                      -87.6, -87.7, -88.0, -1e4, 1e-45])
    got = torch.from_numpy(_exp_all(x.numpy()))
    assert got[:2].isnan().all()
    assert got[2] == math.inf and got[3] == 0.0 and got[4] == 1.0 and got[5] == 1.0
    assert got[6].item() == pytest.approx(math.exp(x[6].item()), rel=1e-6)  # just below ln(FLT_MAX): finite
    assert math.isfinite(got[7].item())
    assert (got[8:11] == math.inf).all()  # exp(88.723) > FLT_MAX
    assert got[11].item() == pytest.approx(math.exp(x[11].item()), rel=1e-5)  # a subnormal-sized result near the end
    assert (got[12:15] == 0.0).all()
    assert got[15] == 1.0


def test_exp2_32_relative_error():
    g = torch.Generator().manual_seed(4)
    t = torch.cat([torch.empty(1 << 20).uniform_(-125.0, 127.5, generator=g), torch.randn(1 << 16, generator=g),
                   torch.linspace(-2, 2, 40001)])
    got = torch.from_numpy(_exp2_all(t.numpy())).double()
    want = torch.exp2(t.double())
    assert ((got - want) / want).abs().max().item() < 2e-7


def test_exp2_32_special_values_and_range_ends():
    t = torch.tensor([math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, 3.0, -127.0, -200.0, 128.5, 1e4,
                      -3.4e38])
    got = torch.from_numpy(_exp2_all(t.numpy()))
    assert got[:2].isnan().all()
    assert got[2] == math.inf and got[3] == 0.0
    assert got[4] == 1.0 and got[5] == 1.0  # exactly: P of a row's max is 1
    assert got[6] == 0.5 and got[7] == 8.0
    assert (got[8:10] == 0.0).all() and (got[10:12] == math.inf).all() and got[12] == 0.0


NONPOSITIVE = torch.cat([torch.empty(1 << 20).uniform_(-87.3, 0.0, generator=torch.Generator().manual_seed(6)),
                         -torch.linspace(0, 4, 40001), -torch.arange(1, 126) * math.log(2)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_exp_nonpositive_is_as_precise_as_the_result_dtype_needs(dtype):
    like = kernel_view(torch.empty(1, dtype=dtype))
    got = torch.from_numpy(_exp_like_all(NONPOSITIVE.numpy(), like, True))
    want = NONPOSITIVE.double().exp()
    rel = ((got.double() - want) / want).abs().max().item()
    if dtype == torch.float32:  # the degree-5 polynomial, at least as precise as exp32
        assert rel < 2e-7
        return
    assert 2e-7 < rel < 3.2e-6  # the degree-4 polynomial and r = d - n ln2 with one float32 ln2: 1/150 of half an ulp


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_exp_nonpositive_special_values(dtype):
    d = torch.tensor([0.0, -0.0, -1e-30, -88.0, -88.5, -200.0, -math.inf, math.nan, -3.4e38, -87.3])
    got = torch.from_numpy(_exp_like_all(d.numpy(), kernel_view(torch.empty(1, dtype=dtype)), True))
    assert got[0] == 1.0 and got[1] == 1.0 and got[2] == 1.0  # exactly: P of a row's max is 1
    assert (got[3:7] == 0.0).all() and got[8] == 0.0  # masked logits give exactly 0
    assert got[7].isnan()
    assert got[9].item() == pytest.approx(math.exp(-87.3), rel=3e-6)  # a normal result near the end


EXP_ARGUMENTS = torch.cat([torch.empty(1 << 20).uniform_(-87.3, 88.7, generator=torch.Generator().manual_seed(7)),
                           torch.linspace(-1, 1, 20001)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_exp_for_is_as_precise_as_the_result_dtype_needs(dtype):
    got = torch.from_numpy(_exp_like_all(EXP_ARGUMENTS.numpy(), kernel_view(torch.empty(1, dtype=dtype)), False))
    want = EXP_ARGUMENTS.double().exp()
    rel = ((got.double() - want) / want).abs()
    if dtype == torch.float32:  # exp32: no rounding of the argument
        assert rel.max().item() < 5e-7
        return
    below = EXP_ARGUMENTS < 88.37  # exp2_32's polynomial range ends at 2**127.5
    bound = 1.23 * EXP_ARGUMENTS.double().abs() * 2**-24 + 2e-7  # rounding x * log2 e, exp2_32's polynomial
    assert (rel[below] <= bound[below]).all()
    assert rel.max().item() < 6e-5  # above: still 1/36 of half a bfloat16 ulp
    assert rel[below].max().item() > 2e-6  # the rounding of x * log2 e shows at large |x|: this is not exp32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_exp_for_special_values(dtype):
    x = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 89.0, -88.0, -1e4])
    got = torch.from_numpy(_exp_like_all(x.numpy(), kernel_view(torch.empty(1, dtype=dtype)), False))
    assert got[0].isnan() and got[1] == math.inf and got[2] == 0.0
    assert got[3] == 1.0 and got[4] == 1.0 and got[5] == math.inf
    assert (got[6:] == 0.0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_narrow_ftz_is_narrow_above_the_smallest_normal(dtype):
    g = torch.Generator().manual_seed(5)
    v = torch.cat([torch.randn(1 << 16, generator=g) * 10, torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0,
                                                                       1.0 + 2**-8, 1.0 + 3 * 2**-8, 65504.0, 2**-126,
                                                                       3e38, 1e-40, -1e-42])])
    exact, fast = torch.empty(v.shape, dtype=dtype), torch.empty(v.shape, dtype=dtype)
    _narrow_all(v.numpy(), kernel_view(exact))
    _narrow_ftz_all(v.numpy(), kernel_view(fast))
    tiny = v.abs() < 2**-126
    assert_same_floats(fast[~tiny], exact[~tiny])
    if dtype == torch.bfloat16 and HAS_AVX512_BF16:
        assert (fast[tiny] == 0).all()
    else:
        assert_same_floats(fast[tiny], exact[tiny])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fast", [False, True])
def test_narrow_finite_and_fast_are_narrow_off_nans(dtype, fast):
    v = narrow_inputs()
    exact, got = torch.empty(v.shape, dtype=dtype), torch.empty(v.shape, dtype=dtype)
    _narrow_all(v.numpy(), kernel_view(exact))
    _narrow_finite_all(v.numpy(), kernel_view(got), fast)
    kept = ~v.isnan()
    if fast and dtype == torch.bfloat16 and HAS_AVX512_BF16:
        kept &= v.abs() >= 2**-126
    assert kept.sum() > v.numel() * 0.9
    assert_same_floats(got[kept], exact[kept])


def test_fmaximum_reduction_propagates_nan_and_finds_the_max():
    v = np.random.default_rng(2).standard_normal(1001).astype(np.float32)
    assert _max_all(v) == v.max()
    v[500] = np.nan
    assert np.isnan(_max_all(v))
    assert _max_all(np.full(7, -np.inf, np.float32)) == -np.inf


def test_fmax_any_nan_finds_the_max():
    v = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    assert _max_all(v, False) == v.max()
    assert _max_all(np.full(5, -np.inf, np.float32), False) == -np.inf


@njit
def _prefetch_sum(a, into_l2):
    total = np.float32(0.0)
    for i in range(a.size):  # hints only: the sum must not change
        if into_l2:
            prefetch_l2(a.ctypes.data + 4 * min(i + 64, a.size - 1))
        else:
            prefetch(a.ctypes.data + 4 * min(i + 64, a.size - 1))
        total += a[i]
    return total


@njit
def _prefetch_into_l1(a):
    prefetch_bytes(a.ctypes.data, a.nbytes)


@njit
def _prefetch_into_l2(a):
    prefetch_bytes(a.ctypes.data, a.nbytes, True)


@pytest.mark.parametrize("into_l2", [False, True])
def test_prefetch_is_only_a_hint(into_l2):
    a = np.arange(1000, dtype=np.float32)
    assert _prefetch_sum(a, into_l2) == np.float32(a.sum())


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the instruction names are x86's")
def test_prefetch_bytes_picks_the_cache_level():
    a = np.arange(1000, dtype=np.float32)
    hints = {}
    for name, kernel in (("prefetcht0", _prefetch_into_l1), ("prefetcht1", _prefetch_into_l2)):
        kernel(a)
        hints[name] = kernel.inspect_asm(kernel.signatures[0])
    assert "prefetcht0" in hints["prefetcht0"] and "prefetcht1" not in hints["prefetcht0"]
    assert "prefetcht1" in hints["prefetcht1"] and "prefetcht0" not in hints["prefetcht1"]


@njit
def _copy_at(dst, src, offset, nbytes, stream):
    copy_row(dst.ctypes.data + offset, src.ctypes.data + 3, nbytes, stream)
    stream_fence()


@pytest.mark.parametrize("stream", [False, True])
def test_copy_row_writes_exactly_the_requested_bytes(stream):
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, 600, dtype=np.uint8)
    for offset in range(0, 130, 7):  # every alignment of the destination's head and tail
        for nbytes in (0, 1, 63, 64, 65, 127, 128, 129, 200, 513):
            dst = np.zeros(1024, dtype=np.uint8)
            _copy_at(dst, src, offset, nbytes, stream)
            expected = np.zeros(1024, dtype=np.uint8)
            expected[offset:offset + nbytes] = src[3:3 + nbytes]
            assert np.array_equal(dst, expected), (offset, nbytes)


@njit
def _select_bits_at(bits, byte, shift, value, out, at):
    select_bits(bits.ctypes.data + byte, shift, value, out.ctypes.data + at * 4)


def test_select_bits_expands_sixteen_bits_at_every_offset():
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 256, 40, dtype=np.uint8)
    flat = np.unpackbits(bits, bitorder="little")
    value = np.float32(1.0) / np.float32(0.7)
    for byte in (0, 5, 36):  # 36: the last four bytes
        for shift in range(8):
            out = np.full(20, -1.0, np.float32)
            _select_bits_at(bits, byte, shift, value, out, 3)
            start = 8 * byte + shift
            expected = np.where(flat[start:start + 16] == 1, value, np.float32(0.0))
            assert np.array_equal(out[3:19], expected), (byte, shift)
            assert (out[:3] == -1).all() and (out[19:] == -1).all()


def test_streams_only_outputs_larger_than_the_threshold():
    assert streams(STREAM_MIN_BYTES) and not streams(STREAM_MIN_BYTES - 1)


@njit(fastmath=FASTMATH)
def _smallest_positive_of(v):
    acc = NO_POSITIVE
    for i in range(v.size):
        acc = track_smallest_positive(acc, v[i])
    return smallest_positive(acc)


def test_smallest_positive_skips_zeros_negatives_and_nans():
    rng = np.random.default_rng(3)
    v = (rng.standard_normal(1003) * 1e-30).astype(np.float32)  # odd size: the vector loop's remainder too
    v[::5] = 0.0
    v[7], v[11], v[13] = np.nan, -np.inf, np.inf
    v[600] = np.float32(1e-44)  # a subnormal is the smallest
    positive = v[(v > 0) & np.isfinite(v)]
    assert _smallest_positive_of(v) == np.float32(1e-44)
    v[600] = 1.0
    assert _smallest_positive_of(v) == positive[positive != np.float32(1e-44)].min()
    assert _smallest_positive_of(np.zeros(9, np.float32)) == 0.0
    for no_positive in ([0.0, -2.0, -0.0], [-1.0, -np.inf], [np.nan, 0.0], [-np.nan]):
        assert not _smallest_positive_of(np.array(no_positive, np.float32)) > 0
    assert _smallest_positive_of(np.array([np.nan, np.float32(2.0**-149), 3.0], np.float32)) == np.float32(2.0**-149)


@njit
def _aligned(shape, dtype):
    return aligned_empty(shape, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.uint16, np.int16, np.uint8])
@pytest.mark.parametrize("shape", [(1,), (301,), (3, 1031), (2, 3, 5)])
def test_aligned_empty_starts_on_a_cache_line(dtype, shape):
    for _ in range(5):
        a = _aligned(shape, dtype)
        assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous
        assert a.ctypes.data % 64 == 0
        a[...] = 7  # the whole array is writable memory of its own
        assert (a == 7).all()


@njit
def _through_unowned(a):
    v = unowned(a)
    total = 0.0
    for i in range(v.shape[0]):
        for j in range(v.shape[1]):
            for k in range(v.shape[2]):
                total += v[i, j, k]
    v[1, 0, 2] = -1.0
    return total, v.shape, v.strides


def test_unowned_views_the_array_with_its_strides():
    a = np.arange(2 * 6 * 5, dtype=np.float32).reshape(2, 6, 5)[:, ::2, 1:]
    want = float(a.sum())
    total, shape, strides = _through_unowned(a)
    assert total == want and shape == a.shape and strides == a.strides
    assert a[1, 0, 2] == -1.0


@njit
def _transposed_serial(src, dst, stream):
    transpose_matrix(src.ctypes.data, src.strides[0], dst.ctypes.data, dst.strides[0], src.shape[0], src.shape[1],
                     src, stream)
    stream_fence()


def _aligned_full(shape, value, dtype):
    """np.full(shape, value, dtype) starting on a 64-byte boundary."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(size + 64, np.uint8)
    start = -raw.ctypes.data % 64
    out = raw[start:start + size].view(dtype).reshape(shape)
    out[...] = value
    return out


@njit(parallel=True)
def _transposed_parallel(src, dst):  # one matrix per prange task, as the flash attention kernels call it
    for m in prange(src.shape[0]):
        transpose_matrix(src[m].ctypes.data, src.strides[1], dst[m].ctypes.data, dst.strides[1], src.shape[1],
                         src.shape[2], src)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.uint32, np.uint16, np.int16])
@pytest.mark.parametrize("shape", [(16, 16), (32, 48), (200, 96), (37, 21), (5, 3), (1, 17), (0, 4)])
def test_transpose_matrix_whole_blocks_and_edges(dtype, shape, stream):
    """Whole 16 x 16 blocks and the edges; with ``stream`` the 4-byte blocks whose destination rows are 64-byte
    aligned go through non-temporal stores ((16, 16), (32, 48): pitches of 64 and 128 bytes), the others through
    plain ones, with the same result."""
    rng = np.random.default_rng(0)
    # rows of a wider array: the source pitch is not its width
    wide = rng.integers(0, 30000, (shape[0], shape[1] + 7)).astype(dtype)
    src = wide[:, 3:3 + shape[1]]
    dst = _aligned_full(shape[::-1], 99, dtype)
    _transposed_serial(src, dst, stream)
    np.testing.assert_array_equal(dst, src.T)
    stack = rng.integers(0, 30000, (3, *shape)).astype(dtype)
    out = np.full((3, *shape[::-1]), 99, dtype)
    _transposed_parallel(stack, out)
    np.testing.assert_array_equal(out, stack.transpose(0, 2, 1))


@njit
def _products_around_flush(a, b):
    """a[k] * b[k] before (k = 0), while (1) and after (2) denormals are flushed; three pairs of loads, so that
    the compiler cannot compute one product for all three."""
    out = np.empty(3, np.float32)
    out[0] = a[0] * b[0]
    mode = flush_denormals()
    out[1] = a[1] * b[1]
    restore_float_mode(mode)
    out[2] = a[2] * b[2]
    return out


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the flush mode is x86's MXCSR")
def test_flush_denormals_until_the_mode_is_restored():
    a, b = np.full(3, 1e-38, np.float32), np.full(3, 0.01, np.float32)  # the product, 1e-40, is subnormal
    before, flushed, after = _products_around_flush(a, b)
    assert before == after == a[0] * b[0] > 0
    assert flushed == 0
    assert np.float32(1e-38) * np.float32(0.01) > 0  # this thread's own mode is the one it had
