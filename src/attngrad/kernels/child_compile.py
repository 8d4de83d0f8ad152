"""Compile a new kernel specialisation in a child process and load it from numba's disk cache.

A process that compiles a parallel numba kernel itself runs code that differs from the same specialisation
loaded from numba's disk cache: the results differ in the last bits and the fresh code is slower (numba links
separately compiled functions, such as the outlined ``prange`` body, into the kernel, and the compiling
process keeps calling its own first copies; see docs/performance.md). So every process should run cached code.
:func:`compile_cached` compiles a specialisation that is in neither this process nor the cache in a child
interpreter (``sys.executable``, the same environment and ``sys.path``), which saves it to the cache, and then
loads it here. Specialisations already in the cache are simply loaded.

A lock file per specialisation (:func:`compile_lock_path`, beside numba's index) makes processes that ask for
the same specialisation at once (pytest-xdist workers, distributed ranks) wait for one child and then load its
result; different specialisations of a kernel compile side by side. The kernel is compiled
in this process instead, as numba does by default, where the child cannot help: ``ATTNGRAD_COMPILE_IN_CHILD=0``
(set in the child itself, so it never recurses), a kernel without a disk cache (``cache=False``) or not
importable by name (defined in a function), no interpreter to start; and, with a warning, where the child fails,
times out (:data:`TIMEOUT_S`) or leaves nothing in the cache, or the signature cannot be pickled (the kernel's
later specialisations then compile in this process too). :func:`on_first_child` lets a caller act when a child is
about to start (:func:`.precompile.call_forward` starts the backward's compile beside the forward's).
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import hashlib
import importlib
import logging
import os
import pickle
import subprocess
import sys
import time
import warnings

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no lock; two children may compile the same kernel
    fcntl = None

from numba.core import config

ENV_SWITCH = "ATTNGRAD_COMPILE_IN_CHILD"
TIMEOUT_S = 900.0  # the largest kernels compile in 1-2 minutes alone, several times that on a busy machine

_log = logging.getLogger(__name__)
_failed: set[str] = set()  # kernels whose child failed once: their other specialisations compile here
_on_first_child = contextvars.ContextVar("attngrad_on_first_child", default=None)  # :func:`on_first_child`

_BOOTSTRAP = ("import pickle, sys; job = pickle.load(sys.stdin.buffer); sys.path[:] = job['path']; "
              "from attngrad.kernels.child_compile import compile_here; compile_here(job)")


def enabled() -> bool:
    """Whether new specialisations compile in a child process (``ATTNGRAD_COMPILE_IN_CHILD``, default on)."""
    return switched_on(ENV_SWITCH)


def switched_on(variable: str) -> bool:
    """Whether the environment variable ``variable`` is on: unset, or anything but 0, false, no, off."""
    return os.environ.get(variable, "1").strip().lower() not in ("0", "false", "no", "off")


def child_environment() -> dict[str, str]:
    """The environment of a process that fills this process's numba cache: this one's, with ``NUMBA_CACHE_DIR``
    where this process set numba's cache directory in code."""
    return {**os.environ, **({"NUMBA_CACHE_DIR": config.CACHE_DIR} if config.CACHE_DIR else {})}


def compile_cached(kernel, signature: tuple, companions: tuple = ()):
    """``kernel.compile(signature)`` (a numba dispatcher, a tuple of numba types) such that the code comes from
    numba's disk cache: a specialisation missing from the cache is compiled in a child process first.
    ``companions``: more ``(dispatcher, signature)`` pairs that such a child compiles too, where they are missing
    from the cache (a kernel after its worker: one interpreter start for both); they are not loaded here."""
    reason = _why_not_in_child(kernel, signature)
    if reason is None:
        _announce_child()
        start = time.perf_counter()
        reason = _compile_in_child(kernel, signature, companions)
        if reason is None:
            _log.debug("%s %s: in the disk cache after %.1f s (child process)", _name(kernel), signature,
                       time.perf_counter() - start)
            misses = kernel.stats.cache_misses[signature]
            entry = kernel.compile(signature)
            if kernel.stats.cache_misses[signature] != misses:
                _give_up(kernel, "the child's result did not load from the disk cache")
            return entry
        _give_up(kernel, reason)
    else:
        _log.debug("%s %s: no child process (%s)", _name(kernel), signature, reason)
    return kernel.compile(signature)


@contextlib.contextmanager
def on_first_child(callback):
    """While this context lasts in this thread, ``callback()`` is called once, when a kernel specialisation is about to
    compile in a child process (the cache lacks it); nothing is called when every kernel comes from the cache."""
    token = _on_first_child.set(callback)
    try:
        yield
    finally:
        _on_first_child.reset(token)


def _announce_child() -> None:
    """Call the armed :func:`on_first_child` callback, once; an error in it is logged, the compile goes on."""
    callback = _on_first_child.get()
    if callback is not None:
        _on_first_child.set(None)  # the context's exit restores the value before it
        try:
            callback()
        except Exception:  # noqa: BLE001 - the callback is an optimisation, never a reason for a call to fail
            _log.debug("the on_first_child callback failed", exc_info=True)


def _name(kernel) -> str:
    return f"{kernel.py_func.__module__}.{kernel.py_func.__qualname__}"


