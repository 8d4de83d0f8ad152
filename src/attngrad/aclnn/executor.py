"""The two-phase aclnn protocol: ``aclnnXGetWorkspaceSize`` validates and builds an executor,
``aclnnX`` runs it. Bad input becomes a status (and ``aclGetRecentErrMsg``), never an exception.
"""

from __future__ import annotations

import torch

from ..errors import (ACLNN_ERR_INNER, ACLNN_ERR_INNER_NOT_TRANS_EXECUTOR, ACLNN_ERR_PARAM_INVALID,
                      ACLNN_ERR_PARAM_NULLPTR, ACLNN_ERR_RUNTIME_ERROR, ACLNN_SUCCESS, AclnnError)
from ..validation import check_int_list, invalid
from .runtime import ACL_FORMAT_ND, AclIntArray, AclTensor, record_error


class AclOpExecutor:
    """What GetWorkspaceSize hands to the execute call: the validated work, runnable once."""

    def __init__(self, op: str, run):
        self.op = op
        self._run = run
        self.used = False

    def __repr__(self) -> str:
        return f"AclOpExecutor({self.op}, used={self.used})"


def as_torch(op: str, name: str, t) -> torch.Tensor | None:
    """An aclTensor argument as the torch view it describes (None stays None)."""
    if t is None:
        return None
    if isinstance(t, torch.Tensor):
        return t
    if not isinstance(t, AclTensor):
        raise invalid(op, name, "must be an aclTensor", type(t).__name__)
    return t.to_torch(name)


def as_torch_views(op: str, named: dict) -> dict:
    """The aclTensor arguments ``{CANN name: aclTensor or None}`` as ``{CANN name: torch view or None}``,
    converted in order (the first bad one is the one reported)."""
    return {name: as_torch(op, name, t) for name, t in named.items()}


def as_ints(op: str, name: str, array) -> list[int] | None:
    """An aclIntArray (or Python sequence) argument as a list of ints; non-integers are 161002."""
    return check_int_list(op, name, array.values if isinstance(array, AclIntArray) else array)


def check_formats_nd(op: str, named: dict) -> None:
    """aclnn-only rule, checked after the contract's: every given aclTensor of ``{CANN name: aclTensor or
    None}`` has the ND storage format."""
    for name, t in named.items():
        if isinstance(t, AclTensor) and t.format != ACL_FORMAT_ND:
            raise invalid(op, name, f"format must be one of {[ACL_FORMAT_ND]} (ND = 2)", t.format)


def run_into(out: torch.Tensor, inputs, kernel) -> None:
    """Run ``kernel(dest)`` straight into the caller's output view, or into a fresh tensor copied there
    when the output shares storage with one of ``inputs`` (a kernel may read an input after writing)."""
    storage = out.untyped_storage().data_ptr()
    if any(t is not None and t.untyped_storage().data_ptr() == storage for t in inputs):
        write_output(out, kernel(None))
    else:
        with torch.no_grad():
            kernel(out)


def write_output(out: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a result into the caller's output view (its dtype and shape were validated).

    Outside autograd: a wrapped torch tensor that requires grad is written like device memory.
    """
    with torch.no_grad():
        out.copy_(value)


def no_work() -> None:
    """The run of an executor with nothing to compute (CANN's empty fast paths: success, no work)."""


def two_phase(op: str, prepare):
    """Build ``(aclnnXGetWorkspaceSize, aclnnX)`` from ``prepare(*args) -> run``.

    ``prepare`` validates through the operator's contract and returns a zero-argument callable that
    computes and writes the outputs. The workspace is always 0 bytes: attngrad kernels allocate their
    own scratch.
    """

    def get_workspace_size(*args):
        try:
            run = prepare(*args)
        except AclnnError as exc:
            record_error(str(exc))
            return exc.status, 0, None
        except Exception as exc:  # a malformed argument the contract did not anticipate
            record_error(f"{op}: internal error while checking parameters: {exc!r}")
            return ACLNN_ERR_INNER, 0, None
        record_error("")
        return ACLNN_SUCCESS, 0, AclOpExecutor(op, run)

    def execute(workspace, workspace_size, executor, stream=None):
        if executor is None:
            record_error(f"{op}: executor must not be null")
            return ACLNN_ERR_PARAM_NULLPTR
        if not isinstance(executor, AclOpExecutor) or executor.op != op:
            record_error(f"{op}: executor was not created by {op}GetWorkspaceSize")
            return ACLNN_ERR_PARAM_INVALID
        if executor.used:
            record_error(f"{op}: executor already ran (executors are single-use)")
            return ACLNN_ERR_INNER_NOT_TRANS_EXECUTOR
        executor.used = True
        try:
            executor._run()
        except AclnnError as exc:
            record_error(str(exc))
            return exc.status
        except Exception as exc:
            record_error(f"{op}: runtime failure: {exc!r}")
            return ACLNN_ERR_RUNTIME_ERROR
        return ACLNN_SUCCESS

    get_workspace_size.__name__ = get_workspace_size.__qualname__ = f"{op}GetWorkspaceSize"
    execute.__name__ = execute.__qualname__ = op
    get_workspace_size.__doc__ = f"Validate the arguments of {op}; returns (status, workspace_size, executor)."
    execute.__doc__ = f"Run the executor made by {op}GetWorkspaceSize; returns a status."
    return get_workspace_size, execute
