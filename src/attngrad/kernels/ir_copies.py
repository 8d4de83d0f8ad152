"""Cheaper deep copies of numba IR while attngrad compiles its kernels.

numba copies IR by ``copy.deepcopy`` in many places: its inliner copies a helper marked ``inline="always"`` one block
at a time, its parallel passes copy single statements. Every such copy also copies the function's whole variable
scope (each variable made anew), so a function of thousands of variables (after nested inlining) makes all of them
again for every block and statement copied, and the garbage collector's passes over those objects cost a sixth of
the time taken to compile the flash attention kernels (docs/performance.md, 'Test suite time').

Within :func:`shared_scope_copies` a scope is copied once (:func:`_scope_copy`) and the copy is handed out again to
every deep copy made from the same scope while that scope is unchanged (no variable defined in it since). The
copies then share the one scope, as the blocks of one function do, where numba gave each its own: same names, same
variables, the same compiled code (the kernels' LLVM IR compared; a small function's in the tests). The block holds
numba's compiler lock, so no other compile in the process runs meanwhile, and leaves numba as it was on exit.
"""

from __future__ import annotations

import contextlib
import copy

from numba.core import ir
from numba.core.compiler_lock import global_compiler_lock

# id(scope) -> (scope, its variable count when copied, the copy, {id(variable): its copy} including the scope's)
_copies: dict[int, tuple] = {}


def _fresh_copy(scope: ir.Scope) -> tuple:
    """A deep copy of ``scope`` as numba's default makes it, with the memo entries that lead to it."""
    new = ir.Scope.__new__(ir.Scope)
    new.__dict__.update(scope.__dict__)
    memo = {id(scope): new}
    new.parent = copy.deepcopy(scope.parent, memo)
    new.loc = copy.deepcopy(scope.loc, memo)
    new.redefined = copy.deepcopy(scope.redefined, memo)
    new.var_redefinitions = copy.deepcopy(scope.var_redefinitions, memo)
    new.localvars = ir.VarMap()
    variables = new.localvars._con
    for name, var in scope.localvars._con.items():
        if var.scope is scope:
            variables[name] = memo[id(var)] = ir.Var(new, var.name, var.loc)
        else:
            variables[name] = copy.deepcopy(var, memo)
    memo.pop(id(memo), None)  # deepcopy's list of objects kept alive
    return scope, len(scope.localvars._con), new, memo


def _scope_copy(scope: ir.Scope, memo: dict) -> ir.Scope:
    """``copy.deepcopy(scope, memo)``: the copy made last for this scope while it is unchanged, else a new one."""
    entry = _copies.get(id(scope))
    if entry is None or entry[0] is not scope or entry[1] != len(scope.localvars._con):
        entry = _copies[id(scope)] = _fresh_copy(scope)
    memo.update(entry[3])
    return entry[2]


def _understood() -> bool:
    """Whether numba's scopes are laid out as :func:`_fresh_copy` expects and copied by the default deep copy."""
    scope = ir.Scope(None, ir.Loc("", 0))
    return (set(vars(scope)) == {"parent", "localvars", "loc", "redefined", "var_redefinitions"}
            and isinstance(getattr(scope.localvars, "_con", None), dict) and "__deepcopy__" not in vars(ir.Scope))


_APPLIES = _understood()


@contextlib.contextmanager
def shared_scope_copies():
    """Compile within this block to have numba's scopes deep-copied by :func:`_scope_copy`. Reentrant; does
    nothing where numba's scopes are not what this module knows."""
    if not _APPLIES:
        yield
        return
    with global_compiler_lock:
        if vars(ir.Scope).get("__deepcopy__") is _scope_copy:  # nested
            yield
            return
        ir.Scope.__deepcopy__ = _scope_copy
        try:
            yield
        finally:
            del ir.Scope.__deepcopy__
            _copies.clear()
