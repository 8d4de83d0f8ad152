"""``attngrad bench``: attngrad and its PyTorch peers timed side by side in one process.

The machine's rooflines are measured first (copy bandwidth, fp32 and bf16 GEMM), then every case of
the modules in ``benchmarks/`` (installed as ``attngrad.benchmarks``). Each case times several
implementations of the same computation (best of N after warm-up) and reports the ratio of each peer's
time to attngrad's, plus GB/s or TFLOP/s against the matching roofline. Results go to the terminal
(a rich table), a JSON file and PNG plots.
"""

from __future__ import annotations

import importlib
import json
import sys
import pkgutil
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class BenchCase:
    """One computation timed across implementations. The first entry of ``impls`` is attngrad's."""

    op: str
    dtype: torch.dtype
    label: str
    impls: dict[str, Callable[[], object]]
    bytes_moved: int | None = None  # memory-bound cases: bytes read + written
    flops: float | None = None  # compute-bound cases: effective FLOPs
    roofline: str = "copy"  # "copy", "gemm_fp32" or "gemm_bf16"
    notes: str = ""


@dataclass
class BenchResult:
    case: BenchCase
    seconds: dict[str, float] = field(default_factory=dict)

    def to_json(self, rooflines: dict[str, float]) -> dict:
        c = self.case
        ours = next(iter(c.impls))
        row = {"op": c.op, "dtype": str(c.dtype).replace("torch.", ""), "label": c.label, "notes": c.notes,
               "seconds": self.seconds,
               "speedup_vs": {k: v / self.seconds[ours] for k, v in self.seconds.items() if k != ours}}
        if c.bytes_moved:
            row["gbps"] = {k: c.bytes_moved / v / 1e9 for k, v in self.seconds.items()}
            row["fraction_of_copy_bw"] = row["gbps"][ours] / rooflines["copy_gbps"]
        if c.flops:
            row["tflops"] = {k: c.flops / v / 1e12 for k, v in self.seconds.items()}
            row["fraction_of_gemm"] = row["tflops"][ours] / rooflines[f"{c.roofline}_tflops"]
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


def measure_rooflines(quick: bool) -> dict[str, float]:
    """Copy bandwidth (read + write) and GEMM throughput of this machine, measured now."""
    n = (64 if quick else 256) * 2**20 // 4
    src, dst = torch.randn(n), torch.empty(n)
    t = best_time(lambda: dst.copy_(src), 5 if quick else 10)
    size = 1024 if quick else 2048
    a32, b32 = torch.randn(size, size), torch.randn(size, size)
    t32 = best_time(lambda: torch.mm(a32, b32), 3 if quick else 5)
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    t16 = best_time(lambda: torch.mm(a16, b16), 3 if quick else 5)
    flops = 2 * size**3
    return {"copy_gbps": 2 * n * 4 / t / 1e9, "gemm_fp32_tflops": flops / t32 / 1e12,
            "gemm_bf16_tflops": flops / t16 / 1e12}


def collect_cases(args) -> list[BenchCase]:
    import attngrad.benchmarks as package

    dtypes = {getattr(torch, d) for d in args.dtype} if args.dtype else None
    cases = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        if not hasattr(module, "cases"):
            continue
        for case in module.cases(quick=args.quick):
            if args.op and not any(o.lower() in case.op.lower() for o in args.op):
                continue
            if dtypes and case.dtype not in dtypes:
                continue
            cases.append(case)
    return cases


