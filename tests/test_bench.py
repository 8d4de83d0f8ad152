"""The ``attngrad bench`` machinery on tiny synthetic cases (no timing assertions).

Covers: option parsing, case selection (--op, --dtype, --size, --quick), the JSON rows (ratios, GB/s,
fractions of the roofline), the machine header (CPU, ISA, threads, GEMM paths, --calibrate), the rendered table,
the plots, the scaling helpers (stop rules, slope fit, plot) and the first-call child process plumbing.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import json
import math
import types

import pytest
import torch

from attngrad import bench
from attngrad.benchmarks import bench_scaling
from attngrad.cli import main
from attngrad.kernels import gemm_paths
from attngrad.kernels.numeric import HAS_AVX512_FP16
from attngrad.machine import cpu_model, isa_flags

ROOFLINES = {"copy_gbps": 20.0, "gemm_fp32_torch_tflops": 0.5, "gemm_fp32_tiles_tflops": 0.45,
             "gemm_fp32_tflops": 0.5, "gemm_bf16_tflops": 2.0, "gemm_bf16_widened_tflops": 0.4,
             "gemm_bf16_tiles_tflops": 1.5, "gemm_bf16_best_tflops": 2.0}


@pytest.fixture
def calibration_in(tmp_path, monkeypatch):
    """The GEMM-path calibration in a temporary cache, with fixed timings (widened faster): a list of the
    measured dtypes."""
    measured = []
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(gemm_paths.ENV, raising=False)
    monkeypatch.delenv(gemm_paths.SCALING_ENV, raising=False)
    monkeypatch.setattr(gemm_paths, "measure", lambda d: measured.append(d) or {"native": 10.0, "widened_fp32": 5.0})
    monkeypatch.setattr(gemm_paths, "measure_float16_scaling", lambda: {"grid": 1.0, "conversions": 2.0})
    gemm_paths.calibration.cache_clear()
    gemm_paths.scaling_calibration.cache_clear()
    yield measured
    gemm_paths.calibration.cache_clear()
    gemm_paths.scaling_calibration.cache_clear()


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def memory_case(dtype=torch.float32) -> bench.BenchCase:
    return bench.BenchCase("ToyCopy", dtype, "n[64]", {"ours": lambda: None, "peer": lambda: None},
                           bytes_moved=4_000_000)


def gemm_case() -> bench.BenchCase:
    return bench.BenchCase("ToyGemm", torch.bfloat16, "S2048", {"ours": lambda: None, "peer": lambda: None},
                           flops=3e9, roofline="gemm_bf16")


def test_options_parse():
    args = parse("--op", "Softmax", "--op", "Flash", "--dtype", "bfloat16", "--size", "S2048", "--quick",
                 "--repeat", "2", "--no-first-call", "--scaling", "--scaling-max-s", "4096")
    assert args.op == ["Softmax", "Flash"] and args.dtype == ["bfloat16"] and args.size == ["S2048"]
    assert args.quick and args.repeat == 2 and args.first_call is False and args.scaling
    assert args.scaling_max_s == 4096 and args.scaling_call_limit == 60.0 and args.scaling_mem_limit_gib == 8.0
    defaults = parse()
    assert defaults.first_call is None and not defaults.scaling and not defaults.quick
    with pytest.raises(SystemExit):
        parse("--dtype", "float64")


def test_json_row_ratios_and_fractions():
    result = bench.BenchResult(memory_case(), {"ours": 0.001, "peer": 0.004})
    row = result.to_json(ROOFLINES)
    assert row["speedup_vs"] == {"peer": pytest.approx(4.0)}
    assert row["gbps"]["ours"] == pytest.approx(4.0) and row["gbps"]["peer"] == pytest.approx(1.0)
    assert row["fraction_of_copy_bw"] == pytest.approx(0.2)
    assert row["fraction_of_roofline"]["peer"] == pytest.approx(0.05)
    gemm = bench.BenchResult(gemm_case(), {"ours": 0.003, "peer": 0.001}).to_json(ROOFLINES)
    assert gemm["tflops"]["ours"] == pytest.approx(1.0) and gemm["fraction_of_gemm"] == pytest.approx(0.5)
    assert gemm["speedup_vs"]["peer"] == pytest.approx(1 / 3)
    assert gemm["dtype"] == "bfloat16" and "gbps" not in gemm
    json.dumps([row, gemm])  # serialisable


def test_best_time_takes_the_minimum_after_warmup():
    calls = []
    assert bench.best_time(lambda: calls.append(1), repeat=4, warmup=2) >= 0.0
    assert len(calls) == 6


@pytest.mark.parametrize("argv, expected, modules", [
    ((), {"ScaledMaskedSoftmax", "ScaledMaskedSoftmaxBackward", "ExpSegsum", "ExpSegsumBackward",
          "FlashAttentionScore", "FlashAttentionScoreGrad"}, ()),
    (("--op", "scaledmasked"), {"ScaledMaskedSoftmax", "ScaledMaskedSoftmaxBackward"},
     ("custom_ops", "scaled_masked_softmax")),
    (("--op", "ExpSegsumBackward"), {"ExpSegsumBackward"}, ("exp_segsum",)),
])
def test_quick_selection_by_operator(argv, expected, modules, monkeypatch):
    built = []
    module_cases = bench._module_cases
    monkeypatch.setattr(bench, "_module_cases", lambda name, quick: built.append(name) or module_cases(name, quick))
    cases = bench.collect_cases(parse("--quick", *argv))
    ops = {c.op for c in cases}
    assert ops >= expected if not argv else ops == expected
    for name in built:  # each module declares the operators of its cases; only modules that can match are built
        assert {c.op for c in module_cases(name, True)} == set(importlib.import_module(name).OPS)
    assert (len(built) >= 5) if not argv else built == [f"attngrad.benchmarks.bench_{m}" for m in modules]
    assert all(next(iter(c.impls)).startswith("attngrad") for c in cases)
    assert all(c.bytes_moved or c.flops or c.roofline == "none" for c in cases)
    if not argv:  # the rope and sink cases can be run alone by their labels (cases are built once per process)
        for size, names in (("rope Dr64", {"attngrad fused rope", "attngrad on concatenated q/k"}),
                            (" sink", {"attngrad sink", "attngrad no sink"})):
            picked = bench.collect_cases(parse("--quick", "--op", "FlashAttention", "--size", size))
            assert len(picked) >= 2 and all(names <= set(c.impls) for c in picked)


def test_selection_by_dtype_and_size():
    cases = bench.collect_cases(parse("--quick", "--op", "ScaledMasked", "--dtype", "bfloat16"))
    assert cases and {c.dtype for c in cases} == {torch.bfloat16}
    label = cases[0].label
    assert bench.collect_cases(parse("--quick", "--op", "ScaledMasked", "--size", label))
    assert not bench.collect_cases(parse("--quick", "--op", "ScaledMasked", "--size", "no-such-size"))
    quick_sms = bench.collect_cases(parse("--quick", "--op", "ScaledMaskedSoftmaxBackward", "--dtype", "float32"))
    assert "[2, 8, 256, 1024]" in quick_sms[0].label  # the quick preset uses the small shape


def test_sms_cases_compute_the_same_thing():
    case = bench.collect_cases(parse("--quick", "--op", "ScaledMaskedSoftmaxBackward", "--dtype", "float32"))[0]
    outs = [fn() for fn in case.impls.values()]
    allocated = [o for o in outs if o is not None]
    assert len(allocated) >= 2
    for o in allocated[1:]:
        torch.testing.assert_close(o, allocated[0], rtol=1e-5, atol=1e-6)


def test_rope_and_sink_cases_compute_what_they_compare():
    """Rope: fused == attngrad on the concatenated q / k (dq / dk split at D) ~ torch on them (v padded).
    Sink: only the sink side has it (its sum includes exp(sink)) and returns dsink."""
    from attngrad.benchmarks.bench_flash_attention import rope_cases, sink_cases

    shape, d = (1, 2, 64, 128), 128
    grad, forward = rope_cases(shape, torch.bfloat16)
    fused, concat, peer = (fn() for fn in grad.impls.values())
    for got, want in ((fused[0], concat[0][..., :d]), (fused[4], concat[0][..., d:]), (fused[1], concat[1][..., :d]),
                      (fused[5], concat[1][..., d:]), (fused[2], concat[2])):
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)
    torch.testing.assert_close(concat[0], peer[0], rtol=0.05, atol=0.05)
    torch.testing.assert_close(concat[2], peer[2][..., :d], rtol=0.05, atol=0.05)
    out, out_concat, out_peer = (fn() for fn in forward.impls.values())
    torch.testing.assert_close(out[0], out_concat[0], rtol=0.02, atol=0.02)
    torch.testing.assert_close(out[0], out_peer[..., :d], rtol=0.05, atol=0.05)
    assert "MiB" in grad.notes and forward.flops == 2 * (2 * d + 64) * 64 * 65  # causal: S (S + 1) / 2 pairs per head

    grad, forward = sink_cases(shape)
    with_sink, without = (fn() for fn in grad.impls.values())
    assert with_sink[6].shape == (2,) and without[6] is None
    (_, m, s), (_, m0, s0) = (fn() for fn in forward.impls.values())
    # the sink's term exp(sink[n]) of every row's sum (the first rows: few keys, no cancellation)
    extra = (s * torch.exp(m) - s0 * torch.exp(m0))[..., :8]
    assert (extra > 0).all()
    torch.testing.assert_close(extra, extra[..., :1].expand_as(extra), rtol=1e-3, atol=0)


def test_render_and_plots(tmp_path):
    results = [bench.BenchResult(memory_case(dt), {"ours": 0.001, "peer": 0.002}) for dt in
               (torch.float32, torch.bfloat16)] + [bench.BenchResult(gemm_case(), {"ours": 0.002, "peer": 0.001},
                                                                     round_seconds={"ours": [0.002, 0.003],
                                                                                    "peer": [0.001, 0.0015]})]
    console = bench._console()
    with console.capture() as cap:
        bench._render(results, ROOFLINES, console)
    text = cap.get()
    assert "ToyCopy" in text and "2.00x" in text and "20% of copy" in text and "per round 0.50x, 0.50-0.50x" in text
    paths = bench._plot(results, ROOFLINES, tmp_path)
    assert {p.name for p in paths} == {"ToyCopy.png", "ToyGemm.png"}
    assert all(p.stat().st_size > 1000 for p in paths)


def test_scaling_stop_rules_and_fit(tmp_path):
    last = {"s": 4096, "forward_s": 4.0, "grad_s": 40.0, "peak_bytes": 600 * 2**20}
    assert "would take about 160 s" in bench_scaling.stop_reason(last, 8192, 60.0, 8 * 2**30, "attngrad")
    assert bench_scaling.stop_reason(last, 8192, 200.0, 8 * 2**30, "attngrad") is None  # memory grows as S
    assert "2.3 GiB" in bench_scaling.stop_reason(last, 8192, 200.0, 2 * 2**30, "torch math")  # S^2
    assert bench_scaling.sizes(4096) == [512, 1024, 2048, 4096]
    assert bench_scaling.slope([(s, 3 * s**2) for s in (512, 1024, 4096)]) == pytest.approx(2.0)
    assert bench_scaling.slope([(512, 1.0)]) is None
    rows = [{"impl": impl, "s": s, "d": 64, "forward_s": 1e-9 * s**2, "grad_s": 2e-9 * s**2,
             "peak_bytes": s * (1000 if impl == "attngrad" else s)} for impl in bench_scaling.IMPLS
            for s in (1024, 2048, 4096, 8192)]
    summary = bench_scaling.summarise(rows, {"torch math": "S=16384 skipped"})
    assert summary["fits"]["attngrad"]["time_exponent"] == pytest.approx(2.0)
    assert summary["fits"]["attngrad"]["memory_exponent"] == pytest.approx(1.0)
    assert summary["fits"]["torch math"]["memory_exponent"] == pytest.approx(2.0)
    assert summary["fits"]["torch math"]["stopped"] == "S=16384 skipped"
    path = bench_scaling.plot(summary, tmp_path / "scaling.png")
    assert path.stat().st_size > 1000
    console = bench._console()
    with console.capture() as cap:
        bench_scaling.render(summary, console)
    assert "time ~ S^2.00, memory ~ S^1.00" in cap.get()


def test_scaling_run_stops_by_the_rules(monkeypatch):
    def fake_measure(impl, s, d=64):
        return {"impl": impl, "s": s, "d": d, "forward_s": 1e-8 * s**2, "grad_s": 2e-8 * s**2,
                "peak_bytes": 16 * s * (s if impl == "torch math" else 100)}

    monkeypatch.setattr(bench_scaling, "measure", fake_measure)
    args = types.SimpleNamespace(scaling_max_s=32768, scaling_call_limit=10.0, scaling_mem_limit_gib=1.0)
    summary = bench_scaling.run(args)
    biggest = {impl: max(r["s"] for r in summary["rows"] if r["impl"] == impl) for impl in bench_scaling.IMPLS}
    assert biggest == {"attngrad": 16384, "torch math": 8192}  # 32768: 32 s per call; math 16384: 4 GiB
    assert "32768 skipped" in summary["fits"]["attngrad"]["stopped"]
    assert "GiB" in summary["fits"]["torch math"]["stopped"]


def test_child_json_and_first_call_plumbing(monkeypatch):
    assert bench.child_json("import json, sys; print('noise'); print(json.dumps({'a': sys.argv[1]}))",
                            argv=("x",)) == {"a": "x"}
    with pytest.raises(RuntimeError, match="child failed"):
        bench.child_json("raise SystemExit(3)")
    seen = []
    monkeypatch.setattr(bench, "child_json", lambda code, env=None, **kw: seen.append((code, env)) or
                        {"import_s": 1.0, "first_call_s": 5.0 if len(seen) == 1 else 0.5})
    row = bench.first_call_latency("ExpSegsum")
    assert row["cold_s"] == 5.0 and row["cached_s"] == 0.5 and row["import_s"] == 1.0
    (code1, env1), (code2, env2) = seen
    assert code1 == code2 and "attngrad.exp_segsum(t)" in code1
    assert env1 == env2 and "NUMBA_CACHE_DIR" in env1  # the second process reuses the first one's cache
    assert bench.selected_first_calls(parse("--op", "flash")) == ["FlashAttentionScore", "FlashAttentionScoreGrad"]


def test_first_call_snippets_run():
    ns: dict = {}
    exec(bench._FIRST_CALL_SETUP, ns)
    import attngrad

    ns["attngrad"] = attngrad
    for op in ("ScaledMaskedSoftmax", "ScaledMaskedSoftmaxBackward", "ExpSegsum", "ExpSegsumBackward"):
        assert eval(bench.FIRST_CALLS[op], ns) is not None


def test_cli_runs_a_selected_quick_bench(tmp_path, monkeypatch, calibration_in):
    monkeypatch.setattr(bench, "measure_rooflines", lambda quick: dict(ROOFLINES))
    monkeypatch.setattr(bench, "collect_cases", lambda args: [memory_case()])
    assert main(["bench", "--quick", "--repeat", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["rooflines"] == ROOFLINES and "first_call" not in report and "scaling" not in report
    assert report["results"][0]["op"] == "ToyCopy" and math.isfinite(report["results"][0]["fraction_of_copy_bw"])
    assert (tmp_path / "ToyCopy.png").exists()


@pytest.mark.parametrize("n", range(1, 8))
def test_round_orders_give_every_implementation_each_predecessor_and_place_equally_often(n):
    orders = bench.round_orders(n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    calls = [i for order in orders * 2 for i in order]
    assert n < 3 or all(a != b for a, b in zip(calls, calls[1:]))  # no call right after itself, cycles included
    predecessors = collections.Counter((a, b) for order in orders for a, b in zip(order, order[1:]))
    assert set(predecessors) == {(a, b) for a in range(n) for b in range(n) if a != b} or n == 1
    assert len(set(predecessors.values())) <= 1
    places = collections.Counter((place, i) for order in orders for place, i in enumerate(order))
    assert len(places) == n * n and len(set(places.values())) == 1


def test_time_case_interleaves_rounds_and_rates_against_the_copy_alongside():
    calls = []
    case = bench.BenchCase("ToyCopy", torch.float32, "n", {"ours": lambda: calls.append("o"),
                                                          "peer": lambda: calls.append("p")}, bytes_moved=8_000_000)
    result = bench.time_case(case, repeat=3, min_s=0.0)
    # one warm-up call each (and the copy's), then the six rounds of round_orders(3) (ours 0, peer 1, copy 2): at
    # least three, and then the end of the cycle
    assert calls == ["o", "p"] + [{0: "o", 1: "p"}[i] for order in bench.round_orders(3) for i in order if i < 2]
    assert set(result.seconds) == {"ours", "peer"} and result.copy_gbps > 0
    assert set(result.round_seconds) == {"ours", "peer"}
    row = result.to_json(ROOFLINES)
    assert row["copy_gbps_alongside"] == result.copy_gbps
    assert row["fraction_of_copy_bw"] == pytest.approx(row["gbps"]["ours"] / result.copy_gbps)
    assert bench.time_case(gemm_case(), repeat=1).copy_gbps is None


def test_time_case_runs_whole_cycles_of_balanced_orders():
    """Four implementations, at least four rounds: the calls follow round_orders(4) row by row (a plain rotation
    of the four would not)."""
    calls = []
    case = bench.BenchCase("Toy", torch.float32, "n", {name: functools.partial(calls.append, i)
                                                       for i, name in enumerate("abcd")})
    bench.time_case(case, repeat=3, min_s=0.0)
    assert calls == [0, 1, 2, 3] + [i for order in bench.round_orders(4) for i in order]


def test_time_case_keeps_each_rounds_ratio_and_the_report_shows_their_median_and_range(monkeypatch):
    """Per-round ratios pair the calls of one round (a fake clock; the times of both change from round to round,
    so ratios of calls from different rounds would differ). Three rounds asked, four run: two orders a cycle."""
    clock = [0.0]
    times = {"ours": iter([1.0, 2.0, 4.0, 2.0, 3.0]), "peer": iter([9.0, 3.0, 5.0, 4.0, 6.0])}

    def call(name):
        clock[0] += next(times[name])

    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    case = bench.BenchCase("Toy", torch.float32, "n", {"ours": lambda: call("ours"), "peer": lambda: call("peer")})
    result = bench.time_case(case, repeat=3, min_s=0.0, budget_s=1e9)
    assert result.seconds == {"ours": 2.0, "peer": 3.0}
    assert result.round_seconds == {"ours": [2.0, 4.0, 2.0, 3.0], "peer": [3.0, 5.0, 4.0, 6.0]}
    assert result.round_ratios() == {"peer": [1.5, 1.25, 2.0, 2.0]}
    row = result.to_json(ROOFLINES)
    assert row["seconds_per_round"] == result.round_seconds
    assert row["speedup_vs"]["peer"] == 1.5
    assert row["speedup_per_round"]["peer"] == {"median": 1.75, "low": 1.25, "high": 2.0, "rounds": 4}
    assert bench.peer_text(row, "peer", 1) == "peer 3000.0 (1.50x; per round 1.75x, 1.25-2.00x)"
    assert "speedup_per_round" not in bench.BenchResult(case, {"ours": 1.0, "peer": 2.0}).to_json(ROOFLINES)
    assert bench.peer_text(bench.BenchResult(case, {"ours": 1.0, "peer": 2.0}).to_json(ROOFLINES), "peer", 1) == \
        "peer 2000.0 (2.00x)"


def test_compute_bound_cases_are_rated_against_their_roofline_scaled_by_the_tiles_alongside():
    """A compute-bound case times the kernels' tile GEMM in its rounds (fp32 tiles for the fp32 roofline, else
    the faster tiles of the run's start) and its roofline follows the machine: tiles at half their starting rate
    halve it."""
    fp32 = bench.BenchCase("ToyGemm", torch.float32, "S", {"ours": lambda: None}, flops=1e9, roofline="gemm_fp32")
    assert bench.alongside_tiles(fp32, ROOFLINES) == torch.float32
    assert bench.alongside_tiles(gemm_case(), ROOFLINES) == torch.bfloat16
    assert bench.alongside_tiles(gemm_case(), {**ROOFLINES, "gemm_bf16_tiles_tflops": 0.2}) == torch.float32
    assert bench.alongside_tiles(memory_case(), ROOFLINES) is None
    result = bench.time_case(fp32, repeat=2, min_s=0.0, tiles=torch.float32)
    assert result.tiles_roofline == "gemm_fp32_tiles_tflops" and 0 < result.tiles_tflops < float("inf")
    halved = bench.BenchResult(gemm_case(), {"ours": 0.003, "peer": 0.001}, tiles_tflops=0.75,
                               tiles_roofline="gemm_bf16_tiles_tflops").to_json(ROOFLINES)
    assert halved["roofline_tflops"] == pytest.approx(1.0) and halved["fraction_of_gemm"] == pytest.approx(1.0)
    assert halved["tiles_tflops_alongside"] == 0.75


def test_the_rooflines_keep_the_better_of_two_tile_measurements(monkeypatch):
    """The tiles' starting rate, the base of every scaled roofline, is timed before and after the other rooflines
    and the better kept: a burst of load during one of them does not inflate the run's fractions."""
    rates = iter([0.05, 1.5, 0.45, 0.3])  # fp32 then bf16 tiles, before and after
    monkeypatch.setattr(gemm_paths, "tile_tflops", lambda dtype, threads, seconds: next(rates))
    monkeypatch.setattr(bench, "best_time", lambda fn, repeat: 1.0)
    r = bench.measure_rooflines(quick=True)
    assert (r["gemm_fp32_tiles_tflops"], r["gemm_bf16_tiles_tflops"]) == (0.45, 1.5)
    assert r["gemm_fp32_tflops"] == 0.45 and r["gemm_bf16_best_tflops"] == 1.5


