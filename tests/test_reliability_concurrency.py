"""Concurrency: calls from several Python threads at once (4 threads, mixed operators, dtypes and
entry points) give the same bits as the same calls made serially; a rejected aclnn call on one thread
reports its own message while other threads succeed.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import torch

from attngrad import aclnn
from helpers import same_bits
from reliability_cases import ACL, DTYPES, OPS, make_outs

WORKERS = 4


def build_jobs() -> list:
    """(op, layer, args, dtype name) for every operator x dtype x a torch and an aclnn entry point."""
    jobs = []
    rng = random.Random(11)
    for op_name, op in OPS.items():
        for dtype_name, dtype in DTYPES.items():
            for layer in ("torch", "aclnn"):
                args = op.build(random.Random(rng.randrange(2**31)), dtype, layer)
                jobs.append((op_name, layer, args))
    return jobs


def run_job(job) -> list:
    op_name, layer, args = job
    op = OPS[op_name]
    if layer in ACL:
        outs = make_outs(op, args)
        assert op.callers[layer](args, outs) == aclnn.ACLNN_SUCCESS, aclnn.aclGetRecentErrMsg()
        return [outs[n] for n in sorted(outs)]
    result = op.callers[layer](args, {})
    return [result[n].detach() for n in sorted(result)]


def test_threads_give_serial_bits():
    jobs = build_jobs() * 2
    serial = [run_job(job) for job in jobs]
    with ThreadPoolExecutor(WORKERS) as pool:
        threaded = list(pool.map(run_job, jobs))
    for job, want, got in zip(jobs, serial, threaded):
        assert len(want) == len(got)
        for w, g in zip(want, got):
            assert same_bits(w, g), f"{job[0]} on {job[1]} differs under threads"


def _rejected_call(tag: int) -> tuple[int, str]:
    """An aclnn call rejected for a parameter named after the thread's tag (scale = a string)."""
    x = torch.randn(1, 1, 2, 4)
    mask = torch.zeros(1, 1, 2, 4, dtype=torch.bool)
    y = torch.zeros_like(x)
    a = aclnn.AclTensor.from_torch
    status, _, _ = aclnn.aclnnScaledMaskedSoftmaxGetWorkspaceSize(a(x), a(mask), f"bad-{tag}", False, a(y))
    return status, aclnn.aclGetRecentErrMsg()


def test_error_messages_are_per_thread_under_mixed_load():
    jobs = [job for job in build_jobs() if job[1] in ACL]  # a successful aclnn call clears the message

    def work(i):
        if i % 2:
            return _rejected_call(i)
        run_job(jobs[i % len(jobs)])
        return aclnn.ACLNN_SUCCESS, aclnn.aclGetRecentErrMsg()

    with ThreadPoolExecutor(WORKERS) as pool:
        results = list(pool.map(work, range(48)))
    for i, (status, msg) in enumerate(results):
        if i % 2:
            assert status == aclnn.ACLNN_ERR_PARAM_INVALID and f"bad-{i}" in msg and "scale" in msg, msg
        else:
            assert status == aclnn.ACLNN_SUCCESS and msg == "", msg
