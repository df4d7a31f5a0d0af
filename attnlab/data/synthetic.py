"""Synthetic seq2seq tasks for the encoder-decoder: copy, reverse, sort, add.

Example ``i`` of a split is a pure function of (seed, split, i), so any batch
can be rebuilt from its index alone (that index is the iterator's state).
"""

from __future__ import annotations

import string

import numpy as np

SPLITS = {"train": 0, "validation": 1}


def make_example(task: str, rng: np.random.Generator, *, min_len: int, max_len: int,
                 vocab_chars: int) -> tuple[str, str]:
  """One (source, target) pair of text."""
  if task == "add":
    # Operands of 1..max_len//2 digits: "123+45" -> "168".
    top = max(1, max_len // 2)
    a, b = (int(rng.integers(0, 10 ** int(rng.integers(1, top + 1)))) for _ in range(2))
    return f"{a}+{b}", str(a + b)
  alphabet = string.ascii_lowercase[:vocab_chars]
  n = int(rng.integers(min_len, max_len + 1))
  src = "".join(alphabet[i] for i in rng.integers(0, vocab_chars, n))
  if task == "copy":
    return src, src
  if task == "reverse":
    return src, src[::-1]
  if task == "sort":
    return src, "".join(sorted(src))
  raise ValueError(f"task={task!r} is not one of 'copy', 'reverse', 'sort', 'add'")


class SyntheticPairs:
  """An endless, indexable source of (source, target) text pairs."""

  def __init__(self, task: str, *, seed: int, split: str, min_len: int, max_len: int,
               vocab_chars: int):
    self.task, self.seed, self.split_id = task, seed, SPLITS[split]
    self.kw = dict(min_len=min_len, max_len=max_len, vocab_chars=vocab_chars)
    self.size = None  # endless

  def __getitem__(self, i: int) -> tuple[str, str]:
    rng = np.random.default_rng([self.seed, self.split_id, int(i)])
    return make_example(self.task, rng, **self.kw)

  def longest(self) -> tuple[int, int]:
    """Upper bounds on source / target characters."""
    if self.task == "add":
      top = max(1, self.kw["max_len"] // 2)
      return 2 * top + 1, top + 1
    return self.kw["max_len"], self.kw["max_len"]
