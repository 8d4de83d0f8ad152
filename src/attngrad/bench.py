"""``attngrad bench``: attngrad and its PyTorch peers timed side by side in one process.

The report opens with the machine (CPU model, instruction sets, thread count, the GEMM paths the bf16 / fp16
kernels take: :mod:`attngrad.kernels.gemm_paths`). The machine's rooflines are measured first (copy bandwidth, fp32
GEMM, bf16 GEMM native and on widened fp32, the kernels' own tile GEMM on all threads), then every case of
the modules in ``benchmarks/`` (installed as ``attngrad.benchmarks``). Each case times several
implementations of the same computation (best of N after warm-up) and reports the ratio of each peer's
time to attngrad's, plus GB/s or TFLOP/s against the matching roofline (a copy, or the kernels' tile GEMM, timed
in the same rounds tracks the machine's speed during the case). Results go to the terminal
(a rich table: the ``cli`` extra), a JSON file and PNG plots (matplotlib: the ``plot`` extra). The method
is described in docs/performance.md.

Three more sections, each measured in fresh child processes so that runs do not contaminate each other:

* ``first_call`` (``--first-call``; on by default except with ``--quick``): the latency of the first call
  of every operator in a new process with an empty numba cache (``NUMBA_CACHE_DIR`` = a new temporary
  folder: compilation included), then again in a second process with the same folder (kernels loaded
  from the cache);
* ``scaling`` (``--scaling``): time and peak memory of flash attention forward + grad against the
  O(S^2)-memory math path as the sequence length grows (:mod:`attngrad.benchmarks.bench_scaling`);
* ``ring`` (``--op ring``): context parallelism's per-rank memory and wall time against one process
  (:mod:`attngrad.benchmarks.bench_ring`).

The process's malloc settings are left alone. Memory-bound cases rate a call writing into a preallocated
output against the copy roofline (which does the same) and time the allocating calls alongside.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import pkgutil
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .cli import op_selected


@dataclass
class BenchCase:
    """One computation timed across implementations. The first entry of ``impls`` is attngrad's."""

    op: str
    dtype: torch.dtype
    label: str
    impls: dict[str, Callable[[], object]]
    bytes_moved: int | None = None  # memory-bound cases: bytes read + written
    flops: float | None = None  # compute-bound cases: effective FLOPs
    roofline: str = "copy"  # "copy", "gemm_fp32", "gemm_bf16", "gemm_bf16_best", or "none" (a ratio only)
    notes: str = ""


@dataclass
class BenchResult:
    """Best times per implementation; ``round_seconds``: each implementation's time in each round, where the
    rounds were recorded (a round's calls ran moments apart, so the per-round ratios of a peer to attngrad,
    their median and range, show the noise that a ratio of two bests hides); ``copy_gbps``: a copy of the same
    bytes timed in the same rounds; ``tiles_tflops``: the kernels' tile GEMM timed in the same rounds, the one
    whose rate at the start of the run is the rooflines' ``tiles_roofline`` entry."""

    case: BenchCase
    seconds: dict[str, float] = field(default_factory=dict)
    copy_gbps: float | None = None
    tiles_tflops: float | None = None
    tiles_roofline: str | None = None
    round_seconds: dict[str, list[float]] = field(default_factory=dict)

    def round_ratios(self) -> dict[str, list[float]]:
        """Per peer, its time over attngrad's in each round (empty without recorded rounds)."""
        if not self.round_seconds:
            return {}
        ours, *peers = self.case.impls
        return {peer: [p / o for p, o in zip(self.round_seconds[peer], self.round_seconds[ours])] for peer in peers}

    def to_json(self, rooflines: dict[str, float]) -> dict:
        c = self.case
        ours = next(iter(c.impls))
        row = {"op": c.op, "dtype": str(c.dtype).replace("torch.", ""), "label": c.label, "notes": c.notes,
               "seconds": self.seconds,
               "speedup_vs": {k: v / self.seconds[ours] for k, v in self.seconds.items() if k != ours}}
        if self.round_seconds:
            row["seconds_per_round"] = self.round_seconds
            row["speedup_per_round"] = {k: {"median": statistics.median(v), "low": min(v), "high": max(v),
                                            "rounds": len(v)} for k, v in self.round_ratios().items()}
        if c.bytes_moved:
            # the copy timed alongside is the roofline when there is one: it saw the same machine load
            copy = self.copy_gbps or rooflines["copy_gbps"]
            row["copy_gbps_alongside"] = self.copy_gbps
            row["gbps"] = {k: c.bytes_moved / v / 1e9 for k, v in self.seconds.items()}
            row["fraction_of_roofline"] = {k: v / copy for k, v in row["gbps"].items()}
            row["fraction_of_copy_bw"] = row["fraction_of_roofline"][ours]
        if c.flops:
            roofline = rooflines[f"{c.roofline}_tflops"]
            if self.tiles_tflops:  # the machine's speed during the case's rounds against the start of the run
                roofline *= self.tiles_tflops / rooflines[self.tiles_roofline]
            row["tiles_tflops_alongside"] = self.tiles_tflops
            row["roofline_tflops"] = roofline
            row["tflops"] = {k: c.flops / v / 1e12 for k, v in self.seconds.items()}
            row["fraction_of_roofline"] = {k: v / roofline for k, v in row["tflops"].items()}
            row["fraction_of_gemm"] = row["fraction_of_roofline"][ours]
        return row


