"""Shared generators and child-process entry points of the reliability suite.

Every operator is described once by an :class:`Op`: its parameters (with the name the contract uses in
its messages and the name of the aclnn argument), a builder of a small VALID call, its aclnn outputs,
one caller per entry point ("torch", "npu", "npu_v2", "aclnn" = the V2 two-phase API, "aclnn_v1") and
a success check against the float64 reference. A case is a JSON-able tuple
``(op, layer, dtype, seed, mutations)``: the valid call, then 1-2 generic mutations (wrong dtype, rank,
dims, layout, non-tensors, meta/sparse tensors, bad attributes, overlapping outputs, ...).

:func:`run_case` judges a case by one rule (bad input never crashes nor returns wrong data): the call either fails with
``AclnnError`` (torch / npu layers; the status is 161001/161002 and ``err.param`` names a parameter of
the operator) or with such a status and ``aclGetRecentErrMsg`` naming a parameter (aclnn layer, which
never raises and then leaves its outputs untouched), or it succeeds and the result matches the float64
reference. Nothing else is allowed: no other exception type, no wrong data.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import attngrad
from attngrad import AclnnError, aclnn, npu
from attngrad.kernels.exp_segsum_reference import (exp_segsum_backward_reference, exp_segsum_reference,
                                                   saturate)
from attngrad.kernels.flash_attention_plan import AttentionPlan
from attngrad.kernels.flash_attention_reference import (flash_attention_backward_reference,
                                                         flash_attention_forward_reference)
from attngrad.kernels.scaled_masked_softmax_reference import (scaled_masked_softmax_backward_reference,
                                                               scaled_masked_softmax_reference)
from attngrad.ops.flash_attention import from_bnsd, to_bnsd
from attngrad.precision import NORM_REL_TOL, assert_close, compare

from helpers import same_bits

NULL, INVALID, SUCCESS = aclnn.ACLNN_ERR_PARAM_NULLPTR, aclnn.ACLNN_ERR_PARAM_INVALID, aclnn.ACLNN_SUCCESS
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FLOATS = tuple(DTYPES.values())
SENTINEL = 7.0  # aclnn outputs are filled with it: a rejected call must leave it there


# ------------------------------------------------------------------------------------------ parameters
@dataclass(frozen=True)
class Param:
    """One argument. ``name``: torch-layer keyword; ``cann``: the name the contract's messages use;
    ``acl``: the aclnn wrapper's name; ``kind`` selects the mutation catalog; ``layers``: where it exists;
    ``required``: a None here must be 161001 naming it (in these layers)."""

    name: str
    cann: str
    kind: str
    acl: str = ""
    layers: tuple = ("torch", "npu", "npu_v2", "aclnn", "aclnn_v1")
    required: tuple = ()

    @property
    def acl_name(self) -> str:
        return self.acl or self.cann


ALL = ("torch", "npu", "npu_v2", "aclnn", "aclnn_v1")
ACL = ("aclnn", "aclnn_v1")
V2 = ("torch", "npu_v2", "aclnn")


@dataclass
class Op:
    name: str
    params: tuple
    outs: tuple                      # aclnn outputs (Params of kind "out" / "stats_out")
    build: Callable                  # (rng, dtype, layer) -> valid args dict
    out_specs: Callable              # args -> {name: (shape, dtype)} of the aclnn outputs
    callers: dict                    # layer -> (args, outs) -> {result name: tensor}
    check: Callable                  # (args, results) -> None; asserts the result is the golden
    extra_names: tuple = ()          # other parameter names messages may use (derived quantities)
    data_names: tuple = field(default=())  # float tensors that share the input dtype ("all_dtype")

    @property
    def layers(self) -> tuple:
        return tuple(self.callers)

    def known_names(self) -> set:
        names = set(self.extra_names)
        for p in self.params + self.outs:
            names |= {p.name, p.cann, p.acl_name}
        return names

    def mutable(self, layer: str) -> list:
        ps = [p for p in self.params if layer in p.layers]
        if layer in ACL:
            ps += list(self.outs)
        return ps + [Param("*", "*", "all")]


# ------------------------------------------------------------------------------------------ mutations
def _float_tensor(shape, dtype, rng: random.Random) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    t = torch.randn(tuple(shape), generator=g) * 0.5
    if dtype == torch.bool:
        return t > 0
    if dtype.is_complex or dtype.is_floating_point:
        return t.to(dtype)
    return (t * 4).to(dtype)


def _like(t: torch.Tensor, shape, rng) -> torch.Tensor:
    return _float_tensor(shape, t.dtype, rng)


def _noncontig(t: torch.Tensor, rng) -> torch.Tensor:
    """Same shape and values, non-contiguous strides (every element still distinct in memory)."""
    if not t.dim():
        return t.clone()
    if t.dim() >= 2 and rng.random() < 0.5:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


def _neg_bit(t: torch.Tensor) -> torch.Tensor:
    """The same values carried by a tensor with torch's lazy negation bit (``z.conj().imag``)."""
    if t.dtype != torch.float32:
        return t
    z = torch.complex(torch.zeros_like(t), -t)
    return z.conj().imag


def _with_dim(t, rng):
    if not t.dim():
        return t
    shape = list(t.shape)
    dim = rng.randrange(len(shape))
    shape[dim] = rng.choice([v for v in (0, 1, 2, 3, 5, 7) if v != shape[dim]])
    return _like(t, shape, rng)


def _overlap(t, rng):
    """An output view where two indices share memory (stride 0 on a dim of size > 1)."""
    dims = [d for d, s in enumerate(t.shape) if s > 1]
    if not dims:
        return t
    d = rng.choice(dims)
    base = torch.full([1 if i == d else s for i, s in enumerate(t.shape)], SENTINEL, dtype=t.dtype)
    return base.expand(t.shape)


def _smaller_stats(t, rng):
    return _like(t, list(t.shape[:-1]) + [rng.choice([1, 4, 16])], rng) if t.dim() else t


NOT_TENSOR = {"list": lambda t, r: t.tolist() if isinstance(t, torch.Tensor) else [1.0],
              "str": lambda t, r: "tensor", "int": lambda t, r: 3, "float": lambda t, r: 1.5,
              "numpy": lambda t, r: t.numpy() if isinstance(t, torch.Tensor) and t.dtype != torch.bfloat16
              else np.zeros((2, 2), np.float32),
              "tuple": lambda t, r: (t,)}
DEVICE = {"meta": lambda t, r: t.to("meta") if isinstance(t, torch.Tensor) else torch.zeros(2, device="meta"),
          "sparse": lambda t, r: t.to_sparse() if isinstance(t, torch.Tensor) and t.dim()
          else torch.zeros(2, 2).to_sparse()}
BAD_DTYPES = {f"dtype_{n}": (lambda d: lambda t, r: t.to(d) if isinstance(t, torch.Tensor) else t)(d)
              for n, d in (("int32", torch.int32), ("int64", torch.int64), ("float64", torch.float64),
                           ("complex64", torch.complex64), ("uint8", torch.uint8), ("int8", torch.int8))}
BAD_DTYPES["dtype_bool"] = lambda t, r: t > 0 if isinstance(t, torch.Tensor) else t
FLOAT_DTYPES = {f"dtype_{n}": (lambda d: lambda t, r: t.to(d) if isinstance(t, torch.Tensor) else t)(d)
                for n, d in (("float32", torch.float32), ("float16", torch.float16), ("bfloat16", torch.bfloat16))}
SHAPES = {"rank_up": lambda t, r: t.unsqueeze(0), "rank_down": lambda t, r: t.flatten(0, 1) if t.dim() > 1 else t.sum(),
          "rank_5": lambda t, r: _like(t, [1, 1, 2, 2, 2], r), "dim": _with_dim,
          "zero_dim": lambda t, r: t.reshape(-1)[0].clone() if t.numel() else t.sum()}
VALID_VIEWS = {"noncontig": _noncontig, "requires_grad": lambda t, r: (t.detach().clone().requires_grad_(True)
                                                                      if t.dtype.is_floating_point else t),
               "neg_bit": lambda t, r: _neg_bit(t)}
NULL_MUT = {"null": lambda t, r: None}


def _consts(values: dict) -> dict:
    return {label: (lambda v: lambda t, r: v)(v) for label, v in values.items()}


FLOAT_ATTRS = _consts({"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "-1": -1.0, "0": 0.0,
                       "half": 0.5, "2": 2.0, "1e308": 1e308, "int_huge": 2**1100, "str": "0.5", "none": None,
                       "bool": True, "list": [1.0], "complex": 1j, "np32": np.float32(0.25),
                       "np64": np.float64(2.0), "tensor": torch.tensor(0.5), "int": 3})
INT_ATTRS = _consts({"-1": -1, "0": 0, "1": 1, "2": 2, "3": 3, "7": 7, "65536": 65536, "i32max": 2**31 - 1,
                     "2^31": 2**31, "-2^31": -2**31, "2^63": 2**63, "-2^63-1": -2**63 - 1, "2^100": 2**100,
                     "float": 1.0, "frac": 2.5, "true": True, "false": False, "str": "1", "none": None,
                     "np64": np.int64(2), "np32": np.int32(1), "tensor": torch.tensor(1), "list": [1]})
