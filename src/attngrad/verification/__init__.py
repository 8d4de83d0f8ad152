"""Precision sweep behind ``attngrad verify``: one module per operator, each with ``cases()``.

A case runs the operator and its float64 reference on the same generated inputs and returns the
figures of :func:`attngrad.precision.compare`. Adding an operator means adding a module here.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..precision import PrecisionReport


@dataclass
class VerifyCase:
    op: str
    dtype: torch.dtype
    label: str
    run: Callable[[], list[tuple[str, PrecisionReport]]]  # (output name, report) per output


def all_cases() -> list[VerifyCase]:
    """Every case of every operator module (building a case runs nothing)."""
    cases = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        cases.extend(importlib.import_module(f"{__name__}.{info.name}").cases())
    return cases


def select_cases(ops: list[str] | None) -> list[VerifyCase]:
    """The cases whose operator name contains one of ``ops`` (case-insensitive, as ``attngrad bench --op``);
    None: all. An entry of ``ops`` that no operator name contains raises ValueError listing the names."""
    from ..cli import op_selected

    cases = all_cases()
    names = sorted({case.op for case in cases})
    unknown = [o for o in ops or () if not any(op_selected(name, [o]) for name in names)]
    if unknown:
        raise ValueError(f"no operator matches {', '.join(map(repr, unknown))}; the operators: {', '.join(names)}")
    return [case for case in cases if op_selected(case.op, ops)]
