"""Embeddings, norms and the einsum projection every layer is built from.

Parameters carry their logical axes as metadata (``axes=("embed", "mlp")``);
training/sharding.py maps logical axes to mesh axes. Layers never name a mesh.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from attnlab.config import DTYPES
from attnlab.nn.partitioning import logical_constraint


def as_dtype(name_or_dtype):
  """A dtype name of ``config.DTYPES`` as a jnp dtype; a dtype passes through."""
  if isinstance(name_or_dtype, str):
    if name_or_dtype not in DTYPES:
      raise ValueError(f"dtype={name_or_dtype!r} is not one of {', '.join(map(repr, DTYPES))}")
    return jnp.dtype(name_or_dtype)
  return name_or_dtype


def fan_in_init(in_axes: tuple[int, ...], scale: float = 1.0):
  """Truncated-normal init with variance ``scale / fan_in`` over ``in_axes``."""

  def init(key, shape, dtype):
    fan_in = math.prod(shape[a] for a in in_axes)
    std = math.sqrt(scale / fan_in) / 0.87962566103423978  # truncation at +-2 std
    return std * jax.random.truncated_normal(key, -2.0, 2.0, shape, dtype)

  return init


def param(rngs: nnx.Rngs, shape, axes, init, dtype) -> nnx.Param:
  """A parameter tagged with its logical axes, drawn in float32 and stored in ``dtype``: one
  seed gives one model in every ``param_dtype``, rounded (until 2026-12-04 the draws were
  made in ``dtype``, and bfloat16 parameters were another random model)."""
  if len(axes) != len(shape):
    raise ValueError(f"axes {axes} must name every dimension of shape {shape}")
  return nnx.Param(init(rngs.params(), shape, jnp.float32).astype(dtype), axes=tuple(axes))


def weight_einsum(equation: str, x, w):
  """``jnp.einsum(equation, x, w)`` with the contraction in ``w``'s dimension order.

  ``jnp.einsum`` may list the contracted dimensions in another order than the
  weight stores them (``"BTNH,NHD->BTD"`` contracts (H, N)); XLA then
  transposes the weight into that order, a copy of the whole weight on every
  call, which a decode loop pays on every step. Here the contracted (and
  batch) dimensions follow ``w``'s order, so a weight is read as stored.
  """
  ins, _, out = equation.replace(" ", "").partition("->")
  xs, _, ws = ins.partition(",")
  if ("->" not in equation or not xs or not ws or "," in ws or len(set(xs)) != len(xs)
      or len(set(ws)) != len(ws) or len(set(out)) != len(out) or not set(out) <= set(xs + ws)):
    raise ValueError("weight_einsum takes an explicit two-operand einsum 'x,w->out' with each "
                     f"letter once per operand, got {equation!r}")
  batch = [c for c in ws if c in xs and c in out]
  contract = [c for c in ws if c in xs and c not in out]
  summed = [c for c in xs + ws if c not in out and c not in contract]
  if summed:
    raise ValueError(f"weight_einsum: {equation!r} sums {''.join(summed)} over one operand only")
  y = jax.lax.dot_general(
      x, w, (([xs.index(c) for c in contract], [ws.index(c) for c in contract]),
             ([xs.index(c) for c in batch], [ws.index(c) for c in batch])))
  got = batch + [c for c in xs if c not in ws] + [c for c in ws if c not in xs]
  if got != list(out):
    y = jnp.transpose(y, [got.index(c) for c in out])
  return y


class Einsum(nnx.Module):
  """A projection written as an einsum, e.g. ``"BTD,DNH->BTNH"`` with w [D, N, H].

  Args:
    equation: the einsum; the second operand is the weight.
    shape: the weight shape.
    axes: logical axis names of the weight, one per dimension.
    in_axes: weight dimensions that are contracted (for the init's fan-in).
    bias_axes: weight dimensions (indices) that a bias spans, or None.
  """

  def __init__(self, equation: str, shape, axes, *, in_axes, bias_dims=None, init_scale=1.0,
               dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    self.equation = equation
    self.dtype = dtype
    self.w = param(rngs, shape, axes, fan_in_init(in_axes, init_scale), param_dtype)
    if bias_dims is None:
      self.b = nnx.data(None)
    else:
      bshape = tuple(shape[d] for d in bias_dims)
      self.b = nnx.Param(jnp.zeros(bshape, param_dtype), axes=tuple(axes[d] for d in bias_dims))

  def __call__(self, x):
    y = weight_einsum(self.equation, x.astype(self.dtype), self.w[...].astype(self.dtype))
    if self.b is not None:
      y = y + self.b[...].astype(self.dtype)
    return y


class RMSNorm(nnx.Module):
  """Root-mean-square norm (no centering, no bias), computed in float32."""

  def __init__(self, dim: int, *, eps: float = 1e-6, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
    del rngs
    self.eps = eps
    self.dtype = dtype
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), axes=("embed",))

  def __call__(self, x_BTD):
    x = x_BTD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
    return (x * self.scale[...].astype(jnp.float32)).astype(self.dtype)


class LayerNorm(nnx.Module):
  """Layer norm with scale and bias (the 2017 paper), computed in float32."""

  def __init__(self, dim: int, *, eps: float = 1e-6, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
    del rngs
    self.eps = eps
    self.dtype = dtype
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), axes=("embed",))
    self.bias = nnx.Param(jnp.zeros((dim,), param_dtype), axes=("embed",))

  def __call__(self, x_BTD):
    x = x_BTD.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    x = (x - mean) * jax.lax.rsqrt(var + self.eps)
    y = x * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
    return y.astype(self.dtype)


_NORMS = {"rmsnorm": RMSNorm, "layernorm": LayerNorm}


def make_norm(kind: str, dim: int, *, eps: float, dtype, param_dtype):
  """The norm layer ``kind`` ("rmsnorm" | "layernorm") over the last dimension of size dim."""
  if kind not in _NORMS:
    raise ValueError(f"norm={kind!r} is not one of {', '.join(map(repr, _NORMS))}")
  return _NORMS[kind](dim, eps=eps, dtype=dtype, param_dtype=param_dtype)


class Embedder(nnx.Module):
  """Token embedding ``embed_tokens`` [V, D] and the output projection.

  Args:
    vocab_size, d_model: V and D.
    tied: logits use ``embed_tokens`` transposed; otherwise a separate
      ``lm_head`` [D, V].
    scale_embeddings: multiply embeddings by sqrt(D) (the 2017 paper, which
      ties the weights and so initializes them at std D^-1/2).
  """

  def __init__(self, vocab_size: int, d_model: int, *, tied: bool = True,
               scale_embeddings: bool = False, dtype=jnp.float32, param_dtype=jnp.float32,
               rngs: nnx.Rngs):
    self.tied = tied
    self.scale = math.sqrt(d_model) if scale_embeddings else 1.0
    self.dtype = dtype
    std = d_model**-0.5
    self.embed_tokens = param(
        rngs, (vocab_size, d_model), ("vocab", "embed"),
        lambda k, s, d: std * jax.random.normal(k, s, d), param_dtype,
    )
    if tied:
      self.lm_head = nnx.data(None)
    else:
      self.lm_head = param(rngs, (d_model, vocab_size), ("embed", "vocab"), fan_in_init((0,)),
                           param_dtype)

  def encode(self, tokens_BT):
    # A gather cannot move rows of a table whose embed dimension is sharded
    # (fsdp) to batch-sharded outputs: the partitioner would replicate the
    # output and split it again. Gather from the whole rows (the all-gather
    # FSDP does for every weight anyway) into batch-sharded activations.
    w_VD = logical_constraint(self.embed_tokens[...], ("vocab", None))
    x_BTD = jnp.take(w_VD, tokens_BT, axis=0).astype(self.dtype)
    x_BTD = logical_constraint(x_BTD, ("batch", "length", "embed"))
    return x_BTD * self.scale if self.scale != 1.0 else x_BTD

  def decode(self, x_BTD):
    """Logits [B, T, V] in float32."""
    if self.tied:
      w_VD = self.embed_tokens[...].astype(self.dtype)
      logits_BTV = jnp.einsum("BTD,VD->BTV", x_BTD, w_VD, preferred_element_type=jnp.float32)
    else:
      w_DV = self.lm_head[...].astype(self.dtype)
      logits_BTV = jnp.einsum("BTD,DV->BTV", x_BTD, w_DV, preferred_element_type=jnp.float32)
    return logical_constraint(logits_BTV, ("batch", "length", "vocab"))
