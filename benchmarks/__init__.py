"""Benchmark cases of ``attngrad bench``: one module per operator, each with ``cases(quick)``."""
