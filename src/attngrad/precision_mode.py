"""The precision mode of the operators: ``"npu"`` (the default) or ``"golden"``.

* ``"npu"``: the NPU's computation order. Flash attention rounds P and dS to the input dtype before their
  matrix products (as CANN's kernels and torch's CPU flash attention do); float16 ScaledMaskedSoftmax scales
  in float16.
* ``"golden"``: what CANN's golden generators compute: inputs widened once to float32, P, dP, dS and every
  intermediate in float32 (flash attention's ``D = rowsum(P * dP)`` from the unrounded output), one rounding
  to the output dtype at the end. ExpSegsum(+Backward) and ScaledMaskedSoftmaxBackward compute the same in
  both modes (float32 throughout, one rounding).

The mode of a call is, first found: the innermost :func:`precision_mode` context of the calling thread, the
process-wide :func:`set_precision_mode`, the environment variable ``ATTNGRAD_PRECISION`` (read at each call),
``"npu"``. Each operator reads it once, when its arguments are parsed, and carries it in its attribute object
and as an argument of its custom op. Under ``torch.compile`` the mode is read while the graph is traced: a
different context or process mode at a later call recompiles, a changed environment variable does not.
"""

from __future__ import annotations

import contextlib
import os
import threading

from .errors import ACLNN_ERR_PARAM_INVALID, AclnnError

NPU, GOLDEN = "npu", "golden"
MODES = (NPU, GOLDEN)
ENV_VAR = "ATTNGRAD_PRECISION"

_thread = threading.local()  # .mode: the innermost precision_mode of the thread (torch.compile guards on it)
_process_mode: str | None = None


def check_precision(mode, source: str = "precision") -> str:
    """``mode`` if it is one of :data:`MODES`, else AclnnError 161002 naming ``source`` and the rule."""
    if mode not in MODES:
        raise AclnnError(ACLNN_ERR_PARAM_INVALID,
                         f"attngrad: {source} must be 'npu' or 'golden', got {mode!r}", source)
    return mode


def current_precision() -> str:
    """The mode of a call made now from this thread (module docstring for the order of the sources)."""
    mode = getattr(_thread, "mode", None)
    if mode is not None:
        return mode
    if _process_mode is not None:
        return _process_mode
    env = os.environ.get(ENV_VAR)
    return check_precision(env, ENV_VAR) if env else NPU


def set_precision_mode(mode: str | None) -> None:
    """Set the process-wide mode (threads without a :func:`precision_mode` context use it); None returns to
    ``ATTNGRAD_PRECISION`` / ``"npu"``."""
    global _process_mode
    _process_mode = None if mode is None else check_precision(mode)


@contextlib.contextmanager
def precision_mode(mode: str):
    """``with attngrad.precision_mode("golden"):`` the operators called by this thread inside the block use
    ``mode``; other threads are not affected."""
    outer = getattr(_thread, "mode", None)
    _thread.mode = check_precision(mode)
    try:
        yield mode
    finally:
        _thread.mode = outer
