"""Command line: ``attngrad examples | verify | bench | compile | train | golden | compare``."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import pkgutil
import signal
import sys
import threading
import time


def run_examples(names: list[str] | None) -> int:
    """Run the Python ports of CANN's C++ examples (modules of ``attngrad.examples`` with ``main()``): those
    named, or all; a name that is not an example exits with status 2 and the list of examples."""
    import attngrad.examples as package

    modules = {info.name: importlib.import_module(f"{package.__name__}.{info.name}")
               for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name)}
    examples = {name: module for name, module in modules.items() if hasattr(module, "main")}
    unknown = [name for name in names or () if name not in examples]
    if unknown:
        print(f"attngrad examples: no example {', '.join(map(repr, unknown))}; the examples: {', '.join(examples)}",
              file=sys.stderr)
        return 2
    status = 0
    for name, module in examples.items():
        if names and name not in names:
            continue
        print(f"=== {name} ===", flush=True)
        rc = module.main()
        if rc:
            print(f"{name} returned {rc}", file=sys.stderr)
            status = 1
    return status


def op_selected(op: str, filters: list[str] | None) -> bool:
    """The ``--op`` rule of ``bench`` and ``verify``: ``op`` contains one of ``filters`` (case-insensitive
    substrings); no filters select every operator."""
    return not filters or any(f.lower() in op.lower() for f in filters)


def require_extra(module: str, extra: str, hint: str = ""):
    """Import ``module`` (an optional dependency) for a command, or exit with one line naming the extra that
    installs it (``pip install "attngrad[<extra>]"``)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise SystemExit(f'attngrad: this command needs {module.split(".")[0]}, which is not installed: '
                         f'pip install "attngrad[{extra}]"{hint}') from None


def plain_table(title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """``rows`` as left-aligned text columns under ``title`` (the output without rich)."""
    widths = [max(len(cell) for cell in column) for column in zip(columns, *rows)]
    lines = [title] + ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                       for row in (columns, *rows)]
    return "\n".join(lines)


VERIFY_TITLE = "attngrad verify: precision against the float64 golden"
VERIFY_COLUMNS = ("operator", "dtype", "case", "output", "norm-rel", "MERE", "MARE", "special", "verdict")


def verify_rows(cases: list, on_case=None) -> list[tuple[str, ...]]:
    """One row of text cells (``VERIFY_COLUMNS``) per output of each verify case; ``on_case(case)`` is called
    before each case runs."""
    rows = []
    for case in cases:
        if on_case:
            on_case(case)
        dtype = str(case.dtype).replace("torch.", "")
        for name, report in case.run():
            rows.append((case.op, dtype, case.label, name, f"{report.norm_rel:.2e}",
                         f"{report.mere:.2e}" if report.use_mere else "-", f"{report.mare:.2e}",
                         "ok" if report.special_ok else "BAD", "pass" if report.passed else "FAIL"))
    return rows


