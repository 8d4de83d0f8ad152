"""numba's disk cache is saved under a per-kernel file lock, so concurrent processes cannot cross signatures."""

import fcntl
import os

import numpy as np
from numba import njit
from numba.core import caching

import attngrad.kernels  # noqa: F401 - installs the lock


def _lock_is_held(index_path: str) -> bool:
    """True when another open file description holds the kernel's lock (flock conflicts across opens)."""
    fd = os.open(index_path + ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_cache_saves_and_loads_hold_the_kernel_lock(tmp_path, monkeypatch):
    seen = []
    for name in ("_save_index", "_save_data", "_load_index"):
        original = getattr(caching.IndexDataCacheFile, name)

        def spy(self, *args, _original=original, _name=name):
            seen.append((_name, _lock_is_held(self._index_path)))
            return _original(self, *args)

        monkeypatch.setattr(caching.IndexDataCacheFile, name, spy)
    monkeypatch.setattr(caching.config, "CACHE_DIR", str(tmp_path))

    @njit(cache=True)
    def add_one(x):
        return x + 1

    assert add_one(np.int64(1)) == 2 and add_one(np.float64(0.5)) == 1.5
    names = {n for n, _ in seen}
    assert {"_save_index", "_save_data", "_load_index"} <= names
    assert all(held for _, held in seen), seen


def test_install_wraps_save_and_load_once():
    wrapped = (caching.IndexDataCacheFile.save, caching.IndexDataCacheFile.load)
    attngrad.kernels.cache_lock.install()
    assert (caching.IndexDataCacheFile.save, caching.IndexDataCacheFile.load) == wrapped
    assert all(m.attngrad_locked for m in wrapped)
