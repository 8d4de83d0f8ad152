"""Run a test case in a child Python process, so a hard crash (segfault, abort) fails the test
instead of killing pytest.

``run_in_child("module:function", *args)`` imports ``module`` in a fresh interpreter (the tests folder
and ``src`` are on its path), calls ``function(*args)`` and returns a :class:`ChildResult` with the
child's exit code: 0 = the function returned, 1 = it raised (e.g. a failed assert), negative = killed
by that signal (-11 = SIGSEGV). ``args`` must be JSON-serialisable. ``assert_child_ok`` is the
one-liner for tests. The child runs with ``-X faulthandler``, so a crash leaves a traceback in stderr.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
_SRC_DIR = TESTS_DIR.parent / "src"

_RUNNER = (
    "import importlib, json, sys\n"
    "module, _, name = sys.argv[1].partition(':')\n"
    "getattr(importlib.import_module(module), name)(*json.loads(sys.argv[2]))\n"
)


@dataclass
class ChildResult:
    target: str
    returncode: int
    stdout: str
    stderr: str

    @property
    def crashed(self) -> bool:
        """Killed by a signal (segfault, abort, ...) rather than exiting."""
        return self.returncode < 0

    def describe(self) -> str:
        code = self.returncode
        how = f"signal {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() else "exit"
        tail = self.stderr[-3000:]
        return f"child {self.target} ended with code {code} ({how})\n--- stderr tail ---\n{tail}"


def run_in_child(target: str, *args, timeout: float = 300.0, env: dict | None = None) -> ChildResult:
    """Call ``module:function(*args)`` in a fresh interpreter and report how it ended."""
    child_env = dict(os.environ, **(env or {}))
    paths = [str(TESTS_DIR), str(_SRC_DIR), child_env.get("PYTHONPATH", "")]
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _RUNNER, target, json.dumps(list(args))],
                          capture_output=True, text=True, timeout=timeout, env=child_env, cwd=TESTS_DIR.parent)
    return ChildResult(target, proc.returncode, proc.stdout, proc.stderr)


def assert_child_ok(target: str, *args, **kw) -> ChildResult:
    """``run_in_child`` and fail (with the exit code and the child's stderr) unless it exited with 0."""
    result = run_in_child(target, *args, **kw)
    assert result.returncode == 0, result.describe()
    return result
