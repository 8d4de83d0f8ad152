"""attngrad.distributed: ring attention on 2, 3 and 4 gloo ranks (CPU processes) against the unsharded call.

One spawn per world size runs every case inside the ranks (process start-up dominates the cost); each rank
computes the unsharded reference on the full tensors itself and compares its own shard. Faults: metadata
that differ between ranks, a rank that hangs and a rank that exits must give clear errors, never a hang
(the harness fails a run whose ranks do not finish).
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attngrad
from attngrad.distributed import (RingCommunicationError, ring_flash_attention, ringattn_context_parallel,
                                  zigzag_shard, zigzag_unshard)
from attngrad.kernels.dropout import generate_drop_mask
from attngrad.ops.flash_attention_core import SEQ_DIM, from_bnsd

B, N1, N2, D, DV = 2, 4, 2, 16, 8
HARNESS_LIMIT_S = 240          # a run whose ranks are not all done by then has hung
RING_TIMEOUT_S = 2.0
SCALE = 0.3

# name -> (layout, dtype, causal, zigzag, extra attributes)
CASES = {
    "causal zigzag BSND fp32 GQA Dv<D": ("BSND", torch.float32, True, True, {}),
    "non-causal contiguous BNSD fp32": ("BNSD", torch.float32, False, False, {}),
    "non-causal zigzag BSH fp32": ("BSH", torch.float32, False, True, {}),
    "causal contiguous SBH fp32": ("SBH", torch.float32, True, False, {}),
    "causal zigzag BSH fp32 dropout": ("BSH", torch.float32, True, True, dict(keep_prob=0.8, seed=7, offset=5)),
    "causal zigzag SBH fp32 alibi": ("SBH", torch.float32, True, True, dict(alibi=2, q_start_idx=[3],
                                                                             kv_start_idx=[1])),
    "non-causal BNSD fp32 alibi sqrt dropout": ("BNSD", torch.float32, False, False,
                                                dict(alibi=3, keep_prob=0.9, seed=3)),
    "causal zigzag BSND bf16": ("BSND", torch.bfloat16, True, True, {}),
    "non-causal zigzag BNSD bf16 alibi": ("BNSD", torch.bfloat16, False, True, dict(alibi=2)),
    "causal zigzag BSND fp32 golden": ("BSND", torch.float32, True, True, dict(precision="golden")),
    "causal zigzag BSH bf16 golden dropout": ("BSH", torch.bfloat16, True, True,
                                              dict(precision="golden", keep_prob=0.8, seed=2)),
}


# ------------------------------------------------------------------------------------------ harness
def _entry(rank, world, store, target, results):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        import numba
        numba.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        results.put((rank, target(rank, world)))
    except BaseException:  # report, do not hang the harness
        results.put((rank, {"crash": traceback.format_exc()}))
    results.close()
    results.join_thread()
    os._exit(0)


def launch(world: int, target) -> dict[int, dict]:
    """Run ``target(rank, world) -> dict`` on ``world`` gloo ranks (a file rendezvous: no port race);
    returns each reporting rank's dict."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="attngrad-cp-") as tmp:
        procs = [ctx.Process(target=_entry, args=(r, world, os.path.join(tmp, "store"), target, results))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline, reports = time.monotonic() + HARNESS_LIMIT_S, {}
        while len(reports) < world and time.monotonic() < deadline and any(p.is_alive() for p in procs) \
                or not results.empty():
            try:
                rank, report = results.get(timeout=1)
                reports[rank] = report
            except Exception:
                pass
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    return reports


# ------------------------------------------------------------------------------------------- checks
def _full_inputs(layout, dtype, s, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((N1, D), (N2, D), (N2, DV), (N1, DV))
    return [from_bnsd(torch.randn(B, n, s, d, generator=g), layout).to(dtype) for n, d in shapes]


def _attrs(extra, s):
    """(ring keyword arguments, the unsharded call's keyword arguments)."""
    ring, ref = {}, {}
    for name in ("keep_prob", "seed", "offset"):
        if name in extra:
            ring[name] = extra[name]
    if ring.get("keep_prob", 1.0) < 1:
        ref["keep_prob"] = ring["keep_prob"]
        ref["drop_mask"] = generate_drop_mask(ring.get("seed", 0), ring.get("offset", 0), B * N1 * s * s,
                                              ring["keep_prob"])
    if "alibi" in extra:
        slopes = 2.0 ** (-torch.arange(1, N1 + 1, dtype=torch.float32))
        alibi = dict(pse=slopes, pse_type=extra["alibi"], q_start_idx=extra.get("q_start_idx"),
                     kv_start_idx=extra.get("kv_start_idx"))
        ring.update(alibi)
        ref.update(alibi)
    return ring, ref


def _mismatch(got, want, dtype) -> float:
    """fp32: max |got - want| / max |want| (error on the output's scale); bf16: norm-relative error."""
    got, want = got.double(), want.double()
    if dtype == torch.float32:
        return ((got - want).abs().max() / want.abs().max()).item()
    return ((got - want).norm() / want.norm()).item()


def _reference(name, s):
    """The unsharded call of a case on S = s (in the case's precision mode): inputs, (out, softmax_max,
    softmax_sum), (dq, dk, dv)."""
    layout, dtype, causal, _, extra = CASES[name]
    q, k, v, dy = _full_inputs(layout, dtype, s)
    ref_kw = _attrs(extra, s)[1]
    if causal:
        ref_kw.update(atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1), sparse_mode=3)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    with attngrad.precision_mode(extra.get("precision", "npu")):
        results = attngrad.flash_attention_score(*full, N1, layout, scale_value=SCALE, **ref_kw)
        results[0].backward(dy)
    return (q, k, v, dy), results, [t.grad for t in full]


@pytest.fixture(scope="module", autouse=True)
def _compiled_kernels():
    """Compile (or load) every case's kernels here first: the ranks then only read numba's cache, which is
    not safe against several processes saving new specialisations at once."""
    for name in CASES:
        _reference(name, 8)


def _check_case(name, rank, world, s_per_rank=8):
    layout, dtype, causal, zigzag, extra = CASES[name]
    s = s_per_rank * world
    (q, k, v, dy), (out, smax, ssum), grads = _reference(name, s)
    ring_kw = _attrs(extra, s)[0]
    seq = SEQ_DIM[layout]

    def shard(t, dim=seq):
        return zigzag_shard(t.detach(), dim, zigzag=zigzag)

    local = [shard(t).requires_grad_() for t in (q, k, v)]
    with attngrad.precision_mode(extra.get("precision", "npu")):
        r_out, r_max, r_sum = ring_flash_attention(*local, N1, layout, causal=causal, scale_value=SCALE,
                                                   zigzag=zigzag, return_stats=True, **ring_kw)
        r_out.backward(shard(dy))
    limit = 1e-5 if dtype == torch.float32 else 1.5e-2
    pairs = {"out": (r_out, shard(out)), "softmax_max": (r_max, shard(smax, 2)),
             "softmax_sum": (r_sum, shard(ssum, 2)), "dq": (local[0].grad, shard(grads[0])),
             "dk": (local[1].grad, shard(grads[1])), "dv": (local[2].grad, shard(grads[2]))}
    errors = {what: _mismatch(got, want, dtype if what not in ("softmax_max", "softmax_sum") else torch.float32)
              for what, (got, want) in pairs.items()}
    gathered = zigzag_unshard(r_out.detach(), seq, zigzag=zigzag)
    errors["unshard"] = _mismatch(gathered, out.detach(), dtype)
    return {what: err for what, err in errors.items() if not err <= limit}


def run_cases(names, rank, world):
    """Run inside a rank: the failing comparisons of every named case, by case."""
    return {name: _check_case(name, rank, world) for name in names}


def _assert_all_pass(reports, world):
    assert sorted(reports) == list(range(world)), reports
    for rank, report in reports.items():
        assert "crash" not in report, report["crash"]
        failing = {name: errs for name, errs in report.items() if errs}
        assert not failing, f"rank {rank}: {failing}"


def _raised(exc_type, call):
    """The ``exc_type`` error that ``call()`` raises, or the string 'no error'."""
    try:
        call()
    except exc_type as exc:
        return exc
    return "no error"


# -------------------------------------------------------------------------------------- world sizes
def _four_ranks(rank, world):
    report = run_cases(list(CASES), rank, world)
    q, k, v = (zigzag_shard(t, 0) for t in _full_inputs("SBH", torch.float32, 8 * world)[:3])
    full = _full_inputs("SBH", torch.float32, 8 * world)
    want = attngrad.flash_attention_score(*full[:3], N1, "SBH", scale_value=0.25, sparse_mode=3,
                                          atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1))[0]
    got = ringattn_context_parallel(q, k, v, N1, {"causal": True}, softmax_scale=0.25)
    err = _mismatch(got, zigzag_shard(want, 0), torch.float32)
    report["ringattn_context_parallel"] = {} if err <= 1e-5 else {"out": err}
    return report


