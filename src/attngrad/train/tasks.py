"""Synthetic training data: packed variable-length documents of two tasks that need attention to solve.

* ``recall`` (multi-query associative recall): ``RECALL k1 v1 ... kn vn SEP q1 a1 ... qn an`` with n distinct
  keys; the queries are the keys in a shuffled order and each answer ``a`` is the value paired with ``q``.
* ``copy``: ``COPY x1 ... xm SEP x1 ... xm``; the answers are the repeated ``x``.

Only answer tokens are predicted (the target of position t is token t + 1 when that token is an answer, else
ignored), so held-out accuracy is the fraction of answers predicted exactly. Documents are packed whole into
rows of ``seq`` tokens; the tail of a row that no further document fits into is one PAD document with no
targets. Every batch is a pure function of ``(seed, split, step)`` (numpy PCG64), so two models, a resumed
run and a fresh run all see the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

PAD, RECALL, COPY, SEP = 0, 1, 2, 3
KEYS = 32                      # key tokens 4 .. 35
VALUES = 32                    # value / copied tokens 36 .. 67
KEY0 = 4
VALUE0 = KEY0 + KEYS
VOCAB = VALUE0 + VALUES
TASKS = ("recall", "copy")
RECALL_PAIRS = (2, 8)          # n, inclusive bounds
COPY_LENGTH = (3, 12)          # m, inclusive bounds
IGNORE = -100                  # target of a position that predicts nothing (torch's cross-entropy default)
TRAIN, HELD_OUT = 0, 1         # data splits


def recall_document(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One associative-recall document: ``(tokens [4n + 2], answer flags [4n + 2])``."""
    n = int(rng.integers(RECALL_PAIRS[0], RECALL_PAIRS[1] + 1))
    keys = KEY0 + rng.permutation(KEYS)[:n]
    values = VALUE0 + rng.integers(0, VALUES, n)
    order = rng.permutation(n)
    pairs = np.stack([keys, values], 1).reshape(-1)
    queries = np.stack([keys[order], values[order]], 1).reshape(-1)
    tokens = np.concatenate([[RECALL], pairs, [SEP], queries])
    answers = np.zeros(tokens.size, bool)
    answers[2 * n + 3::2] = True
    return tokens, answers


def copy_document(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One copy document: ``(tokens [2m + 2], answer flags [2m + 2])``."""
    m = int(rng.integers(COPY_LENGTH[0], COPY_LENGTH[1] + 1))
    content = VALUE0 + rng.integers(0, VALUES, m)
    tokens = np.concatenate([[COPY], content, [SEP], content])
    answers = np.zeros(tokens.size, bool)
    answers[m + 2:] = True
    return tokens, answers


DOCUMENTS = (recall_document, copy_document)  # indexed like TASKS


@dataclass
class Batch:
    """``rows`` packed rows of ``seq`` tokens.

    tokens / targets / positions ``[rows, seq]`` int64 (positions count from 0 in each document); task
    ``[rows, seq]`` int64: the TASKS index of each position's target (-1 where the target is IGNORE);
    lengths: the document lengths of each row, in order (they sum to ``seq``); cumulative_lengths: int64 end
    offsets of every document in the flattened ``[rows * seq]`` order (TND's actual_seq_qlen);
    document_starts: bool ``[rows, seq]``, True at the first token of each document.
    """

    tokens: torch.Tensor
    targets: torch.Tensor
    task: torch.Tensor
    positions: torch.Tensor
    lengths: list[list[int]]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)

    def __post_init__(self):
        # the tensors a model reads are made here, outside any compiled region: a compiled model then takes
        # them as graph inputs and new documents do not recompile it
        self.cumulative_lengths = torch.from_numpy(np.cumsum([n for row in self.lengths for n in row]))
        self.document_starts = torch.zeros(self.shape, dtype=torch.bool)
        for r, row in enumerate(self.lengths):
            self.document_starts[r, np.cumsum([0, *row[:-1]])] = True

    @cached_property
    def causal_mask(self) -> torch.Tensor:
        """bool ``[rows, 1, seq, seq]``: True where query i may attend key j (same document, j <= i)."""
        doc = torch.cumsum(self.document_starts, 1)
        same = doc[:, :, None] == doc[:, None, :]
        return (same & torch.ones(self.shape[1], self.shape[1], dtype=torch.bool).tril())[:, None]


def _pack_row(rng: np.random.Generator, seq: int):
    """Whole documents of random tasks until the next does not fit, then one PAD document for the rest."""
    tokens, answers, task, lengths = [], [], [], []
    used = 0
    while True:
        kind = int(rng.integers(0, len(TASKS)))
        doc, ans = DOCUMENTS[kind](rng)
        if used + doc.size > seq:
            break
        tokens.append(doc), answers.append(ans), task.append(np.full(doc.size, kind)), lengths.append(doc.size)
        used += doc.size
    if used < seq:
        rest = seq - used
        tokens.append(np.full(rest, PAD)), answers.append(np.zeros(rest, bool)), task.append(np.full(rest, -1))
        lengths.append(rest)
    return np.concatenate(tokens), np.concatenate(answers), np.concatenate(task), lengths


def make_batch(seed: int, split: int, step: int, rows: int, seq: int) -> Batch:
    """Batch ``step`` of ``split`` (TRAIN or HELD_OUT): ``rows`` rows of ``seq`` tokens."""
    rng = np.random.default_rng([seed, split, step])
    packed = [_pack_row(rng, seq) for _ in range(rows)]
    tokens = np.stack([p[0] for p in packed])
    answers = np.stack([p[1] for p in packed])
    task = np.stack([p[2] for p in packed])
    lengths = [p[3] for p in packed]
    targets = np.full(tokens.shape, IGNORE)
    targets[:, :-1] = np.where(answers[:, 1:], tokens[:, 1:], IGNORE)
    task = np.where(targets != IGNORE, task, -1)
    positions = np.concatenate([np.arange(n) for row in lengths for n in row]).reshape(rows, seq)
    return Batch(torch.from_numpy(tokens), torch.from_numpy(targets), torch.from_numpy(task),
                 torch.from_numpy(positions), lengths)
