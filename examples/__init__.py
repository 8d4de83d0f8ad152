"""Examples run by ``attngrad examples``, each a module with ``main() -> int``.

The Python ports of CANN's C++ operator examples follow their C++ programs line by line against
:mod:`attngrad.aclnn`; ``context_parallel`` trains a small causal model over two ranks with
:mod:`attngrad.distributed`.
"""
