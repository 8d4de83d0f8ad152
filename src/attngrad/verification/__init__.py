"""Precision sweep behind ``attngrad verify``: one module per operator, each with ``cases()``.

A case runs the operator and its float64 reference on the same generated inputs and returns the
figures of :func:`attngrad.precision.compare`. Adding an operator means adding a module here.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..precision import PrecisionReport


@dataclass
class VerifyCase:
    op: str
    dtype: torch.dtype
    label: str
    run: Callable[[], list[tuple[str, PrecisionReport]]]  # (output name, report) per output


def all_cases(ops: set[str] | None = None) -> Iterator[VerifyCase]:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for case in module.cases():
            if ops is None or case.op in ops:
                yield case
