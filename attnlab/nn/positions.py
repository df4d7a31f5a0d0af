"""Position information: the 2017 sinusoidal table, RoPE, learned positions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from attnlab.nn.layers import param
from attnlab.nn.partitioning import logical_constraint


def sinusoidal_positions(positions_BT, d_model: int, *, max_timescale: float = 10000.0):
  """The 2017 paper's table at the given positions: [B, T, D] float32.

  PE[pos, 2i] = sin(pos / max_timescale^(2i / D)) and
  PE[pos, 2i + 1] = cos(pos / max_timescale^(2i / D)) (interleaved, exactly
  as the paper writes it).
  """
  if d_model % 2:
    raise ValueError(f"d_model={d_model} must be even for sinusoidal positions")
  two_i = jnp.arange(0, d_model, 2, dtype=jnp.float32)
  inv_freq = max_timescale ** (-two_i / d_model)
  angle_BTI = positions_BT.astype(jnp.float32)[..., None] * inv_freq
  pe = jnp.stack([jnp.sin(angle_BTI), jnp.cos(angle_BTI)], axis=-1)
  return pe.reshape(*positions_BT.shape, d_model)


def rope_frequencies(head_dim: int, theta: float):
  """Inverse frequencies theta^(-2i/H), i < H/2, float32."""
  return theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)


def apply_rope(x_BTNH, positions_BT, *, theta: float = 10000.0, pairing: str = "half"):
  """Rotary position embedding: rotates pairs of features by position * freq.

  Args:
    x_BTNH: queries or keys [B, T, N, H]; H even.
    positions_BT: int positions [B, T].
    theta: base frequency.
    pairing: "half" rotates (x_i, x_{i+H/2}) (Llama / GPT-NeoX layout);
      "adjacent" rotates (x_{2i}, x_{2i+1}) (the RoFormer paper).

  Returns:
    [B, T, N, H] in the dtype of ``x_BTNH``; computed in float32.
  """
  H = x_BTNH.shape[-1]
  if H % 2:
    raise ValueError(f"head_dim={H} must be even for RoPE")
  angle_BTI = positions_BT.astype(jnp.float32)[..., None] * rope_frequencies(H, theta)
  cos = jnp.cos(angle_BTI)[:, :, None, :]
  sin = jnp.sin(angle_BTI)[:, :, None, :]
  x = x_BTNH.astype(jnp.float32)
  if pairing == "half":
    x1, x2 = x[..., : H // 2], x[..., H // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  elif pairing == "adjacent":
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)
  else:
    raise ValueError(f"pairing={pairing!r} is not one of 'half', 'adjacent'")
  return out.astype(x_BTNH.dtype)


class LearnedPositions(nnx.Module):
  """A learned table ``embed_positions`` [max_len, D] added to the embeddings."""

  def __init__(self, max_len: int, d_model: int, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
    self.max_len = max_len
    self.embed_positions = param(
        rngs, (max_len, d_model), (None, "embed"),
        lambda k, s, d: 0.02 * jax.random.normal(k, s, d), param_dtype,
    )

  def __call__(self, positions_BT):
    # Clipped, not NaN-filled: the models refuse inputs longer than max_len, and
    # a padded or idle row (a free serving slot) past the table must stay finite,
    # since a NaN key or value written where a 0 probability reads it still
    # poisons the sum (0 * NaN).
    # As the token embedding: gather from whole rows into batch-sharded activations (a
    # table whose embed dimension is split over fsdp made the partitioner replicate the
    # output and split it again, "[SPMD] Involuntary full rematerialization" on a (2, 2, 2)
    # mesh, until 2026-12-06).
    table = logical_constraint(self.embed_positions[...], (None, None))
    x_BTD = jnp.take(table, positions_BT, axis=0, mode="clip")
    return logical_constraint(x_BTD, ("batch", "length", "embed"))