def _verify_with_rich(cases: list) -> list[tuple[str, ...]]:
    """The rows of :func:`verify_rows`, with a progress line while they run, printed as a rich table."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 200)
    with console.status("verifying...") as status:
        rows = verify_rows(cases, lambda case: status.update(f"verifying {case.op} {case.dtype} {case.label}"))
    table = Table(title=VERIFY_TITLE)
    for col in VERIFY_COLUMNS:
        table.add_column(col)
    for row in rows:
        verdict = "[green]pass[/green]" if row[-1] == "pass" else "[red]FAIL[/red]"
        table.add_row(*row[:-1], verdict)
    console.print(table)
    return rows


def run_verify(ops: list[str] | None) -> int:
    """Print the precision table of the operators ``ops`` selects (:func:`.verification.select_cases`; default
    all) in every dtype against the float64 golden (a rich table when rich is installed, plain text otherwise).
    An ``op`` that selects nothing exits with status 2 and the list of operators."""
    import torch

    from .precision import MERE_TOL, NORM_REL_TOL
    from .verification import select_cases

    try:
        cases = select_cases(ops)
    except ValueError as err:
        print(f"attngrad verify: {err}", file=sys.stderr)
        return 2
    try:
        import rich  # noqa: F401 - optional (the cli extra)
    except ImportError:
        rows = verify_rows(cases)
        print(plain_table(VERIFY_TITLE, VERIFY_COLUMNS, rows))
    else:
        rows = _verify_with_rich(cases)
    failures = sum(row[-1] != "pass" for row in rows)
    limits = ", ".join(f"{str(d).replace('torch.', '')}: norm-rel <= {NORM_REL_TOL[d]:.1e}, MERE < {MERE_TOL[d]:.2e}"
                       for d in (torch.float32, torch.float16, torch.bfloat16))
    print(f"thresholds: {limits}")
    print(f"{failures} failing outputs" if failures else "all outputs pass")
    return 1 if failures else 0


def run_compile(ops: list[str] | None, dtypes: list[str] | None, precisions: list[str] | None,
                workers: int | None) -> int:
    """Compile the selected operators' kernels into numba's cache (:mod:`.precompile`), printing each job as it
    ends and a line per failure; status 1 when a job failed, 2 when the selection is unknown, 130 when interrupted
    (SIGTERM and SIGHUP stop it as Ctrl-C does: the running jobs are killed)."""
    from .precompile import compile_jobs, select_jobs, worker_count

    try:
        if workers is not None and workers < 1:
            raise ValueError(f"--jobs must be at least 1, got {workers}")
        jobs = select_jobs(ops, dtypes, precisions)
    except ValueError as err:
        print(f"attngrad compile: {err}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    print(f"compiling {len(jobs)} kernel sets (operator, dtype, precision mode), {worker_count(jobs, workers)} at a "
          f"time, into {_numba_cache_dir()}", flush=True)
    done = 0

    def report(result):
        nonlocal done
        done += 1
        status = "FAILED" if result.error else "cached"
        print(f"[{done}/{len(jobs)}] {result.job}: {status} after {result.seconds:.1f} s", flush=True)

    try:
        with _signals_raise(signal.SIGTERM, getattr(signal, "SIGHUP", None)):
            failed = [r for r in compile_jobs(jobs, workers, report) if r.error]
    except KeyboardInterrupt:
        print("attngrad compile: interrupted; the running jobs were stopped", file=sys.stderr)
        return 130
    for result in failed:
        print(f"attngrad compile: {result.job} {result.error}", file=sys.stderr)
    print(f"{len(jobs) - len(failed)} of {len(jobs)} in the cache after {time.perf_counter() - start:.1f} s")
    return 1 if failed else 0


def _numba_cache_dir() -> str:
    """Where numba caches the kernels: ``NUMBA_CACHE_DIR``, else beside the kernel modules."""
    from numba.core import config

    from . import kernels

    return config.CACHE_DIR or os.path.join(os.path.dirname(kernels.__file__), "__pycache__")


@contextlib.contextmanager
def _signals_raise(*signals):
    """Within the block, each of ``signals`` (None: one this system lacks) raises SystemExit(128 + signal number)
    instead of ending the process unwound; nothing changes outside the main thread, where handlers cannot be set."""
    def raise_exit(signum, frame):
        raise SystemExit(128 + signum)

    in_main = threading.current_thread() is threading.main_thread()
    present = [sig for sig in signals if sig is not None and in_main]
    previous = [signal.signal(sig, raise_exit) for sig in present]
    try:
        yield
    finally:
        for sig, handler in zip(present, previous):
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="attngrad", description="attngrad: Huawei Ascend CANN's attention "
                                     "training operators on the CPU; one subcommand per task (docs in README.md).")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("examples", help="run the Python ports of CANN's C++ examples")
    ex.add_argument("names", nargs="*", help="example module names (default: all)")
    ve = sub.add_parser("verify", help="precision sweep against the float64 golden")
    ve.add_argument("--op", action="append", help="operator name substring, case-insensitive (repeatable; default: "
                    "all; one that matches nothing lists the operators)")
    from .precision_mode import MODES
    from .precompile import DTYPES

    co = sub.add_parser("compile", help="compile the kernels ahead of their first call, in parallel processes")
    co.add_argument("--op", action="append", help="CANN operator name substring, case-insensitive (repeatable; "
                    "default: all; 'Grad' or 'Backward' select the backward operators)")
    co.add_argument("--dtype", action="append", choices=DTYPES, help="repeatable; default: all")
    co.add_argument("--precision", action="append", choices=MODES, help="precision mode (repeatable: "
                    "--precision npu --precision golden compiles both; default: the current mode, "
                    "ATTNGRAD_PRECISION or npu)")
    co.add_argument("--jobs", type=int, help="processes at once (default: one per core; each needs up to 1.5 GB)")
    be = sub.add_parser("bench", help="benchmark against the PyTorch peers (needs the cli and plot extras)")
    from .bench import add_arguments
    from .golden_cli import add_parsers as add_golden_parsers, main as run_golden_command
    from .train.cli import add_parser as add_train_parser, main as run_train

    add_arguments(be)
    add_train_parser(sub)
    add_golden_parsers(sub)
    args = parser.parse_args(argv)
    if args.command == "examples":
        return run_examples(args.names)
    if args.command == "verify":
        return run_verify(args.op)
    if args.command == "compile":
        return run_compile(args.op, args.dtype, args.precision, args.jobs)
    if args.command == "train":
        return run_train(args)
    if args.command in ("golden", "compare"):
        return run_golden_command(args)
    from .bench import run_bench

    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
