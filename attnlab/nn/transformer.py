"""Transformer blocks and the two model families.

``DecoderOnly`` (GPT / Llama-like) and ``EncoderDecoder`` (the 2017
Transformer) are built from one ``Block``: self-attention, optional
cross-attention, feed-forward, each a residual sublayer in pre-LN
(``x + f(norm(x))``) or the paper's post-LN (``norm(x + f(x))``) position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnlab.config import ModelConfig, effective_window
from attnlab.nn.attention import Attention
from attnlab.nn.kv_cache import (
  BlockCache,
  KVCache,
  PagedKVCache,
  RingKVCache,
  positions_after,
  with_cross,
)
from attnlab.nn.layers import Embedder, as_dtype, make_norm
from attnlab.nn.mlp import MLP
from attnlab.nn.partitioning import logical_constraint
from attnlab.nn.positions import LearnedPositions, sinusoidal_positions


def _dtypes(cfg: ModelConfig):
  return dict(dtype=as_dtype(cfg.dtype), param_dtype=as_dtype(cfg.param_dtype))


def _dropout(cfg: ModelConfig, rngs: nnx.Rngs):
  """``nnx.Dropout`` of ``cfg.dropout_rate``; with an RNG stream only where it drops:
  without dropout a block holds no RNG state, which ``nnx.remat`` would write back
  (``remat=True`` under ``jax.grad`` of ``nnx.merge``d parameters raised "Cannot mutate
  RngCount from a different trace level" until 2026-12-07). The stream is forked either
  way, as ``nnx.Dropout`` forks it: a model built from one seed (``nnx.Rngs(0)``, whose
  parameters and dropout draw from one stream) keeps the parameters it had."""
  if cfg.dropout_rate > 0:
    return nnx.Dropout(cfg.dropout_rate, rngs=rngs)
  if _has_stream(rngs, "dropout"):  # nnx.Rngs(params=0) has none (a KeyError until 2026-12-07)
    rngs["dropout"].fork()
  return nnx.Dropout(cfg.dropout_rate)


def _has_stream(rngs: nnx.Rngs, name: str) -> bool:
  """Whether ``rngs[name]`` draws: from its own stream, or else from the ``default`` one."""
  return name in rngs or "default" in rngs


def _check_build_args(who: str, cfg, rngs) -> None:
  """A ValueError naming what ``who`` cannot build from: a cfg that is not a ModelConfig,
  rngs that are not an nnx.Rngs, or rngs without a stream the model draws from (until
  2026-12-07 the model classes themselves raised an AttributeError on the first two and
  Flax a KeyError on the last)."""
  if not isinstance(cfg, ModelConfig):
    raise ValueError(f"{who} needs a ModelConfig, got {type(cfg).__name__}")
  if not isinstance(rngs, nnx.Rngs):  # an AttributeError inside Flax until 2026-12-06
    raise ValueError(f"rngs must be an nnx.Rngs (nnx.Rngs(0), or nnx.Rngs(params=0, "
                     f"dropout=1)), got {type(rngs).__name__}")
  rates = " and ".join(f"{name}={getattr(cfg, name)}" for name in ("dropout_rate",
                       "attention_dropout_rate") if getattr(cfg, name) > 0)
  for stream, user in (("params", "the parameters are"), ("dropout", rates and f"{rates}: the "
                                                           "masks are")):
    if user and not _has_stream(rngs, stream):
      raise ValueError(f"{user} drawn from a {stream!r} RNG stream, and rngs has none (its "
                       f"streams: {', '.join(rngs) or 'none'}): give one, nnx.Rngs(params=0, "
                       "dropout=1), or one seed for all, nnx.Rngs(0)")


def _norm(cfg: ModelConfig):
  return make_norm(cfg.norm, cfg.d_model, eps=cfg.norm_eps, **_dtypes(cfg))


def default_positions(tokens_BT):
  B, T = tokens_BT.shape
  return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


class Block(nnx.Module):
  """One transformer layer: self-attention, [cross-attention,] MLP."""

  def __init__(self, cfg: ModelConfig, *, causal: bool, cross: bool, rngs: nnx.Rngs):
    self.pre_norm = cfg.norm_position == "pre"
    attn_kw = dict(
        use_bias=cfg.has_bias("qkv"), o_bias=cfg.has_bias("o"),
        dropout_rate=cfg.attention_dropout_rate,
        implementation=cfg.attention_impl, rngs=rngs, **_dtypes(cfg),
    )
    dims = (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    self.input_layernorm = _norm(cfg)
    self.self_attn = Attention(
        *dims, causal=causal, window=effective_window(cfg),
        rope_theta=cfg.rope_theta if cfg.pos == "rope" else None,
        rope_pairing=cfg.rope_pairing, **attn_kw,
    )
    if cross:
      self.cross_attn_layernorm = _norm(cfg)
      self.cross_attn = Attention(*dims, **attn_kw)
    else:
      self.cross_attn_layernorm = nnx.data(None)
      self.cross_attn = nnx.data(None)
    self.post_attention_layernorm = _norm(cfg)
    self.mlp = MLP(cfg.d_model, cfg.d_ff, kind=cfg.mlp, use_bias=cfg.has_bias("mlp"), rngs=rngs,
                   **_dtypes(cfg))
    self.dropout = _dropout(cfg, rngs)

  def _residual(self, x_BTD, norm, sublayer):
    if self.pre_norm:
      return x_BTD + self.dropout(sublayer(norm(x_BTD)))
    return norm(x_BTD + self.dropout(sublayer(x_BTD)))

  def __call__(self, x_BTD, positions_BT, segment_ids_BT, context_BSD=None,
               context_segment_ids_BS=None, cache=None):
    """[B, T, D]; with a ``BlockCache`` ``cache``, ([B, T, D], updated cache)."""
    if cache is not None:
      return self._call_cached(x_BTD, positions_BT, segment_ids_BT, cache)
    x_BTD = self._residual(x_BTD, self.input_layernorm, lambda h: self.self_attn(
        h, positions_BT=positions_BT, segment_ids_BT=segment_ids_BT))
    if self.cross_attn is not None:
      x_BTD = self._residual(x_BTD, self.cross_attn_layernorm, lambda h: self.cross_attn(
          h, segment_ids_BT=segment_ids_BT, context_BSD=context_BSD,
          context_segment_ids_BS=context_segment_ids_BS))
    return self._residual(x_BTD, self.post_attention_layernorm, self.mlp)

  def _call_cached(self, x_BTD, positions_BT, segment_ids_BT, cache):
    new = {}

    def self_attn(h):
      out, new["self_attn"] = self.self_attn(h, positions_BT=positions_BT,
                                             segment_ids_BT=segment_ids_BT, cache=cache.self_attn)
      return out

    def cross_attn(h):
      out, new["cross_attn"] = self.cross_attn(h, cache=cache.cross_attn)
      return out

    x_BTD = self._residual(x_BTD, self.input_layernorm, self_attn)
    if self.cross_attn is not None:
      if cache.cross_attn is None:
        raise ValueError("a decoder block with cross-attention needs cache.cross_attn "
                         "(EncoderDecoder.cross_cache(src_BS))")
      x_BTD = self._residual(x_BTD, self.cross_attn_layernorm, cross_attn)
    x_BTD = self._residual(x_BTD, self.post_attention_layernorm, self.mlp)
    return x_BTD, cache.replace(**new)


class Stack(nnx.Module):
  """Input positions, ``num_layers`` blocks and (pre-LN) the final norm.

  Shared by the encoder (bidirectional), the decoder of an encoder-decoder
  (causal + cross-attention) and the decoder-only model (causal).
  """

  def __init__(self, cfg: ModelConfig, num_layers: int, *, causal: bool, cross: bool,
               rngs: nnx.Rngs):
    self.cfg = cfg
    self.learned_positions = (
        LearnedPositions(cfg.max_len, cfg.d_model, param_dtype=as_dtype(cfg.param_dtype),
                         rngs=rngs)
        if cfg.pos == "learned" else nnx.data(None)
    )
    self.embed_dropout = _dropout(cfg, rngs)
    self.layers = nnx.List(
        [Block(cfg, causal=causal, cross=cross, rngs=rngs) for _ in range(num_layers)]
    )
    self.norm = _norm(cfg) if cfg.norm_position == "pre" else nnx.data(None)

  def add_positions(self, x_BTD, positions_BT):
    length = x_BTD.shape[1]
    if length > self.cfg.max_len:
      # A learned table has max_len rows (a position past it would silently
      # read the last one); the bound holds for every kind of position.
      raise ValueError(f"a sequence of {length} tokens is longer than ModelConfig.max_len="
                       f"{self.cfg.max_len}: raise max_len or shorten the inputs")
    if self.cfg.pos == "sinusoidal":
      x_BTD = x_BTD + sinusoidal_positions(positions_BT, self.cfg.d_model).astype(x_BTD.dtype)
    elif self.cfg.pos == "learned":
      x_BTD = x_BTD + self.learned_positions(positions_BT).astype(x_BTD.dtype)
    return self.embed_dropout(x_BTD)

  def __call__(self, x_BTD, positions_BT, segment_ids_BT=None, context_BSD=None,
               context_segment_ids_BS=None, cache=None):
    """[B, T, D]; with ``cache`` (one ``BlockCache`` per layer), ([B, T, D], cache)."""
    _check_inputs(self.cfg, len(self.layers), x_BTD.shape[:2], positions_BT, segment_ids_BT,
                  cache)
    x_BTD = self.add_positions(x_BTD, positions_BT)
    if cache is not None:
      new_cache = []
      for block, block_cache in zip(self.layers, cache, strict=True):
        x_BTD, block_cache = block(x_BTD, positions_BT, segment_ids_BT, cache=block_cache)
        new_cache.append(block_cache)
      return (x_BTD if self.norm is None else self.norm(x_BTD)), tuple(new_cache)
    for block in self.layers:
      if self.cfg.remat:
        x_BTD = nnx.remat(lambda blk, *args: blk(*args))(
            block, x_BTD, positions_BT, segment_ids_BT, context_BSD, context_segment_ids_BS)
      else:
        x_BTD = block(x_BTD, positions_BT, segment_ids_BT, context_BSD, context_segment_ids_BS)
      x_BTD = logical_constraint(x_BTD, ("batch", "length", "embed"))
    return x_BTD if self.norm is None else self.norm(x_BTD)


def _check_ints(name, value, what="token ids", example="tokens", *,
                bools: bool = False) -> None:
  """An integer array of ``what`` (a list was an AttributeError, float ids an error from
  inside JAX, and bools were read as ids 0 / 1 until 2026-12-06; positions and segment ids
  the same until 2026-12-07: float positions turned RoPE and sinusoidal positions by
  fractions, float segment ids of a cached call counted as tokens). ``bools``: a bool array
  is taken too (a padding mask ``tokens != pad`` as segment ids: 1 / 0, as ``attention()``
  takes it)."""
  dtype = getattr(value, "dtype", None)
  if dtype is None:
    raise ValueError(f"{name} is a {type(value).__name__}; give an int array of {what} "
                     f"[B, T] (jnp.asarray({example}, jnp.int32))")
  if not (jnp.issubdtype(dtype, jnp.integer) or (bools and dtype == jnp.bool_)):
    raise ValueError(f"{name} has dtype {dtype}; give int {what} [B, T]")


def _check_positions_and_segments(**named) -> None:
  """``_check_ints`` on the positions and segment ids given (their shapes: ``_check_inputs``);
  segment ids may be bool (a padding mask)."""
  for name, value in named.items():
    if value is not None:
      segments = "positions" not in name
      _check_ints(name, value, "segment ids" if segments else "positions", name,
                  bools=segments)


def _check_tokens(name, tokens) -> None:
  """Integer token ids [B, T] (``_check_ints``)."""
  _check_ints(name, tokens)
  if jnp.ndim(tokens) != 2:
    raise ValueError(f"{name} has shape {tuple(jnp.shape(tokens))}; give int token ids [B, T] "
                     "(a batch of one: tokens[None])")


def _check_cache(cache, num_layers) -> None:
  """A ValueError unless ``cache`` is a model's cache: a tuple of ``num_layers`` ``BlockCache``
  holding self-attention caches, as ``init_cache`` makes it (a string, one layer's
  ``BlockCache`` or () were an AttributeError, a TypeError, an IndexError until 2026-12-07,
  as the positions read ``cache[0].self_attn``)."""
  made = ("a cache is what attnlab.nn.kv_cache.init_cache(cfg, kind, batch, max_len) returns, "
          "a tuple of BlockCache, one per layer")
  if not isinstance(cache, tuple | list):
    raise ValueError(f"cache is a {type(cache).__name__}; {made}")
  for i, block_cache in enumerate(cache):
    if not isinstance(block_cache, BlockCache):
      raise ValueError(f"cache[{i}] is a {type(block_cache).__name__}; {made}")
    if not isinstance(block_cache.self_attn, KVCache | RingKVCache | PagedKVCache):
      raise ValueError(f"cache[{i}].self_attn is a {type(block_cache.self_attn).__name__}; "
                       f"{made}")
  if len(cache) != num_layers:
    raise ValueError(f"the cache holds {len(cache)} layer caches and the stack has "
                     f"{num_layers} layers: make it for this model "
                     "(attnlab.nn.kv_cache.init_cache(model.cfg, ...))")


def _check_logits_at(logits_at_B, shape_BT):
  """``logits_at_B`` as an int array [B] (a list of ints is taken), or a ValueError; its
  indices in [0, T) where they are concrete (an eager call). Until 2026-12-07 an index past
  T gave NaN logits, -1 the last token's, floats were truncated, and another shape was an
  error from inside JAX."""
  B, T = shape_BT
  if getattr(logits_at_B, "dtype", None) is None:
    logits_at_B = jnp.asarray(logits_at_B)  # a list (of tracers, too)
  if not jnp.issubdtype(logits_at_B.dtype, jnp.integer):
    raise ValueError(f"logits_at_B has dtype {logits_at_B.dtype}; give int indices [B], one "
                     "token per row")
  if tuple(jnp.shape(logits_at_B)) != (B,):
    raise ValueError(f"logits_at_B has shape {tuple(jnp.shape(logits_at_B))}; give int "
                     f"indices [B] = ({B},), one token per row")
  if not isinstance(logits_at_B, jax.core.Tracer):
    at_B = np.asarray(logits_at_B)
    bad_B = (at_B < 0) | (at_B >= T)
    if bad_B.any():
      b = int(np.argmax(bad_B))
      raise ValueError(f"logits_at_B[{b}]={at_B[b]} is not an index of the {T} tokens: give "
                       f"0 <= logits_at_B < {T}")
  return logits_at_B


def _check_inputs(cfg, num_layers, shape_BT, positions_BT, segment_ids_BT, cache) -> None:
  """A ValueError naming the input that does not fit the tokens [B, T] and the stack: a
  cache of another number of layers, batch, KV heads or head dim, positions or segment ids
  of another shape, new tokens past a cache's room (``_check_room``). Shapes only (and, on
  concrete values, the room): until 2026-12-04 a cached call took segment ids of another
  width, advanced the cache past what it wrote and read unwritten slots as keys, and the
  other mismatches were errors from inside the ops."""
  B, T = shape_BT
  if cache is not None:
    _check_cache(cache, num_layers)
    first = cache[0].self_attn
    if first.lengths_B.shape[0] != B:
      raise ValueError(f"the cache holds {first.lengths_B.shape[0]} sequences and the tokens "
                       f"{B} rows: make the cache for this batch "
                       "(attnlab.nn.kv_cache.init_cache(cfg, kind, B, ...))")
    held, want = first.kv_heads_and_dim, (cfg.num_kv_heads, cfg.head_dim)
    if held != want:
      raise ValueError(f"the cache holds {held[0]} KV heads of dim {held[1]} and the model "
                       f"has {want[0]} of dim {want[1]}: make the cache for this model "
                       "(attnlab.nn.kv_cache.init_cache(model.cfg, ...))")
  # Positions may be one row for all, [1, T] (they broadcast).
  for name, value, shapes in (("positions_BT", positions_BT, {(B, T), (1, T)}),
                              ("segment_ids_BT", segment_ids_BT, {(B, T)})):
    if value is not None and tuple(jnp.shape(value)) not in shapes:
      raise ValueError(f"{name} has shape {tuple(jnp.shape(value))}; it must be the tokens' "
                       f"[B, T] = ({B}, {T})" + (" or [1, T]" if len(shapes) > 1 else "") +
                       (" (with a cache: 1 on the new tokens, 0 on right padding)"
                        if name == "segment_ids_BT" and cache is not None else ""))
  if cache is not None and not isinstance(cache[0].self_attn, RingKVCache):
    _check_room(cache[0].self_attn, T, segment_ids_BT)  # a ring wraps: it takes any length


def _check_room(self_cache, T, segment_ids_BT) -> None:
  """A ValueError where the new tokens do not fit a contiguous or paged cache: more than its
  capacity (a shape, where no segment ids say that some are right padding, which is not
  stored: ``generate_requests`` prefills prompts padded to their bucket, wider than a cache
  for the longest request), or, where the lengths and segment ids are concrete (an eager
  call), more than a row has left. Until 2026-12-07 the tokens past the capacity were
  dropped yet counted in the lengths, and the logits from the first of them on were wrong (a
  decode step with "auto" attention on a full cache, too). Under jit the lengths are
  tracers: only the shape is checked, and a decode loop pays nothing."""
  kind = "contiguous" if isinstance(self_cache, KVCache) else "paged"
  capacity = self_cache.capacity
  make = (f"make a cache for the whole sequence (attnlab.nn.kv_cache.init_cache(cfg, {kind!r}, "
          "B, max_len), max_len at least the prompt plus the tokens to generate)")
  if segment_ids_BT is None and capacity < T:
    raise ValueError(f"{T} new tokens are more than the {capacity} positions of the {kind} "
                     f"cache: {make}")
  if any(isinstance(x, jax.core.Tracer) for x in (self_cache.lengths_B, segment_ids_BT)):
    return
  lengths_B = np.asarray(self_cache.lengths_B)
  num_new_B = (np.full_like(lengths_B, T) if segment_ids_BT is None
               else np.sum(np.asarray(segment_ids_BT) != 0, axis=1))  # right padding: not stored
  over_B = lengths_B + num_new_B > capacity
  if over_B.any():
    b = int(np.argmax(over_B))
    raise ValueError(f"row {b} of the {kind} cache: {lengths_B[b]} tokens held + "
                     f"{num_new_B[b]} new are more than its {capacity} positions; {make}")


class DecoderOnly(nnx.Module):
  """A causal language model (GPT / Llama / Mistral-like)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    _check_build_args("DecoderOnly", cfg, rngs)
    if cfg.arch != "decoder_only":
      raise ValueError(f"DecoderOnly needs arch='decoder_only', got arch={cfg.arch!r}")
    self.cfg = cfg
    self.embedder = Embedder(cfg.vocab_size, cfg.d_model, tied=cfg.tie_embeddings,
                             scale_embeddings=cfg.scale_embeddings, rngs=rngs, **_dtypes(cfg))
    self.decoder = Stack(cfg, cfg.num_layers, causal=True, cross=False, rngs=rngs)

  def __call__(self, tokens_BT, *, positions_BT=None, segment_ids_BT=None, cache=None,
               logits_at_B=None):
    """Logits [B, T, V] (float32) for tokens [B, T].

    Args:
      tokens_BT: int token ids.
      positions_BT: positions for RoPE / sinusoidal / learned; default
        0..T-1 (packing passes positions that restart per document).
      segment_ids_BT: documents packed in a row attend only within their
        segment; 0 marks padding.
      cache: decoding: one ``BlockCache`` per layer (``attnlab.nn.kv_cache
        .init_cache``). The tokens continue each sequence at its cache
        length (positions default to lengths + 0..T-1); ``segment_ids_BT``
        then only marks right padding (0), which is not cached.
      logits_at_B: int [B]: only row b's logits at index ``logits_at_B[b]``
        are computed, [B, 1, V] (a prefill needs the last prompt token's:
        the output projection then costs D x V per row instead of T x D x V).

    Returns:
      logits [B, T, V], or (logits, updated cache) when ``cache`` is given.
    """
    _check_tokens("tokens_BT", tokens_BT)
    _check_positions_and_segments(positions_BT=positions_BT, segment_ids_BT=segment_ids_BT)
    if logits_at_B is not None:
      logits_at_B = _check_logits_at(logits_at_B, tokens_BT.shape)
    if cache is not None:  # before the positions read it
      _check_cache(cache, self.cfg.num_layers)
    if positions_BT is None:
      positions_BT = (default_positions(tokens_BT) if cache is None
                      else _cached_positions(tokens_BT, cache))
    x_BTD = self.embedder.encode(tokens_BT)
    if cache is not None:
      x_BTD, cache = self.decoder(x_BTD, positions_BT, segment_ids_BT, cache=cache)
      return self._logits(x_BTD, logits_at_B), cache
    x_BTD = self.decoder(x_BTD, positions_BT, segment_ids_BT)
    return self._logits(x_BTD, logits_at_B)

  def _logits(self, x_BTD, logits_at_B):
    if logits_at_B is not None:
      x_BTD = jnp.take_along_axis(x_BTD, jnp.asarray(logits_at_B, jnp.int32)[:, None, None],
                                  axis=1)
    return self.embedder.decode(x_BTD)


