"""Which GEMM the bfloat16 and float16 kernels run on this machine: ``native`` or ``widened_fp32``.

* ``native``: the GEMM of the input dtype, fp32 accumulation (:mod:`.gemm`: torch's brgemm where it serves the
  dtype, else MKL's mixed-precision GEMM);
* ``widened_fp32``: the tiles widened to float32 (exact) and multiplied by the float32 GEMM (brgemm or MKL sgemm).

Both keep the precision contract (exact products, fp32 accumulation); which is faster depends on the CPU: without
AMX or AVX512-BF16, MKL's bfloat16 GEMM can run at half the float32 rate. float32 is always ``native``.

The choice is measured once per machine (:func:`calibrate`, a few hundred ms): one backward tile's five GEMMs at
head dim 128 (the kernels' ``[256, 256, 128]`` score, ``[128, 256, 256]`` dK/dV and ``[256, 128, 256]`` dQ
products), called single-threaded through the same numba/MKL entries as the kernels, best of interleaved rounds;
the widened timing includes widening both operands of every product (the kernels widen some once per key block,
so this favours ``native``), the native brgemm timing the VNNI packing of B. ``widened_fp32`` is chosen when it is
at least ``_MARGIN`` faster, so that near ties stay native. The result is cached on disk (:func:`cache_path`, JSON)
under a key of the CPU model, its instruction sets, the caps the environment puts on the GEMM libraries
(:func:`..machine.gemm_isa_caps`) and the torch, MKL and attngrad versions; a missing, corrupted or
foreign cache file means a new measurement, never an error. ``ATTNGRAD_GEMM_PATH=native|widened_fp32`` forces a
path for both dtypes (``auto`` or unset: the calibration); ``attngrad bench --calibrate`` measures again.

The same cache entry holds how the float16 softmax rounds its scaled logits to float16 (:func:`float16_scaling`):
``numeric.float16_grid`` (integer operations) or the float16 conversions, which give the same values and whose
speeds rank differently from one CPU to the next. It is timed on the forward kernel itself the first time a float16
softmax asks (:func:`scaling_calibration`); a CPU with AVX512-FP16 multiplies in float16 and is not timed.
``ATTNGRAD_FLOAT16_SCALING=grid|conversions`` forces one.
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import json
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from numba import njit

from ..machine import cpu_model, gemm_isa_caps, isa_flags
from .gemm import BRGEMM_DTYPES, NO_TRANS, brgemm, gemm
from .numeric import HAS_AVX512_FP16, widen
from .tensor_view import aligned_bytes

ENV = "ATTNGRAD_GEMM_PATH"
NATIVE, WIDENED = "native", "widened_fp32"
PATHS = (NATIVE, WIDENED)
SCALING_ENV = "ATTNGRAD_FLOAT16_SCALING"
GRID, CONVERSIONS, FLOAT16_MULTIPLY = "grid", "conversions", "float16_multiply"
SCALINGS = (GRID, CONVERSIONS)
CALIBRATED_DTYPES = (torch.bfloat16, torch.float16)
_FORMAT = 1
_MARGIN = 0.9  # widened_fp32 is chosen when it takes at most this fraction of the native time
_TILE_SET = ((256, 256, 128), (256, 256, 128), (128, 256, 256), (128, 256, 256), (256, 128, 256))  # (m, n, k)
_ROUNDS = 12
_KERNEL_BITS = {torch.bfloat16: np.uint16, torch.float16: np.int16}


def gemm_path(dtype: torch.dtype) -> str:
    """``native`` or ``widened_fp32`` for the kernels' GEMMs on ``dtype`` tiles (float32: ``native``)."""
    forced = forced_path()
    if dtype not in CALIBRATED_DTYPES:
        return NATIVE
    if forced is not None:
        return forced
    return calibration()["paths"][str(dtype).removeprefix("torch.")]


def forced_path() -> str | None:
    """The path ``ATTNGRAD_GEMM_PATH`` forces, None when it is unset or ``auto``."""
    value = os.environ.get(ENV, "auto").strip().lower()
    if value == "auto":
        return None
    if value not in PATHS:
        raise ValueError(f"{ENV} must be one of {', '.join(PATHS)} or auto, got {os.environ[ENV]!r}")
    return value