def test_four_ranks_every_case_and_the_mindspeed_adapter():
    _assert_all_pass(launch(4, _four_ranks), 4)


def _two_ranks_then_faults(rank, world):
    report = run_cases(list(CASES), rank, world)
    q, k, v = _full_inputs("BSND", torch.float32, 8 + 2 * rank)[:3]       # rank 1's sequence is longer
    exc = _raised(attngrad.AclnnError, lambda: ring_flash_attention(q, k, v, N1, "BSND", causal=True))
    report["mismatch"] = (exc.status, exc.param, str(exc))
    q, k, v = _full_inputs("BSND", torch.float32, 8)[:3]
    unsupported = [_raised(attngrad.AclnnError, lambda: ring_flash_attention(q, k, v, N1, layout, **kwargs))
                   for layout, kwargs in (("BSND", dict(sparse_mode=2)), ("TND", {}),
                                          ("BSND", dict(pse=torch.zeros(1, N1, 16, 16), pse_type=1)))]
    report["unsupported"] = [(exc.status, exc.param) for exc in unsupported]
    ring_flash_attention(q, k, v, N1, "BSND", timeout=RING_TIMEOUT_S)   # agreed metadata: no all_gather later
    if rank == 1:
        time.sleep(3 * RING_TIMEOUT_S)                                     # hung: never joins the next call
        return report
    report["hang"] = str(_raised(RingCommunicationError,
                                 lambda: ring_flash_attention(q, k, v, N1, "BSND", timeout=RING_TIMEOUT_S)))
    return report


