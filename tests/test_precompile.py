"""``attngrad compile``: which jobs a selection makes, how a failing, hanging or interrupted job is handled, that
each job's calls pass the operators' checks, that a job fills numba's cache so that a later process runs the
operator on other shapes without compiling anything, and when a differentiated forward starts its backward's job
beside its own compile."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from attngrad import precompile
from attngrad.cli import main
from attngrad.kernels import child_compile


def test_operators_are_selected_by_cann_name_substring_dtypes_and_modes(monkeypatch):
    monkeypatch.delenv("ATTNGRAD_PRECISION", raising=False)
    jobs = precompile.select_jobs(["softmax"], ["float32", "bfloat16"])
    assert [str(j) for j in jobs] == [
        "ScaledMaskedSoftmax bfloat16 (npu)", "ScaledMaskedSoftmax float32 (npu)",
        "ScaledMaskedSoftmaxBackward bfloat16 (npu)", "ScaledMaskedSoftmaxBackward float32 (npu)"]
    assert len(precompile.select_jobs()) == len(precompile.OPERATORS) * len(precompile.DTYPES)
    both = precompile.select_jobs(["grad"], ["float16"], ["golden", "npu"])
    assert [str(j) for j in both] == ["FlashAttentionScoreGrad float16 (npu)",
                                      "FlashAttentionScoreGrad float16 (golden)"]


def test_the_default_precision_mode_is_the_current_one(monkeypatch):
    monkeypatch.setenv("ATTNGRAD_PRECISION", "golden")
    assert {j.precision for j in precompile.select_jobs(["segsum"])} == {"golden"}


def test_an_unknown_selection_exits_with_status_2_and_says_why(capsys):
    assert main(["compile", "--op", "nothing"]) == 2
    assert "no operator matches 'nothing'; the operators: FlashAttentionScoreGrad" in capsys.readouterr().err
    assert main(["compile", "--jobs", "0"]) == 2
    assert "--jobs must be at least 1, got 0" in capsys.readouterr().err
    for option in ("--dtype", "--precision"):
        with pytest.raises(SystemExit) as exit_:
            main(["compile", option, "exact"])
        assert exit_.value.code == 2
        assert "invalid choice: 'exact'" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", precompile.OPERATORS)
def test_each_job_calls_pass_the_operators_checks(op, dtype, monkeypatch):
    monkeypatch.setattr(child_compile, "_failed", set())  # this test's kernels only
    precompile.run_job(op, dtype, "npu")  # raises on a rejected argument or a kernel compiled outside the cache


def test_a_failing_job_is_named_with_its_error_and_the_status_is_1(monkeypatch, capsys):
    monkeypatch.setattr(precompile.Job, "command",
                        lambda self: [sys.executable, "-c", f"raise SystemExit('no {self.op} here')"])
    assert main(["compile", "--op", "segsum", "--dtype", "float32", "--jobs", "2"]) == 1
    out, err = capsys.readouterr()
    assert "ExpSegsumBackward float32 (npu) failed with status 1: no ExpSegsumBackward here" in err
    assert "ExpSegsum float32 (npu) failed with status 1: no ExpSegsum here" in err
    assert "0 of 2 in the cache" in out


def _sleeping_job(pid_file):
    """A job command that starts a grandchild (writing its pid to ``pid_file``) and sleeps, as would a job whose
    compiling child hangs."""
    grandchild = f"import os, time; open({str(pid_file)!r}, 'a').write(f'{{os.getpid()}} '); time.sleep(600)"
    return lambda self: [sys.executable, "-c", f"import subprocess, sys, time; "
                         f"subprocess.Popen([sys.executable, '-c', {grandchild!r}]); time.sleep(600)"]


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (or is a zombie) within 5 s."""
    for _ in range(100):
        try:
            with open(f"/proc/{pid}/status") as status:
                if "zombie" in status.read():
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def _grandchild_pid(pid_file) -> int:
    for _ in range(200):
        if pid_file.exists() and pid_file.read_text():
            return int(pid_file.read_text().split()[0])
        time.sleep(0.05)
    raise AssertionError("the grandchild did not start")


@pytest.mark.skipif(not os.path.isdir("/proc") or not hasattr(os, "killpg"), reason="needs /proc and process groups")
def test_a_job_past_its_time_is_killed_with_its_children(monkeypatch, tmp_path):
    monkeypatch.setattr(precompile.Job, "command", _sleeping_job(tmp_path / "pid"))
    monkeypatch.setattr(precompile, "JOB_TIMEOUT_S", 3.0)
    [result] = precompile.compile_jobs(precompile.select_jobs(["ExpSegsum"], ["float32"])[:1])
    assert result.error.startswith("ran past 3 s and was killed")
    assert _gone(_grandchild_pid(tmp_path / "pid"))


