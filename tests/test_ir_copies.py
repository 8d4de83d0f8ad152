"""numba IR deep-copied within ``ir_copies.shared_scope_copies``: one scope copy shared, the same compiled code."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
from numba import njit
from numba.core import ir
from numba.core.compiler import run_frontend

from attngrad.kernels import ir_copies

pytestmark = pytest.mark.skipif(not ir_copies._APPLIES, reason="numba's scopes differ from what ir_copies knows")


@njit(inline="always")
def _signed_sum(x, threshold):
    total = 0.0
    for i in range(x.size):
        if x[i] > threshold:
            total += x[i] * 2.0
        else:
            total -= x[i]
    return total


def _nested(x):
    return _signed_sum(x, 0.5) + _signed_sum(x, -0.5) * _signed_sum(x[::2], 0.0)


def _branches(n):
    a = 0
    for i in range(n):
        if i % 3:
            a += i
        else:
            a -= 1
    return a


_LOCAL = re.compile(r'(%|^)("(?:[^"\\]|\\.)*"|[A-Za-z_.$][\w.$]*)(?(1)|:)', re.M)  # %value or a label:


def _canonical_llvm(dispatcher) -> str:
    """The dispatcher's one LLVM module with mangled names, addresses and each function's local value and label
    names replaced by placeholders (numba numbers its variables, blocks and functions per process)."""
    (text,) = dispatcher.inspect_llvm().values()
    text = re.sub(r"_ZN\w+", "SYMBOL", text)
    text = re.sub(r"0x[0-9a-f]+", "ADDRESS", text)
    text = re.sub(r'c"missing Environment: [^"]*"', "MISSING", text)
    text = re.sub(r"[ \t]*;.*$", "", text, flags=re.M)  # comments, aligned after the labels
    parts = []
    for function in re.split(r"(?m)^(?=define )", text):
        names: dict[str, str] = {}

        def placeholder(m):
            return m.group(0).replace(m.group(2), names.setdefault(m.group(2), f"v{len(names)}"))

        parts.append(_LOCAL.sub(placeholder, function))
    return "".join(parts)


def test_compiled_code_is_the_same_and_the_copies_were_made(monkeypatch):
    copies, original = [], ir_copies._scope_copy

    def counted(scope, memo):
        copies.append(scope)
        return original(scope, memo)

    monkeypatch.setattr(ir_copies, "_scope_copy", counted)
    x = np.linspace(-1.0, 1.0, 37)
    plain = njit(_nested)
    expected = plain(x)
    with ir_copies.shared_scope_copies():
        shared = njit(_nested)
        got = shared(x)
    assert copies, "the inlining made no scope copy through ir_copies"
    assert got == expected
    assert _canonical_llvm(shared) == _canonical_llvm(plain)
    assert "__deepcopy__" not in vars(ir.Scope)


def test_blocks_share_one_copy_of_an_unchanged_scope():
    func_ir = run_frontend(_branches)
    first, second = list(func_ir.blocks.values())[:2]
    assert first.scope is second.scope
    apart = copy.deepcopy(first), copy.deepcopy(second)
    assert apart[0].scope is not apart[1].scope  # numba's own copies: one scope per block
    with ir_copies.shared_scope_copies():
        a, b = copy.deepcopy(first), copy.deepcopy(second)
        assert a.scope is b.scope is not first.scope
        for name, var in a.scope.localvars._con.items():
            assert var.scope is a.scope and var is not first.scope.localvars.get(name)
        copied_vars = {v.name: v for stmt in a.body for v in stmt.list_vars()}
        for name, var in copied_vars.items():  # the block's variables are the scope's copies
            if name in a.scope.localvars:
                assert var is a.scope.localvars.get(name)
        first.scope.define("added_after_the_copy", first.loc)
        c = copy.deepcopy(first)
        assert c.scope is not a.scope and "added_after_the_copy" in c.scope.localvars
        assert "added_after_the_copy" not in a.scope.localvars
    assert "__deepcopy__" not in vars(ir.Scope) and not ir_copies._copies


def test_nested_use_and_errors_leave_numba_as_it_was():
    with pytest.raises(RuntimeError, match="inside"):
        with ir_copies.shared_scope_copies():
            with ir_copies.shared_scope_copies():
                assert vars(ir.Scope)["__deepcopy__"] is ir_copies._scope_copy
            assert vars(ir.Scope)["__deepcopy__"] is ir_copies._scope_copy  # the outer block still holds it
            raise RuntimeError("inside")
    assert "__deepcopy__" not in vars(ir.Scope) and not ir_copies._copies