def float16_scaling() -> str:
    """How the float16 softmax rounds ``x * scale`` to float16 here: ``grid`` or ``conversions`` (module
    docstring), ``float16_multiply`` with AVX512-FP16."""
    if HAS_AVX512_FP16:
        return FLOAT16_MULTIPLY
    value = os.environ.get(SCALING_ENV, "auto").strip().lower()
    if value == "auto":
        return scaling_calibration()["float16_scaling"]
    if value not in SCALINGS:
        raise ValueError(f"{SCALING_ENV} must be one of {', '.join(SCALINGS)} or auto, got {os.environ[SCALING_ENV]!r}")
    return value


def cache_path() -> Path:
    """``$XDG_CACHE_HOME/attngrad/gemm_paths.json`` (default ``~/.cache/attngrad/gemm_paths.json``)."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "attngrad" / "gemm_paths.json"


def machine_key() -> dict:
    """What the measurement depends on: CPU model and ISA, the GEMM libraries' ISA caps, torch, MKL and attngrad
    versions."""
    return {"cpu": cpu_model(), "isa": list(isa_flags()), "isa_caps": gemm_isa_caps(), "torch": torch.__version__,
            "mkl": _version("mkl"), "attngrad": _version("attngrad")}


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@functools.cache
def calibration() -> dict:
    """This machine's entry (``paths``: dtype name -> path; ``microseconds``: the timings), from the cache when
    it holds one for :func:`machine_key`, else measured now and saved."""
    key = machine_key()
    entry = _load_entries().get(_key_text(key))
    if _valid(entry):
        return entry
    return _measure_and_save(key)


@functools.cache
def scaling_calibration() -> dict:
    """This machine's entry (:func:`calibration`) with ``float16_scaling`` (and its ``float16_scaling_microseconds``):
    measured and added to the cached entry the first time it is asked for, by a float16 softmax or the bench, so that
    a process that runs none never compiles the float16 softmax for it."""
    entry = calibration()
    if entry.get("float16_scaling") in (*SCALINGS, FLOAT16_MULTIPLY):
        return entry
    return _with_scaling(entry)


def calibrate() -> dict:
    """Measure again (whatever the cache holds: the GEMM paths and the float16 scaling), save and return the
    entry."""
    calibration.cache_clear()
    scaling_calibration.cache_clear()
    entry = _with_scaling(_measure_and_save(machine_key()))
    calibration.cache_clear()
    scaling_calibration.cache_clear()
    return entry


def _key_text(key: dict) -> str:
    return json.dumps(key, sort_keys=True)


def _valid(entry) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("paths"), dict):
        return False
    return all(entry["paths"].get(str(d).removeprefix("torch.")) in PATHS for d in CALIBRATED_DTYPES)


def _load_entries() -> dict:
    """The cache file's entries; {} when it is missing or unreadable (then it is rewritten)."""
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != _FORMAT or not isinstance(data.get("entries"), dict):
        return {}
    return data["entries"]


def _measure_and_save(key: dict) -> dict:
    timings = {str(d).removeprefix("torch."): measure(d) for d in CALIBRATED_DTYPES}
    entry = {"key": key, "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "paths": {d: WIDENED if t[WIDENED] <= _MARGIN * t[NATIVE] else NATIVE for d, t in timings.items()},
             "microseconds": timings}
    _save(entry)
    return entry


def _with_scaling(entry: dict) -> dict:
    """``entry`` with the float16 scaling measured now (the faster of :data:`SCALINGS`; ``float16_multiply``,
    untimed, with AVX512-FP16), saved."""
    timings = {} if HAS_AVX512_FP16 else measure_float16_scaling()
    entry = {**entry, "key": machine_key(), "float16_scaling": min(timings, key=timings.get) if timings
             else FLOAT16_MULTIPLY, "float16_scaling_microseconds": timings}
    _save(entry)
    return entry


def _save(entry: dict) -> None:
    entries = _load_entries()
    entries[_key_text(entry["key"])] = entry
    _write_atomically(cache_path(), json.dumps({"format": _FORMAT, "entries": entries}, indent=1))


