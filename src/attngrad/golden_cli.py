"""``attngrad golden`` and ``attngrad compare``: golden outputs of a FlashAttentionScore(Grad) case and CANN's
verdict on another implementation's outputs (docs/golden.md).

A case file is ``.pt`` (a dict, read with ``torch.load(weights_only=True)``) or ``.npz`` (read with
``np.load(allow_pickle=False)``). Tensors: ``query``, ``key``, ``value``, optional ``dy`` (then the grad runs
too), ``atten_mask``, ``pse``, ``drop_mask``, ``padding_mask``, ``query_rope``, ``key_rope``, ``sink`` (any other
entry is an error); attributes (``head_num``, ``input_layout`` and the scalar and list keywords of
:func:`attngrad.flash_attention_score`, e.g. ``scale_value``, ``sparse_mode``, ``prefix``) in an ``attributes``
dict of the ``.pt`` or in a JSON file next to the case (``case.json``), which wins. An ``.npz`` has no bfloat16:
the attribute ``dtype`` casts the float inputs but the sink (``"bfloat16"``).

Output files (``.pt``) map names to tensors: ``attention_out``, ``softmax_max``, ``softmax_sum`` and, with
dy, ``dq``, ``dk``, ``dv`` (``dpse`` for a pseType 0/1 pse, ``dq_rope`` / ``dk_rope`` with the rope parts, ``dsink``
with a sink); ``--float64`` adds ``<name>_float64`` from the float64 reference.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

from .errors import AclnnError
from .precision import ELEMENT_BAD_RATIO, MERE_TOL, element_bad

INPUTS = ("query", "key", "value", "dy")
OPTIONAL_TENSORS = ("atten_mask", "pse", "drop_mask", "padding_mask", "query_rope", "key_rope", "sink")
FORWARD_OUTPUTS = ("attention_out", "softmax_max", "softmax_sum")
GRAD_OUTPUTS = ("dq", "dk", "dv", "dpse", "dq_rope", "dk_rope", "dsink")  # flash_attention_score_grad's order
RULES = {"fa": FORWARD_OUTPUTS, "fag": GRAD_OUTPUTS, "mere": FORWARD_OUTPUTS + GRAD_OUTPUTS}
WORST = 5
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class CaseError(Exception):
    """A file that cannot be used: unreadable, malformed, missing entries or mismatched shapes."""


# ------------------------------------------------------------------------------------------------ files
def load_tensors(path: Path) -> dict:
    """The entries of a ``.pt`` dict or an ``.npz`` archive (arrays as tensors), read as data only."""
    if not path.is_file():
        raise CaseError(f"{path}: no such file")
    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                return {name: _from_numpy(archive[name]) for name in archive.files}
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - every reader error means the same: not a usable file
        raise CaseError(f"{path}: cannot read it as a {'.npz archive' if path.suffix == '.npz' else 'torch file'} "
                        f"({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise CaseError(f"{path}: must hold a dict of named tensors, got {type(data).__name__}")
    return data


def _from_numpy(array: np.ndarray):
    if array.dtype.kind in "US":  # a string entry, e.g. JSON attributes
        return str(array)
    return torch.from_numpy(np.ascontiguousarray(array))


def load_case(path: Path) -> tuple[dict, dict]:
    """``(tensors, attributes)`` of a case file (module docstring)."""
    data = load_tensors(path)
    attributes = data.pop("attributes", {})
    if isinstance(attributes, str):
        attributes = _json(attributes, f"{path}: attributes")
    side = path.with_suffix(".json")
    if side.is_file():
        attributes = {**attributes, **_json(side.read_text(), str(side))}
    missing = [name for name in ("query", "key", "value") if name not in data]
    missing += [name for name in ("head_num", "input_layout") if name not in attributes]
    if missing:
        raise CaseError(f"{path}: missing {', '.join(missing)} (tensors query, key, value; attributes head_num, "
                        f"input_layout in 'attributes' or {side.name})")
    for name, value in data.items():
        if name not in INPUTS + OPTIONAL_TENSORS:
            raise CaseError(f"{path}: unknown entry {name!r} (tensors: {', '.join(INPUTS + OPTIONAL_TENSORS)}; "
                            f"attributes go in 'attributes' or {side.name})")
        if not isinstance(value, torch.Tensor):
            raise CaseError(f"{path}: entry {name!r} must be a tensor, got {type(value).__name__}")
    dtype = attributes.pop("dtype", None)
    if dtype is not None:
        if dtype not in DTYPES:
            raise CaseError(f"{path}: attribute dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        cast = INPUTS + ("pse", "query_rope", "key_rope")  # the sink stays float32
        data = {n: t.to(DTYPES[dtype]) if t.is_floating_point() and n in cast else t for n, t in data.items()}
    return data, attributes


def _json(text: str, where: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CaseError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CaseError(f"{where}: must be a JSON object of attributes")
    return value


# ----------------------------------------------------------------------------------------------- golden
def golden_outputs(tensors: dict, attributes: dict, float64: bool = False) -> dict:
    """The case's outputs in the golden precision mode (and the float64 reference's with ``float64``)."""
    from . import flash_attention_score, flash_attention_score_grad
    from .precision_mode import precision_mode

    inputs = [tensors[name] for name in ("query", "key", "value")]
    kw = {**attributes, **{name: tensors[name] for name in OPTIONAL_TENSORS if name in tensors}}
    head_num, layout = kw.pop("head_num"), kw.pop("input_layout")
    with precision_mode("golden"):
        out, smax, ssum = flash_attention_score(*inputs, head_num, layout, **kw)
        results = dict(zip(FORWARD_OUTPUTS, (out, smax, ssum)))
        if "dy" in tensors:
            grads = flash_attention_score_grad(*inputs, tensors["dy"], head_num, layout, softmax_max=smax,
                                               softmax_sum=ssum, attention_in=out, **kw)
            results.update({n: g for n, g in zip(GRAD_OUTPUTS, grads) if g is not None})
    if float64:
        results.update({f"{n}_float64": t for n, t in float64_outputs(inputs, tensors.get("dy"), head_num, layout,
                                                                         kw).items()})
    return results


def float64_outputs(inputs: list, dy, head_num: int, layout: str, kw: dict) -> dict:
    """The float64 reference of a non-TND case: attention_out and, with dy, dq / dk / dv (with
    ``D = rowsum(P dP)``), in the case's layout."""
    from .kernels.flash_attention_reference import (flash_attention_backward_reference,
                                                    flash_attention_forward_reference)
    from .ops.flash_attention import check_forward, from_bnsd
    from .ops.flash_attention_core import split_kwargs, to_bnsd

    if layout == "TND":
        raise CaseError("--float64 supports the BSH, SBH, BSND and BNSD layouts (not TND)")
    extras = [name for name in ("query_rope", "key_rope", "sink") if kw.get(name) is not None]
    if extras:
        raise CaseError(f"--float64 does not support {', '.join(extras)} (the golden outputs do)")
    p = check_forward(*inputs, *split_kwargs(head_num, layout, **kw))
    out, smax, ssum = flash_attention_forward_reference(p.q, p.k, p.v, p.plan)
    results = {"attention_out": from_bnsd(out, layout)}
    if dy is not None:
        grads = flash_attention_backward_reference(p.q, p.k, p.v, to_bnsd(dy, layout, p.geo.n1), out, smax, ssum,
                                                   p.plan)
        results.update({n: from_bnsd(g, layout) for n, g in zip(("dq", "dk", "dv"), grads)})
    return results


