"""Python ports of CANN's C++ operator examples, run by ``attngrad examples``.

Each module follows its C++ program line by line against :mod:`attngrad.aclnn` and has ``main() -> int``.
"""
