"""``attngrad train``: train a small LLaMA or Mamba2 on attngrad's operators (see docs/training.md)."""

from __future__ import annotations

import argparse
import json
import sys

from .checkpoint import CheckpointError
from .loop import DEFAULT_STEPS, DTYPES, TrainConfig, train


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``train`` subcommand to an argparse subparsers object."""
    p = subparsers.add_parser("train", help="train a small model on attngrad's operators (optionally beside "
                                            "plain PyTorch)",
                              description="Train a small LLaMA or Mamba2 on attngrad's operators "
                                          "(docs/training.md).")
    p.add_argument("--model", choices=("llama", "mamba2"), default="llama", help="the model (default llama)")
    p.add_argument("--steps", type=int, help="training steps (default: "
                   + ", ".join(f"{steps} for {model}" for model, steps in DEFAULT_STEPS.items()) + ")")
    p.add_argument("--seq", type=int, default=256, help="tokens per packed row (default 256)")
    p.add_argument("--batch", type=int, default=8, help="rows per step (default 8)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    p.add_argument("--threads", type=int, default=1, help="torch and numba threads (default 1; 0: leave as is)")
    p.add_argument("--compile", action="store_true", help="run the model through torch.compile")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (default 3e-3)")
    p.add_argument("--dropout", type=float, default=0.0, help="llama: attention dropout probability")
    p.add_argument("--alibi", action="store_true", help="llama: add CANN's generated alibi (pseType 2)")
    p.add_argument("--compare", action="store_true",
                   help="train the plain-PyTorch twin (same weights, same batches) side by side")
    p.add_argument("--out", default="attngrad-train", help="output folder (default ./attngrad-train)")
    p.add_argument("--resume", metavar="CHECKPOINT", help="continue from a checkpoint-STEP.pt of the same run")
    p.add_argument("--save-every", type=int, default=0, help="also checkpoint every N steps")
    p.add_argument("--json", action="store_true", help="print metrics.json to stdout")
    return p


def _summary(m: dict) -> str:
    lines = [f"{m['model']}: {m['steps']} steps in {m['wall_s']:.0f} s, final loss {m['loss'][-1]:.4f}, "
             f"held-out accuracy {m['accuracy']:.1%}, {m['tokens_per_s'] or 0:,.0f} tokens/s, "
             f"peak RSS {m['peak_rss_bytes'] / 2**20:.0f} MiB"]
    if "loss_reference" in m:
        lines.append(f"plain PyTorch: final loss {m['loss_reference'][-1]:.4f}, held-out accuracy "
                     f"{m['accuracy_reference']:.1%}, {m['tokens_per_s_reference'] or 0:,.0f} tokens/s, "
                     f"peak RSS {m['peak_rss_bytes_reference'] / 2**20:.0f} MiB")
    lines.append(f"metrics: {m['config']['out']}/metrics.json, plot: {m['plot'] or m['plot_note']}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Run ``attngrad train`` with parsed arguments; 2 on a bad checkpoint or configuration."""
    cfg = TrainConfig(model=args.model, steps=args.steps, seq=args.seq, batch=args.batch, dtype=args.dtype,
                      threads=args.threads, compile=args.compile, seed=args.seed, lr=args.lr,
                      dropout=args.dropout, alibi=args.alibi, compare=args.compare, out=args.out,
                      resume=args.resume, save_every=args.save_every)
    try:
        metrics = train(cfg)
    except (CheckpointError, ValueError) as e:
        print(f"attngrad train: {e}", file=sys.stderr)
        return 2
    print(json.dumps(metrics, indent=1) if args.json else _summary(metrics))
    return 0