def run_golden(case: str, out: str | None, float64: bool) -> int:
    path = Path(case)
    tensors, attributes = load_case(path)
    results = golden_outputs(tensors, attributes, float64)
    target = Path(out) if out else path.with_name(path.stem + ".golden.pt")
    torch.save({n: t.contiguous() for n, t in results.items()}, target)
    print(f"wrote {target}: " + ", ".join(f"{n} {list(t.shape)} {str(t.dtype).replace('torch.', '')}"
                                          for n, t in results.items()))
    return 0


# ---------------------------------------------------------------------------------------------- compare
def compare_output(name: str, golden: torch.Tensor, actual: torch.Tensor, rule: str | None) -> dict:
    """CANN's figures for one output: element rule (bad ratio), max abs/rel diff, MERE/MARE with the dtype's
    thresholds, nan/inf mismatches, the worst elements; ``passed`` by ``rule`` (``mere``: MERE < T and
    MARE < 10 T; otherwise the bad ratio <= 0.5%), and never with a nan/inf mismatch."""
    if golden.shape != actual.shape:
        raise CaseError(f"{name}: shape mismatch, golden {list(golden.shape)} vs actual {list(actual.shape)}")
    a, g = actual.detach().double().flatten(), golden.detach().double().flatten()
    bad = element_bad(a, g)
    special = int(((a.isnan() != g.isnan()) | ((a.isinf() | g.isinf()) & (a != g))).sum())
    finite = a.isfinite() & g.isfinite()
    diff = (a - g).abs().where(finite, torch.zeros((), dtype=torch.float64))
    rel = diff / (g.abs() + 1e-7)
    threshold = MERE_TOL.get(actual.dtype, MERE_TOL[torch.float32])
    mere = float(rel[finite].mean()) if finite.any() else 0.0
    mare = float(rel[finite].max()) if finite.any() else 0.0
    ratio = float(bad.double().mean()) if bad.numel() else 0.0
    ok = (mere < threshold and mare < 10 * threshold) if rule == "mere" else ratio <= ELEMENT_BAD_RATIO
    top = float(diff.max()) + 1.0 if a.numel() else 0.0
    worst = torch.argsort(diff + bad.double() * top, descending=True)[:WORST]  # bad ones first, by difference
    return dict(output=name, dtype=str(actual.dtype).replace("torch.", ""), shape=list(actual.shape),
                bad=int(bad.sum()), bad_ratio=ratio, max_abs=float(diff.max()) if a.numel() else 0.0,
                max_rel=float(rel[finite].max()) if finite.any() else 0.0, mere=mere, mare=mare, mere_tol=threshold,
                nan_inf_mismatch=special, passed=bool(ok and special == 0),
                worst=[dict(index=[int(x) for x in np.unravel_index(int(i), tuple(actual.shape))],
                            golden=float(g[i]), actual=float(a[i])) for i in worst])


