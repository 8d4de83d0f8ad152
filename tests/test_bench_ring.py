"""``attngrad bench --op ring``: the run plan, the ratios and the plot (the child-process runs themselves take
tens of seconds even on short sequences: they are exercised by the benchmark, not here)."""

from __future__ import annotations

import argparse

import pytest

from attngrad import bench
from attngrad.benchmarks import bench_ring


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_selected_by_op_ring_only():
    assert bench_ring.selected(parse("--op", "Ring"))
    assert not bench_ring.selected(parse("--op", "FlashAttention")) and not bench_ring.selected(parse())
    assert bench_ring.selected_alone(parse("--op", "ring")) and not bench_ring.selected_alone(parse())
    assert not bench_ring.selected_alone(parse("--op", "ring", "--op", "grad"))


def test_plan_quick_covers_every_cp_and_the_timing_pair():
    memory, timing = bench_ring.plan(parse("--op", "ring", "--quick", "--dtype", "bfloat16"))
    assert {cp for cp, _, _ in memory} == set(bench_ring.CPS)
    assert {s for _, s, _ in memory} == set(bench_ring.QUICK_SIZES)
    assert all(dtype == "bfloat16" for *_, dtype in memory + timing)
    assert sorted((cp, threads) for cp, threads, _ in timing) == [(1, 2), (2, 1)]


def _row(cp, s, peak, seconds=1.0, threads=1):
    return {"cp": cp, "s": s, "dtype": "float32", "threads_per_rank": threads, "peak_bytes": peak,
            "seconds": seconds, "rank_peak_bytes": [peak] * cp}


def test_ratios_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [_row(1, 1024, 100), _row(2, 1024, 50), _row(1, 2048, 200), _row(2, 2048, 110)]
    times = [_row(2, 2048, 0, 3.0), _row(1, 2048, 0, 2.0, threads=2)]
    ratios = bench_ring.ratios(rows, times)
    assert ratios["memory_per_rank_over_single"] == pytest.approx({"cp2 float32 S1024": 0.5,
                                                                   "cp2 float32 S2048": 0.55})
    assert ratios["time"] == pytest.approx({"cp2 / 1 process 2 threads float32": 1.5})
    ring = {"shape": "toy", "memory": rows, "timing": times, "ratios": ratios}
    assert bench_ring.plot(ring, tmp_path / "ring.png").stat().st_size > 0