def test_two_ranks_every_case_mismatched_metadata_unsupported_attributes_and_a_hung_rank():
    reports = launch(2, _two_ranks_then_faults)
    faults = {rank: {name: report.pop(name, None) for name in ("mismatch", "unsupported", "hang")}
              for rank, report in reports.items()}
    _assert_all_pass(reports, 2)
    for rank in (0, 1):
        status, param, message = faults[rank]["mismatch"]
        assert (status, param) == (161002, "query"), message
        assert "rank 0: float32[2, 8, 4, 16]" in message and "rank 1: float32[2, 10, 4, 16]" in message
        assert faults[rank]["unsupported"] == [(161002, "sparse_mode"), (161002, "input_layout"),
                                               (161002, "pse_type")]
    assert "could not" in faults[0]["hang"] and "within 2 s" in faults[0]["hang"], faults[0]["hang"]


def _three_ranks_then_exit(rank, world):
    report = run_cases(["causal zigzag BSND fp32 GQA Dv<D", "non-causal BNSD fp32 alibi sqrt dropout"], rank,
                       world)
    if rank == 2:
        dist.barrier()
        os._exit(0)                                                         # dies without a word
    dist.barrier()
    # the metadata of the first case (already agreed): the call goes straight to the ring
    q, k, v = (t.requires_grad_() for t in _full_inputs("BSND", torch.float32, 16)[:3])
    report["exit"] = str(_raised(RingCommunicationError, lambda: ring_flash_attention(
        q, k, v, N1, "BSND", causal=True, scale_value=SCALE, timeout=30).sum().backward()))
    return report


def test_three_ranks_and_a_rank_that_exits():
    reports = launch(3, _three_ranks_then_exit)
    assert sorted(reports) == [0, 1], reports        # rank 2 exits before reporting
    exits = {rank: report.pop("exit") for rank, report in reports.items()}
    for rank, report in reports.items():
        assert not {name: errs for name, errs in report.items() if errs}, (rank, report)
        assert "could not" in exits[rank] and "exited" in exits[rank], exits[rank]
