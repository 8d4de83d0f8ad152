"""Make numba's on-disk kernel cache safe when several processes fill it at once.

numba saves a compiled specialisation by reading the kernel's index file, picking the first free data-file
number, writing the index back and then the data file. Two processes doing this at the same moment (the ranks
of a distributed job, data-loader workers, pytest-xdist workers) can pick the same number for two different
signatures: the index then names the other signature's machine code, which a later process loads and calls
with the wrong argument types. :func:`install` wraps numba's index/data save and load in an exclusive
``flock`` on one lock file per kernel, so each save is atomic with respect to other processes. Compiling
still happens outside the lock; only the few file operations are serialised.
"""

from __future__ import annotations

import contextlib
import functools
import os

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock, numba's own behaviour is kept
    fcntl = None

from numba.core import caching


@contextlib.contextmanager
def _locked(cache_file):
    """Hold an exclusive lock on ``<index file>.lock`` beside the kernel's numba index.

    Where the lock file cannot be created (a read-only cache directory, which nobody can write to either),
    the operation runs unlocked.
    """
    try:
        fd = os.open(cache_file._index_path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _under_lock(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with _locked(self):
            return method(self, *args, **kwargs)

    wrapper.attngrad_locked = True
    return wrapper


def install() -> None:
    """Serialise numba's cache saves and loads across processes (idempotent; a no-op without ``flock``)."""
    cls = caching.IndexDataCacheFile
    if fcntl is None or getattr(cls.save, "attngrad_locked", False):
        return
    for name in ("save", "load"):
        setattr(cls, name, _under_lock(getattr(cls, name)))
