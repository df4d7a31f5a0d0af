"""Logical sharding of activations: layers name axes, the trainer maps them to a mesh.

A layer declares what its output's dimensions are,

    x_BTD = logical_constraint(x_BTD, ("batch", "length", "embed"))

and never names a mesh axis. Outside ``activation_sharding(...)`` the call
returns ``x`` unchanged (a model on one device, decoding, tests). Inside it
(the training steps enter it while they are traced) it becomes
``jax.lax.with_sharding_constraint(x, resolve(axes, x.shape))``, where
``resolve`` is the trainer's rules table (``training.sharding``). Declaring the
activations' layout where they are produced keeps the SPMD partitioner from
guessing one from the parameters (an ``embed`` dimension sharded like
``embed_tokens``) that it can only leave by replicating the tensor.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

_RESOLVE = contextvars.ContextVar("attnlab_activation_sharding", default=None)


@contextlib.contextmanager
def activation_sharding(resolve):
  """Within the block, ``logical_constraint`` shards by ``resolve(axes, shape)``.

  Args:
    resolve: ``(logical axes, shape) -> jax.sharding.Sharding``.
  """
  token = _RESOLVE.set(resolve)
  try:
    yield
  finally:
    _RESOLVE.reset(token)


def logical_constraint(x, axes: tuple[str | None, ...]):
  """``x`` constrained to the sharding of its logical ``axes`` (one per dimension).

  A no-op outside ``activation_sharding``.
  """
  resolve = _RESOLVE.get()
  if resolve is None:
    return x
  if len(axes) != x.ndim:
    raise ValueError(f"axes {axes} must name every dimension of shape {x.shape}")
  return jax.lax.with_sharding_constraint(x, resolve(tuple(axes), x.shape))
