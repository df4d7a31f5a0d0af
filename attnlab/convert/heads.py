"""Multi-head to grouped / multi-query attention conversion (Ainslie et al., 2023).

A model with K0 key/value heads becomes one with K heads (K divides K0): the
K0 heads are cut into K contiguous groups of G' = K0 / K heads, matching the
attention op's grouping (query head n reads KV head n // G), so query head n
reads, after conversion, the merged head of the group its old KV head was in.

- ``mean``: each new ``k_proj`` / ``v_proj`` head (weight and bias) is the
  mean of its group (the paper's recipe);
- ``first``: each new head is the first head of its group;
- ``random``: the new K/V projections are freshly initialized.

Every other parameter is copied unchanged. Cross-attention K/V of an
encoder-decoder are converted the same way (they share ``num_kv_heads``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from attnlab.config import CONVERT_METHODS, is_integer
from attnlab.nn.transformer import DecoderOnly, EncoderDecoder, build_model

METHODS = CONVERT_METHODS
KV_PROJECTIONS = ("k_proj", "v_proj")


def check_conversion(source_kv_heads: int, num_kv_heads, method) -> None:
  """Raise ValueError (naming the field, value and what is allowed) unless a
  ``source_kv_heads``-head model can be converted to ``num_kv_heads`` heads."""
  if method not in METHODS:
    raise ValueError(f"method={method!r} is not one of {', '.join(map(repr, METHODS))}")
  if not is_integer(num_kv_heads) or num_kv_heads < 1:  # a NumPy int too (not a bool)
    raise ValueError(f"num_kv_heads={num_kv_heads!r} must be a positive integer")
  if num_kv_heads > source_kv_heads:
    raise ValueError(f"num_kv_heads={num_kv_heads} is larger than the source model's "
                     f"{source_kv_heads} KV heads: conversion only merges heads")
  if source_kv_heads % num_kv_heads:
    raise ValueError(f"num_kv_heads={num_kv_heads} must divide the source model's "
                     f"{source_kv_heads} KV heads")


def _merge(x, axis: int, groups: int, method: str):
  """Merge ``axis`` of ``x`` (K0 heads) into ``groups`` heads by ``method``."""
  k0 = x.shape[axis]
  grouped = x.reshape(*x.shape[:axis], groups, k0 // groups, *x.shape[axis + 1:])
  if method == "mean":
    return jnp.mean(grouped.astype(jnp.float32), axis=axis + 1).astype(x.dtype)
  return jnp.take(grouped, 0, axis=axis + 1)


def convert_heads(model, num_kv_heads: int, method: str, *, rngs: nnx.Rngs | None = None):
  """A copy of ``model`` with ``num_kv_heads`` key/value heads.

  Args:
    model: a ``DecoderOnly`` or ``EncoderDecoder`` (its ``cfg`` names K0).
    num_kv_heads: K, dividing K0 (K = K0 with "mean" or "first" is a copy).
    method: "mean" | "first" | "random".
    rngs: initializes the new model before the copy (so, with "random", the
      new K/V projections); default ``nnx.Rngs(params=0, dropout=1)``.

  Returns:
    The new model (built from ``model.cfg.replace(num_kv_heads=K)``), in the
    train / eval mode of a freshly built model.

  Raises:
    ValueError: ``model`` is not a model, K does not divide K0, K > K0, or an unknown
      method.
  """
  if not isinstance(model, DecoderOnly | EncoderDecoder):  # an AttributeError until 12-06
    raise ValueError(f"convert_heads needs a model (a DecoderOnly or EncoderDecoder: "
                     f"build_model(cfg, rngs=...) or load_checkpoint(workdir)), got "
                     f"{type(model).__name__}")
  cfg = model.cfg
  check_conversion(cfg.num_kv_heads, num_kv_heads, method)  # a ModelConfig resolves None to N
  num_kv_heads = int(num_kv_heads)
  new_cfg = cfg.replace(num_kv_heads=num_kv_heads)
  new_model = build_model(new_cfg, rngs=rngs if rngs is not None else nnx.Rngs(params=0,
                                                                                 dropout=1))
  old = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  new_state = nnx.state(new_model, nnx.Param)
  fresh = nnx.to_pure_dict(new_state)

  def convert(path, old_leaf, fresh_leaf):
    names = [k.key for k in path]  # a pure dict: every key is a DictKey
    is_kv = len(names) >= 2 and names[-2] in KV_PROJECTIONS
    if not is_kv:
      if old_leaf.shape != fresh_leaf.shape:
        raise AssertionError(f"{'/'.join(map(str, names))}: {old_leaf.shape} vs "
                             f"{fresh_leaf.shape}")
      return old_leaf
    if method == "random":
      return fresh_leaf
    # weight w [D, K, H], bias b [K, H]: the head axis is 1 or 0.
    axis = 1 if names[-1] == "w" else 0
    return _merge(jnp.asarray(old_leaf), axis, num_kv_heads, method)

  converted = jax.tree_util.tree_map_with_path(convert, old, fresh)
  nnx.replace_by_pure_dict(new_state, converted)
  nnx.update(new_model, new_state)
  return new_model
