"""Fused CPU kernels (numba) and the plain float64 references that are the tests' golden."""

from .cache_lock import install as _install_cache_lock

_install_cache_lock()  # numba's disk cache is shared by every process that runs attngrad
