"""Checkpoints: ``torch.save`` of plain dicts (state dicts, the run's identity, the losses so far), read back
with ``torch.load(..., weights_only=True)``; anything else is refused with :class:`CheckpointError`."""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import torch

FORMAT = "attngrad.train checkpoint 1"
# Fields of the run that must match on resume: they decide the model, the batches and the loss curve.
IDENTITY = ("model", "dtype", "seq", "batch", "seed", "lr", "dropout", "alibi", "compare")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not belong to the run being resumed."""


def save(path: Path, identity: dict, step: int, sides: dict[str, dict]) -> None:
    """sides: implementation name -> ``{"model": state dict, "optimizer": state dict, "losses": [float]}``."""
    torch.save({"format": FORMAT, "identity": identity, "step": step, "sides": sides}, path)


def load(path: Path, identity: dict) -> dict:
    """The checkpoint dict; CheckpointError when the file is not a checkpoint or ``identity`` differs."""
    try:
        ckpt = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable attngrad train checkpoint ({type(e).__name__}: {e})") from e
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an attngrad train checkpoint (no format tag {FORMAT!r})")
    if not all(isinstance(ckpt.get(k), t) for k, t in (("identity", dict), ("step", int), ("sides", dict))):
        raise CheckpointError(f"{path}: malformed checkpoint (identity, step or sides missing)")
    differ = {k: (ckpt["identity"].get(k), identity[k]) for k in IDENTITY if ckpt["identity"].get(k) != identity[k]}
    if differ:
        listed = ", ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in differ.items())
        raise CheckpointError(f"{path}: belongs to another run ({listed})")
    return ckpt
