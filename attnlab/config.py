"""Frozen, validated configuration dataclasses.

Every field is checked once in ``__post_init__``; a bad value raises a
``ValueError`` that names the field, the value and what is allowed. Modules
receive these typed values, never gin.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ARCHS = ("decoder_only", "encoder_decoder")
POSITIONS = ("rope", "sinusoidal", "learned", "none")
ROPE_PAIRINGS = ("half", "adjacent")
NORMS = ("rmsnorm", "layernorm")
NORM_POSITIONS = ("pre", "post")
MLPS = ("relu", "gelu", "swiglu")
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_IMPLS = ("auto", "reference", "chunked", "xla", "cudnn", "pallas")


def _choice(name: str, value, allowed: tuple) -> None:
  if value not in allowed:
    raise ValueError(f"{name}={value!r} is not one of {', '.join(map(repr, allowed))}")


def _positive(name: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{name}={value!r} must be a positive integer")


def _fraction(name: str, value) -> None:
  if not 0.0 <= value < 1.0:
    raise ValueError(f"{name}={value!r} must be in [0, 1)")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Architecture of a transformer: everything needed to build it.

  Attributes:
    arch: "decoder_only" (GPT / Llama-like) or "encoder_decoder" (the 2017
      Transformer).
    vocab_size: V, shared by source and target.
    d_model: D, the residual width.
    num_layers: L, decoder layers (and encoder layers unless
      ``num_encoder_layers`` is set).
    num_encoder_layers: encoder depth of an encoder-decoder; None = num_layers.
    num_heads: N query heads.
    num_kv_heads: K key/value heads; None = num_heads (MHA), 1 = MQA, else GQA.
      Must divide num_heads.
    head_dim: H; None = d_model // num_heads.
    d_ff: F, the hidden width of the feed-forward block.
    pos: "rope" | "sinusoidal" | "learned" | "none".
    rope_theta: RoPE base frequency.
    rope_pairing: "half" (rotate-half, the Llama layout) or "adjacent"
      (pairs (2i, 2i+1), the RoFormer paper's layout).
    window: sliding window of that many keys (the query's own included) for
      self-attention; None = full attention.
    norm: "rmsnorm" or "layernorm".
    norm_position: "pre" (x + f(norm(x))) or "post" (norm(x + f(x)), the
      2017 paper).
    norm_eps: epsilon of the norm layers.
    mlp: "relu" (the paper), "gelu" or "swiglu".
    use_bias: biases on the attention and MLP projections.
    tie_embeddings: output logits use the transposed input embedding.
    scale_embeddings: multiply embeddings by sqrt(d_model) (the paper).
    dropout_rate: residual / embedding dropout (the paper: 0.1).
    attention_dropout_rate: dropout on the attention probabilities (only with
      the "reference" implementation).
    max_len: longest sequence the positions support (the size of the learned
      table; a bound on sinusoidal / RoPE positions is not needed but checked).
    dtype: compute dtype of activations; parameters are ``param_dtype``.
    param_dtype: storage dtype of the parameters.
    attention_impl: "auto" | "reference" | "chunked" | "xla" | "cudnn" |
      "pallas". "auto" picks the best for the backend and the length.
    pad_id: the padding token; encoder inputs equal to it are masked.
    remat: rematerialize each block in the backward pass (less memory).
  """

  arch: str = "decoder_only"
  vocab_size: int = 259
  d_model: int = 256
  num_layers: int = 4
  num_encoder_layers: int | None = None
  num_heads: int = 8
  num_kv_heads: int | None = None
  head_dim: int | None = None
  d_ff: int = 1024
  pos: str = "rope"
  rope_theta: float = 10000.0
  rope_pairing: str = "half"
  window: int | None = None
  norm: str = "rmsnorm"
  norm_position: str = "pre"
  norm_eps: float = 1e-6
  mlp: str = "swiglu"
  use_bias: bool = False
  tie_embeddings: bool = True
  scale_embeddings: bool = False
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  max_len: int = 2048
  dtype: str = "float32"
  param_dtype: str = "float32"
  attention_impl: str = "auto"
  pad_id: int = 0
  remat: bool = False

  def __post_init__(self):
    _choice("arch", self.arch, ARCHS)
    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "max_len"):
      _positive(name, getattr(self, name))
    for name in ("num_encoder_layers", "num_kv_heads", "head_dim"):
      if getattr(self, name) is not None:
        _positive(name, getattr(self, name))
    if self.num_heads % self.kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.kv_heads}"
      )
    if self.head_dim is None and self.d_model % self.num_heads:
      raise ValueError(
          f"d_model={self.d_model} must be divisible by num_heads={self.num_heads} "
          "when head_dim is not given"
      )
    _choice("pos", self.pos, POSITIONS)
    _choice("rope_pairing", self.rope_pairing, ROPE_PAIRINGS)
    if self.pos == "rope" and self.dim_per_head % 2:
      raise ValueError(f"head_dim={self.dim_per_head} must be even with pos='rope'")
    if self.pos == "sinusoidal" and self.d_model % 2:
      raise ValueError(f"d_model={self.d_model} must be even with pos='sinusoidal'")
    if self.rope_theta <= 0:
      raise ValueError(f"rope_theta={self.rope_theta!r} must be positive")
    if self.window is not None:
      _positive("window", self.window)
    _choice("norm", self.norm, NORMS)
    _choice("norm_position", self.norm_position, NORM_POSITIONS)
    if self.norm_eps <= 0:
      raise ValueError(f"norm_eps={self.norm_eps!r} must be positive")
    _choice("mlp", self.mlp, MLPS)
    _fraction("dropout_rate", self.dropout_rate)
    _fraction("attention_dropout_rate", self.attention_dropout_rate)
    _choice("dtype", self.dtype, DTYPES)
    _choice("param_dtype", self.param_dtype, DTYPES)
    _choice("attention_impl", self.attention_impl, ATTENTION_IMPLS)
    if self.attention_dropout_rate > 0 and self.attention_impl not in ("reference", "auto"):
      raise ValueError(
          f"attention_dropout_rate={self.attention_dropout_rate} needs "
          f"attention_impl='reference', got attention_impl={self.attention_impl!r}"
      )
    if not 0 <= self.pad_id < self.vocab_size:
      raise ValueError(f"pad_id={self.pad_id} must be in [0, vocab_size={self.vocab_size})")
    if self.arch == "decoder_only" and self.num_encoder_layers is not None:
      raise ValueError(
          f"num_encoder_layers={self.num_encoder_layers} is only allowed with "
          "arch='encoder_decoder'"
      )

  @property
  def kv_heads(self) -> int:
    """K, the number of key/value heads."""
    return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

  @property
  def dim_per_head(self) -> int:
    """H, the head dimension."""
    return self.d_model // self.num_heads if self.head_dim is None else self.head_dim

  @property
  def encoder_layers(self) -> int:
    return self.num_layers if self.num_encoder_layers is None else self.num_encoder_layers

  def kv_cache_bytes_per_token(self, dtype: str | None = None) -> int:
    """Bytes of K and V cached per token over all decoder layers (self-attention)."""
    import numpy as np

    itemsize = np.dtype(_numpy_dtype(dtype or self.dtype)).itemsize
    return 2 * self.num_layers * self.kv_heads * self.dim_per_head * itemsize

  def replace(self, **changes) -> ModelConfig:
    return dataclasses.replace(self, **changes)


def _numpy_dtype(name: str):
  import jax.numpy as jnp

  return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]
