"""What a training run reports: peak memory per implementation, a progress display, metrics.json and loss.png.

Peak RSS is measured around each implementation's own training steps in the one process. Before a step
the allocator's free memory is returned to the system (glibc ``malloc_trim``, so memory the other side
freed is neither counted as this side's nor reused unseen) and the kernel's high-water mark is reset
(``/proc/self/clear_refs`` = 5); after the step ``VmHWM`` is that step's peak. ``peak_rss_bytes`` is the
largest such peak over the side's steps (it includes all that stays resident: both models' weights and
optimizer states, the Python runtime); ``peak_rss_rise_bytes`` the largest rise above the RSS before a
step (the step's own working memory). Where the high-water mark cannot be reset, both are the process's
peak (``getrusage``) and ``peak_rss_method`` says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import resource
import sys
from contextlib import contextmanager
from pathlib import Path


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


_LIBC = _libc()


def _status_bytes(field: str) -> int:
    """A ``kB`` field of /proc/self/status in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRss:
    """Peak resident memory during the measured blocks (see the module docstring for the method)."""

    def __init__(self):
        self.peak = 0
        self.rise = 0
        self.method = "VmHWM reset per step"

    @contextmanager
    def measure(self):
        if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
            _LIBC.malloc_trim(0)
        before = _status_bytes("VmRSS")
        resettable = _reset_high_water_mark()
        yield
        if resettable:
            peak = _status_bytes("VmHWM")
        else:
            self.method = "process peak (getrusage): the high-water mark cannot be reset here"
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.peak = max(self.peak, peak)
        self.rise = max(self.rise, peak - before)


class Progress:
    """A rich progress bar with loss and tokens/s on stderr when it is a terminal and rich is installed, else
    a plain line every ``every`` steps (nothing when not ``enabled``). Use as a context manager;
    ``update(step, loss, tokens_per_s)`` after each step."""

    def __init__(self, total: int, first: int, every: int = 10, enabled: bool = True):
        self.total, self.every, self.enabled = total, every, enabled
        self._bar = None
        if not (enabled and sys.stderr.isatty()):
            return
        try:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn
            from rich.progress import TimeRemainingColumn
        except ImportError:
            pass
        else:
            self._bar = RichProgress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
                                     console=Console(stderr=True))
            self._task = self._bar.add_task("train", total=total, completed=first, status="")

    def __enter__(self):
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.stop()

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        status = f"loss {loss:.4f}  {tokens_per_s:,.0f} tok/s"
        if self._bar is not None:
            self._bar.update(self._task, completed=step, status=status)
        elif self.enabled and (step % self.every == 0 or step == self.total):
            print(f"step {step}/{self.total}  {status}", file=sys.stderr, flush=True)


def write_metrics(out: Path, metrics: dict) -> Path:
    path = out / "metrics.json"
    path.write_text(json.dumps(metrics, indent=1) + "\n")
    return path


def plot_losses(out: Path, metrics: dict) -> Path | None:
    """``loss.png``: the training loss per step (and the reference's with --compare); None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = range(1, len(metrics["loss"]) + 1)
    ax.plot(steps, metrics["loss"], label="attngrad")
    if metrics.get("loss_reference"):
        ax.plot(steps, metrics["loss_reference"], label="plain PyTorch", linestyle="--")
    ax.set(xlabel="step", ylabel="training loss (answer tokens)", yscale="log",
           title=f"{metrics['model']} {metrics['config']['dtype']}: held-out accuracy {metrics['accuracy']:.1%}")
    ax.legend()
    fig.tight_layout()
    path = out / "loss.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
