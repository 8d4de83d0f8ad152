"""Shared generators and child-process entry points of the reliability suite (issue 9).

Every operator is described once by an :class:`Op`: its parameters (with the name the contract uses in
its messages and the name of the aclnn argument), a builder of a small VALID call, its aclnn outputs,
one caller per entry point ("torch", "npu", "npu_v2", "aclnn" = the V2 two-phase API, "aclnn_v1") and
a success check against the float64 reference. A case is a JSON-able tuple
``(op, layer, dtype, seed, mutations)``: the valid call, then 1-2 generic mutations (wrong dtype, rank,
dims, layout, non-tensors, meta/sparse tensors, bad attributes, overlapping outputs, ...).

:func:`run_case` judges a case by the one rule of API.md section 4: the call either fails with
``AclnnError`` (torch / npu layers; the status is 161001/161002 and ``err.param`` names a parameter of
the operator) or with such a status and ``aclGetRecentErrMsg`` naming a parameter (aclnn layer, which
never raises and then leaves its outputs untouched), or it succeeds and the result matches the float64
reference. Nothing else is allowed: no other exception type, no wrong data.
"""

from __future__ import annotations

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

NULL, INVALID, SUCCESS = aclnn.ACLNN_ERR_PARAM_NULLPTR, aclnn.ACLNN_ERR_PARAM_INVALID, aclnn.ACLNN_SUCCESS
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FLOATS = tuple(DTYPES.values())
SENTINEL = 7.0  # aclnn outputs are filled with it: a rejected call must leave it there


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor (for bit-exact comparisons, nan included)."""
    return t.detach().contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
                                        [t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


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


def fa_forward_args(rng, dtype, layer=None, layout: str | None = None) -> dict:
    geo = fa_geometry(rng, layout)
    q, k, v, _ = fa_tensors(geo, dtype, rng)
    return {"query": q, "key": k, "value": v, "head_num": geo["n1"], "input_layout": geo["layout"],
            **FA_DEFAULTS}


def fa_problem(a: dict):
    """BNSD views and the plan of a call that the contract accepted (geometry derived like spec 2)."""
    layout, n1 = a["input_layout"], a["head_num"]
    q = to_bnsd(a["query"].detach(), layout, n1)
    d = q.shape[-1]
    n2 = a["key"].shape[2] // d if layout in ("BSH", "SBH") else a["key"].shape[1 if layout == "BNSD" else 2]
    k, v = to_bnsd(a["key"].detach(), layout, n2), to_bnsd(a["value"].detach(), layout, n2)
    keep = float(a["keep_prob"])
    plan = AttentionPlan(scale=float(a["scale_value"]), keep_prob=keep,
                         drop_mask=a["drop_mask"] if keep < 1 else None)
    return q, k, v, n2, plan


def fa_golden_forward(a: dict):
    q, k, v, _, plan = fa_problem(a)
    return flash_attention_forward_reference(q, k, v, plan)


def fa_grad_args(rng, dtype, layer=None) -> dict:
    a = fa_forward_args(rng, dtype, layer)
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
    floor = NORM_REL_TOL[dtype] * abs(plan.scale) * float(dy.double().norm()) * _amax(v) * max(_amax(q), _amax(k))
    for name, ref, want in zip(("dq", "dk", "dv"), (a["query"], a["key"], a["value"]), golden):
        got = res[name].detach()
        assert got.shape == ref.shape and got.dtype == dtype, name
        want = from_bnsd(want, layout)
        report = compare(got, want, dtype)
        err = float((got.double() - want).nan_to_num(0.0).norm())
        assert report.passed or (report.special_ok and err <= floor), f"{name}: {report}, |err| {err} > {floor}"


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
    build=fa_forward_args,
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

OPS = {op.name: op for op in (SMS_FORWARD, SMS_BACKWARD, SEG_FORWARD, SEG_BACKWARD, FA_FORWARD, FA_GRAD)}


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
    """Run one case and assert the rule of API.md section 4; returns 'ok', 'rejected <status> <param>'."""
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