def compare_files(golden_path: str, actual_path: str, rule: str | None) -> list[dict]:
    golden, actual = load_tensors(Path(golden_path)), load_tensors(Path(actual_path))
    names = [n for n in actual if isinstance(actual[n], torch.Tensor) and (rule is None or n in RULES[rule])]
    if not names:
        raise CaseError(f"{actual_path}: no output to compare" + (f" for --rule {rule}" if rule else ""))
    missing = [n for n in names if not isinstance(golden.get(n), torch.Tensor)]
    if missing:
        raise CaseError(f"{golden_path}: missing {', '.join(missing)} (outputs of {actual_path})")
    return [compare_output(n, golden[n], actual[n], rule) for n in names]


COLUMNS = ("output", "dtype", "bad / total", "bad ratio", "max abs", "max rel", "MERE (tol)", "MARE", "nan/inf",
           "worst (index: golden, actual)", "verdict")


def _row(r: dict) -> tuple[str, ...]:
    total = math.prod(r["shape"])
    worst = r["worst"][0] if r["worst"] else None
    where = f"{tuple(worst['index'])}: {worst['golden']:.4g}, {worst['actual']:.4g}" if worst else "-"
    return (r["output"], r["dtype"], f"{r['bad']} / {total}", f"{r['bad_ratio']:.3%}", f"{r['max_abs']:.3e}",
            f"{r['max_rel']:.3e}", f"{r['mere']:.2e} ({r['mere_tol']:.1e})", f"{r['mare']:.2e}",
            str(r["nan_inf_mismatch"]), where, "pass" if r["passed"] else "FAIL")