BOOL_ATTRS = _consts({"true": True, "false": False, "0": 0, "1": 1, "none": None, "str": "false",
                      "npbool": np.bool_(False)})
STR_ATTRS = _consts({"empty": "", "lower": "bnsd", "space": "BNSD ", "xyz": "XYZ", "TND": "TND", "BSH": "BSH",
                     "SBH": "SBH", "BSND": "BSND", "BNSD": "BNSD", "none": None, "int": 3, "bytes": b"BNSD",
                     "list": ["BNSD"]})
INTS_ATTRS = _consts({"none": None, "empty": [], "zero": [0], "pair": [1, 2], "neg": [-1], "huge": [2**70],
                      "frac": [1.5], "str": "abc", "int": 5, "tensor": torch.tensor([1, 2]),
                      "ftensor": torch.tensor([1.0]), "2d": torch.tensor([[1]]), "none_in": [None],
                      "npy": np.array([1, 2]), "bool_in": [True]})


def _on_tensor(catalog: dict) -> dict:
    """Tensor mutations applied to an absent optional tensor act on a small float32 one instead."""
    def wrap(fn):
        return lambda t, r: fn(t if isinstance(t, torch.Tensor) else torch.zeros(1, 1, 2, 2), r)
    return {label: wrap(fn) for label, fn in catalog.items()}


BAD_DTYPES, FLOAT_DTYPES, SHAPES, VALID_VIEWS, DEVICE = (_on_tensor(c) for c in (BAD_DTYPES, FLOAT_DTYPES, SHAPES,
                                                                                 VALID_VIEWS, DEVICE))
_overlap, _noncontig, _smaller_stats = (_on_tensor({"f": f})["f"] for f in (_overlap, _noncontig, _smaller_stats))
CATALOGS = {
    "data": {**NULL_MUT, **NOT_TENSOR, **DEVICE, **BAD_DTYPES, **FLOAT_DTYPES, **SHAPES, **VALID_VIEWS},
    "mask": {**NULL_MUT, **NOT_TENSOR, **DEVICE, **BAD_DTYPES, **FLOAT_DTYPES, **SHAPES, "noncontig": _noncontig},
    "opt": {**NULL_MUT, **NOT_TENSOR, **DEVICE, "dtype_complex64": BAD_DTYPES["dtype_complex64"],
            "dtype_float64": BAD_DTYPES["dtype_float64"], "rank_5": SHAPES["rank_5"]},
    "stats": {**NULL_MUT, **NOT_TENSOR, **DEVICE, **BAD_DTYPES, **FLOAT_DTYPES, **SHAPES, **VALID_VIEWS,
              "smaller": _smaller_stats},
    "out": {**NULL_MUT, **NOT_TENSOR, **DEVICE, **BAD_DTYPES, **FLOAT_DTYPES, **SHAPES, "overlap": _overlap,
            "noncontig": _noncontig, "requires_grad": VALID_VIEWS["requires_grad"]},
    "float": FLOAT_ATTRS, "int": INT_ATTRS, "bool": BOOL_ATTRS, "str": STR_ATTRS, "ints": INTS_ATTRS,
    "all": {k: v for k, v in FLOAT_DTYPES.items()},
}
# single mutations of a present required tensor that can never be valid
ALWAYS_INVALID = set(NOT_TENSOR) | set(DEVICE) | {"dtype_int32", "dtype_int64", "dtype_float64", "dtype_complex64",
                                                  "dtype_uint8", "dtype_int8", "dtype_bool"}
ALWAYS_VALID = {"noncontig", "requires_grad"}


# ------------------------------------------------------------------------------------------ aclnn calls
def as_acl(value):
    """A torch tensor as an aclTensor (zero copy) when it can be wrapped; anything else as it is."""
    if isinstance(value, torch.Tensor):
        try:
            return aclnn.AclTensor.from_torch(value)
        except Exception:  # sparse / unsupported dtype: hand the raw object to the operator
            return value
    return value


def run_two_phase(pair, *args) -> int:
    """Both aclnn phases; the aclnn layer must never raise."""
    get_ws, execute = pair
    status, ws, executor = get_ws(*(as_acl(a) for a in args))
    if status != SUCCESS:
        assert executor is None
        return status
    assert ws == 0 and aclnn.aclGetRecentErrMsg() == ""
    return execute(None, ws, executor, None)


def make_outs(op: Op, args: dict) -> dict:
    return {name: torch.full(shape, SENTINEL, dtype=dtype) for name, (shape, dtype) in op.out_specs(args).items()}


# ------------------------------------------------------------------------------------- ScaledMaskedSoftmax
def _sms_shape(rng):
    return [rng.choice([1, 2, 3]), rng.choice([1, 2, 3]), rng.choice([1, 2, 5]), rng.choice([1, 3, 8, 17])]


def _sms_mask(shape, rng):
    lead = rng.choice([shape[:2], [1, shape[1]], [shape[0], 1], [1, 1]])
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    return torch.rand(lead + shape[2:], generator=g) < 0.3


def sms_forward_args(rng, dtype, layer=None) -> dict:
    shape = _sms_shape(rng)
    return {"x": _float_tensor(shape, dtype, rng) * 2, "mask": _sms_mask(shape, rng), "scale": 0.5,
            "fix_triu_mask": False}


def sms_backward_args(rng, dtype, layer=None) -> dict:
    shape = _sms_shape(rng)
    mask = _sms_mask(shape, rng)
    y = scaled_masked_softmax_reference(_float_tensor(shape, dtype, rng), mask, 1.0).to(dtype)
    return {"grad_output": _float_tensor(shape, dtype, rng), "y": y, "mask": mask, "scale": 0.5,
            "fix_triu_mask": False}


def _sms_mask_of(a, data):
    if a["fix_triu_mask"] is True:
        s1, s2 = data.shape[2:]
        return torch.ones(s1, s2, dtype=torch.bool).triu(1).view(1, 1, s1, s2)
    return a["mask"]


def sms_check(a, res, backward: bool):
    data = a["grad_output"] if backward else a["x"]
    out = res["out" if backward else "y"].detach()
    mask = _sms_mask_of(a, data)
    scale = float(a["scale"])
    if backward:
        golden = scaled_masked_softmax_backward_reference(data, a["y"].detach(), mask, scale)
    else:
        golden = scaled_masked_softmax_reference(data.detach(), mask, scale)
    assert out.shape == data.shape and out.dtype == data.dtype, (out.shape, out.dtype)
    assert_close(out, golden, data.dtype, use_mere=True, exact_zero=mask if backward else None)


SMS_ATTRS = (Param("scale", "scale", "float"), Param("fix_triu_mask", "fixTriuMask", "bool"))
SMS_FWD_FN = (aclnn.aclnnScaledMaskedSoftmaxGetWorkspaceSize, aclnn.aclnnScaledMaskedSoftmax)
SMS_BWD_FN = (aclnn.aclnnScaledMaskedSoftmaxBackwardGetWorkspaceSize, aclnn.aclnnScaledMaskedSoftmaxBackward)
SMS_LAYERS = ("torch", "npu", "aclnn")

SMS_FORWARD = Op(
    "scaled_masked_softmax",
    params=(Param("x", "x", "data", layers=SMS_LAYERS, required=SMS_LAYERS),
            Param("mask", "mask", "mask", layers=SMS_LAYERS, required=SMS_LAYERS), *SMS_ATTRS),
    outs=(Param("y", "y", "out", required=ACL),),
    build=sms_forward_args,
    out_specs=lambda a: {"y": (a["x"].shape, a["x"].dtype)},
    callers={
        "torch": lambda a, o: {"y": attngrad.scaled_masked_softmax(a["x"], a["mask"], a["scale"],
                                                                   a["fix_triu_mask"])},
        "npu": lambda a, o: {"y": npu.npu_scaled_masked_softmax(a["x"], a["mask"], a["scale"], a["fix_triu_mask"])},
        "aclnn": lambda a, o: run_two_phase(SMS_FWD_FN, a["x"], a["mask"], a["scale"], a["fix_triu_mask"], o["y"]),
    },
    check=lambda a, r: sms_check(a, r, False),
    extra_names=("last dim (S2)",), data_names=("x",))