@pytest.mark.skipif(not os.path.isdir("/proc") or not hasattr(os, "killpg"), reason="needs /proc and process groups")
def test_an_interrupt_kills_the_running_job_with_its_children_and_starts_no_other(monkeypatch, tmp_path):
    """Ctrl-C (a SIGINT once the first job's grandchild is up) while a job runs, one at a time."""
    pid_file = tmp_path / "pid"
    monkeypatch.setattr(precompile.Job, "command", _sleeping_job(pid_file))
    monkeypatch.setattr(precompile, "JOB_TIMEOUT_S", 20.0)  # bounds the test should the interrupt not come

    def press_ctrl_c():  # a real SIGINT: it wakes the main thread's wait, as Ctrl-C does
        _grandchild_pid(pid_file)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    # Python's own SIGINT handler, also where this process inherited SIGINT ignored (a shell's background job)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=press_ctrl_c, daemon=True).start()
        start = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            precompile.compile_jobs(precompile.select_jobs(None, ["float32"]), 1)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.perf_counter() - start < 30
    assert _gone(_grandchild_pid(pid_file))
    time.sleep(1.0)
    assert len(pid_file.read_text().split()) == 1  # the five other jobs never started


_LATER_PROCESS = """
import subprocess, torch, attngrad
children, run = [], subprocess.run
subprocess.run = lambda *args, **kwargs: children.append(args) or run(*args, **kwargs)
x = torch.randn(1, 3, 32, 96, requires_grad=True)
mask = torch.rand(1, 3, 32, 96) < 0.3
y = attngrad.scaled_masked_softmax(x, mask, scale=0.7)
y.backward(torch.ones_like(y))
expected = torch.softmax(torch.where(mask, -10000.0, x.detach().double() * 0.7), -1)
assert torch.allclose(y.double(), expected, atol=1e-6), "wrong softmax"
assert x.grad.abs().max() < 1e-5, "the gradient of a sum of softmax rows is zero"
print("compile children:", len(children))
"""


def test_a_compiled_operator_runs_other_shapes_in_a_later_process_without_compiling(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "ATTNGRAD_COMPILE_IN_CHILD": "1"}
    compiled = subprocess.run([sys.executable, "-m", "attngrad.cli", "compile", "--op", "ScaledMaskedSoftmax",
                               "--dtype", "float32"], env=env, capture_output=True, text=True, timeout=900)
    assert compiled.returncode == 0, compiled.stderr
    assert f"into {tmp_path}" in compiled.stdout and "2 of 2 in the cache" in compiled.stdout
    later = subprocess.run([sys.executable, "-c", _LATER_PROCESS], env=env, capture_output=True, text=True,
                           timeout=900)
    assert later.returncode == 0, later.stderr
    assert later.stdout.strip().endswith("compile children: 0")


def _compiling_forward(x, *attributes):
    """Stands in for a forward custom op whose kernel is missing from the cache: it is about to compile in a child."""
    child_compile._announce_child()
    return x


@pytest.fixture
def early_jobs(monkeypatch):
    """The backward jobs :func:`precompile.call_forward` starts, recorded (each runs ``python -c pass``)."""
    started = []
    monkeypatch.setattr(precompile, "_early", {})
    monkeypatch.setattr(precompile.Job, "command", lambda self: started.append(self) or [sys.executable, "-c", "pass"])
    monkeypatch.delenv(precompile.EARLY_BACKWARD_ENV, raising=False)
    yield started
    for proc, _ in filter(None, precompile._early.values()):
        proc.wait()