def print_report(results: list[dict], title: str) -> None:
    """A rich table when rich is installed, plain text otherwise."""
    rows = [_row(r) for r in results]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        from .cli import plain_table

        print(plain_table(title, COLUMNS, rows))
        return
    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col)
    for row in rows:
        table.add_row(*row[:-1], "[green]pass[/green]" if row[-1] == "pass" else "[red]FAIL[/red]")
    Console(width=None if sys.stdout.isatty() else 220).print(table)


def plot_bad_blocks(golden_path: str, actual_path: str, results: list[dict], target: str, blocks: int = 64) -> None:
    """Heatmaps of the bad-element fraction per (row block, column block) of each output seen as
    ``[prod(shape[:-1]), shape[-1]]``."""
    from .cli import require_extra

    require_extra("matplotlib", "plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    golden, actual = load_tensors(Path(golden_path)), load_tensors(Path(actual_path))
    fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 4), squeeze=False)
    for ax, r in zip(axes[0], results):
        a = actual[r["output"]]
        bad = element_bad(a, golden[r["output"]]).double().reshape(-1, a.shape[-1] if a.dim() else 1)
        rb, cb = -(-bad.shape[0] // blocks), -(-bad.shape[1] // blocks)
        grid = torch.nn.functional.avg_pool2d(bad[None, None], (rb, cb), ceil_mode=True)[0, 0]
        image = ax.imshow(grid.numpy(), aspect="auto", cmap="Reds", vmin=0, vmax=max(float(grid.max()), 1e-9))
        ax.set_title(f"{r['output']}: {r['bad_ratio']:.2%} bad")
        ax.set_xlabel(f"column block ({cb} cols)")
        ax.set_ylabel(f"row block ({rb} rows)")
        fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(target)


def run_compare(golden: str, actual: str, rule: str | None, as_json: bool, plot: str | None) -> int:
    results = compare_files(golden, actual, rule)
    if as_json:
        print(json.dumps({"rule": rule or "element", "passed": all(r["passed"] for r in results),
                          "outputs": results}, indent=2))
    else:
        rule_name = rule or "every output, element rule"
        print_report(results, f"attngrad compare {actual} against {golden} (rule: {rule_name})")
    if plot:
        plot_bad_blocks(golden, actual, results, plot)
    return 0 if all(r["passed"] for r in results) else 1


# ------------------------------------------------------------------------------------------ command line
def add_parsers(sub) -> None:
    """The ``golden`` and ``compare`` subcommands on the cli's subparsers."""
    go = sub.add_parser("golden", help="golden outputs of a flash attention case (golden precision mode)")
    go.add_argument("case", help="case file (.pt or .npz) with query, key, value[, dy] and the attributes")
    go.add_argument("--out", help="output .pt (default: CASE's name with .golden.pt)")
    go.add_argument("--float64", action="store_true", help="also write the float64 reference (<name>_float64)")
    co = sub.add_parser("compare", help="CANN's precision verdict on ACTUAL's outputs against GOLDEN's")
    co.add_argument("golden", help="golden outputs (.pt or .npz)")
    co.add_argument("actual", help="outputs to judge (.pt or .npz), named as in GOLDEN")
    co.add_argument("--rule", choices=sorted(RULES), help="fa: forward outputs, fag: gradients (element rule); "
                    "mere: every output by MERE/MARE (default: every output by the element rule)")
    co.add_argument("--json", action="store_true", help="print the figures as JSON")
    co.add_argument("--plot", help="write a heatmap of the bad elements by row/column blocks to this image file")


def main(args) -> int:
    """Run ``golden`` or ``compare``; a file that cannot be used exits with status 2 and one line."""
    try:
        if args.command == "golden":
            return run_golden(args.case, args.out, args.float64)
        return run_compare(args.golden, args.actual, args.rule, args.json, args.plot)
    except (CaseError, AclnnError, TypeError) as exc:  # TypeError: an attribute no keyword takes
        print(f"attngrad {args.command}: error: {exc}", file=sys.stderr)
        return 2
