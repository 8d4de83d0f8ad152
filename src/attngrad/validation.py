"""The one vocabulary of parameter checks shared by every operator contract.

Each helper raises :class:`~attngrad.errors.AclnnError` with CANN's status and a message of the form
``"<op>: <param> <rule>, got <value>"``. Contracts call them in CANN's check order; nothing else in the
library re-implements a check.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from .errors import ACLNN_ERR_PARAM_INVALID, ACLNN_ERR_PARAM_NULLPTR, AclnnError

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MASK_DTYPES = (torch.bool, torch.uint8)

_DTYPE_NAMES = {
    torch.float32: "FLOAT",
    torch.float16: "FLOAT16",
    torch.bfloat16: "BFLOAT16",
    torch.bool: "BOOL",
    torch.uint8: "UINT8",
    torch.int8: "INT8",
    torch.int16: "INT16",
    torch.int32: "INT32",
    torch.int64: "INT64",
    torch.float64: "DOUBLE",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", "").upper())


def invalid(op: str, param: str | None, rule: str, value=None) -> AclnnError:
    """Build the 161002 error for ``param`` breaking ``rule``."""
    where = f"{op}: {param} " if param else f"{op}: "
    got = "" if value is None else f", got {value}"
    return AclnnError(ACLNN_ERR_PARAM_INVALID, f"{where}{rule}{got}", param)


def require_tensor(op: str, name: str, t, status: int = ACLNN_ERR_PARAM_NULLPTR) -> torch.Tensor:
    """A required tensor must be given (CANN: nullptr -> 161001 unless the operator says otherwise)."""
    if t is None:
        raise AclnnError(status, f"{op}: {name} must not be null (None)", name)
    if not isinstance(t, torch.Tensor):
        raise invalid(op, name, "must be a torch.Tensor", type(t).__name__)
    if t.device.type != "cpu":
        raise invalid(op, name, "must be a CPU tensor", t.device)
    if t.layout != torch.strided:  # sparse / mkldnn tensors have no strided memory for the kernels
        raise invalid(op, name, "must be a dense (strided) tensor", t.layout)
    # e.g. z.conj().imag: the memory holds -t; the kernels read memory (dynamo cannot trace is_neg(), and a
    # traced graph's inputs are materialised)
    if not torch.compiler.is_compiling() and t.is_neg():
        raise invalid(op, name, "must not carry torch's lazy negation bit (call .resolve_neg() first)",
                      "is_neg() == True")
    return t


def check_output_view(op: str, name: str, t: torch.Tensor) -> None:
    """An output written in place must not overlap itself (a dim of size > 1 with stride 0; empty is fine)."""
    if t.numel() and any(size > 1 and stride == 0 for size, stride in zip(t.shape, t.stride())):
        raise invalid(op, name, "must not overlap itself (a dim of size > 1 has stride 0)",
                      f"shape {list(t.shape)}, strides {list(t.stride())}")


def check_dtype(op: str, name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(dtype_name(d) for d in allowed)
        raise invalid(op, name, f"dtype must be one of [{names}]", dtype_name(t.dtype))


def check_same_dtype(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise invalid(op, name, f"dtype must equal {ref_name}'s dtype {dtype_name(ref.dtype)}",
                      dtype_name(t.dtype))


def check_rank(op: str, name: str, t: torch.Tensor, ranks: Iterable[int]) -> None:
    ranks = tuple(ranks)
    if t.dim() not in ranks:
        want = " or ".join(f"{r}-D" for r in ranks)
        raise invalid(op, name, f"must be {want}", f"{t.dim()}-D shape {list(t.shape)}")


def check_shape(op: str, name: str, t: torch.Tensor, expected: Sequence[int], why: str = "") -> None:
    if tuple(t.shape) != tuple(expected):
        rule = f"shape must be {list(expected)}" + (f" ({why})" if why else "")
        raise invalid(op, name, rule, list(t.shape))


def check_dim_broadcast(op: str, name: str, t: torch.Tensor, dim: int, target: int, ref_name: str) -> None:
    """CANN broadcast rule for one dim: size 1 or equal to the target's size."""
    size = t.shape[dim]
    if size not in (1, target):
        raise invalid(op, name, f"dim {dim} must be 1 or {ref_name}'s size {target} (broadcast rule)",
                      f"{size} in shape {list(t.shape)}")


def check_dim_equal(op: str, name: str, t: torch.Tensor, dim: int, target: int, ref_name: str) -> None:
    if t.shape[dim] != target:
        raise invalid(op, name, f"dim {dim} must equal {ref_name}'s size {target}",
                      f"{t.shape[dim]} in shape {list(t.shape)}")


def check_range(op: str, name: str, value, low=None, high=None, *, low_open=False, high_open=False) -> None:
    """``value`` must lie in the interval [low, high]; either end may be open or absent."""
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if below or above or value != value:
        lo = "(-inf" if low is None else ("(" if low_open else "[") + f"{low}"
        hi = "+inf)" if high is None else f"{high}" + (")" if high_open else "]")
        raise invalid(op, name, f"must be in {lo}, {hi}", value)


def check_choice(op: str, name: str, value, allowed: Iterable) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise invalid(op, name, f"must be one of {list(allowed)}", repr(value))


def check_int(op: str, name: str, value) -> int:
    """Integer attributes (tokens, modes, head counts) must be integers, not floats or bools."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise invalid(op, name, "must be an integer", repr(value))
    value = int(value)
    if not -2**63 <= value < 2**63:  # CANN's integer attributes are int64_t
        raise invalid(op, name, "must fit in int64", value)
    return value


def check_float(op: str, name: str, value) -> float:
    """Real attributes (scale, keep_prob) must be real numbers, not bools or strings."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise invalid(op, name, "must be a real number", repr(value))
    try:
        return float(value)
    except OverflowError:  # a Python int beyond the double range
        raise invalid(op, name, "must be representable as a double", value) from None


def check_int_list(op: str, name: str, values) -> list[int] | None:
    """prefix / start indices / sequence lengths: a list (or 1-D integer CPU tensor) of integers."""
    if values is None:
        return None
    if isinstance(values, torch.Tensor):
        values = check_int_tensor(op, name, values).tolist()
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise invalid(op, name, "must be a list of integers", repr(values))
    return [check_int(op, name, v) for v in values]


def check_int_tensor(op: str, name: str, values: torch.Tensor) -> torch.Tensor:
    """An integer list given as a tensor: 1-D (or 0-D), on the CPU, of an integer dtype (values not read)."""
    if values.device.type != "cpu" or values.dim() > 1 or values.dtype.is_floating_point \
            or values.dtype.is_complex or values.dtype == torch.bool:
        raise invalid(op, name, "must be a 1-D integer list (or CPU integer tensor)",
                      f"{values.dim()}-D {values.dtype} on {values.device}")
    return values


def is_int64(value) -> bool:
    """A Python int (not a bool) within CANN's int64_t range."""
    return isinstance(value, int) and not isinstance(value, bool) and -2**63 <= value < 2**63


def is_real(value) -> bool:
    """An int64 integer or a Python float: a value a ``float`` op argument takes as it is."""
    return is_int64(value) or isinstance(value, float)
