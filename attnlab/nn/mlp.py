"""The position-wise feed-forward block: relu (the paper), gelu, swiglu."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from attnlab.nn.layers import Einsum


class MLP(nnx.Module):
  """``down(act(up(x)))``, or ``down(silu(gate(x)) * up(x))`` for SwiGLU.

  Args:
    d_model, d_ff: D and F.
    kind: "relu" | "gelu" | "swiglu".
    use_bias: biases on the projections (the paper's FFN has them).
  """

  def __init__(self, d_model: int, d_ff: int, *, kind: str = "swiglu", use_bias: bool = False,
               dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    if kind not in ("relu", "gelu", "swiglu"):
      raise ValueError(f"mlp kind={kind!r} is not one of 'relu', 'gelu', 'swiglu'")
    self.kind = kind
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    bias = (1,) if use_bias else None
    # Activations are flattened to rows [R = B*T, D]: on XLA:CPU the 2-D matmuls avoid
    # a strided transpose that the 3-D einsum produced.
    self.up_proj = Einsum("RD,DF->RF", (d_model, d_ff), ("embed", "mlp"), in_axes=(0,),
                          bias_dims=bias, **kw)
    self.gate_proj = (
        Einsum("RD,DF->RF", (d_model, d_ff), ("embed", "mlp"), in_axes=(0,), bias_dims=bias,
               **kw)
        if kind == "swiglu" else nnx.data(None)
    )
    self.down_proj = Einsum("RF,FD->RD", (d_ff, d_model), ("mlp", "embed"), in_axes=(0,),
                            bias_dims=bias, **kw)

  def __call__(self, x_BTD):
    B, T, D = x_BTD.shape
    x_RD = x_BTD.reshape(B * T, D)
    if self.kind == "swiglu":
      h_RF = jax.nn.silu(self.gate_proj(x_RD)) * self.up_proj(x_RD)
    elif self.kind == "gelu":
      h_RF = jax.nn.gelu(self.up_proj(x_RD))
    else:
      h_RF = jax.nn.relu(self.up_proj(x_RD))
    return self.down_proj(h_RF).reshape(B, T, D)
