"""Training, side-by-side comparison, checkpoints and metrics (see docs/training.md).

One run trains the attngrad model and, with ``compare``, its plain-PyTorch twin (a deep copy with
``impl = "torch"``: same initial weights) in lockstep on the same batches, each with its own AdamW.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from . import checkpoint
from .models import Llama, LlamaConfig, Mamba2, Mamba2Config
from .report import PeakRss, Progress, plot_losses, write_metrics
from .tasks import HELD_OUT, IGNORE, TASKS, TRAIN, VOCAB, Batch, make_batch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_STEPS = {"llama": 600, "mamba2": 300}
WARMUP = 0.05            # fraction of the steps with a linear learning-rate warm-up, then cosine decay to 10%


@dataclass
class TrainConfig:
    model: str = "llama"
    steps: int | None = None      # None: DEFAULT_STEPS[model]
    seq: int = 256
    batch: int = 8
    dtype: str = "fp32"
    threads: int = 1
    compile: bool = False
    seed: int = 0
    lr: float = 3e-3
    dropout: float = 0.0
    alibi: bool = False
    compare: bool = False
    out: str = "attngrad-train"
    resume: str | None = None
    save_every: int = 0           # also write a checkpoint every this many steps (0: only at the end)
    eval_batches: int = 4
    quiet: bool = False           # no progress display

    @property
    def total_steps(self) -> int:
        return DEFAULT_STEPS[self.model] if self.steps is None else self.steps

    def identity(self) -> dict:
        return {k: getattr(self, k) for k in checkpoint.IDENTITY}


@dataclass
class Side:
    """One implementation under training: its model (and compiled runner), optimizer, losses and costs."""

    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    runner: torch.nn.Module
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0          # training-step time after the first step of this run
    timed_steps: int = 0
    rss: PeakRss = field(default_factory=PeakRss)


def build_model(cfg: TrainConfig, impl: str = "attngrad") -> torch.nn.Module:
    """The configured model with seed-determined initial weights, in the run's dtype."""
    torch.manual_seed(cfg.seed)
    if cfg.model == "llama":
        model = Llama(LlamaConfig(dropout=cfg.dropout, alibi=cfg.alibi), impl)
    elif cfg.model == "mamba2":
        if cfg.dropout or cfg.alibi:
            raise ValueError("--dropout and --alibi apply to --model llama only")
        model = Mamba2(Mamba2Config(chunk=min(64, cfg.seq)), impl)
    else:
        raise ValueError(f"--model must be llama or mamba2, got {cfg.model!r}")
    return model.to(DTYPES[cfg.dtype])


