"""Helpers shared by the test files: seeded random inputs, raw-bit comparisons, aclTensor wrapping."""

from __future__ import annotations

import contextlib

import torch

from attngrad import aclnn
from attngrad.kernels.gemm import BRGEMM_DTYPES
from attngrad.kernels.gemm_paths import WIDENED, gemm_path
from attngrad.ops.flash_attention import from_bnsd


def same_up_to_gemm_order(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether two flash-attention results of one problem with differently placed operands (strided views vs
    contiguous copies, a varlen batch vs its own BNSD call) agree. Bit for bit where the kernels' GEMMs on
    ``dtype`` are torch's float32 brgemm, on float32 or widened tiles (fixed summation order). MKL's bf16/fp16
    GEMMs pick their kernel by leading dimension and row alignment, so the fp32 order may differ, and a last-bit
    change can move a rounding of P or dS by one ulp, whose effect on a sum is bounded by that ulp times the
    sum's scale: then within two ulps of ``dtype`` relative to the largest magnitude (fp32 results within 1e-5)."""
    if want.numel() == 0 or (torch.float32 in BRGEMM_DTYPES
                             and (dtype == torch.float32 or gemm_path(dtype) == WIDENED)):
        return torch.equal(got, want)
    tolerance = 2 * torch.finfo(dtype).eps if got.dtype == dtype else 1e-5
    got, want = got.float(), want.float()
    return torch.allclose(got, want, rtol=tolerance, atol=tolerance * float(want.abs().max().clamp_min(1e-30)))


@contextlib.contextmanager
def torch_threads(n: int):
    """Run the block with ``torch.set_num_threads(n)`` (which the kernels follow), restoring torch's count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def random_tensors(shapes, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """One standard-normal tensor per shape, drawn in order from one generator seeded with ``seed``, rounded
    to ``dtype`` (so a float64 reference sees exactly the values the kernels see)."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=g).to(dtype) for shape in shapes)


def attention_inputs(layout: str, b: int, n1: int, n2: int, sq: int, skv: int, d: int, dv: int,
                     dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random q ``[B, N1, Sq, D]``, k ``[B, N2, Skv, D]``, v ``[B, N2, Skv, Dv]``, dy ``[B, N1, Sq, Dv]``
    (BNSD shapes), returned in ``layout`` (BSH, SBH, BSND or BNSD)."""
    shapes = ((b, n1, sq, d), (b, n2, skv, d), (b, n2, skv, dv), (b, n1, sq, dv))
    return tuple(from_bnsd(t, layout) for t in random_tensors(shapes, dtype, seed))


def varlen_inputs(q_lens, kv_lens, n1: int, n2: int, d: int, dv: int, dtype: torch.dtype, seed: int = 0,
                  extra: tuple[int, int] = (0, 0)) -> tuple[torch.Tensor, ...]:
    """Random TND q ``[T1, N1, D]``, k ``[T2, N2, D]``, v ``[T2, N2, Dv]``, dy ``[T1, N1, Dv]`` for per-batch
    lengths ``q_lens`` / ``kv_lens`` (not cumulative), with ``T = the totals + extra`` rows."""
    t1, t2 = sum(q_lens) + extra[0], sum(kv_lens) + extra[1]
    return random_tensors(((t1, n1, d), (t2, n2, d), (t2, n2, dv), (t1, n1, dv)), dtype, seed)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor (for bit-exact comparisons, nan included)."""
    return t.detach().contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
                                        [t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def acl(value, fmt: int = aclnn.ACL_FORMAT_ND):
    """A tensor wrapped as an aclTensor of format ``fmt``; anything else (None for nullptr, scalars) as it is."""
    return aclnn.AclTensor.from_torch(value, fmt) if isinstance(value, torch.Tensor) else value
