"""Sequence-length scaling of flash attention: time O(S^2), memory O(S), against the O(S^2)-memory math path.

``attngrad bench --scaling`` runs, for S = 512, 1024, ... up to ``--scaling-max-s`` (32768), one child
process per (implementation, S) (B1 N1 D64 bf16, layout BNSD, no mask):

* ``attngrad``: ``flash_attention_score`` then ``flash_attention_score_grad`` (stats from the forward);
* ``torch math``: ``scaled_dot_product_attention`` on the math backend (materialises the S x S scores)
  and ``autograd.grad`` of its output.

The child first runs both calls at S = 256 (kernels compiled or loaded), makes the inputs, resets the
kernel's peak-RSS mark (``/proc/self/clear_refs``), then times one forward and one grad at the requested
S; the peak memory is the peak RSS (VmHWM) minus the RSS before the calls (inputs excluded). A sweep stops once
the next size would take longer than ``--scaling-call-limit`` seconds per call or more than ``--scaling-mem-limit-gib`` of
peak memory (extrapolated as S^2 from the last size), and the report says so. Exponents are the
least-squares slopes of log(time) and log(memory) against log(S) over the sizes from 2048 on.

This module has no ``cases``: it is not part of the ordinary per-case timing.
"""

from __future__ import annotations

import math

IMPLS = ("attngrad", "torch math")
SIZES_FROM = 512
FIT_FROM = 2048
HEADS, HEAD_DIM = 1, 64

_CHILD = """
import json, sys
from attngrad.benchmarks.bench_scaling import call_pair, inputs, peak_rss_reset, rss_bytes
impl, s, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
call_pair(impl, *inputs(256, d))
data = inputs(s, d)
base = peak_rss_reset()
times = call_pair(impl, *data)
print(json.dumps({"forward_s": times[0], "grad_s": times[1], "peak_bytes": rss_bytes("VmHWM") - base}))
"""