def _why_not_in_child(kernel, signature: tuple) -> str | None:
    """None when a child process should compile ``signature``; else why not (quiet reasons only)."""
    if not enabled():
        return f"{ENV_SWITCH} is off"
    if tuple(signature) in kernel.overloads:
        return "already in this process"
    if _name(kernel) in _failed:
        return "its child process failed before"
    if getattr(kernel._cache, "_cache_file", None) is None:
        return "the kernel has no disk cache"
    if "<locals>" in kernel.py_func.__qualname__:
        return "the kernel cannot be imported by name"
    if not sys.executable:
        return "no Python interpreter to start"
    if _in_cache(kernel, signature):
        return "in the disk cache"
    return None


def _in_cache(kernel, signature: tuple) -> bool:
    """Whether numba's index for ``kernel`` lists ``signature`` for this machine and this source (no loading)."""
    cache = kernel._cache
    key = cache._index_key(signature, kernel.targetctx.codegen())
    try:
        return key in cache._cache_file._load_index()
    except Exception:  # noqa: BLE001 - an unreadable index is a missing one; numba then overwrites it
        return False


def _compile_in_child(kernel, signature: tuple, companions: tuple = ()) -> str | None:
    """Compile ``signature`` of ``kernel`` (and the ``companions`` that a child can compile) into the disk cache in a
    child process, unless another process does so meanwhile (:func:`compile_lock_path`); None once ``signature`` is
    in the cache, else the reason of the failure."""
    wanted = [(kernel, signature), *((k, s) for k, s in companions if _why_not_in_child(k, s) is None)]
    try:
        job = pickle.dumps({"path": list(sys.path), "specialisations": [
            (k.py_func.__module__, k.py_func.__qualname__, tuple(s)) for k, s in wanted]})
    except Exception as exc:  # noqa: BLE001 - e.g. a namedtuple class defined in a function
        return f"the signature cannot be pickled: {exc}"
    deadline = time.monotonic() + TIMEOUT_S
    with _held_lock(compile_lock_path(kernel, signature), deadline) as locked:
        if not locked:
            return f"another process held the compile lock for {TIMEOUT_S:.0f} s"
        if _in_cache(kernel, signature):  # another process compiled it while this one waited
            return None
        env = {**child_environment(), ENV_SWITCH: "0"}
        try:
            proc = subprocess.run([sys.executable, "-c", _BOOTSTRAP], input=job, capture_output=True, env=env,
                                  timeout=max(1.0, deadline - time.monotonic()))
            failure = (f"the child process failed with status {proc.returncode}: {stderr_tail(proc.stderr)}"
                       if proc.returncode else None)
        except subprocess.TimeoutExpired:
            failure = f"the child process ran past {TIMEOUT_S:.0f} s"
        except OSError as exc:
            return f"the child process did not start: {exc}"
    if _in_cache(kernel, signature):
        if failure:  # on a companion, compiled after this one: its own launch reports it
            _log.debug("%s: in the disk cache, but then %s", _name(kernel), failure)
        return None
    return failure or "the child process left nothing in the disk cache"


def stderr_tail(stderr: bytes) -> str:
    """The end of a child process's stderr (its last 1500 characters), decoded, for an error message."""
    return stderr.decode(errors="replace").strip()[-1500:]


def failed_kernels() -> list[str]:
    """The kernels of this process whose child process failed, so that they compiled here (sorted names)."""
    return sorted(_failed)


def compile_lock_path(kernel, signature: tuple) -> str:
    """``<numba index of kernel>.<digest of signature and target>.compile.lock``."""
    digest = hashlib.sha256(repr((signature, kernel.targetctx.codegen().magic_tuple())).encode()).hexdigest()
    return f"{kernel._cache._cache_file._index_path}.{digest[:16]}.compile.lock"


@contextlib.contextmanager
def _held_lock(path: str, deadline: float):
    """Hold an exclusive ``flock`` on ``path``, polling until ``deadline``; yields whether it is held. Without
    ``flock`` or a writable lock file, yields True unlocked (two children then compile the same thing, which
    costs time but is harmless: numba's saves are serialised by :mod:`.cache_lock`)."""
    if fcntl is None:
        yield True
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield True
        return
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.2)
        yield True
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _give_up(kernel, reason: str) -> None:
    """Warn that ``kernel`` compiles in this process, and compile its later specialisations here too."""
    _failed.add(_name(kernel))
    warnings.warn(f"{_name(kernel)} compiles in this process, so its results may differ in the last bits from "
                  f"those of the cached code ({reason})", RuntimeWarning, stacklevel=4)


def compile_here(job: dict) -> None:
    """The child's side: import each kernel's module, compile its signature (saved to the disk cache), in the order
    of ``job['specialisations']``. The garbage collector is paused while a specialisation compiles and runs once after
    it: numba's passes make and drop millions of objects, and the collector's passes over them are a measurable share
    of a large kernel's compile time; the child's peak memory grows instead (docs/performance.md, 'Test suite
    time')."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for module, qualname, signature in job["specialisations"]:
            kernel = importlib.import_module(module)
            for part in qualname.split("."):
                kernel = getattr(kernel, part)
            kernel = getattr(kernel, "dispatcher", kernel)  # a :func:`.layouts.strided_layout` wrapper
            kernel.compile(signature)
            gc.collect()
    finally:
        if was_enabled:
            gc.enable()
