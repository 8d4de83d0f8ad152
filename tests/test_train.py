"""attngrad train: the models learn, match their plain-PyTorch twins step by step, and resume exactly."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from attngrad.train import CheckpointError, TrainConfig, train
from attngrad.train import cli
from attngrad.train.models import smear_keys, torch_exp_segsum
from attngrad.train.tasks import HELD_OUT, IGNORE, TRAIN, make_batch

import attngrad


def _run(tmp_path, **kw) -> dict:
    cfg = dict(steps=50, seq=64, batch=2, quiet=True, eval_batches=1, out=str(tmp_path / "run"))
    return train(TrainConfig(**{**cfg, **kw}))


def _relative_gaps(m: dict) -> torch.Tensor:
    loss, ref = torch.tensor(m["loss"]), torch.tensor(m["loss_reference"])
    return (loss - ref).abs() / ref.abs()


@pytest.mark.parametrize("model, dtype, steps, extra, tol", [
    ("llama", "fp32", 50, {}, 0.005),
    ("llama", "bf16", 20, {"dropout": 0.1, "alibi": True}, 0.03),
    ("mamba2", "fp32", 30, {"seq": 128}, 0.005),
    ("mamba2", "bf16", 30, {"seq": 128}, 0.03),
])
def test_compare_curves_agree_and_loss_falls(tmp_path, model, dtype, steps, extra, tol):
    m = _run(tmp_path, model=model, dtype=dtype, steps=steps, compare=True, **extra)
    assert len(m["loss"]) == len(m["loss_reference"]) == steps
    assert _relative_gaps(m).max() < tol
    assert sum(m["loss"][-5:]) < 0.9 * sum(m["loss"][:5])
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    for key in ("accuracy", "accuracy_reference", "tokens_per_s", "tokens_per_s_reference", "peak_rss_bytes",
                "peak_rss_bytes_reference"):
        assert saved[key] > 0, key


def test_resume_continues_the_same_curve(tmp_path):
    straight = _run(tmp_path, steps=6, save_every=3, model="llama")
    resumed = _run(tmp_path, steps=6, model="llama", resume=str(tmp_path / "run" / "checkpoint-000003.pt"),
                   out=str(tmp_path / "resumed"))
    assert resumed["loss"] == straight["loss"]


def test_bad_checkpoints_are_refused(tmp_path, capsys):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="not a readable attngrad train checkpoint"):
        _run(tmp_path, steps=2, resume=str(garbage))
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="no format tag"):
        _run(tmp_path, steps=2, resume=str(tmp_path / "other.pt"))
    _run(tmp_path, steps=2, out=str(tmp_path / "a"))
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["train", "--steps", "2", "--seq", "64", "--batch", "2", "--seed", "1", "--out",
                              str(tmp_path / "b"), "--resume", str(tmp_path / "a" / "checkpoint-000002.pt")])
    assert cli.main(args) == 2
    assert "belongs to another run (seed: checkpoint 0, now 1)" in capsys.readouterr().err


def test_batches_are_deterministic_and_packed():
    a, b = make_batch(3, TRAIN, 7, 2, 96), make_batch(3, TRAIN, 7, 2, 96)
    assert torch.equal(a.tokens, b.tokens) and a.lengths == b.lengths
    assert not torch.equal(a.tokens, make_batch(3, HELD_OUT, 7, 2, 96).tokens)
    assert all(sum(row) == 96 for row in a.lengths) and a.cumulative_lengths[-1] == 192
    starts = a.document_starts.reshape(-1).nonzero().squeeze(1).tolist()
    assert starts == [0, *a.cumulative_lengths[:-1].tolist()]
    assert (a.targets[a.task >= 0] != IGNORE).all() and (a.targets[a.task < 0] == IGNORE).all()


def test_torch_exp_segsum_matches_attngrad():
    x = -torch.rand(2, 3, 4, 16)
    torch.testing.assert_close(torch_exp_segsum(x), attngrad.exp_segsum(x))


def test_smeared_keys_do_not_cross_documents():
    k = torch.arange(1.0, 5.0).view(4, 1, 1)
    starts = torch.tensor([True, False, True, False])
    smeared = smear_keys(k, starts, torch.zeros(1, 1))          # w = 1/2
    assert smeared.flatten().tolist() == [0.5, 1.5, 1.5, 3.5]