class EncoderDecoder(nnx.Module):
  """The 2017 Transformer: a bidirectional encoder, a causal decoder with
  cross-attention, one embedding shared by source, target and output (when
  ``tie_embeddings``)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    _check_build_args("EncoderDecoder", cfg, rngs)
    if cfg.arch != "encoder_decoder":
      raise ValueError(f"EncoderDecoder needs arch='encoder_decoder', got arch={cfg.arch!r}")
    self.cfg = cfg
    self.embedder = Embedder(cfg.vocab_size, cfg.d_model, tied=cfg.tie_embeddings,
                             scale_embeddings=cfg.scale_embeddings, rngs=rngs, **_dtypes(cfg))
    self.encoder = Stack(cfg, cfg.num_encoder_layers, causal=False, cross=False, rngs=rngs)
    self.decoder = Stack(cfg, cfg.num_layers, causal=True, cross=True, rngs=rngs)

  def source_segment_ids(self, src_BS):
    """1 for real source tokens, 0 for ``pad_id``: padding is masked."""
    _check_tokens("src_BS", src_BS)  # the first use of the source (a list was an AttributeError)
    return (src_BS != self.cfg.pad_id).astype(jnp.int32)

  def encode(self, src_BS, *, src_segment_ids_BS=None, src_positions_BS=None):
    """Encoder output [B, S, D]."""
    _check_tokens("src_BS", src_BS)
    _check_positions_and_segments(src_segment_ids_BS=src_segment_ids_BS,
                                  src_positions_BS=src_positions_BS)
    if src_segment_ids_BS is None:
      src_segment_ids_BS = self.source_segment_ids(src_BS)
    if src_positions_BS is None:
      src_positions_BS = default_positions(src_BS)
    x_BSD = self.embedder.encode(src_BS)
    return self.encoder(x_BSD, src_positions_BS, src_segment_ids_BS)

  def cross_cache(self, src_BS, *, src_segment_ids_BS=None, src_positions_BS=None):
    """Encode the source once; the cross-attention K/V of every decoder layer.

    Returns:
      tuple of ``CrossKVCache`` (for ``attnlab.nn.kv_cache.with_cross``).
    """
    if src_segment_ids_BS is None:
      src_segment_ids_BS = self.source_segment_ids(src_BS)
    encoded_BSD = self.encode(src_BS, src_segment_ids_BS=src_segment_ids_BS,
                              src_positions_BS=src_positions_BS)
    return tuple(block.cross_attn.cross_kv(encoded_BSD, src_segment_ids_BS)
                 for block in self.decoder.layers)

  def decode(self, tgt_in_BT, encoded_BSD, *, src_segment_ids_BS, tgt_positions_BT=None,
             tgt_segment_ids_BT=None, cache=None):
    """Logits [B, T, V] of the decoder given the encoder output.

    With ``cache`` (whose cross-attention K/V are filled, see ``cross_cache``)
    ``encoded_BSD`` and ``src_segment_ids_BS`` are unused and the result is
    (logits, updated cache).
    """
    _check_tokens("tgt_in_BT", tgt_in_BT)
    _check_positions_and_segments(tgt_positions_BT=tgt_positions_BT,
                                  tgt_segment_ids_BT=tgt_segment_ids_BT)
    if cache is not None:
      _check_cache(cache, self.cfg.num_layers)
      if tgt_positions_BT is None:
        tgt_positions_BT = _cached_positions(tgt_in_BT, cache)
      y_BTD = self.embedder.encode(tgt_in_BT)
      y_BTD, cache = self.decoder(y_BTD, tgt_positions_BT, tgt_segment_ids_BT, cache=cache)
      return self.embedder.decode(y_BTD), cache
    _check_positions_and_segments(src_segment_ids_BS=src_segment_ids_BS)
    if tgt_positions_BT is None:
      tgt_positions_BT = default_positions(tgt_in_BT)
    y_BTD = self.embedder.encode(tgt_in_BT)
    y_BTD = self.decoder(y_BTD, tgt_positions_BT, tgt_segment_ids_BT, encoded_BSD,
                         src_segment_ids_BS)
    return self.embedder.decode(y_BTD)

  def __call__(self, src_BS, tgt_in_BT, *, src_segment_ids_BS=None, tgt_segment_ids_BT=None,
               src_positions_BS=None, tgt_positions_BT=None, cache=None):
    """Logits [B, T, V] of the target given the source (teacher forcing).

    Source tokens equal to ``pad_id`` are masked in encoder self-attention and
    in cross-attention unless ``src_segment_ids_BS`` is given. With ``cache``
    (decoding), the source is encoded into the cross-attention K/V of layers
    whose ``cross_attn`` entry is still None, and the result is
    (logits, updated cache).
    """
    if cache is not None:
      _check_cache(cache, self.cfg.num_layers)
      if any(block_cache.cross_attn is None for block_cache in cache):
        cross = self.cross_cache(src_BS, src_segment_ids_BS=src_segment_ids_BS,
                                 src_positions_BS=src_positions_BS)
        # only the empty entries: a filled one is kept (until 2026-12-06 all were replaced)
        cache = with_cross(cache, tuple(c if blk.cross_attn is None else blk.cross_attn
                                        for blk, c in zip(cache, cross, strict=True)))
      return self.decode(tgt_in_BT, None, src_segment_ids_BS=None,
                         tgt_positions_BT=tgt_positions_BT, tgt_segment_ids_BT=tgt_segment_ids_BT,
                         cache=cache)
    if src_segment_ids_BS is None:
      src_segment_ids_BS = self.source_segment_ids(src_BS)
    encoded_BSD = self.encode(src_BS, src_segment_ids_BS=src_segment_ids_BS,
                              src_positions_BS=src_positions_BS)
    return self.decode(tgt_in_BT, encoded_BSD, src_segment_ids_BS=src_segment_ids_BS,
                       tgt_positions_BT=tgt_positions_BT, tgt_segment_ids_BT=tgt_segment_ids_BT)


def _cached_positions(tokens_BT, cache):
  """Positions [B, T] that continue each cached sequence."""
  return positions_after(cache[0].self_attn.lengths_B, tokens_BT.shape[1])


def build_model(cfg: ModelConfig, *, rngs: nnx.Rngs) -> DecoderOnly | EncoderDecoder:
  """The model ``cfg.arch`` names, with freshly initialized parameters."""
  _check_build_args("build_model", cfg, rngs)
  if cfg.arch == "decoder_only":
    return DecoderOnly(cfg, rngs=rngs)
  return EncoderDecoder(cfg, rngs=rngs)


def count_params(model: nnx.Module) -> int:
  """Number of parameter scalars (``nnx.Param`` leaves) in a model (or its ``nnx.State``)."""
  if not isinstance(model, nnx.Module | nnx.State):  # a config: an IndexError until 12-06
    raise ValueError(f"count_params needs a model (an nnx.Module: build_model(cfg, rngs=...)) "
                     f"or its nnx.State, got {type(model).__name__}")
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
