"""``attngrad train``: small models (LLaMA, Mamba2) trained on attngrad's operators beside plain PyTorch.

:mod:`.models` holds the models (one ``impl`` switch each), :mod:`.tasks` the synthetic data, :mod:`.loop`
the training run, :mod:`.checkpoint` and :mod:`.report` its files. See docs/training.md.
"""

from .checkpoint import CheckpointError
from .loop import TrainConfig, train

__all__ = ["CheckpointError", "TrainConfig", "train"]
