"""Random test inputs drawn with NumPy, placed as jax arrays.

A ``jax.random`` draw is a compiled program, one per new shape and dtype: on a 2-core
CPU box ~0.2-0.3 s of tracing and compiling each, paid again by every parametrized shape
(hundreds of them in the suite). NumPy's generator compiles nothing, and ``jax.device_put``
places its result without a program (``jnp.asarray`` of a NumPy array compiles one per shape,
a copy named ``stage``, in jax 0.10).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def rng(seed_or_rng) -> np.random.Generator:
  """A generator: ``seed_or_rng`` itself, or a new one seeded with it."""
  if isinstance(seed_or_rng, np.random.Generator):
    return seed_or_rng
  return np.random.default_rng(seed_or_rng)


def normal(seed_or_rng, shape, dtype=jnp.float32):
  """Standard-normal float32 values of ``shape``, cast to ``dtype``. Given a generator,
  successive calls draw successive arrays from its stream."""
  x = rng(seed_or_rng).standard_normal(shape, np.float32)
  return jax.device_put(x.astype(dtype))


def randint(seed_or_rng, shape, low, high):
  """int32 values in [low, high)."""
  return jax.device_put(rng(seed_or_rng).integers(low, high, shape, dtype=np.int32))