SMS_BACKWARD = Op(
    "scaled_masked_softmax_backward",
    params=(Param("grad_output", "gradOutput", "data", layers=SMS_LAYERS, required=SMS_LAYERS),
            Param("y", "y", "data", layers=SMS_LAYERS, required=SMS_LAYERS),
            Param("mask", "mask", "mask", layers=SMS_LAYERS, required=SMS_LAYERS), *SMS_ATTRS),
    outs=(Param("out", "out", "out", required=ACL),),
    build=sms_backward_args,
    out_specs=lambda a: {"out": (a["grad_output"].shape, a["grad_output"].dtype)},
    callers={
        "torch": lambda a, o: {"out": attngrad.scaled_masked_softmax_backward(
            a["grad_output"], a["y"], a["mask"], a["scale"], a["fix_triu_mask"])},
        "npu": lambda a, o: {"out": npu.npu_scaled_masked_softmax_backward(
            a["grad_output"], a["y"], a["mask"], a["scale"], a["fix_triu_mask"])},
        "aclnn": lambda a, o: run_two_phase(SMS_BWD_FN, a["grad_output"], a["y"], a["mask"], a["scale"],
                                            a["fix_triu_mask"], o["out"]),
    },
    check=lambda a, r: sms_check(a, r, True),
    extra_names=("last dim (S2)",), data_names=("grad_output", "y", "out"))


# ------------------------------------------------------------------------------------------ ExpSegsum
def _seg_lead(rng):
    return [rng.choice([1, 2, 3]) for _ in range(rng.choice([2, 3]))]


def seg_forward_args(rng, dtype, layer=None) -> dict:
    return {"x": _float_tensor(_seg_lead(rng) + [rng.choice([1, 2, 5, 9])], dtype, rng)}


def seg_backward_args(rng, dtype, layer=None) -> dict:
    shape = _seg_lead(rng) + [rng.choice([1, 2, 5, 9])]
    grad_self = exp_segsum_reference(_float_tensor(shape, dtype, rng)).to(dtype)
    return {"grad_output": _float_tensor(grad_self.shape, dtype, rng), "grad_self": grad_self}


def seg_check(a, res, backward: bool):
    inputs = (a["grad_output"], a["grad_self"]) if backward else (a["x"],)
    out = res["grad_input" if backward else "out"]
    if any(t.numel() == 0 for t in (*inputs, out)):  # empty result (torch) / CANN's empty fast path (aclnn)
        assert out.numel() == 0 or bool((out == SENTINEL).all()), "empty fast path wrote an output"
        return
    if backward:
        data, out = a["grad_output"], res["grad_input"].detach()
        golden = exp_segsum_backward_reference(data, a["grad_self"].detach())
        assert out.shape == data.shape[:-1]
    else:
        data, out = a["x"], res["out"].detach()
        golden = exp_segsum_reference(data.detach())
        assert out.shape == (*data.shape, data.shape[-1])
    assert out.dtype == data.dtype
    assert_close(out, saturate(golden, data.dtype), data.dtype, use_mere=True)


SEG_LAYERS = ("torch", "aclnn")
SEG_FWD_FN = (aclnn.aclnnExpSegsumGetWorkspaceSize, aclnn.aclnnExpSegsum)
SEG_BWD_FN = (aclnn.aclnnExpSegsumBackwardGetWorkspaceSize, aclnn.aclnnExpSegsumBackward)

SEG_FORWARD = Op(
    "exp_segsum",
    params=(Param("x", "self", "data", layers=SEG_LAYERS, required=SEG_LAYERS),),
    outs=(Param("out", "out", "out", required=ACL),),
    build=seg_forward_args,
    out_specs=lambda a: {"out": ((*a["x"].shape, a["x"].shape[-1]), a["x"].dtype)},
    callers={"torch": lambda a, o: {"out": attngrad.exp_segsum(a["x"])},
             "aclnn": lambda a, o: run_two_phase(SEG_FWD_FN, a["x"], o["out"])},
    check=lambda a, r: seg_check(a, r, False), data_names=("x", "out"))

SEG_BACKWARD = Op(
    "exp_segsum_backward",
    params=(Param("grad_output", "gradOutput", "data", layers=SEG_LAYERS, required=SEG_LAYERS),
            Param("grad_self", "gradSelf", "data", layers=SEG_LAYERS, required=SEG_LAYERS)),
    outs=(Param("grad_input", "gradInput", "out", required=ACL),),
    build=seg_backward_args,
    out_specs=lambda a: {"grad_input": (a["grad_output"].shape[:-1], a["grad_output"].dtype)},
    callers={"torch": lambda a, o: {"grad_input": attngrad.exp_segsum_backward(a["grad_output"], a["grad_self"])},
             "aclnn": lambda a, o: run_two_phase(SEG_BWD_FN, a["grad_output"], a["grad_self"], o["grad_input"])},
    check=lambda a, r: seg_check(a, r, True), data_names=("grad_output", "grad_self", "grad_input"))


# ---------------------------------------------------------------------------------------- FlashAttention
LAYOUTS = ("BSH", "SBH", "BSND", "BNSD")


