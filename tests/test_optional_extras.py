"""rich and matplotlib are optional (the ``cli`` and ``plot`` extras): ``import attngrad``, ``attngrad examples``
and ``attngrad verify`` work without them, and ``attngrad bench`` says in one line which extra to install.

Each case runs in a fresh interpreter whose ``sys.modules`` maps rich and matplotlib to None, which makes any
import of them fail as if they were not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"

_WITHOUT_EXTRAS = """
import sys
for name in ("rich", "matplotlib"):
    sys.modules[name] = None
import attngrad
from attngrad.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_without_extras(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", _WITHOUT_EXTRAS, *argv], capture_output=True, text=True,
                          env=env, timeout=600)


def test_examples_run_without_rich_and_matplotlib():
    proc = run_without_extras("examples", "exp_segsum")
    assert proc.returncode == 0, proc.stderr
    assert "=== exp_segsum ===" in proc.stdout


def test_verify_falls_back_to_plain_text():
    proc = run_without_extras("verify", "--op", "ExpSegsum")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "attngrad verify: precision against the float64 golden"
    assert lines[1].split() == ["operator", "dtype", "case", "output", "norm-rel", "MERE", "MARE", "special",
                                "verdict"]
    assert any(line.startswith("ExpSegsum") and line.endswith("pass") for line in lines)
    assert lines[-1] == "all outputs pass"


def test_bench_names_the_cli_extra():
    proc = run_without_extras("bench", "--quick")
    assert proc.returncode == 1
    message = proc.stderr.strip().splitlines()
    assert len(message) == 1 and 'pip install "attngrad[cli]"' in message[0], proc.stderr


def test_bench_names_the_plot_extra_when_only_matplotlib_is_missing(monkeypatch):
    pytest.importorskip("rich")
    from attngrad import cli

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit, match=r'pip install "attngrad\[plot\]" \(or pass --no-plots\)'):
        cli.main(["bench", "--quick", "--op", "none"])
