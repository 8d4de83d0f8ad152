"""``attngrad compile``: which jobs a selection makes, how a failing job is reported, and that a job fills numba's
cache so that a later process runs the operator on other shapes without compiling anything."""

import os
import subprocess
import sys

import pytest

from attngrad import precompile
from attngrad.cli import main


def test_operators_are_selected_by_substring_and_dtypes_by_name():
    jobs = precompile.select_jobs(["softmax"], ["float32", "bfloat16"])
    assert [str(j) for j in jobs] == [
        "ScaledMaskedSoftmax backward bfloat16 (npu)", "ScaledMaskedSoftmax backward float32 (npu)",
        "ScaledMaskedSoftmax forward bfloat16 (npu)", "ScaledMaskedSoftmax forward float32 (npu)"]
    assert len(precompile.select_jobs()) == len(precompile.OPERATORS) * 2 * len(precompile.DTYPES)
    both = precompile.select_jobs(["FlashAttention"], ["float16"], ["golden", "npu"])
    assert [(j.direction, j.precision) for j in both] == [("backward", "npu"), ("backward", "golden"),
                                                          ("forward", "npu"), ("forward", "golden")]


def test_the_default_precision_mode_is_the_current_one(monkeypatch):
    monkeypatch.setenv("ATTNGRAD_PRECISION", "golden")
    assert {j.precision for j in precompile.select_jobs(["segsum"])} == {"golden"}


@pytest.mark.parametrize("argv, message", [(["--op", "nothing"], "no operator matches ['nothing']"),
                                           (["--dtype", "int8"], "unknown dtype int8"),
                                           (["--precision", "exact"], "unknown precision mode exact"),
                                           (["--jobs", "0"], "--jobs must be at least 1, got 0")])
def test_an_unknown_selection_exits_with_status_2_and_says_why(argv, message, capsys):
    assert main(["compile", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_failing_job_is_named_with_its_error_and_the_status_is_1(monkeypatch, capsys):
    monkeypatch.setattr(precompile.Job, "command",
                        lambda self: [sys.executable, "-c", f"raise SystemExit('no {self.direction} here')"])
    assert main(["compile", "--op", "segsum", "--dtype", "float32", "--jobs", "2"]) == 1
    out, err = capsys.readouterr()
    assert "ExpSegsum backward float32 (npu) failed with status 1: no backward here" in err
    assert "ExpSegsum forward float32 (npu) failed with status 1: no forward here" in err
    assert "0 of 2 in the cache" in out


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
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    compiled = subprocess.run([sys.executable, "-m", "attngrad.cli", "compile", "--op", "ScaledMaskedSoftmax",
                               "--dtype", "float32"], env=env, capture_output=True, text=True, timeout=900)
    assert compiled.returncode == 0, compiled.stderr
    assert "2 of 2 in the cache" in compiled.stdout
    later = subprocess.run([sys.executable, "-c", _LATER_PROCESS], env=env, capture_output=True, text=True,
                           timeout=900)
    assert later.returncode == 0, later.stderr
    assert later.stdout.strip().endswith("compile children: 0")
