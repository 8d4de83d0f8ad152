"""A ``torch_npu`` module backed by attngrad, for running torch_npu code on a CPU (docs/interop.md).

:func:`install` puts the module into ``sys.modules`` under the name ``torch_npu``, so ``import torch_npu`` and
``from torch_npu import npu_fusion_attention`` resolve to the functions of :mod:`attngrad.npu`. Only the
names in :data:`PROVIDED` exist; any other attribute (``torch_npu.npu``, other ``npu_*`` operators) raises an
``AttributeError`` saying it is not emulated. Devices, streams and ``Tensor.npu()`` are not emulated either:
tensors stay on the CPU and torch itself is not patched.
"""

from __future__ import annotations

import sys
import types

from .fusion_attention import (npu_fusion_attention, npu_fusion_attention_grad, npu_fusion_attention_grad_v2,
                               npu_fusion_attention_v2)
from .softmax import npu_scaled_masked_softmax, npu_scaled_masked_softmax_backward

MODULE_NAME = "torch_npu"
_FUNCTIONS = (npu_fusion_attention, npu_fusion_attention_grad, npu_fusion_attention_v2, npu_fusion_attention_grad_v2,
              npu_scaled_masked_softmax, npu_scaled_masked_softmax_backward)
PROVIDED = tuple(f.__name__ for f in _FUNCTIONS)


class _TorchNpuShim(types.ModuleType):
    """The ``torch_npu`` stand-in: the :data:`PROVIDED` functions, and a clear error for anything else."""

    def __getattr__(self, name: str):
        if name.startswith("__"):  # import machinery probes (__path__, __spec__ ...): a plain module
            raise AttributeError(name)
        raise AttributeError(f"torch_npu.{name} is not emulated by attngrad's torch_npu shim, which provides only "
                             f"{', '.join(PROVIDED)} (see docs/interop.md)")


_SHIM = _TorchNpuShim(MODULE_NAME, __doc__)
for _function in _FUNCTIONS:
    setattr(_SHIM, _function.__name__, _function)


def install() -> types.ModuleType:
    """Make ``import torch_npu`` resolve to attngrad's shim and return it; calling it again changes nothing.

    Raises ``RuntimeError`` when another module named ``torch_npu`` (the real one) is already imported:
    the shim never replaces it.
    """
    current = sys.modules.get(MODULE_NAME)
    if current is None:
        sys.modules[MODULE_NAME] = _SHIM
    elif current is not _SHIM:
        raise RuntimeError(f"a torch_npu module is already imported ({current!r}); attngrad's shim does not "
                           "replace it")
    return _SHIM
