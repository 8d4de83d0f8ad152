"""Fused CPU kernels (numba) and the plain float64 references that are the tests' golden."""