def test_time_case_evicts_the_caches_before_each_timed_call_of_a_memory_bound_case(monkeypatch):
    events = []
    monkeypatch.setattr(bench, "evict_caches", lambda: events.append("evict"))
    case = bench.BenchCase("ToyCopy", torch.float32, "n", {"ours": lambda: events.append("o")},
                           bytes_moved=8_000)
    bench.time_case(case, repeat=2, min_s=0.0)
    # warm-up, then round 0 (ours, copy) and round 1 (copy, ours), each timed call after an eviction
    assert events == ["o"] + ["evict", "o", "evict"] + ["evict", "evict", "o"]
    events.clear()
    bench.time_case(gemm_case(), repeat=2, min_s=0.0)
    assert "evict" not in events


def test_time_case_runs_more_rounds_for_fast_cases_within_limits():
    calls = []
    case = bench.BenchCase("Toy", torch.float32, "n", {"ours": lambda: calls.append(1)})
    bench.time_case(case, repeat=2, min_s=60.0)
    assert len(calls) == 1 + 5 * 2  # warm-up, then rounds up to five times repeat while under min_s
    calls.clear()
    bench.time_case(case, repeat=2, min_s=0.0)
    assert len(calls) == 1 + 2


def test_report_opens_with_the_machine_and_calibrate_measures_again(tmp_path, monkeypatch, capsys, calibration_in):
    monkeypatch.setattr(bench, "measure_rooflines", lambda quick: dict(ROOFLINES))
    monkeypatch.setattr(bench, "collect_cases", lambda args: [memory_case()])
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX512_E3")
    argv = ["bench", "--quick", "--repeat", "1", "--no-plots", "--out", str(tmp_path)]
    assert main(argv) == 0 and len(calibration_in) == 2
    assert main([*argv, "--calibrate"]) == 0 and len(calibration_in) == 4
    out = capsys.readouterr().out
    scaling = gemm_paths.FLOAT16_MULTIPLY if HAS_AVX512_FP16 else gemm_paths.GRID  # grid timed faster here
    assert "GEMM-path calibration" in out and f"; chosen: {scaling}" in out
    machine = json.loads((tmp_path / "bench.json").read_text())["machine"]
    assert machine["float16_scaling"] == scaling
    assert machine["cpu"] == cpu_model() and machine["isa"] == list(isa_flags())
    assert machine["threads"] == torch.get_num_threads()
    assert machine["gemm_paths"] == {"bfloat16": "widened_fp32", "float16": "widened_fp32"}
    summary = (tmp_path / "bench.md").read_text()
    assert summary.startswith(f"CPU: {cpu_model()}") and "GEMM paths: bfloat16 widened_fp32" in summary
    assert f"; float16 softmax scaling: {scaling}" in summary
    assert "; GEMMs capped by MKL_ENABLE_INSTRUCTIONS=AVX512_E3)" in summary
    assert "kernel tiles (best 0.5)" in summary and "fp32 tiles 2)" in summary  # the best of each dtype's GEMMs
