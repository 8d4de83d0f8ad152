"""What this machine is: its CPU model and the instruction sets that decide attngrad's GEMM paths.

Read by ``attngrad bench`` (its header) and by :mod:`attngrad.kernels.gemm_paths` (the key of its cache).
The instruction sets are LLVM's view of the host, the one numba compiles the kernels for. The GEMM libraries may
be told to use fewer (:func:`gemm_isa_caps`): with ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_FP16`` and
``MKL_ENABLE_INSTRUCTIONS=AVX512_E3`` a CPU with AMX multiplies as one without it does, torch's GEMMs included.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

from numba.core import config
from numba.core.codegen import get_host_cpu_features

# reported name -> the LLVM features that must all be present
ISA_FEATURES = {
    "AMX-BF16": ("amx-tile", "amx-bf16"),
    "AMX-FP16": ("amx-tile", "amx-fp16"),
    "AVX512F": ("avx512f",),
    "AVX512-BF16": ("avx512bf16",),
    "AVX512-FP16": ("avx512fp16",),
    "AVX2": ("avx2",),
    "NEON": ("neon",),
    "SVE": ("sve",),
}

# environment variables that cap the instruction sets of oneDNN (torch's brgemm and bf16 GEMMs) and MKL
GEMM_ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; elsewhere what :mod:`platform` knows, else the architecture)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


@functools.cache
def isa_flags() -> tuple[str, ...]:
    """The names of :data:`ISA_FEATURES` this CPU has, in that order."""
    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else get_host_cpu_features()
    present = {f[1:] for f in features.split(",") if f.startswith("+")}
    return tuple(name for name, needs in ISA_FEATURES.items() if present.issuperset(needs))


def gemm_isa_caps() -> dict[str, str]:
    """The :data:`GEMM_ISA_CAPS` set in this process's environment, name -> value (empty: no cap)."""
    return {name: os.environ[name] for name in GEMM_ISA_CAPS if os.environ.get(name)}
