"""Operator contracts: validation, dispatch to a kernel, autograd. One module per operator."""