def add_arguments(parser) -> None:
    parser.add_argument("--op", action="append", help="operator name substring (repeatable)")
    parser.add_argument("--dtype", action="append", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (< 2 minutes)")
    parser.add_argument("--repeat", type=int, default=None, help="timed calls per implementation")
    parser.add_argument("--out", default="bench-results", help="folder for the JSON file and plots")
    parser.add_argument("--no-plots", action="store_true")


def _render(results: list[BenchResult], rooflines: dict[str, float]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="attngrad bench (times: best of N, ms; ratio = peer time / attngrad time)")
    for col in ("operator", "dtype", "case", "attngrad ms", "peers: ms (ratio)", "attngrad rate"):
        table.add_column(col)
    for r in results:
        row = r.to_json(rooflines)
        ours = next(iter(r.case.impls))
        peers = "; ".join(f"{k} {v * 1e3:.2f} ({row['speedup_vs'][k]:.2f}x)"
                          for k, v in r.seconds.items() if k != ours)
        if "gbps" in row:
            rate = f"{row['gbps'][ours]:.1f} GB/s ({100 * row['fraction_of_copy_bw']:.0f}% of copy)"
        elif "tflops" in row:
            rate = f"{row['tflops'][ours]:.3f} TFLOP/s ({100 * row['fraction_of_gemm']:.0f}% of {r.case.roofline})"
        else:
            rate = "-"
        table.add_row(r.case.op, row["dtype"], r.case.label, f"{r.seconds[ours] * 1e3:.2f}", peers, rate)
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(f"rooflines: copy {rooflines['copy_gbps']:.1f} GB/s, fp32 GEMM "
                  f"{rooflines['gemm_fp32_tflops']:.2f} TFLOP/s, bf16 GEMM {rooflines['gemm_bf16_tflops']:.2f} TFLOP/s")
    console.print(table)


def _plot(results: list[BenchResult], rooflines: dict[str, float], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    ops = sorted({r.case.op for r in results})
    for op in ops:
        rows = [r for r in results if r.case.op == op]
        fig, (ax_t, ax_f) = plt.subplots(1, 2, figsize=(13, 0.45 * len(rows) + 2.5))
        labels = [f"{r.case.label} {str(r.case.dtype).replace('torch.', '')}" for r in rows]
        impls = list(dict.fromkeys(k for r in rows for k in r.seconds))
        height = 0.8 / max(len(impls), 1)
        for i, name in enumerate(impls):
            ys = [j + i * height for j in range(len(rows))]
            ax_t.barh(ys, [r.seconds.get(name, 0) * 1e3 for r in rows], height, label=name)
        ax_t.set_yticks([j + 0.4 - height / 2 for j in range(len(rows))], labels, fontsize=7)
        ax_t.set_xlabel("time (ms, lower is better)")
        ax_t.legend(fontsize=7)
        fractions = []
        for r in rows:
            row = r.to_json(rooflines)
            fractions.append(row.get("fraction_of_copy_bw", row.get("fraction_of_gemm", 0.0)))
        ax_f.barh(range(len(rows)), fractions, color="tab:green")
        ax_f.set_yticks(range(len(rows)), labels, fontsize=7)
        ax_f.set_xlabel("attngrad: fraction of the machine's roofline")
        fig.suptitle(f"{op} ({platform.processor() or platform.machine()})")
        fig.tight_layout()
        path = out / f"{op}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def run_bench(args) -> int:
    from rich.progress import Progress

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rooflines = measure_rooflines(args.quick)
    cases = collect_cases(args)
    repeat = args.repeat or (3 if args.quick else 10)
    results = []
    with Progress(transient=True) as progress:
        task = progress.add_task("benchmarking", total=sum(len(c.impls) for c in cases))
        for case in cases:
            result = BenchResult(case)
            for name, fn in case.impls.items():
                progress.update(task, description=f"{case.op} {case.label} {name}")
                result.seconds[name] = best_time(fn, repeat)
                progress.advance(task)
            results.append(result)
    _render(results, rooflines)
    report = {"machine": {"processor": platform.processor(), "torch": torch.__version__,
                          "threads": torch.get_num_threads()},
              "rooflines": rooflines, "results": [r.to_json(rooflines) for r in results]}
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    plots = [] if args.no_plots else _plot(results, rooflines, out)
    print(f"wrote {out / 'bench.json'}" + "".join(f", {p}" for p in plots))
    return 0