@pytest.mark.skipif(os.name != "posix", reason="the jobs start on POSIX systems only")
def test_a_differentiated_forward_that_compiles_starts_its_backward_job_once(early_jobs):
    x = torch.zeros(2, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(2):
        assert precompile.call_forward(_compiling_forward, (x, 0.5), "ScaledMaskedSoftmaxBackward", "golden") is x
    assert early_jobs == [precompile.Job("ScaledMaskedSoftmaxBackward", "bfloat16", "golden")]


@pytest.mark.parametrize("case", ["no input requires grad", "grad mode off", "torch.compile traces", "switched off",
                                  "float64", "the forward's kernels were cached"])
def test_no_backward_job_starts_where_autograd_will_not_differentiate_or_nothing_compiles(case, early_jobs,
                                                                                          monkeypatch):
    x = torch.zeros(2, dtype=torch.float64 if case == "float64" else torch.float32,
                    requires_grad=case != "no input requires grad")
    if case == "switched off":
        monkeypatch.setenv(precompile.EARLY_BACKWARD_ENV, "0")
    if case == "torch.compile traces":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    if case == "the forward's kernels were cached":  # decided by the first call: a later compile starts nothing
        precompile.call_forward(lambda x: x, (x,), "ExpSegsumBackward", "npu")
    with torch.set_grad_enabled(case != "grad mode off"):
        assert precompile.call_forward(_compiling_forward, (x,), "ExpSegsumBackward", "npu") is x
    assert early_jobs == []


def test_a_backward_job_that_cannot_start_leaves_the_forward_to_run(early_jobs, monkeypatch):
    monkeypatch.setattr(precompile.Job, "command", lambda self: [str(os.path.join(os.sep, "no", "such", "python"))])
    x = torch.zeros(2, requires_grad=True)
    assert precompile.call_forward(_compiling_forward, (x,), "ExpSegsumBackward", "npu") is x
    assert list(precompile._early.values()) == [None]


class _Called(Exception):
    """Raised by a stand-in for :func:`precompile.call_forward` once it has recorded its arguments."""


@pytest.mark.parametrize("op", ["ScaledMaskedSoftmax", "ExpSegsum", "FlashAttentionScore"])
def test_each_forward_names_its_backward_operator_and_mode(op, monkeypatch):
    """The public forwards pass their backward's CANN name (a job of ``attngrad compile``) and the precision mode
    its kernels depend on: flash attention's own, the softmax's and ExpSegsum's backward are the same in both."""
    import attngrad
    from attngrad.ops import exp_segsum, flash_attention, scaled_masked_softmax
    from attngrad.precision_mode import precision_mode

    seen = []

    def record(forward, args, grad_op, precision):
        seen.append((grad_op, precision))
        raise _Called

    for module in (exp_segsum, flash_attention, scaled_masked_softmax):
        monkeypatch.setattr(module, "call_forward", record)
    x = torch.zeros(1, 2, 8, 16, requires_grad=True)
    with precision_mode("golden"), pytest.raises(_Called):
        if op == "ScaledMaskedSoftmax":
            attngrad.scaled_masked_softmax(x, None)
        elif op == "ExpSegsum":
            attngrad.exp_segsum(x[0])
        else:
            attngrad.flash_attention_score(x, x, x, 2, "BNSD")
    assert seen == [(f"{op}Grad" if op == "FlashAttentionScore" else f"{op}Backward",
                     "golden" if op == "FlashAttentionScore" else "npu")]
    assert seen[0][0] in precompile.OPERATORS


_EXITING_PROCESS = """
import os, time, torch
from attngrad import precompile
from attngrad.kernels import child_compile
precompile.Job.command = lambda self: {command!r}
def forward(x):
    child_compile._announce_child()
    return x
precompile.call_forward(forward, (torch.zeros(1, requires_grad=True),), "ExpSegsumBackward", "npu")
[(proc, _)] = precompile._early.values()
while not (os.path.exists({pid_file!r}) and open({pid_file!r}).read()):  # the job's child has started
    time.sleep(0.05)
print(proc.pid)
"""


@pytest.mark.skipif(not os.path.isdir("/proc") or not hasattr(os, "killpg"), reason="needs /proc and process groups")
def test_a_backward_job_still_running_when_its_process_exits_is_killed_with_its_children(tmp_path):
    script = _EXITING_PROCESS.format(command=_sleeping_job(tmp_path / "pid")(None), pid_file=str(tmp_path / "pid"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert _gone(int(done.stdout.split()[-1]))
    assert _gone(_grandchild_pid(tmp_path / "pid"))


_FIRST_STEP = """
import subprocess, torch, attngrad
from attngrad import precompile
children, run = [], subprocess.run
subprocess.run = lambda *args, **kwargs: children.append(args) or run(*args, **kwargs)
x = torch.randn(2, 3, 32, 96, dtype=torch.float64)
mask = torch.rand(2, 1, 32, 96) < 0.3
dy = torch.randn(2, 3, 32, 96, dtype=torch.float64)
leaf = x.float().requires_grad_()
y = attngrad.scaled_masked_softmax(leaf, mask, scale=0.7)
[((op, dtype, mode), (proc, _))] = precompile._early.items()
print(op, dtype, mode, "ended with", proc.wait())
y.backward(dy.float())
x.requires_grad_()
expected = torch.autograd.grad(torch.softmax(torch.where(mask, -10000.0, x * 0.7), -1), x, dy)[0]
assert torch.allclose(leaf.grad.double(), expected, rtol=1e-5, atol=1e-6), "wrong gradient"
print("compile children:", len(children))
"""


@pytest.mark.skipif(os.name != "posix", reason="the jobs start on POSIX systems only")
def test_the_first_forward_with_grad_compiles_its_backward_beside_it(tmp_path):
    """With an empty cache the forward compiles in one child and starts the backward's job; once the job ends, the
    backward loads every kernel from the cache: the job compiled what autograd's call needs."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "ATTNGRAD_COMPILE_IN_CHILD": "1"}
    env.pop(precompile.EARLY_BACKWARD_ENV, None)
    env.pop("ATTNGRAD_PRECISION", None)
    done = subprocess.run([sys.executable, "-c", _FIRST_STEP], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    assert "ScaledMaskedSoftmaxBackward torch.float32 npu ended with 0" in done.stdout
    assert done.stdout.strip().endswith("compile children: 1")