def rss_bytes(field: str = "VmRSS") -> int:
    """A memory figure of this process from /proc/self/status (VmRSS now, VmHWM its peak), in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_rss_reset() -> int:
    """Reset the peak RSS to the current RSS (Linux ``clear_refs`` 5) and return the current RSS."""
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_bytes()


def inputs(s: int, d: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, HEADS, s, d, generator=g).bfloat16() for _ in range(4))


def call_pair(impl: str, q, k, v, dy) -> tuple[float, float]:
    """Forward and grad of one BNSD bf16 attention with ``impl``; returns their wall times."""
    import time

    import torch

    scale = 1.0 / math.sqrt(q.shape[-1])
    t0 = time.perf_counter()
    if impl == "attngrad":
        import attngrad

        out, smax, ssum = attngrad.flash_attention_score(q, k, v, HEADS, "BNSD", scale_value=scale)[:3]
        t1 = time.perf_counter()
        attngrad.flash_attention_score_grad(q, k, v, dy, HEADS, "BNSD", softmax_max=smax, softmax_sum=ssum,
                                            attention_in=out, scale_value=scale)
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention

        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(SDPBackend.MATH):
            out = scaled_dot_product_attention(*leaves, scale=scale)
        t1 = time.perf_counter()
        torch.autograd.grad(out, leaves, dy)
    return t1 - t0, time.perf_counter() - t1


def measure(impl: str, s: int, d: int = HEAD_DIM) -> dict:
    """One (implementation, S) point in a fresh child process."""
    from attngrad.bench import child_json

    return {"impl": impl, "s": s, "d": d, **child_json(_CHILD, argv=(impl, str(s), str(d)), timeout=1800)}


def stop_reason(last: dict, next_s: int, call_limit_s: float, mem_limit_bytes: float, impl: str) -> str | None:
    """Why the sweep of ``impl`` stops before ``next_s`` (time grows as S^2; the math path's memory too)."""
    growth = (next_s / last["s"]) ** 2
    if max(last["forward_s"], last["grad_s"]) * growth > call_limit_s:
        return f"S={next_s} skipped: one call would take about {max(last['forward_s'], last['grad_s']) * growth:.0f} s"
    mem_growth = growth if impl != "attngrad" else next_s / last["s"]
    if last["peak_bytes"] * mem_growth > mem_limit_bytes:
        return f"S={next_s} skipped: peak memory would be about {last['peak_bytes'] * mem_growth / 2**30:.1f} GiB"
    return None


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of log(y) against log(x); None with fewer than two usable points."""
    pts = [(math.log(x), math.log(y)) for x, y in points if x > 0 and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx


def sizes(max_s: int) -> list[int]:
    out, s = [], SIZES_FROM
    while s <= max_s:
        out.append(s)
        s *= 2
    return out


def summarise(rows: list[dict], stops: dict[str, str]) -> dict:
    """Exponents of time (forward + grad) and peak memory in S, per implementation."""
    fits = {}
    for impl in IMPLS:
        pts = [r for r in rows if r["impl"] == impl and r["s"] >= FIT_FROM]
        fits[impl] = {"time_exponent": slope([(r["s"], r["forward_s"] + r["grad_s"]) for r in pts]),
                      "memory_exponent": slope([(r["s"], r["peak_bytes"]) for r in pts]),
                      "stopped": stops.get(impl, "")}
    return {"layout": "BNSD", "shape": f"B1 N{HEADS} D{HEAD_DIM} bf16", "rows": rows, "fits": fits}


def run(args, progress=None) -> dict:
    """The sweep of ``attngrad bench --scaling``."""
    all_sizes = sizes(args.scaling_max_s)
    task = progress.add_task("scaling", total=len(IMPLS) * len(all_sizes)) if progress else None
    rows, stops = [], {}
    for impl in IMPLS:
        for s in all_sizes:
            if progress:
                progress.update(task, description=f"scaling {impl} S={s}")
            prev = [r for r in rows if r["impl"] == impl]
            reason = prev and stop_reason(prev[-1], s, args.scaling_call_limit, args.scaling_mem_limit_gib * 2**30,
                                          impl)
            if reason:
                stops[impl] = reason
                if progress:
                    progress.advance(task, len(all_sizes) - all_sizes.index(s))
                break
            rows.append(measure(impl, s))
            if progress:
                progress.advance(task)
    return summarise(rows, stops)


def render(scaling: dict, console) -> None:
    from rich.table import Table

    table = Table(title=f"sequence-length scaling, flash attention forward + grad ({scaling['shape']}, "
                        f"{scaling['layout']}); memory = peak RSS rise in a fresh process")
    for col in ("impl", "S", "forward s", "grad s", "peak MiB"):
        table.add_column(col)
    for r in scaling["rows"]:
        table.add_row(r["impl"], str(r["s"]), f"{r['forward_s']:.3f}", f"{r['grad_s']:.3f}",
                      f"{r['peak_bytes'] / 2**20:.1f}")
    console.print(table)
    for impl, fit in scaling["fits"].items():
        console.print(f"{impl}: {fit_text(fit)}", f"({fit['stopped']})" if fit["stopped"] else "")


def fit_text(fit: dict) -> str:
    def part(name, value):
        return f"{name} ~ S^{value:.2f}" if value is not None else f"{name}: too few sizes to fit"

    return f"{part('time', fit['time_exponent'])}, {part('memory', fit['memory_exponent'])}"


def plot(scaling: dict, path):
    """Log-log time and peak memory against S, one line per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 3.8))
    for impl in IMPLS:
        rows = [r for r in scaling["rows"] if r["impl"] == impl]
        if not rows:
            continue
        s = [r["s"] for r in rows]
        ax_t.loglog(s, [r["forward_s"] + r["grad_s"] for r in rows], "o-", label=impl, base=2)
        ax_m.loglog(s, [max(r["peak_bytes"], 1) / 2**20 for r in rows], "o-", label=impl, base=2)
    ax_t.set(xlabel="sequence length S", ylabel="forward + grad time (s)", title="time (O(S^2) expected)")
    ax_m.set(xlabel="sequence length S", ylabel="peak memory rise (MiB)", title="memory")
    for ax in (ax_t, ax_m):
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"flash attention scaling, {scaling['shape']} {scaling['layout']}")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