def _write_atomically(path: Path, text: str) -> None:
    """Write through a temporary file and a rename, so a reader never sees half a file; a cache that cannot be
    written only costs a new measurement in the next process."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp",
                                         delete=False) as f:
            f.write(text)
        os.replace(f.name, path)
    except OSError as exc:
        warnings.warn(f"attngrad: could not save the GEMM-path calibration to {path}: {exc}", stacklevel=3)


# ----------------------------------------------------------------------------------------------- measurement
def _aligned_empty(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """``np.empty`` starting on a cache line, as the kernels' tiles do: with numpy's buffers, which start
    anywhere, a timed AMX product ran at 0.4 to 1.3 TFLOP/s from one process to the next."""
    return aligned_bytes(int(np.prod(shape)) * np.dtype(dtype).itemsize, 64).view(dtype).reshape(shape)


def measure(dtype: torch.dtype) -> dict[str, float]:
    """Microseconds of one backward tile set (module docstring) on each path, best of ``_ROUNDS`` interleaved
    rounds, on ``dtype`` (bfloat16 or float16) tiles."""
    rng = np.random.default_rng(0)
    bits = _KERNEL_BITS[dtype]
    tiles = []
    for m, n, k in _TILE_SET:
        a, b = (torch.from_numpy(rng.standard_normal(s, dtype=np.float32)).to(dtype).view(torch.int16).numpy()
                .view(bits) for s in ((m, k), (k, n)))
        tiles.append((a, b, _aligned_empty((k // 2, n), np.uint32), _aligned_empty((m, k), np.float32),
                      _aligned_empty((k, n), np.float32), _aligned_empty((m, n), np.float32)))
    brgemm_native = dtype in BRGEMM_DTYPES
    brgemm_widened = torch.float32 in BRGEMM_DTYPES
    products = {NATIVE: lambda t: _native_product(*t, brgemm_native),
                WIDENED: lambda t: _widened_product(*t, brgemm_widened)}
    return _best_of_rounds({name: functools.partial(_each_tile, product, tiles) for name, product in products.items()})


def _each_tile(product: Callable, tiles: list) -> None:
    for t in tiles:
        product(t)


def measure_float16_scaling() -> dict[str, float]:
    """Microseconds of the float16 softmax forward (the kernel itself, on torch's threads) on 1024 rows of 1024
    logits by each of :data:`SCALINGS`, best of ``_ROUNDS`` interleaved rounds. The first measurement on a machine
    compiles the kernel for both (numba's cache keeps them)."""
    from .scaled_masked_softmax import CONVERTED_SCALING, GRID_SCALING, scaled_masked_softmax_forward

    x = torch.randn(1, 16, 64, 1024, generator=torch.Generator().manual_seed(0)).half()
    views = (x.view(torch.int16).numpy(), np.zeros((1, 1, 64, 1024), np.uint8), np.float32(0.125))
    y = np.empty(x.shape, np.int16)
    runs = {name: functools.partial(scaled_masked_softmax_forward, *views, marker, False, y)
            for name, marker in ((GRID, GRID_SCALING), (CONVERSIONS, CONVERTED_SCALING))}
    return _best_of_rounds(runs)


def _best_of_rounds(runs: dict[str, Callable[[], None]]) -> dict[str, float]:
    """Microseconds of each of two ``runs``, best of ``_ROUNDS`` rounds that alternate their order, after a
    warm-up call of each (compilation, libraries' first-call set-up)."""
    names = list(runs)
    for run in runs.values():
        run()
    best = dict.fromkeys(names, float("inf"))
    for round_ in range(_ROUNDS):
        for name in (names if round_ % 2 == 0 else names[::-1]):
            start = time.perf_counter()
            runs[name]()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: round(seconds * 1e6, 1) for name, seconds in best.items()}


@njit(cache=True, nogil=True)
def _pack_pairs(b, b_pairs):
    """b ``[k, n]`` 16-bit -> b_pairs ``[k // 2, n]`` uint32: rows 2r and 2r + 1 interleaved (brgemm's VNNI)."""
    sixteen = np.uint32(16)
    for r2 in range(b.shape[0] // 2):
        for j in range(b.shape[1]):
            b_pairs[r2, j] = np.uint32(b[2 * r2, j]) | (np.uint32(b[2 * r2 + 1, j]) << sixteen)


@njit(cache=True, nogil=True)
def _native_product(a, b, b_pairs, a32, b32, c, on_brgemm):
    """c = a b on the dtype's own GEMM: brgemm with b packed in VNNI pairs (packing included), else MKL."""
    m, k = a.shape
    n = b.shape[1]
    if on_brgemm:
        _pack_pairs(b, b_pairs)
        brgemm(a, m, n, k, (a.ctypes.data, k), (b_pairs.ctypes.data, n), (c.ctypes.data, n), False)
    else:
        gemm(a, NO_TRANS, NO_TRANS, m, n, k, (a.ctypes.data, k), (b.ctypes.data, n), (c.ctypes.data, n), False)


@njit(cache=True, nogil=True)
def _widened_product(a, b, b_pairs, a32, b32, c, on_brgemm):
    """c = a b with both operands widened to float32 (included) and the float32 brgemm or MKL sgemm."""
    m, k = a.shape
    n = b.shape[1]
    for i in range(m):
        for j in range(k):
            a32[i, j] = widen(a[i, j])
    for i in range(k):
        for j in range(n):
            b32[i, j] = widen(b[i, j])
    if on_brgemm:
        brgemm(a32, m, n, k, (a32.ctypes.data, k), (b32.ctypes.data, n), (c.ctypes.data, n), False)
    else:
        gemm(a32, NO_TRANS, NO_TRANS, m, n, k, (a32.ctypes.data, k), (b32.ctypes.data, n), (c.ctypes.data, n),
             False)


# ------------------------------------------------------------------------------------------- tile roofline
def tile_tflops(dtype: torch.dtype, threads: int, seconds: float = 0.2) -> float:
    """TFLOP/s of the kernels' own GEMM on all ``threads`` at once: the best of five runs of :func:`tile_work`. A
    roofline for the kernels where torch's own GEMM is slower."""
    run, flops = tile_work(dtype, threads, seconds)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return flops / best / 1e12


def tile_work(dtype: torch.dtype, threads: int, seconds: float) -> tuple[Callable[[], None], float]:
    """``(run, flops)``: ``run()`` has each of ``threads`` threads multiply the backward tile set (module docstring)
    on its own ``dtype`` tiles (bfloat16 or float32), over and over for about ``seconds``, through the native path
    (brgemm with B packed once, as the kernels pack a key block once for many query blocks; else MKL); ``flops``:
    the FLOPs of one run."""
    tiles = [[_tile_operands(dtype, m, n, k) for m, n, k in _TILE_SET] for _ in range(threads)]
    on_brgemm = dtype in BRGEMM_DTYPES
    flops = 2 * sum(m * n * k for m, n, k in _TILE_SET)

    def products(thread: int, reps: int) -> None:
        for a, b, c in tiles[thread]:
            _repeated_products(a, b, c, reps, on_brgemm)

    products(0, 1)  # warm-up (and numba's compile on the first use)
    start = time.perf_counter()
    products(0, 1)
    reps = max(1, int(seconds / max(time.perf_counter() - start, 1e-6)))
    pool = ThreadPoolExecutor(threads)

    def run() -> None:
        list(pool.map(products, range(threads), [reps] * threads))

    return run, threads * reps * flops


def _tile_operands(dtype: torch.dtype, m: int, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(a ``[m, k]``, b as the native path takes it, c ``[m, n]`` fp32) of random values in ``dtype``."""
    a, b = (torch.randn(s).to(dtype) for s in ((m, k), (k, n)))
    c = _aligned_empty((m, n), np.float32)
    if dtype == torch.float32:
        return a.numpy(), b.numpy(), c
    a16, b16 = (t.view(torch.int16).numpy().view(_KERNEL_BITS[dtype]) for t in (a, b))
    if dtype not in BRGEMM_DTYPES:
        return a16, b16, c
    b_pairs = _aligned_empty((k // 2, n), np.uint32)
    _pack_pairs(b16, b_pairs)
    return a16, b_pairs, c


@njit(cache=True, nogil=True)
def _repeated_products(a, b, c, reps, on_brgemm):
    """c = a b, ``reps`` times: brgemm (b as it takes it: VNNI pairs for 16-bit a), else MKL."""
    m, k = a.shape
    n = c.shape[1]
    for _ in range(reps):
        if on_brgemm:
            brgemm(a, m, n, k, (a.ctypes.data, k), (b.ctypes.data, n), (c.ctypes.data, n), False)
        else:
            gemm(a, NO_TRANS, NO_TRANS, m, n, k, (a.ctypes.data, k), (b.ctypes.data, n), (c.ctypes.data, n), False)
