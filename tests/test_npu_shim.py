"""The torch_npu shim (``attngrad.npu.install``), its runner ``python -m attngrad.npu.run`` and the runnable
examples of docs/interop.md (each run in a fresh interpreter, as a user would)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import attngrad
from attngrad.npu import run, shim

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = """\
import sys
import torch
import torch_npu
from torch_npu import npu_fusion_attention

torch.manual_seed(0)
q = torch.randn(1, 2, 8, 16)
out, softmax_max, softmax_sum, _, seed, offset, numels = torch_npu.npu_fusion_attention(
    q, q, q, 2, "BNSD", scale=0.25)
assert npu_fusion_attention is torch_npu.npu_fusion_attention
print(__name__, sys.argv[1:], tuple(out.shape), numels, repr(float(out.double().sum())))
"""


def python(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def no_torch_npu(monkeypatch):
    """sys.modules without torch_npu for the test; whatever the test installs is removed afterwards."""
    monkeypatch.setitem(sys.modules, shim.MODULE_NAME, None)
    del sys.modules[shim.MODULE_NAME]


def test_install_is_idempotent_and_provides_attngrads_functions(no_torch_npu):
    module = attngrad.npu.install()
    assert attngrad.npu.install() is module
    import torch_npu
    from torch_npu import npu_fusion_attention_grad_v2, npu_scaled_masked_softmax
    assert torch_npu is module
    assert npu_fusion_attention_grad_v2 is attngrad.npu.npu_fusion_attention_grad_v2
    assert npu_scaled_masked_softmax is attngrad.npu.npu_scaled_masked_softmax
    assert all(getattr(torch_npu, name) is getattr(attngrad.npu, name) for name in shim.PROVIDED)


def test_names_that_are_not_emulated_raise(no_torch_npu):
    torch_npu = attngrad.npu.install()
    for name in ("npu", "npu_rotary_mul", "npu_format_cast"):
        with pytest.raises(AttributeError, match=f"torch_npu.{name} is not emulated"):
            getattr(torch_npu, name)
    with pytest.raises(ImportError):
        from torch_npu import npu_rotary_mul  # noqa: F401
    with pytest.raises(ModuleNotFoundError):
        import torch_npu.contrib  # noqa: F401


def test_install_never_replaces_another_torch_npu(monkeypatch):
    other = types.ModuleType("torch_npu")
    monkeypatch.setitem(sys.modules, shim.MODULE_NAME, other)
    with pytest.raises(RuntimeError, match="already imported"):
        attngrad.npu.install()
    assert sys.modules[shim.MODULE_NAME] is other


def test_runner_runs_a_torch_npu_script_as_main_with_its_arguments(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    result = python("-m", "attngrad.npu.run", str(script), "--steps", "2")
    assert result.returncode == 0, result.stderr
    torch.manual_seed(0)
    q = torch.randn(1, 2, 8, 16)
    out = attngrad.npu.npu_fusion_attention(q, q, q, 2, "BNSD", scale=0.25)[0]
    *printed, total = result.stdout.split()
    assert printed == ["__main__", "['--steps',", "'2']", "(1,", "2,", "8,", "16)", "128"]
    # same computation in another process: equal up to float32 rounding (not bitwise: a process that compiled the
    # kernel itself and one that loaded it from numba's cache can differ in the last bits, docs/performance.md)
    assert float(total) == pytest.approx(float(out.double().sum()), rel=1e-6)


def test_runner_reports_unemulated_names_and_usage(tmp_path, no_torch_npu, monkeypatch, capsys):
    """In this process: the script runs as __main__ with the shim and fails on a name the shim lacks."""
    script = tmp_path / "device.py"
    script.write_text("import sys, torch_npu\nassert __name__ == '__main__' and sys.argv[1:] == ['-x']\n"
                      "torch_npu.npu.set_device(0)\n")
    monkeypatch.setattr(sys, "argv", ["run.py"])
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(AttributeError, match="torch_npu.npu is not emulated"):
        run.main([str(script), "-x"])
    assert sys.argv == [str(script), "-x"] and sys.path[0] == str(tmp_path)
    assert run.main([]) == 2 and "usage: python -m attngrad.npu.run script.py" in capsys.readouterr().err


def interop_examples() -> tuple[dict[str, str], list[list[str]]]:
    """docs/interop.md's files (python blocks opening with ``# file: NAME``) and its examples: the other python
    blocks (``python -c``) and the ``python -m attngrad.npu.run`` lines of its bash blocks."""
    blocks = re.findall(r"```(python|bash)\n(.*?)```", (ROOT / "docs" / "interop.md").read_text(), re.S)
    files, runs = {}, []
    for language, code in blocks:
        name = re.match(r"# file: (\S+)\n", code)
        if name:
            files[name.group(1)] = code
        elif language == "python":
            runs.append(["-c", code])
        else:
            runs += [shlex.split(line)[1:] for line in code.splitlines() if line.startswith("python -m attngrad")]
    return files, runs


@pytest.mark.parametrize("index", range(len(interop_examples()[1])))
def test_interop_doc_examples_run(index, tmp_path):
    """Each example of docs/interop.md runs as written, in a fresh interpreter, next to the doc's files."""
    files, runs = interop_examples()
    for name, code in files.items():
        (tmp_path / name).write_text(code)
    result = python(*runs[index], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