def fa_geometry(rng, layout: str | None = None) -> dict:
    n2 = rng.choice([1, 2])
    d = rng.choice([1, 2, 4, 8, 16])
    return {"layout": layout or rng.choice(LAYOUTS), "b": rng.choice([1, 2]), "n1": n2 * rng.choice([1, 2]), "n2": n2,
            "sq": rng.choice([1, 2, 3, 5, 8]), "skv": rng.choice([1, 2, 3, 5, 8]), "d": d,
            "dv": rng.choice([d, max(1, d // 2)])}


def fa_tensors(geo: dict, dtype, rng) -> tuple:
    """q, k, v, dy in the geometry's layout (BNSD random data, then laid out)."""
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    shapes = ((geo["n1"], geo["sq"], geo["d"]), (geo["n2"], geo["skv"], geo["d"]),
              (geo["n2"], geo["skv"], geo["dv"]), (geo["n1"], geo["sq"], geo["dv"]))
    return tuple(from_bnsd((torch.randn(geo["b"], *s, generator=g) * 0.7).to(dtype), geo["layout"])
                 for s in shapes)


FA_DEFAULTS = {"pse": None, "drop_mask": None, "padding_mask": None, "atten_mask": None, "prefix": None,
               "q_start_idx": None, "kv_start_idx": None, "scale_value": 0.5, "keep_prob": 1.0,
               "pre_tokens": 2147483647, "next_tokens": 2147483647, "inner_precise": 0, "sparse_mode": 0,
               "pse_type": 1, "softmax_layout": "", "actual_seq_qlen": None, "actual_seq_kvlen": None}


def fa_forward_args(rng, dtype, layer=None, layout: str | None = None, features: bool = False,
                    dropout: bool = True) -> dict:
    """A valid call; with ``features`` (the operator descriptions) some of the valid optional inputs of
    :func:`fa_valid_options` too (``dropout``: an explicit dropMask may be among them)."""
    geo = fa_geometry(rng, layout)
    q, k, v, _ = fa_tensors(geo, dtype, rng)
    a = {"query": q, "key": k, "value": v, "head_num": geo["n1"], "input_layout": geo["layout"], **FA_DEFAULTS}
    if features:
        a |= fa_valid_options(random.Random(rng.randrange(2**31)), geo, dtype, dropout,
                              pse_types=(0, 1) if layer in ("torch", "npu_v2", "aclnn") else (1,))
    return a


COMPRESSED = 2048  # the [2048, 2048] attenMask of sparse modes 2/3/4


def fa_valid_options(rng, geo: dict, dtype, dropout: bool = True, pse_types: tuple = (0, 1)) -> dict:
    """VALID optional inputs, each drawn with probability 1/2: a bool/uint8 attenMask with sparseMode 0..4
    (element-wise [B|1, N1|1, Sq, Skv] / [Sq, Skv] for modes 0/1, the compressed [2048, 2048] for 2/3/4,
    mode 4 with non-negative tokens), a float pse [B, N1, Sq, Skv] or [B, N1, 1, Skv] (of ``pse_types``: the
    V1 entry points run pseType 1),
    keepProb < 1 with a uint8 dropMask of ceil(B*N1*Sq*Skv/8) (+ slack) bytes."""
    b, n1, sq, skv = geo["b"], geo["n1"], geo["sq"], geo["skv"]
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    opts = {}
    if rng.random() < 0.5:
        mode = rng.randrange(5)
        if mode <= 1:
            shape = rng.choice([[sq, skv], [1, 1, sq, skv], [b, 1, sq, skv], [b, n1, sq, skv]])
        else:
            shape = rng.choice([[COMPRESSED, COMPRESSED], [1, 1, COMPRESSED, COMPRESSED]])
        mask = torch.rand(shape, generator=g) < rng.choice([0.0, 0.3, 0.7])
        opts.update(atten_mask=mask.to(rng.choice([torch.bool, torch.uint8])), sparse_mode=mode)
        if mode == 4:
            opts.update(pre_tokens=rng.choice([0, 1, 3, 2147483647]), next_tokens=rng.choice([0, 2, 2147483647]))
    if rng.random() < 0.5:
        rows = rng.choice([sq, 1])
        opts.update(pse=(torch.randn(b, n1, rows, skv, generator=g) * 0.5).to(dtype), pse_type=rng.choice(pse_types))
    if dropout and rng.random() < 0.5:
        need = -(-b * n1 * sq * skv // 8) + rng.choice([0, 0, 3])
        opts.update(keep_prob=rng.choice([0.5, 0.9]), drop_mask=torch.randint(0, 256, (need,), generator=g,
                                                                               dtype=torch.uint8))
    return opts


UNBOUNDED = 2147483647


def _golden_rule(a: dict, sq: int, skv: int) -> tuple:
    """The sparse modes' index rules (docs/cann-semantics.md), written out: ``(pre, next, prefix, mask applied
    element-wise)`` in left-up origin for sparseMode / tokens / prefix; without attenMask everything is visible."""
    if a["atten_mask"] is None:
        return UNBOUNDED, UNBOUNDED, None, False
    mode, pre, nxt, prefix = int(a["sparse_mode"]), int(a["pre_tokens"]), int(a["next_tokens"]), a["prefix"]
    rules = {0: (pre, nxt), 1: (UNBOUNDED, UNBOUNDED), 2: (UNBOUNDED, 0), 3: (UNBOUNDED, skv - sq),
             4: (pre + sq - skv, nxt + skv - sq)}
    if mode == 6 and prefix is not None:  # mode 5 reads its mask alone (the prefix only allows skipping)
        return UNBOUNDED, skv - sq, tuple(int(p) for p in prefix), False
    band = rules.get(mode, (UNBOUNDED, UNBOUNDED))
    return *band, None, mode in (0, 1, 5)


def _rows_without_keys(b: int, sq: int, skv: int, pre: int, nxt: int, prefix) -> bool:
    i, j = torch.arange(sq).view(sq, 1), torch.arange(skv).view(1, skv)
    band = (j >= i - pre) & (j <= i + nxt)
    for p in prefix or (0,):
        if sq and skv and not bool((band | (j < p)).any(dim=1).all()):
            return True
    return False


def golden_plan(a: dict, b: int, n1: int, sq: int, skv: int, mask=None, drop_mask=None) -> AttentionPlan:
    """The float64 reference's plan of an ACCEPTED BNSD call (``mask`` / ``drop_mask``: the varlen caller's
    per-batch slices), derived from the arguments by the rules of docs/cann-semantics.md, not by the contract."""
    pre, nxt, prefix, read_mask = _golden_rule(a, sq, skv)
    mask = a["atten_mask"] if mask is None else mask
    keep = float(a["keep_prob"])
    pse = a["pse"]
    return AttentionPlan(
        scale=float(a["scale_value"]), pse_type=int(a["pse_type"]), pre_tokens=pre, next_tokens=nxt,
        prefix=prefix, atten_mask=mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)) if read_mask else None,
        keep_prob=keep, drop_mask=(a["drop_mask"] if drop_mask is None else drop_mask) if keep < 1 else None,
        pse=None if pse is None else pse.detach(),
        invalid_rows=int(a["inner_precise"]) == 2 or _rows_without_keys(b, sq, skv, pre, nxt, prefix))


def fa_problem(a: dict):
    """BNSD views and the plan of a call that the contract accepted (geometry as in docs/cann-semantics.md,
    'Layouts and geometry')."""
    layout, n1 = a["input_layout"], a["head_num"]
    q = to_bnsd(a["query"].detach(), layout, n1)
    d = q.shape[-1]
    n2 = a["key"].shape[2] // d if layout in ("BSH", "SBH") else a["key"].shape[1 if layout == "BNSD" else 2]
    k, v = to_bnsd(a["key"].detach(), layout, n2), to_bnsd(a["value"].detach(), layout, n2)
    return q, k, v, n2, golden_plan(a, q.shape[0], n1, q.shape[2], k.shape[2])


def fa_golden_forward(a: dict):
    q, k, v, _, plan = fa_problem(a)
    return flash_attention_forward_reference(q, k, v, plan)


def fa_grad_args(rng, dtype, layer=None, features: bool = True) -> dict:
    """A valid grad call; the npu grad names take no dropMask (they draw their own): no dropout there."""
    a = fa_forward_args(rng, dtype, layer, features=features, dropout=layer not in ("npu", "npu_v2"))
    geo_dy = fa_tensors({"layout": a["input_layout"], **_geo_of(a)}, dtype, rng)[3]
    a["dy"] = geo_dy
    saved = layer in ACL or rng.random() < 0.5
    a.update(softmax_max=None, softmax_sum=None, attention_in=None, softmax_in=None)
    if saved:
        out, m, s = fa_golden_forward(a)
        a.update(attention_in=from_bnsd(out.to(dtype), a["input_layout"]),
                 softmax_max=m.float().unsqueeze(-1).expand(*m.shape, 8).contiguous(),
                 softmax_sum=s.float().unsqueeze(-1).expand(*s.shape, 8).contiguous())
    return a


def _geo_of(a: dict) -> dict:
    q, k, v, n2, _ = fa_problem(a)
    return {"b": q.shape[0], "n1": q.shape[1], "n2": n2, "sq": q.shape[2], "skv": k.shape[2], "d": q.shape[3],
            "dv": v.shape[3]}


def _finite_close(got, want, dtype):
    """Stats: compared where the golden is finite; nan/inf must match (a nan row max is implementation's)."""
    assert got.shape == want.shape
    finite = torch.isfinite(want)
    assert_close(got.detach()[finite], want[finite], dtype)


def _generated_dropout(a: dict) -> bool:
    """keep_prob < 1 without a mask: the npu layer draws the mask from its own generator (seed, offset)."""
    return float(a["keep_prob"]) < 1 and a["drop_mask"] is None


def _plain_check(a, res, names):
    """Shape, dtype and finiteness only (for results whose golden needs the library's own dropout draw)."""
    for name, like in names:
        got = res[name]
        assert got.shape == a[like].shape and got.dtype == a[like].dtype and bool(torch.isfinite(got).all()), name


def fa_forward_check(a, res):
    q = a["query"]
    if _generated_dropout(a):
        assert res["attention_out"].dtype == q.dtype and bool(torch.isfinite(res["attention_out"]).all())
        return
    out, m, s = fa_golden_forward(a)
    got = res["attention_out"]
    assert got.dtype == q.dtype and res["softmax_max"].dtype == torch.float32
    assert_close(got.detach(), from_bnsd(out, a["input_layout"]), q.dtype)
    assert res["softmax_max"].shape == (*m.shape, 8) and res["softmax_sum"].shape == (*s.shape, 8)
    _finite_close(res["softmax_max"][..., 0], m, torch.float32)
    _finite_close(res["softmax_sum"][..., 0], s, torch.float32)


def fa_grad_check(a, res):
    if _generated_dropout(a):
        return _plain_check(a, res, (("dq", "query"), ("dk", "key"), ("dv", "value")))
    q, k, v, n2, plan = fa_problem(a)
    layout, n1, dtype = a["input_layout"], a["head_num"], a["query"].dtype
    dy = to_bnsd(a["dy"].detach(), layout, n1)
    if a["softmax_max"] is None:  # recomputed: the kernel's own forward, rounded as the kernel rounds it
        out, m, s = flash_attention_forward_reference(q, k, v, plan)
        out = out.to(dtype)
    else:
        out = to_bnsd(a["attention_in"].detach(), layout, n1)
        m, s = a["softmax_max"].detach()[..., 0], a["softmax_sum"].detach()[..., 0]
    round_to = None if dtype == torch.float32 else dtype
    golden = flash_attention_backward_reference(q, k, v, dy, out, m.float(), s.float(), plan, round_to)
    # dS = P (dP - Dr) cancels exactly when a row attends one key (Skv = 1): the golden is ~0 there and the
    # kernel's fp32 rounding of dP - Dr is all that is left; judge it against the size of the terms.
    floor = NORM_REL_TOL[dtype] * _scale32(plan.scale) * float(dy.double().norm()) * _amax(v) * max(_amax(q), _amax(k))
    for name, ref, want in zip(("dq", "dk", "dv"), (a["query"], a["key"], a["value"]), golden):
        _grad_close(name, res[name].detach(), ref, from_bnsd(want, layout), floor)


def _scale32(scale) -> float:
    """|scaleValue| as the kernels apply it (float32: 1e308 is inf)."""
    with np.errstate(over="ignore"):
        return abs(float(np.float32(float(scale))))


def _amax(t: torch.Tensor) -> float:
    return float(t.detach().double().abs().amax()) if t.numel() else 0.0


def _npu_fwd_kw(a: dict, v2: bool) -> dict:
    kw = {"pse": a["pse"], "padding_mask": a["padding_mask"], "atten_mask": a["atten_mask"],
          "scale": a["scale_value"], "keep_prob": a["keep_prob"], "inner_precise": a["inner_precise"],
          "prefix": a["prefix"], "actual_seq_qlen": a["actual_seq_qlen"], "actual_seq_kvlen": a["actual_seq_kvlen"],
          "sparse_mode": a["sparse_mode"], "softmax_layout": a["softmax_layout"], "dropout_mask": a["drop_mask"]}
    return kw | _tokens(a, v2) | (_v2_extras(a) if v2 else {})


def _tokens(a: dict, v2: bool) -> dict:
    if v2:
        return {"pre_tokens": a["pre_tokens"], "next_tokens": a["next_tokens"]}
    return {"pre_tockens": a["pre_tokens"], "next_tockens": a["next_tokens"]}


def _v2_extras(a: dict) -> dict:
    return {"pse_type": a["pse_type"], "q_start_idx": a["q_start_idx"], "kv_start_idx": a["kv_start_idx"]}


def _fa_torch_fwd(a, o):
    kw = {k: a[k] for k in FA_DEFAULTS}
    out, m, s = attngrad.flash_attention_score(a["query"], a["key"], a["value"], a["head_num"], a["input_layout"],
                                               **kw)
    return {"attention_out": out, "softmax_max": m, "softmax_sum": s}


def _fa_npu_fwd(a, o, v2):
    fn = npu.npu_fusion_attention_v2 if v2 else npu.npu_fusion_attention
    res = fn(a["query"], a["key"], a["value"], a["head_num"], a["input_layout"], **_npu_fwd_kw(a, v2))
    return {"attention_out": res[0], "softmax_max": res[1], "softmax_sum": res[2]}


FA_FWD_V2 = (aclnn.aclnnFlashAttentionScoreV2GetWorkspaceSize, aclnn.aclnnFlashAttentionScoreV2)
FA_FWD_V1 = (aclnn.aclnnFlashAttentionScoreGetWorkspaceSize, aclnn.aclnnFlashAttentionScore)
FA_GRAD_V2 = (aclnn.aclnnFlashAttentionScoreGradV2GetWorkspaceSize, aclnn.aclnnFlashAttentionScoreGradV2)
FA_GRAD_V1 = (aclnn.aclnnFlashAttentionScoreGradGetWorkspaceSize, aclnn.aclnnFlashAttentionScoreGrad)


def _fa_acl_fwd(a, o, v2):
    head = (a["query"], a["key"], a["value"], a["pse"], a["drop_mask"], a["padding_mask"], a["atten_mask"],
            a["prefix"])
    attrs = (a["scale_value"], a["keep_prob"], a["pre_tokens"], a["next_tokens"], a["head_num"], a["input_layout"],
             a["inner_precise"], a["sparse_mode"])
    outs = (o["softmax_max"], o["softmax_sum"], None, o["attention_out"])
    if v2:
        return run_two_phase(FA_FWD_V2, *head, a["q_start_idx"], a["kv_start_idx"], *attrs, a["pse_type"], *outs)
    return run_two_phase(FA_FWD_V1, *head, *attrs, *outs)


def _fa_torch_grad(a, o):
    kw = {k: a[k] for k in (*FA_DEFAULTS, "softmax_max", "softmax_sum", "softmax_in", "attention_in")}
    dq, dk, dv, _ = attngrad.flash_attention_score_grad(a["query"], a["key"], a["value"], a["dy"], a["head_num"],
                                                        a["input_layout"], **kw)
    return {"dq": dq, "dk": dk, "dv": dv}


def _fa_npu_grad(a, o, v2):
    fn = npu.npu_fusion_attention_grad_v2 if v2 else npu.npu_fusion_attention_grad
    kw = _npu_fwd_kw(a, v2)
    kw["scale_value"] = kw.pop("scale")
    del kw["dropout_mask"]
    kw.update(softmax_max=a["softmax_max"], softmax_sum=a["softmax_sum"], softmax_in=a["softmax_in"],
              attention_in=a["attention_in"])
    res = fn(a["query"], a["key"], a["value"], a["dy"], a["head_num"], a["input_layout"], **kw)
    return {"dq": res[0], "dk": res[1], "dv": res[2]}


def _fa_acl_grad(a, o, v2):
    head = (a["query"], a["key"], a["value"], a["dy"], a["pse"], a["drop_mask"], a["padding_mask"], a["atten_mask"],
            a["softmax_max"], a["softmax_sum"], a["softmax_in"], a["attention_in"], a["prefix"])
    attrs = (a["scale_value"], a["keep_prob"], a["pre_tokens"], a["next_tokens"], a["head_num"], a["input_layout"],
             a["inner_precise"], a["sparse_mode"])
    outs = (o["dq"], o["dk"], o["dv"], None)
    if v2:
        return run_two_phase(FA_GRAD_V2, *head, a["q_start_idx"], a["kv_start_idx"], *attrs, a["pse_type"], *outs)
    return run_two_phase(FA_GRAD_V1, *head, *attrs, *outs)


NO_V1 = ("torch", "npu_v2", "aclnn")
NO_ACL = ("torch", "npu", "npu_v2")
FA_COMMON = (
    Param("head_num", "headNum", "int"), Param("input_layout", "inputLayout", "str"),
    Param("atten_mask", "attenMask", "opt"), Param("padding_mask", "paddingMask", "opt"),
    Param("prefix", "prefix", "ints"), Param("q_start_idx", "qStartIdx", "ints", layers=NO_V1),
    Param("kv_start_idx", "kvStartIdx", "ints", layers=NO_V1), Param("scale_value", "scaleValue", "float"),
    Param("keep_prob", "keepProb", "float"), Param("pre_tokens", "preTokens", "int"),
    Param("next_tokens", "nextTokens", "int"), Param("inner_precise", "innerPrecise", "int"),
    Param("sparse_mode", "sparseMode", "int"), Param("pse_type", "pseType", "int", layers=NO_V1),
    Param("softmax_layout", "softmaxLayout", "str", layers=NO_ACL),
    Param("actual_seq_qlen", "actualSeqQlen", "ints", layers=NO_ACL),
    Param("actual_seq_kvlen", "actualSeqKvlen", "ints", layers=NO_ACL))
FA_EXTRA = ("query D axis", "keep_prob", "sink", "dropout_mask")

FA_FORWARD = Op(
    "flash_attention_score",
    params=(Param("query", "query", "data", required=ALL), Param("key", "key", "data", required=ALL),
            Param("value", "value", "data", required=ALL), Param("pse", "pse", "opt", acl="realShift"),
            Param("drop_mask", "dropMask", "opt"), *FA_COMMON),
    outs=(Param("softmax_max", "softmaxMaxOut", "out", required=ACL),
          Param("softmax_sum", "softmaxSumOut", "out", required=ACL),
          Param("attention_out", "attentionOutOut", "out", required=ACL)),
    build=lambda rng, dtype, layer: fa_forward_args(rng, dtype, layer, features=True),
    out_specs=lambda a: {"softmax_max": ((*_stats_shape(a),), torch.float32),
                         "softmax_sum": ((*_stats_shape(a),), torch.float32),
                         "attention_out": (_out_shape(a), a["query"].dtype)},
    callers={"torch": _fa_torch_fwd, "npu": lambda a, o: _fa_npu_fwd(a, o, False),
             "npu_v2": lambda a, o: _fa_npu_fwd(a, o, True), "aclnn": lambda a, o: _fa_acl_fwd(a, o, True),
             "aclnn_v1": lambda a, o: _fa_acl_fwd(a, o, False)},
    check=fa_forward_check, extra_names=FA_EXTRA, data_names=("query", "key", "value", "attention_out"))


def drop_mask_bytes(a: dict) -> int:
    """CANN's minimum dropMask size ceil(B*N1*Sq*Skv / 8) of a valid FlashAttention call."""
    g = _geo_of(a)
    return -(-g["b"] * g["n1"] * g["sq"] * g["skv"] // 8)


def _stats_shape(a):
    g = _geo_of(a)
    return (g["b"], g["n1"], g["sq"], 8)


def _out_shape(a):
    g = _geo_of(a)
    return from_bnsd(torch.empty(g["b"], g["n1"], g["sq"], g["dv"]), a["input_layout"]).shape


NO_NPU_V1 = ("torch", "npu_v2", "aclnn", "aclnn_v1")
FA_GRAD = Op(
    "flash_attention_score_grad",
    params=(Param("query", "query", "data", required=ALL), Param("key", "key", "data", acl="keyIn", required=ALL),
            Param("value", "value", "data", required=ALL), Param("dy", "dy", "data", required=ALL),
            Param("pse", "pse", "opt", acl="pseShift"),
            Param("drop_mask", "dropMask", "opt", layers=("torch", "aclnn", "aclnn_v1")),
            Param("softmax_max", "softmaxMax", "stats", required=ACL),
            Param("softmax_sum", "softmaxSum", "stats", required=ACL),
            Param("attention_in", "attentionIn", "stats", required=ACL),
            Param("softmax_in", "softmaxIn", "opt"), *FA_COMMON),
    outs=(Param("dq", "dqOut", "out", required=ACL), Param("dk", "dkOut", "out", required=ACL),
          Param("dv", "dvOut", "out", required=ACL)),
    build=fa_grad_args,
    out_specs=lambda a: {n: (a[t].shape, a[t].dtype) for n, t in (("dq", "query"), ("dk", "key"), ("dv", "value"))},
    callers={"torch": _fa_torch_grad, "npu": lambda a, o: _fa_npu_grad(a, o, False),
             "npu_v2": lambda a, o: _fa_npu_grad(a, o, True), "aclnn": lambda a, o: _fa_acl_grad(a, o, True),
             "aclnn_v1": lambda a, o: _fa_acl_grad(a, o, False)},
    check=fa_grad_check, extra_names=FA_EXTRA,
    data_names=("query", "key", "value", "dy", "attention_in", "dq", "dk", "dv"))

# ------------------------------------------------------------------------------------ varlen (TND) FlashAttention
def _tnd_lengths(rng) -> tuple[list, list, int, int]:
    """Cumulative ends of 1-3 batches (empty ones included) and T1 / T2, which may exceed the totals (when
    both do, the tail rule needs trailing (0, 0) entries; they are sometimes there anyway)."""
    pairs = [rng.choice([(0, 0), (0, 2), (1, 1), (2, 3), (3, 1), (5, 4), (4, 6)]) for _ in range(rng.choice([1, 2, 3]))]
    cum_q, cum_kv = list(itertools.accumulate(p[0] for p in pairs)), list(itertools.accumulate(p[1] for p in pairs))
    t1, t2 = cum_q[-1] + rng.choice([0, 0, 2]), cum_kv[-1] + rng.choice([0, 0, 1])
    if (t1 > cum_q[-1] and t2 > cum_kv[-1]) or rng.random() < 0.2:
        cum_q, cum_kv = cum_q + [0], cum_kv + [0]
    return cum_q, cum_kv, t1, t2


def varlen_forward_args(rng, dtype, layer=None) -> dict:
    """A valid TND call: query [T1, N1, D], key [T2, N2, D], value [T2, N2, Dv], cumulative lengths (lists;
    torch / npu names also 1-D int32/int64 tensors), softmax_layout "", "TND" or None (torch / npu names;
    aclnn: CANN's default)."""
    cum_q, cum_kv, t1, t2 = _tnd_lengths(rng)
    n2 = rng.choice([1, 2])
    n1, d = n2 * rng.choice([1, 2]), rng.choice([1, 2, 4, 8, 16])
    dv = rng.choice([d, max(1, d // 2)])
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    q, k, v = ((torch.randn(*s, generator=g) * 0.7).to(dtype) for s in ((t1, n1, d), (t2, n2, d), (t2, n2, dv)))
    seq = [cum_q, cum_kv]
    if layer not in ACL and rng.random() < 0.3:  # aclnn: an aclIntArray (a Python list), never a tensor
        seq = [torch.tensor(c, dtype=rng.choice([torch.int32, torch.int64])) for c in seq]
    return {"query": q, "key": k, "value": v, "head_num": n1, "input_layout": "TND", **FA_DEFAULTS,
            "actual_seq_qlen": seq[0], "actual_seq_kvlen": seq[1],
            "softmax_layout": "" if layer in ACL else rng.choice(["", "TND", None])}


def seq_ends(values) -> list[int]:
    """The cumulative ends an ACCEPTED call ran with, active batches only (trailing (0, 0) entries off)."""
    return [int(v) for v in (values.tolist() if isinstance(values, torch.Tensor) else values)]


def varlen_batches(a: dict) -> list[tuple[int, int, int, int]]:
    """``(q0, q1, k0, k1)`` of every active batch of an accepted call."""
    cq, ck = seq_ends(a["actual_seq_qlen"]), seq_ends(a["actual_seq_kvlen"])
    while cq and cq[-1] == 0 and ck[-1] == 0:
        cq, ck = cq[:-1], ck[:-1]
    return [(cq[b - 1] if b else 0, cq[b], ck[b - 1] if b else 0, ck[b]) for b in range(len(cq))]


def _tnd_to_bnsd(t: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    return t.detach()[r0:r1].permute(1, 0, 2).unsqueeze(0)


def _batch_drop_bits(a: dict, start: int, count: int):
    """Batch b's dropMask bits (``count`` bits from bit ``start`` of the LSB-first mask), repacked."""
    if float(a["keep_prob"]) >= 1:
        return None
    bits = np.unpackbits(a["drop_mask"].reshape(-1).numpy(), bitorder="little")[start:start + count]
    return torch.from_numpy(np.packbits(bits, bitorder="little"))


def varlen_golden(a: dict, dy=None, saved=None):
    """Float64 packed golden per batch: forward ``(out [T1,N1,Dv], max, sum [T1,N1])`` (true TND order);
    with ``dy`` the grads ``(dq, dk, dv)`` using ``saved = (out, max, sum)`` (recomputed when None)."""
    q, k, v, n1 = a["query"], a["key"], a["value"], a["head_num"]
    t1, dtype = q.shape[0], q.dtype
    out = torch.zeros(t1, n1, v.shape[2], dtype=torch.float64)
    stats = [torch.zeros(t1, n1, dtype=torch.float64) for _ in range(2)]
    grads = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
    score = 0
    for q0, q1, k0, k1 in varlen_batches(a):
        sq, skv = q1 - q0, k1 - k0
        plan = golden_plan(a, 1, n1, sq, skv, drop_mask=_batch_drop_bits(a, score, n1 * sq * skv))
        score += n1 * sq * skv
        if not sq:
            continue
        bq, bk, bv = _tnd_to_bnsd(q, q0, q1), _tnd_to_bnsd(k, k0, k1), _tnd_to_bnsd(v, k0, k1)
        o, m, s = flash_attention_forward_reference(bq, bk, bv, plan)
        out[q0:q1], stats[0][q0:q1], stats[1][q0:q1] = o[0].permute(1, 0, 2), m[0].T, s[0].T
        if dy is None or not skv:
            continue
        bo, bm, bs = ((o.to(dtype), m, s) if saved is None else
                      (_tnd_to_bnsd(saved[0], q0, q1), saved[1][q0:q1].T[None], saved[2][q0:q1].T[None]))
        round_to = None if dtype == torch.float32 else dtype
        got = flash_attention_backward_reference(bq, bk, bv, _tnd_to_bnsd(dy, q0, q1), bo, bm.float(), bs.float(),
                                                 plan, round_to)
        for grad, g, (r0, r1) in zip(grads, got, ((q0, q1), (k0, k1), (k0, k1))):
            grad[r0:r1] = g[0].permute(1, 0, 2)
    return (out, *stats) if dy is None else tuple(grads)


def tnd_stats(stats: torch.Tensor, layout, a: dict) -> torch.Tensor:
    """Element 0 of [T1, N1, 8] stats in ``layout`` data order ("" / None: per-batch [N1, Sq_b] blocks) as
    [T1, N1] in true TND order."""
    first = stats.detach()[..., 0]
    if layout == "TND":
        return first
    n1, flat, out = first.shape[1], first.reshape(-1), torch.zeros(first.shape, dtype=first.dtype)
    for q0, q1, _, _ in varlen_batches(a):
        out[q0:q1] = flat[q0 * n1:q1 * n1].view(n1, q1 - q0).T
    return out


def pack_stats(stats: torch.Tensor, layout, a: dict) -> torch.Tensor:
    """The inverse of :func:`tnd_stats`: [T1, N1] true TND order -> [T1, N1, 8] float32 in ``layout`` order."""
    if layout != "TND":
        n1, flat = stats.shape[1], torch.zeros(stats.numel(), dtype=stats.dtype)
        for q0, q1, _, _ in varlen_batches(a):
            flat[q0 * n1:q1 * n1] = stats[q0:q1].T.reshape(-1)
        stats = flat.view(stats.shape)
    return stats.float().unsqueeze(-1).expand(*stats.shape, 8).contiguous()


def varlen_forward_check(a, res):
    q = a["query"]
    got = res["attention_out"]
    if _generated_dropout(a):
        assert got.dtype == q.dtype and bool(torch.isfinite(got).all())
        return
    out, m, s = varlen_golden(a)
    assert got.dtype == q.dtype and got.shape == out.shape, (got.dtype, got.shape)
    assert_close(got.detach(), out, q.dtype)
    for name, want in (("softmax_max", m), ("softmax_sum", s)):
        stats = res[name]
        assert stats.dtype == torch.float32 and stats.shape == (*want.shape, 8), (name, stats.shape)
        assert same_bits(stats, stats[..., :1].expand_as(stats)), f"{name}: the 8 copies differ"
        _finite_close(tnd_stats(stats, a["softmax_layout"], a), want, torch.float32)


def varlen_grad_args(rng, dtype, layer=None) -> dict:
    a = varlen_forward_args(rng, dtype, layer)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    a["dy"] = (torch.randn(a["query"].shape[0], a["head_num"], a["value"].shape[2], generator=g) * 0.7).to(dtype)
    a.update(softmax_max=None, softmax_sum=None, attention_in=None, softmax_in=None)
    if layer in ACL or rng.random() < 0.5:
        out, m, s = varlen_golden(a)
        a.update(attention_in=out.to(dtype), softmax_max=pack_stats(m, a["softmax_layout"], a),
                 softmax_sum=pack_stats(s, a["softmax_layout"], a))
    return a


def varlen_grad_check(a, res):
    if _generated_dropout(a):
        return _plain_check(a, res, (("dq", "query"), ("dk", "key"), ("dv", "value")))
    saved = None
    if a["softmax_max"] is not None:
        saved = (a["attention_in"], tnd_stats(a["softmax_max"], a["softmax_layout"], a),
                 tnd_stats(a["softmax_sum"], a["softmax_layout"], a))
    golden = varlen_golden(a, a["dy"].detach(), saved)
    q, dtype = a["query"], a["query"].dtype
    floor = (NORM_REL_TOL[dtype] * _scale32(a["scale_value"]) * float(a["dy"].detach().double().norm())
             * _amax(a["value"]) * max(_amax(q), _amax(a["key"])))
    for name, ref, want in zip(("dq", "dk", "dv"), (q, a["key"], a["value"]), golden):
        _grad_close(name, res[name].detach(), ref, want, floor)


def _grad_close(name: str, got, ref, want, floor: float) -> None:
    """A gradient against its float64 golden; where the golden cancels to ~0 (rows attending one key) the
    kernel's fp32 rounding is judged against ``floor``, the size of the terms. An infinite float32 scale
    (inf, 1e308) makes every product order its own mix of nan and +-inf: there the golden's non-finite
    positions must be non-finite and the finite ones close."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, name
    if not math.isfinite(floor):
        special = ~torch.isfinite(want)
        assert not bool(torch.isfinite(got[special]).any()), f"{name}: finite where the golden is not"
        got, want = got[~special], want[~special]
    report = compare(got, want, ref.dtype)
    err = float((got.double() - want).nan_to_num(0.0).norm())
    assert report.passed or (report.special_ok and err <= floor), f"{name}: {report}, |err| {err} > {floor}"


VARLEN_FWD_V2 = (aclnn.aclnnFlashAttentionVarLenScoreV2GetWorkspaceSize, aclnn.aclnnFlashAttentionVarLenScoreV2)
VARLEN_FWD_V1 = (aclnn.aclnnFlashAttentionVarLenScoreGetWorkspaceSize, aclnn.aclnnFlashAttentionVarLenScore)
VARLEN_GRAD_V2 = (aclnn.aclnnFlashAttentionUnpaddingScoreGradV2GetWorkspaceSize,
                  aclnn.aclnnFlashAttentionUnpaddingScoreGradV2)
VARLEN_GRAD_V1 = (aclnn.aclnnFlashAttentionUnpaddingScoreGradGetWorkspaceSize,
                  aclnn.aclnnFlashAttentionUnpaddingScoreGrad)


def _acl_ints(values):
    """A list of Python ints as an aclIntArray (what a C caller builds); anything else as it is."""
    if isinstance(values, list) and all(type(v) is int for v in values):
        return aclnn.aclCreateIntArray(values, len(values))
    return values


def _varlen_acl(a, o, pair, head: tuple, outs: tuple, v2: bool):
    """Varlen aclnn call: ``head`` (tensors up to prefix), the two length arrays, [qStartIdx, kvStartIdx],
    the FlashAttentionScore attributes, [pseType], ``outs``."""
    attrs = (a["scale_value"], a["keep_prob"], a["pre_tokens"], a["next_tokens"], a["head_num"], a["input_layout"],
             a["inner_precise"], a["sparse_mode"])
    seq = (_acl_ints(a["actual_seq_qlen"]), _acl_ints(a["actual_seq_kvlen"]))
    if v2:
        return run_two_phase(pair, *head, *seq, a["q_start_idx"], a["kv_start_idx"], *attrs, a["pse_type"], *outs)
    return run_two_phase(pair, *head, *seq, *attrs, *outs)


def _varlen_acl_fwd(a, o, v2):
    head = (a["query"], a["key"], a["value"], a["pse"], a["drop_mask"], a["padding_mask"], a["atten_mask"],
            a["prefix"])
    outs = (o["softmax_max"], o["softmax_sum"], None, o["attention_out"])
    return _varlen_acl(a, o, VARLEN_FWD_V2 if v2 else VARLEN_FWD_V1, head, outs, v2)


def _varlen_acl_grad(a, o, v2):
    head = (a["query"], a["key"], a["value"], a["dy"], a["pse"], a["drop_mask"], a["padding_mask"], a["atten_mask"],
            a["softmax_max"], a["softmax_sum"], a["softmax_in"], a["attention_in"], a["prefix"])
    return _varlen_acl(a, o, VARLEN_GRAD_V2 if v2 else VARLEN_GRAD_V1, head, (o["dq"], o["dk"], o["dv"], None), v2)


def _bump_last(delta: int):
    return lambda t, r: (list(t[:-1]) + [int(t[-1]) + delta]) if _is_seq(t) and len(t) else t


def _is_seq(t) -> bool:
    return isinstance(t, (list, tuple)) or (isinstance(t, torch.Tensor) and t.dim() == 1)


def _seq(fn):
    """A length-array mutation acting on the array as a list of ints (absent / malformed: left as it is)."""
    return lambda t, r: fn([int(v) for v in t], r) if _is_seq(t) and len(t) else t


def _non_cumulative(c: list, r) -> list:
    """Per-batch lengths instead of cumulative ends, or a decreasing pair."""
    lengths = [b - a for a, b in zip([0] + c[:-1], c)]
    return lengths if lengths != c else c + [max(c) + 2, max(c) + 1]


SEQ_ATTRS = {
    "none": lambda t, r: None, "empty": lambda t, r: [], "non_cumulative": _seq(_non_cumulative),
    "decreasing": _seq(lambda c, r: c[::-1] + [0] if len(c) > 1 else [c[0] + 1, c[0]]),
    "negative": _seq(lambda c, r: [-1] + c[1:]), "negative_last": _seq(lambda c, r: c[:-1] + [-c[-1] - 1]),
    "drop_last": _seq(lambda c, r: c[:-1]), "extra_entry": _seq(lambda c, r: c + [c[-1] + 1]),
    "extra_zero": _seq(lambda c, r: c + [0]), "beyond_t": _seq(lambda c, r: c[:-1] + [c[-1] + 1000]),
    "plus_one": _bump_last(1), "minus_one": _seq(lambda c, r: c[:-1] + [max(c[-1] - 1, 0)]),
    "strip_tail_zero": _seq(lambda c, r: c[:-1] if len(c) > 1 and c[-1] == 0 else c),
    "huge": _seq(lambda c, r: c[:-1] + [2**63]), "huge_neg": _seq(lambda c, r: [-2**63 - 1] + c[1:]),
    "floats": _seq(lambda c, r: [float(v) for v in c]), "frac": _seq(lambda c, r: c[:-1] + [c[-1] + 0.5]),
    "bools": _seq(lambda c, r: [bool(v) for v in c]), "strs": _seq(lambda c, r: [str(v) for v in c]),
    "none_in": _seq(lambda c, r: c[:-1] + [None]), "nested": _seq(lambda c, r: [c]),
    "tuple": _seq(lambda c, r: tuple(c)), "numpy": _seq(lambda c, r: np.array(c)),
    "str": lambda t, r: "1,2", "int": lambda t, r: 5, "float": lambda t, r: 2.0,
    "tensor_int32": _seq(lambda c, r: torch.tensor(c, dtype=torch.int32)),
    "tensor_int64": _seq(lambda c, r: torch.tensor(c, dtype=torch.int64)),
    "tensor_int8": _seq(lambda c, r: torch.tensor([min(v, 127) for v in c], dtype=torch.int8)),
    "tensor_float": _seq(lambda c, r: torch.tensor(c, dtype=torch.float32)),
    "tensor_bool": _seq(lambda c, r: torch.tensor(c, dtype=torch.bool)),
    "tensor_2d": _seq(lambda c, r: torch.tensor([c])), "tensor_0d": _seq(lambda c, r: torch.tensor(c[-1])),
    "tensor_noncontig": _seq(lambda c, r: torch.tensor([v for v in c for _ in (0, 1)])[::2]),
}
CATALOGS["seqlen"] = SEQ_ATTRS
SOFTMAX_LAYOUTS = _consts({"empty": "", "TND": "TND", "none": None, "lower": "tnd", "BSND": "BSND", "BNSD": "BNSD",
                           "space": "TND ", "int": 0, "bytes": b"TND", "list": ["TND"]})
CATALOGS["softmax_layout"] = SOFTMAX_LAYOUTS

VARLEN_COMMON = (*(p for p in FA_COMMON if not p.name.startswith(("actual_seq", "softmax_layout", "input_layout"))),
                 Param("input_layout", "inputLayout", "str"),
                 Param("softmax_layout", "softmaxLayout", "softmax_layout", layers=NO_ACL),
                 Param("actual_seq_qlen", "actualSeqQLen", "seqlen"),
                 Param("actual_seq_kvlen", "actualSeqKvLen", "seqlen"))
VARLEN_EXTRA = (*FA_EXTRA, "actualSeqQLen length (batch count)", "preTokens/nextTokens")

VARLEN_FORWARD = Op(
    "flash_attention_varlen",
    params=(*FA_FORWARD.params[:5], *VARLEN_COMMON),
    outs=FA_FORWARD.outs,
    build=varlen_forward_args,
    out_specs=lambda a: {"softmax_max": ((*a["query"].shape[:2], 8), torch.float32),
                         "softmax_sum": ((*a["query"].shape[:2], 8), torch.float32),
                         "attention_out": ((*a["query"].shape[:2], a["value"].shape[2]), a["query"].dtype)},
    callers={**{k: FA_FORWARD.callers[k] for k in ("torch", "npu", "npu_v2")},
             "aclnn": lambda a, o: _varlen_acl_fwd(a, o, True),
             "aclnn_v1": lambda a, o: _varlen_acl_fwd(a, o, False)},
    check=varlen_forward_check, extra_names=VARLEN_EXTRA, data_names=FA_FORWARD.data_names)

VARLEN_GRAD = Op(
    "flash_attention_varlen_grad",
    params=(*FA_GRAD.params[:10], *VARLEN_COMMON),
    outs=FA_GRAD.outs,
    build=varlen_grad_args,
    out_specs=FA_GRAD.out_specs,
    callers={**{k: FA_GRAD.callers[k] for k in ("torch", "npu", "npu_v2")},
             "aclnn": lambda a, o: _varlen_acl_grad(a, o, True),
             "aclnn_v1": lambda a, o: _varlen_acl_grad(a, o, False)},
    check=varlen_grad_check, extra_names=VARLEN_EXTRA, data_names=FA_GRAD.data_names)

VARLEN_OPS = (VARLEN_FORWARD.name, VARLEN_GRAD.name)  # their suite: tests/test_reliability_varlen.py
OPS = {op.name: op for op in (SMS_FORWARD, SMS_BACKWARD, SEG_FORWARD, SEG_BACKWARD, FA_FORWARD, FA_GRAD,
                              VARLEN_FORWARD, VARLEN_GRAD)}


# ------------------------------------------------------------------------------------------ judging
def _param(op: Op, name: str) -> Param:
    return next(p for p in op.params + op.outs + (Param("*", "*", "all"),) if p.name == name)


def apply_mutations(op: Op, layer: str, args: dict, outs: dict, mutations) -> None:
    for name, mutation, seed in mutations:
        rng = random.Random(seed)
        fn = CATALOGS[_param(op, name).kind][mutation]
        if name == "*":  # every data tensor (inputs and outputs) to one float dtype together
            for target in (args, outs):
                for n in op.data_names:
                    if isinstance(target.get(n), torch.Tensor):
                        target[n] = fn(target[n], rng)
            continue
        target = outs if name in outs and _param(op, name) in op.outs else args
        target[name] = fn(target[name], rng)


def build_case(case):
    """(op, layer, dtype name, seed, mutations) -> (Op, args, aclnn outputs) with the mutations applied."""
    op_name, layer, dtype_name, seed, mutations = case
    op = OPS[op_name]
    args = op.build(random.Random(seed), DTYPES[dtype_name], layer)
    outs = make_outs(op, args) if layer in ACL else {}
    apply_mutations(op, layer, args, outs, mutations)
    return op, args, outs


def _expectation(op: Op, layer: str, case_mutations, original: dict) -> str | None:
    """'null:<cann>|<acl>' / 'invalid' / 'valid' for a single mutation whose outcome is certain, else None."""
    if len(case_mutations) != 1:
        return None
    name, mutation, _ = case_mutations[0]
    p = _param(op, name)
    if layer not in p.required or not isinstance(original.get(name), torch.Tensor):
        return None
    if mutation == "null":
        return f"null:{p.cann}|{p.acl_name}"
    if mutation in ALWAYS_INVALID and not (p.kind == "mask" and mutation == "dtype_bool"):
        return "invalid"
    if mutation in ALWAYS_VALID and p.kind in ("data", "stats"):
        return "valid"
    return None


def _snapshot(outs: dict) -> dict:
    return {n: t.clone() for n, t in outs.items()
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided}


def run_case(case) -> str:
    """Run one case and assert that rule; returns 'ok', 'rejected <status> <param>'."""
    op_name, layer, dtype_name, seed, mutations = case
    op = OPS[op_name]
    original = op.build(random.Random(seed), DTYPES[dtype_name], layer)
    original |= make_outs(op, original) if layer in ACL else {}
    op, args, outs = build_case(case)
    expect = _expectation(op, layer, mutations, original)
    before = _snapshot(outs)
    known = op.known_names()
    if layer in ACL:
        status = op.callers[layer](args, outs)
        if status == SUCCESS:
            assert expect is None or expect == "valid", f"{case}: accepted, expected {expect}"
            op.check(args, outs)
            return "ok"
        msg = aclnn.aclGetRecentErrMsg()
        assert status in (NULL, INVALID), f"{case}: status {status}: {msg}"
        assert f"{status}" in msg and any(n in msg for n in known), f"{case}: message names no parameter: {msg}"
        if expect and expect.startswith("null:"):
            assert status == NULL and any(n in msg for n in expect[5:].split("|")), (case, msg)
        assert expect != "valid", f"{case}: rejected a valid call: {msg}"
        for n, snap in before.items():  # validation runs before any kernel: nothing written
            assert same_bits(outs[n], snap) if isinstance(outs[n], torch.Tensor) else True, f"{case}: {n} written"
        return f"rejected {status} {msg.split(':')[1].split()[0] if ':' in msg else ''}"
    try:
        results = op.callers[layer](args, outs)
    except AclnnError as err:
        assert err.status in (NULL, INVALID), f"{case}: {err}"
        assert err.param in known and err.param in str(err), f"{case}: param {err.param!r}: {err}"
        if expect and expect.startswith("null:"):
            assert err.status == NULL and err.param in expect[5:].split("|"), (case, str(err))
        assert expect != "valid", f"{case}: rejected a valid call: {err}"
        return f"rejected {err.status} {err.param}"
    assert expect is None or expect == "valid", f"{case}: accepted, expected {expect}"
    op.check(args, results)
    return "ok"


# ------------------------------------------------------------------------------------------ strategies
@st.composite
def cases(draw, op_name: str):
    """A valid call of ``op_name`` on a random entry point, then one or two mutations."""
    op = OPS[op_name]
    layer = draw(st.sampled_from(op.layers))
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    seed = draw(st.integers(0, 2**31 - 1))
    mutations = []
    for _ in range(draw(st.sampled_from([1, 1, 1, 2]))):
        p = draw(st.sampled_from(op.mutable(layer)))
        mutation = draw(st.sampled_from(sorted(CATALOGS[p.kind])))
        mutations.append((p.name, mutation, draw(st.integers(0, 2**16))))
    return (op_name, layer, dtype, seed, tuple(mutations))


def malformed_family(op_name: str, max_examples: int, seed_value: int = 0) -> None:
    """Run ``max_examples`` generated cases of one operator (hypothesis with a fixed seed: CI-stable)."""

    @seed(seed_value)
    @settings(max_examples=max_examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(cases(op_name))
    def family(case):
        run_case(case)

    family()


def single_mutation_cases(op_name: str, kinds: tuple, layers: tuple) -> list:
    """Every single mutation of every parameter of ``kinds`` on every entry point in ``layers`` (float32)."""
    op = OPS[op_name]
    return [(op_name, layer, "float32", 0, ((p.name, m, 0),))
            for layer in op.layers if layer in layers
            for p in op.mutable(layer) if p.kind in kinds
            for m in sorted(CATALOGS[p.kind])]


def malformed_family_child(op_name: str, max_examples: int, seed_value: int) -> None:
    """Child-process entry point (tests/crashproof.py): every single tensor mutation on the entry points the
    in-process sweep leaves out (npu names, aclnn V1) and one generated family, then a marker on stdout."""
    for case in single_mutation_cases(op_name, ("data", "mask", "stats", "out", "opt"), ("npu", "npu_v2",
                                                                                         "aclnn_v1")):
        run_case(case)
    malformed_family(op_name, max_examples, seed_value)
    print(f"family {op_name} ok")


def run_valid(case) -> dict:
    """Run the unmutated valid call of ``(op, layer, dtype name, seed)``: it must succeed and match the
    golden. Returns its arguments."""
    op_name, layer, dtype_name, seed_value = case
    op, args, outs = build_case((op_name, layer, dtype_name, seed_value, ()))
    if layer in ACL:
        status = op.callers[layer](args, outs)
        assert status == SUCCESS, f"{case}: status {status}: {aclnn.aclGetRecentErrMsg()}"
        op.check(args, outs)
    else:
        op.check(args, op.callers[layer](args, outs))
    return args


def varlen_child(op_name: str, max_examples: int, seed_value: int) -> None:
    """Child-process entry point for a varlen operator: every single length-array / softmaxLayout mutation
    on the entry points the in-process tests leave out (npu names, aclnn V1), then a generated family (all
    entry points and mutation kinds), then a marker on stdout."""
    for case in single_mutation_cases(op_name, ("seqlen", "softmax_layout"), ("npu", "npu_v2", "aclnn_v1")):
        run_case(case)
    malformed_family(op_name, max_examples, seed_value)
    print(f"family {op_name} ok")
