"""The demos' data: the documentation text that ships with Python, as character windows."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Text:
  """`pydoc_data.topics` (about 465k characters, 103 symbols) as character tokens; the
  first 90% for training, the rest held out."""

  tokens: np.ndarray
  vocab: int
  split: int

  @classmethod
  def load(cls) -> Text:
    from pydoc_data.topics import topics  # ships with CPython: no download

    text = "".join(topics[key] for key in sorted(topics))
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    tokens = np.fromiter((index[c] for c in text), np.int32, len(text))
    return cls(tokens, len(chars), int(len(tokens) * 0.9))

  def windows(self, starts: np.ndarray, length: int) -> jax.Array:
    """The `length` tokens from each start: an int32 array of shape `starts.shape + (length,)`."""
    return jnp.asarray(self.tokens[starts[..., None] + np.arange(length)])

  def train_starts(self, seed: int, steps: int, batch: int, length: int) -> np.ndarray:
    """Random window starts in the training part, `(steps, batch)`, the same for every run."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, self.split - length, size=(steps, batch))

  def eval_starts(self, seed: int, size: int, length: int) -> np.ndarray:
    """Random window starts in the held-out part."""
    rng = np.random.default_rng(seed + 1)
    return rng.integers(self.split, len(self.tokens) - length, size=size)