def _side(cfg: TrainConfig, name: str, model: torch.nn.Module) -> Side:
    model.impl = name
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    return Side(name, model, optimizer, torch.compile(model) if cfg.compile else model)


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up over WARMUP of the steps, then cosine decay from lr to lr / 10 (step counts from 0)."""
    total = cfg.total_steps
    warm = max(1, int(WARMUP * total))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def _loss(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Mean cross-entropy over the answer positions, in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), batch.targets.reshape(-1), ignore_index=IGNORE)


def train_step(cfg: TrainConfig, side: Side, batch: Batch, step: int, timed: bool) -> float:
    """One AdamW step (gradient norm clipped at 1) on batch; returns the loss."""
    side.model.train()
    for group in side.optimizer.param_groups:
        group["lr"] = learning_rate(cfg, step)
    with side.rss.measure():
        start = time.perf_counter()
        loss = _loss(side.runner(batch, dropout_seed=(cfg.seed * 1_000_003 + step) * 64), batch)
        side.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(side.model.parameters(), 1.0)
        side.optimizer.step()
        if timed:
            side.seconds += time.perf_counter() - start
            side.timed_steps += 1
    side.losses.append(loss.item())
    return side.losses[-1]


@torch.no_grad()
def evaluate(cfg: TrainConfig, side: Side) -> dict:
    """Held-out accuracy: the fraction of answer tokens predicted exactly, overall and per task."""
    side.model.eval()
    hits = torch.zeros(len(TASKS))
    counts = torch.zeros(len(TASKS))
    for i in range(cfg.eval_batches):
        batch = make_batch(cfg.seed, HELD_OUT, i, cfg.batch, cfg.seq)
        correct = side.runner(batch).argmax(-1) == batch.targets
        for t in range(len(TASKS)):
            where = batch.task == t
            hits[t] += correct[where].sum()
            counts[t] += where.sum()
    return {"accuracy": (hits.sum() / counts.sum()).item(),
            "accuracy_per_task": {name: (hits[t] / counts[t]).item() for t, name in enumerate(TASKS)}}


def _save(cfg: TrainConfig, out: Path, step: int, sides: list[Side]) -> Path:
    path = out / f"checkpoint-{step:06d}.pt"
    checkpoint.save(path, cfg.identity(), step, {
        s.name: {"model": s.model.state_dict(), "optimizer": s.optimizer.state_dict(), "losses": s.losses}
        for s in sides})
    return path


def _resume(cfg: TrainConfig, sides: list[Side]) -> int:
    """Load cfg.resume into the sides; returns the step to continue from."""
    ckpt = checkpoint.load(Path(cfg.resume), cfg.identity())
    for side in sides:
        state = ckpt["sides"].get(side.name)
        if state is None:
            raise checkpoint.CheckpointError(f"{cfg.resume}: holds no {side.name!r} model")
        try:
            side.model.load_state_dict(state["model"])
            side.optimizer.load_state_dict(state["optimizer"])
        except (KeyError, RuntimeError, ValueError) as e:
            raise checkpoint.CheckpointError(f"{cfg.resume}: malformed {side.name!r} state ({e})") from e
        side.losses = [float(x) for x in state.get("losses", [])][:ckpt["step"]]
    return ckpt["step"]


def _tokens_per_s(cfg: TrainConfig, side: Side) -> float | None:
    return cfg.batch * cfg.seq * side.timed_steps / side.seconds if side.timed_steps else None


def _metrics(cfg: TrainConfig, sides: list[Side], results: list[dict], wall: float, files: dict) -> dict:
    metrics = {"model": cfg.model, "steps": cfg.total_steps, "config": asdict(cfg),
               "tokens_per_step": cfg.batch * cfg.seq, "wall_s": wall, "peak_rss_method": sides[0].rss.method,
               **files}
    for side, result in zip(sides, results):
        suffix = "" if side.name == "attngrad" else "_reference"
        metrics.update({f"loss{suffix}": side.losses, f"accuracy{suffix}": result["accuracy"],
                        f"accuracy_per_task{suffix}": result["accuracy_per_task"],
                        f"tokens_per_s{suffix}": _tokens_per_s(cfg, side),
                        f"peak_rss_bytes{suffix}": side.rss.peak, f"peak_rss_rise_bytes{suffix}": side.rss.rise})
    return metrics


def train(cfg: TrainConfig) -> dict:
    """Run the configured training; writes checkpoints, metrics.json and loss.png under cfg.out and returns
    the metrics (module docstring; docs/training.md, 'metrics.json and loss.png')."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
        import numba
        numba.set_num_threads(min(cfg.threads, numba.config.NUMBA_NUM_THREADS))
    started = time.perf_counter()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(cfg)
    sides = [_side(cfg, "attngrad", model)]
    if cfg.compare:
        sides.append(_side(cfg, "torch", copy.deepcopy(model)))
    first = _resume(cfg, sides) if cfg.resume else 0
    total = cfg.total_steps
    with Progress(total, first, enabled=not cfg.quiet) as progress:
        for step in range(first, total):
            batch = make_batch(cfg.seed, TRAIN, step, cfg.batch, cfg.seq)
            loss = [train_step(cfg, side, batch, step, timed=step > first) for side in sides][0]
            progress.update(step + 1, loss, _tokens_per_s(cfg, sides[0]) or 0.0)
            if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < total:
                _save(cfg, out, step + 1, sides)
    files = {"checkpoint": str(_save(cfg, out, total, sides))}
    results = [evaluate(cfg, side) for side in sides]
    metrics = _metrics(cfg, sides, results, time.perf_counter() - started, files)
    plot = plot_losses(out, metrics)
    metrics["plot"] = str(plot) if plot else None
    metrics["plot_note"] = None if plot else "matplotlib is not installed: no loss.png"
    write_metrics(out, metrics)
    return metrics