def best_time(fn: Callable[[], object], repeat: int, warmup: int = 1, budget_s: float = 20.0) -> float:
    """Best wall time of ``repeat`` calls after ``warmup`` calls (fewer when a call is slow)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    start = time.perf_counter()
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return best


TILES_SECONDS = 0.05  # one run of the tile GEMM, in the rooflines and alongside a compute-bound case
_TILES_ROOFLINE = {torch.float32: "gemm_fp32_tiles_tflops", torch.bfloat16: "gemm_bf16_tiles_tflops"}


def measure_rooflines(quick: bool) -> dict[str, float]:
    """Copy bandwidth (read + write) and GEMM throughput of this machine, measured now. fp32: the best of torch's
    and numpy's GEMM and the kernels' own tile GEMM on all threads (:func:`.kernels.gemm_paths.tile_tflops`);
    bf16: torch's native GEMM, the bf16 operands widened to fp32 (widening included) on torch's fp32 GEMM, and
    the kernels' bf16 tiles; ``gemm_bf16_best`` the best of those and of the fp32 tiles: the bf16 roofline of a
    kernel free to take either path."""
    from .kernels.gemm_paths import tile_tflops

    # the tiles timed before and after the rest, the better kept: they are the base against which the tiles timed
    # alongside each case scale its roofline (BenchResult.to_json), so a burst of load during one measurement
    # would inflate every fraction of the run
    tiles_before = [tile_tflops(dtype, torch.get_num_threads(), TILES_SECONDS) for dtype in _TILES_ROOFLINE]
    n = (64 if quick else 256) * 2**20 // 4
    src, dst = torch.randn(n), torch.empty(n)
    t = best_time(lambda: dst.copy_(src), 5 if quick else 10)
    size = 1024 if quick else 2048
    reps = 3 if quick else 5
    a32, b32 = torch.randn(size, size), torch.randn(size, size)
    a_np, b_np = a32.numpy(), b32.numpy()
    t32 = min(best_time(lambda: torch.mm(a32, b32), reps), best_time(lambda: a_np @ b_np, reps))
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    t16 = best_time(lambda: torch.mm(a16, b16), reps)
    t16_widened = best_time(lambda: torch.mm(a16.float(), b16.float()), reps)
    tiles = {key: max(before, tile_tflops(dtype, torch.get_num_threads(), TILES_SECONDS))
             for (dtype, key), before in zip(_TILES_ROOFLINE.items(), tiles_before)}
    flops = 2 * size**3
    r = {"copy_gbps": 2 * n * 4 / t / 1e9, "gemm_fp32_torch_tflops": flops / t32 / 1e12,
         "gemm_bf16_tflops": flops / t16 / 1e12, "gemm_bf16_widened_tflops": flops / t16_widened / 1e12, **tiles}
    r["gemm_fp32_tflops"] = max(r["gemm_fp32_torch_tflops"], r["gemm_fp32_tiles_tflops"])
    r["gemm_bf16_best_tflops"] = max(r["gemm_bf16_tflops"], r["gemm_bf16_widened_tflops"],
                                     r["gemm_bf16_tiles_tflops"], r["gemm_fp32_tiles_tflops"])
    return r


def machine_info(recalibrate: bool = False) -> dict:
    """The report's machine: CPU model, instruction sets, torch's thread count (the kernels' too), the GEMM path
    per dtype and the float16 softmax's scaling (``recalibrate``: measured again, else from the calibration cache)
    with their timings."""
    from .kernels import gemm_paths
    from .kernels.threads import kernel_threads
    from .machine import cpu_model, gemm_isa_caps, isa_flags

    entry = gemm_paths.calibrate() if recalibrate else gemm_paths.scaling_calibration()
    return {"cpu": cpu_model(), "isa": list(isa_flags()), "isa_caps": gemm_isa_caps(),
            "processor": platform.processor(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "kernel_threads": kernel_threads(), "cpus": os.cpu_count(),
            "gemm_paths": {str(d).removeprefix("torch."): gemm_paths.gemm_path(d)
                           for d in gemm_paths.CALIBRATED_DTYPES},
            "gemm_path_forced": gemm_paths.forced_path() is not None,
            "float16_scaling": gemm_paths.float16_scaling(),
            "gemm_calibration": {k: entry[k] for k in ("measured", "paths", "microseconds", "float16_scaling",
                                                       "float16_scaling_microseconds")}}


def machine_text(machine: dict) -> str:
    """One line: CPU, ISA, threads, GEMM paths and float16 softmax scaling (the terminal's and the Markdown
    summary's header)."""
    paths = ", ".join(f"{d} {p}" for d, p in machine["gemm_paths"].items())
    source = ("forced by ATTNGRAD_GEMM_PATH" if machine["gemm_path_forced"]
              else f"calibrated {machine['gemm_calibration']['measured']}")
    isa = ", ".join(machine["isa"]) or "no listed ISA extension"
    caps = ", ".join(f"{name}={value}" for name, value in machine["isa_caps"].items())
    caps = f"; GEMMs capped by {caps}" if caps else ""
    return (f"CPU: {machine['cpu']} ({isa}{caps}), {machine['cpus']} CPUs; torch {machine['torch']}, "
            f"{machine['threads']} threads (kernels: {machine['kernel_threads']}); GEMM paths: {paths} ({source}); "
            f"float16 softmax scaling: {machine['float16_scaling']}")


def rooflines_text(r: dict[str, float]) -> str:
    return (f"copy {r['copy_gbps']:.1f} GB/s; fp32 GEMM {r['gemm_fp32_torch_tflops']:.3g} TFLOP/s torch, "
            f"{r['gemm_fp32_tiles_tflops']:.3g} kernel tiles (best {r['gemm_fp32_tflops']:.3g}); bf16 GEMM "
            f"{r['gemm_bf16_tflops']:.3g} TFLOP/s torch, {r['gemm_bf16_widened_tflops']:.3g} torch widened to fp32, "
            f"{r['gemm_bf16_tiles_tflops']:.3g} kernel tiles (best of these and the fp32 tiles "
            f"{r['gemm_bf16_best_tflops']:.3g})")


@functools.lru_cache(maxsize=None)
def _module_cases(module_name: str, quick: bool) -> tuple[BenchCase, ...]:
    """The cases of one ``benchmarks/`` module (built once per process: inputs are large)."""
    module = importlib.import_module(module_name)
    return tuple(module.cases(quick=quick)) if hasattr(module, "cases") else ()


def collect_cases(args) -> list[BenchCase]:
    """The cases ``args`` select. A module whose ``OPS`` (the operators its cases time) none of the ``--op``
    filters select is not built: building runs its kernels, a numba compile on a cold cache."""
    import attngrad.benchmarks as package

    dtypes = {getattr(torch, d) for d in args.dtype} if args.dtype else None
    cases = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        name = f"{package.__name__}.{info.name}"
        if not any(op_selected(op, args.op) for op in getattr(importlib.import_module(name), "OPS", ())):
            continue
        for case in _module_cases(name, args.quick):
            if not op_selected(case.op, args.op):
                continue
            if dtypes and case.dtype not in dtypes:
                continue
            if args.size and not any(z.lower() in case.label.lower() for z in args.size):
                continue
            cases.append(case)
    return cases


def add_arguments(parser) -> None:
    parser.add_argument("--op", action="append", help="operator name substring (repeatable); 'ring': the context "
                        "parallelism section")
    parser.add_argument("--dtype", action="append", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (< 2 minutes)")
    parser.add_argument("--repeat", type=int, default=None, help="timed calls per implementation")
    parser.add_argument("--size", action="append",
                        help="case label substring, e.g. 'S2048' or '[4, 16, 512, 1024]' (repeatable)")
    parser.add_argument("--out", default="bench-results", help="folder for the JSON file and plots (default "
                        "./bench-results)")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure again which GEMM path (native or widened fp32) the bf16 / fp16 kernels take "
                             "on this machine (cached per machine), and show the timings")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--first-call", action=argparse.BooleanOptionalAction, default=None,
                        help="first-call latency per operator in fresh processes, cold and cached numba cache "
                             "(default: on, off with --quick)")
    parser.add_argument("--scaling", action="store_true",
                        help="flash attention time and peak memory vs sequence length (child processes)")
    parser.add_argument("--scaling-max-s", type=int, default=32768, help="largest sequence length tried")
    parser.add_argument("--scaling-call-limit", type=float, default=60.0,
                        help="stop an implementation's sweep once one call would exceed this many seconds")
    parser.add_argument("--scaling-mem-limit-gib", type=float, default=8.0,
                        help="stop an implementation's sweep once its next peak memory would exceed this")


def peer_text(row: dict, peer: str, digits: int) -> str:
    """``peer``'s best time in ms and its ratio to attngrad's (:meth:`BenchResult.to_json`'s ``row``), then the
    median and range of the per-round ratios where they were recorded."""
    text = f"{peer} {row['seconds'][peer] * 1e3:.{digits}f} ({row['speedup_vs'][peer]:.2f}x"
    rounds = row.get("speedup_per_round", {}).get(peer)
    if rounds:
        text += f"; per round {rounds['median']:.2f}x, {rounds['low']:.2f}-{rounds['high']:.2f}x"
    return text + ")"


def _render(results: list[BenchResult], rooflines: dict[str, float], console) -> None:
    from rich.table import Table

    table = Table(title="attngrad bench (times: best of N, ms; ratio = peer time / attngrad time, of the bests, "
                        "then the median and range of the rounds' ratios)")
    for col in ("operator", "dtype", "case", "attngrad ms", "peers: ms (ratio)", "attngrad rate"):
        table.add_column(col)
    for r in results:
        row = r.to_json(rooflines)
        ours = next(iter(r.case.impls))
        peers = "; ".join(peer_text(row, k, 2) for k in r.seconds if k != ours)
        if "gbps" in row:
            rate = f"{row['gbps'][ours]:.1f} GB/s ({100 * row['fraction_of_copy_bw']:.0f}% of copy)"
            if row["copy_gbps_alongside"]:
                rate += f"; copy alongside {row['copy_gbps_alongside']:.1f} GB/s"
        elif "tflops" in row:
            rate = f"{row['tflops'][ours]:.3f} TFLOP/s ({100 * row['fraction_of_gemm']:.0f}% of {r.case.roofline})"
            if row["tiles_tflops_alongside"]:
                rate += f"; tiles alongside {row['tiles_tflops_alongside']:.3g} TFLOP/s"
        else:
            rate = "-"
        table.add_row(r.case.op, row["dtype"], r.case.label, f"{r.seconds[ours] * 1e3:.2f}", peers, rate)
    console.print(f"rooflines: {rooflines_text(rooflines)}")
    console.print(table)


def _plot(results: list[BenchResult], rooflines: dict[str, float], out: Path) -> list[Path]:
    """One PNG per operator: time per case and implementation, and each one's fraction of the roofline."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for op in sorted({r.case.op for r in results}):
        rows = [r for r in results if r.case.op == op]
        fig, (ax_t, ax_f) = plt.subplots(1, 2, figsize=(12, 0.7 * len(rows) + 2.6), sharey=True)
        labels = [textwrap.fill(f"{str(r.case.dtype).replace('torch.', '')} {r.case.label}", 30) for r in rows]
        impls = list(dict.fromkeys(k for r in rows for k in r.seconds))
        height = 0.8 / max(len(impls), 1)
        fractions = [r.to_json(rooflines).get("fraction_of_roofline", {}) for r in rows]
        for i, name in enumerate(impls):
            ys = [j + i * height for j in range(len(rows))]
            best = [r.seconds.get(name, 0) * 1e3 for r in rows]
            median = [statistics.median(r.round_seconds[name]) * 1e3 if name in r.round_seconds else b
                      for r, b in zip(rows, best)]
            ax_t.barh(ys, best, height, label=name,
                      xerr=([0] * len(rows), [m - b for m, b in zip(median, best)]), capsize=2,
                      error_kw={"elinewidth": 0.8})
            ax_f.barh(ys, [f.get(name, 0) for f in fractions], height)
        ax_t.set_yticks([j + 0.4 - height / 2 for j in range(len(rows))], labels, fontsize=7)
        ax_t.invert_yaxis()
        ax_t.set_xlabel("time (ms, best of N, whisker to the median round; lower is better)")
        ax_f.axvline(1.0, color="black", linewidth=0.8)
        rooflines_used = ", ".join(dict.fromkeys(f"{str(r.case.dtype)[6:]}: {r.case.roofline}" for r in rows))
        ax_f.set_xlabel(f"fraction of the case's roofline\n({rooflines_used}; 1 = roofline)", fontsize=8)
        fig.legend(*ax_t.get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=7, frameon=False)
        fig.suptitle(f"{op} ({platform.machine()}, {os.cpu_count()} CPUs)")
        fig.tight_layout(rect=(0, 0.06 + 0.02 * len(impls), 1, 1))
        path = out / f"{op}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths


def markdown_summary(report: dict) -> str:
    """The report as Markdown tables (the tables of docs/performance.md are pasted from it)."""
    lines = [machine_text(report["machine"]) + ".", "",
             f"Rooflines measured first: {rooflines_text(report['rooflines'])}. Memory-bound cases are rated "
             "against a copy of the same bytes timed in the same rounds; compute-bound ones against their roofline "
             "scaled by the kernels' tile GEMM timed in the same rounds over its rate when the rooflines were "
             "measured (the machine's drift during the run).", "",
             "Peers: best time in ms (its ratio to attngrad's best; per round: the median and range of the ratios "
             "of the calls of one round).", "",
             "| operator | dtype | case | attngrad ms | % of roofline | peers: ms (speed-up of attngrad) |",
             "|---|---|---|---|---|---|"]
    for row in report["results"]:
        ours, *peers = row["seconds"]
        frac = row.get("fraction_of_copy_bw", row.get("fraction_of_gemm"))
        lines.append(f"| {row['op']} | {row['dtype']} | {row['label']} | {row['seconds'][ours] * 1e3:.1f} | "
                     f"{'-' if frac is None else f'{100 * frac:.0f}%'} | "
                     f"{'; '.join(peer_text(row, k, 1) for k in peers)} |")
    if "first_call" in report:
        lines += ["", "| operator (first call, fresh process) | import s | cold numba cache s | cached s |",
                  "|---|---|---|---|"]
        lines += [f"| {f['op']} | {f['import_s']:.2f} | {f['cold_s']:.2f} | {f['cached_s']:.2f} |"
                  for f in report["first_call"]]
    if "scaling" in report:
        sc = report["scaling"]
        lines += ["", f"Sequence-length scaling ({sc['shape']}, {sc['layout']}, forward + grad):", "",
                  "| impl | S | forward s | grad s | peak MiB |", "|---|---|---|---|---|"]
        lines += [f"| {x['impl']} | {x['s']} | {x['forward_s']:.3f} | {x['grad_s']:.3f} | "
                  f"{x['peak_bytes'] / 2**20:.1f} |" for x in sc["rows"]]
        from .benchmarks.bench_scaling import fit_text

        lines += [f"\n{impl}: {fit_text(fit)}." + (f" {fit['stopped']}." if fit["stopped"] else "")
                  for impl, fit in sc["fits"].items()]
    return "\n".join(lines) + "\n"


# --- first-call latency: one tiny float32 call per operator in a fresh interpreter ---
_FIRST_CALL_SETUP = """
import torch
x = torch.randn(1, 2, 4, 16); mask = torch.rand(1, 1, 4, 16) < 0.3
t = torch.randn(1, 2, 16) * 0.1; g = torch.randn(1, 2, 16, 16)
q, k, v, dy = (torch.randn(1, 1, 16, 64) for _ in range(4))
"""
FIRST_CALLS = {
    "ScaledMaskedSoftmax": "attngrad.scaled_masked_softmax(x, mask, 0.5)",
    "ScaledMaskedSoftmaxBackward": "attngrad.scaled_masked_softmax_backward(x, x, mask, 0.5)",
    "ExpSegsum": "attngrad.exp_segsum(t)",
    "ExpSegsumBackward": "attngrad.exp_segsum_backward(g, g)",
    "FlashAttentionScore": "attngrad.flash_attention_score(q, k, v, 1, 'BNSD', scale_value=0.125)",
    "FlashAttentionScoreGrad": "attngrad.flash_attention_score_grad(q, k, v, dy, 1, 'BNSD', scale_value=0.125)",
}
_FIRST_CALL_TEMPLATE = """
import json, time
t0 = time.perf_counter()
import attngrad
t1 = time.perf_counter()
{setup}
t2 = time.perf_counter()
{call}
t3 = time.perf_counter()
print(json.dumps({{"import_s": t1 - t0, "first_call_s": t3 - t2}}))
"""


def child_json(code: str, env: dict | None = None, timeout: float = 900.0, argv: tuple[str, ...] = ()) -> dict:
    """Run ``code`` in a fresh interpreter (``sys.argv[1:]`` = argv) and parse its last stdout line as JSON."""
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if proc.returncode:
        raise RuntimeError(f"child failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def first_call_latency(op: str) -> dict:
    """First call of ``op`` in a new process with an empty numba cache, then in one reusing that cache."""
    code = _FIRST_CALL_TEMPLATE.format(setup=_FIRST_CALL_SETUP, call=FIRST_CALLS[op])
    with tempfile.TemporaryDirectory(prefix="attngrad-numba-cache-") as cache:
        cold = child_json(code, {"NUMBA_CACHE_DIR": cache})
        cached = child_json(code, {"NUMBA_CACHE_DIR": cache})
    return {"op": op, "dtype": "float32", "import_s": cached["import_s"], "cold_s": cold["first_call_s"],
            "cached_s": cached["first_call_s"]}


def selected_first_calls(args) -> list[str]:
    return [op for op in FIRST_CALLS if op_selected(op, args.op)]


def _render_first_calls(rows: list[dict], console) -> None:
    from rich.table import Table

    table = Table(title="first call in a fresh process (float32, tiny shapes; numba compile included when cold)")
    for col in ("operator", "import attngrad s", "cold cache s", "cached s"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["op"], f"{r['import_s']:.2f}", f"{r['cold_s']:.2f}", f"{r['cached_s']:.2f}")
    console.print(table)


def _render_calibration(calibration: dict, console) -> None:
    from rich.table import Table

    from .kernels.gemm_paths import NATIVE, WIDENED

    table = Table(title="GEMM-path calibration: one backward tile set at head dim 128, single thread, best of N")
    for col in ("dtype", "native us", "widened fp32 us", "calibrated choice"):
        table.add_column(col)
    for dtype, t in calibration["microseconds"].items():
        table.add_row(dtype, f"{t[NATIVE]:.0f}", f"{t[WIDENED]:.0f}", calibration["paths"][dtype])
    console.print(table)
    scaling = ", ".join(f"{name} {us:.1f} us" for name, us in calibration["float16_scaling_microseconds"].items())
    console.print(f"float16 softmax scaling (its forward on 1024 rows of 1024 logits, best of N): "
                  f"{scaling or 'not timed'}; chosen: {calibration['float16_scaling']}")


def _console():
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 200)


def _copy_fn(bytes_moved: int) -> Callable[[], object]:
    """A float32 copy moving ``bytes_moved`` bytes (read + write), the memory-bound roofline."""
    src = torch.randn(max(bytes_moved // 8, 1))
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


_EVICT_BYTES = 128 << 20  # larger than the last-level cache of the machines this runs on
_EVICT_CHUNK_BYTES = 16 << 20  # smaller than that cache: a chunk's second read hits it


@functools.lru_cache(maxsize=1)
def _evict_chunks() -> torch.Tensor:
    return torch.ones(_EVICT_BYTES // 4).view(_EVICT_BYTES // _EVICT_CHUNK_BYTES, -1)


def evict_caches() -> None:
    """Read 128 MiB, each 16 MiB chunk twice, so that the next call finds none of its data in the caches (a read
    leaves no dirty lines to write back, unlike a copy).

    One streaming read is not enough on AMD Zen 5, whose 32 MiB L3 keeps lines that were hit over lines read
    once: after one read of 128 MiB, an ExpSegsumBackward call on [256, 128, 128] float32 inputs took 212 us,
    against 477 us after this eviction (one process, its inputs read just before). The second read of each chunk
    hits the L3, so the chunk's own lines are the ones kept, and the call's lines are displaced."""
    for chunk in _evict_chunks():
        chunk.sum()
        chunk.sum()


def alongside_tiles(case: BenchCase, rooflines: dict[str, float]) -> torch.dtype | None:
    """The tile GEMM (:func:`.kernels.gemm_paths.tile_work`) to time alongside a compute-bound case: float32 tiles
    for the fp32 roofline, else the faster of the bfloat16 and float32 tiles when the rooflines were measured;
    None for the other cases."""
    if not case.flops or not case.roofline.startswith("gemm"):
        return None
    if case.roofline == "gemm_fp32":
        return torch.float32
    bf16, fp32 = (rooflines[_TILES_ROOFLINE[dtype]] for dtype in (torch.bfloat16, torch.float32))
    return torch.bfloat16 if bf16 >= fp32 else torch.float32


def round_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` implementations for successive rounds, balanced for the call just before (a Williams
    design): over these ``n`` rounds (``2 n`` for an odd ``n`` > 1) every implementation directly follows each
    other one equally often, and holds each place in the round equally often. The mirrored rows of an odd ``n``
    go in the order that starts none of them, nor the cycle after, with the call that ended the round before
    (``n`` >= 3)."""
    first, low, high = [0], 1, n - 1
    for i in range(1, n):
        first.append(low if i % 2 else high)
        low, high = (low + 1, high) if i % 2 else (low, high - 1)
    rows = [[(x + shift) % n for x in first] for shift in range(n)]
    return rows + [rows[-shift % n][::-1] for shift in range(n)] if n % 2 and n > 1 else rows


def time_case(case: BenchCase, repeat: int, budget_s: float = 60.0, min_s: float = 2.0,
              tiles: torch.dtype | None = None) -> BenchResult:
    """Best of at least ``repeat`` interleaved rounds (one call of each implementation per round, after one
    warm-up call each), so that every implementation sees the same machine load; memory-bound cases also time
    a copy of the same bytes in the same rounds, and with ``tiles`` (:func:`alongside_tiles`) a compute-bound
    case times the kernels' tile GEMM on those tiles.

    Memory-bound cases are rated against DRAM bandwidth, so every timed call of theirs (the copy's too) starts
    with evicted caches (:func:`evict_caches`): cases of tens of MB otherwise run partly from the last-level
    cache, more or less depending on the call before. The order changes from round to round
    (:func:`round_orders`), so that no implementation always follows the same neighbour: a plain rotation put
    one implementation right after the tile GEMM whenever it was not first in the round, and that place alone
    made it slower. Fast cases run more rounds, until ``min_s`` has passed: the best of 10 sub-millisecond calls
    on a shared machine still carries its noise. The rounds end with a whole cycle of orders (at most
    ``5 * repeat`` rounds, and none started after ``budget_s``).
    """
    from .kernels.gemm_paths import tile_work

    fns = dict(case.impls)
    if case.bytes_moved:
        fns["__copy__"] = _copy_fn(case.bytes_moved)
    if tiles is not None:
        fns["__tiles__"], tile_flops = tile_work(tiles, torch.get_num_threads(), TILES_SECONDS)
    names = list(fns)
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    start = time.perf_counter()
    orders = round_orders(len(names))
    for round_ in range(5 * repeat):
        elapsed = time.perf_counter() - start
        if round_ >= repeat and elapsed > min_s and round_ % len(orders) == 0 or elapsed > budget_s:
            break
        for name in (names[i] for i in orders[round_ % len(orders)]):
            if case.bytes_moved:
                evict_caches()
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    best = {name: min(t) for name, t in times.items()}
    copy = best.pop("__copy__", None)
    tiles_time = best.pop("__tiles__", None)
    return BenchResult(case, best, case.bytes_moved / copy / 1e9 if copy else None,
                       tile_flops / tiles_time / 1e12 if tiles_time else None,
                       _TILES_ROOFLINE[tiles] if tiles is not None else None,
                       {name: times[name] for name in case.impls})


def _time_cases(cases: list[BenchCase], repeat: int, rooflines: dict[str, float], progress) -> list[BenchResult]:
    task = progress.add_task("benchmarking", total=len(cases))
    results = []
    for case in cases:
        progress.update(task, description=f"{case.op} {str(case.dtype)[6:]} {case.label}")
        results.append(time_case(case, repeat, tiles=alongside_tiles(case, rooflines)))
        progress.advance(task)
    return results


def _first_calls(ops: list[str], progress) -> list[dict]:
    task = progress.add_task("first calls", total=len(ops))
    rows = []
    for op in ops:
        progress.update(task, description=f"first call {op} (two fresh processes)")
        rows.append(first_call_latency(op))
        progress.advance(task)
    return rows


def run_bench(args) -> int:
    from .cli import require_extra

    require_extra("rich", "cli")  # tables and progress; checked before minutes of measuring
    if not args.no_plots:
        require_extra("matplotlib", "plot", " (or pass --no-plots)")
    from rich.progress import Progress

    from .benchmarks import bench_ring

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    first_call = (not args.quick) if args.first_call is None else args.first_call
    machine = machine_info(args.calibrate)
    console = _console()
    console.print(machine_text(machine))
    if args.calibrate:
        _render_calibration(machine["gemm_calibration"], console)
    rooflines = measure_rooflines(args.quick)
    cases = [] if bench_ring.selected_alone(args) else collect_cases(args)
    repeat = args.repeat or (3 if args.quick else 10)
    report = {"machine": machine, "options": {"quick": args.quick, "repeat": repeat}, "rooflines": rooflines}
    with Progress(transient=True) as progress:
        results = _time_cases(cases, repeat, rooflines, progress)
        report["results"] = [r.to_json(rooflines) for r in results]
        if first_call:
            report["first_call"] = _first_calls(selected_first_calls(args), progress)
        if args.scaling:
            from .benchmarks import bench_scaling

            report["scaling"] = bench_scaling.run(args, progress)
        if bench_ring.selected(args):
            report["ring"] = bench_ring.run(args, progress)
    _render(results, rooflines, console)
    if first_call:
        _render_first_calls(report["first_call"], console)
    if args.scaling:
        bench_scaling.render(report["scaling"], console)
    if "ring" in report:
        bench_ring.render(report["ring"], console)
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    (out / "bench.md").write_text(markdown_summary(report))
    plots = [] if args.no_plots else _plot(results, rooflines, out)
    if args.scaling and not args.no_plots:
        plots.append(bench_scaling.plot(report["scaling"], out / "scaling.png"))
    if "ring" in report and not args.no_plots:
        plots.append(bench_ring.plot(report["ring"], out / "ring.png"))
    console.print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}" + "".join(f", {p}" for p in plots))
    return 0
