"""``python -m attngrad.npu.run script.py [args...]``: run a torch_npu script on attngrad's operators.

Installs the ``torch_npu`` shim (:func:`attngrad.npu.install`), then runs the script as ``__main__`` with
``sys.argv = [script.py, args...]`` and the script's directory first on ``sys.path``, as ``python script.py``
would.
"""

from __future__ import annotations

import os
import runpy
import sys

from .shim import install

USAGE = "usage: python -m attngrad.npu.run script.py [args...]"


def main(argv: list[str] | None = None) -> int:
    """Run ``argv[0]`` with the shim installed; exit status 2 (usage) without a script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        return 0 if argv else 2
    install()
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
