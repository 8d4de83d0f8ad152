"""Command line: ``attngrad examples | verify | bench``."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys


def run_examples(names: list[str] | None) -> int:
    """Run every Python port of the seed examples (modules of ``attngrad.examples`` with ``main()``)."""
    import attngrad.examples as package

    status = 0
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if names and info.name not in names:
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        if not hasattr(module, "main"):
            continue
        print(f"=== {info.name} ===", flush=True)
        rc = module.main()
        if rc:
            print(f"{info.name} returned {rc}", file=sys.stderr)
            status = 1
    return status


def run_verify(ops: list[str] | None) -> int:
    """Print the precision table of every operator and dtype against the float64 golden."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from .precision import MERE_TOL, NORM_REL_TOL
    from .verification import all_cases

    table = Table(title="attngrad verify: precision against the float64 golden (API.md section 7)")
    for col in ("operator", "dtype", "case", "output", "norm-rel", "MERE", "MARE", "special", "verdict"):
        table.add_column(col)
    failures = 0
    console = Console(width=None if sys.stdout.isatty() else 200)
    with console.status("verifying...") as status:
        for case in all_cases(set(ops) if ops else None):
            status.update(f"verifying {case.op} {case.dtype} {case.label}")
            for name, report in case.run():
                failures += not report.passed
                dtype = str(case.dtype).replace("torch.", "")
                table.add_row(case.op, dtype, case.label, name, f"{report.norm_rel:.2e}",
                              f"{report.mere:.2e}" if report.use_mere else "-", f"{report.mare:.2e}",
                              "ok" if report.special_ok else "BAD",
                              "[green]pass[/green]" if report.passed else "[red]FAIL[/red]")
    console.print(table)
    limits = ", ".join(f"{str(d).replace('torch.', '')}: norm-rel <= {NORM_REL_TOL[d]:.1e}, MERE < {MERE_TOL[d]:.2e}"
                       for d in (torch.float32, torch.float16, torch.bfloat16))
    console.print(f"thresholds: {limits}")
    console.print(f"{failures} failing outputs" if failures else "all outputs pass")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="attngrad", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("examples", help="run the Python ports of the seed examples")
    ex.add_argument("names", nargs="*", help="example module names (default: all)")
    ve = sub.add_parser("verify", help="precision sweep against the float64 golden")
    ve.add_argument("--op", action="append", help="operator name (repeatable; default: all)")
    be = sub.add_parser("bench", help="benchmark against the PyTorch peers")
    from .bench import add_arguments

    add_arguments(be)
    args = parser.parse_args(argv)
    if args.command == "examples":
        return run_examples(args.names)
    if args.command == "verify":
        return run_verify(args.op)
    from .bench import run_bench

    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
