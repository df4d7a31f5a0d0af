"""Key/value caches: the decoding state of the attention layer.

Contiguous, ring (sliding window) and paged self-attention caches, and the
cross-attention K/V of an encoder-decoder. Every cache is a typed pytree
(``flax.struct.dataclass``) that lives inside ``jit`` and ``lax.while_loop``.

The attention layer calls one method, ``attend``: given the queries and the
K/V of ``T`` new tokens (of which the first ``num_new_B[b]`` are real, the
rest right padding), the cache stores the new K/V and returns the attention
output with the updated cache. How the keys are read is the cache's
business: ``append`` returns the keys/values the new queries may see with
their positions, which go to ``attnlab.attention`` as ``kv_positions``, so
causality and sliding windows come from the same mask predicate as
training (a negative position marks an empty slot). A decode step (one
new causal query per sequence) of the contiguous and ring caches takes its
own path with ``implementation="auto"`` (the default): ``attnlab.ops.decode``
attends over the buffer as it is plus the new token, then the token is
written in place (no copy of the buffer). With ``implementation="pallas"``,
a decode step hands the buffer to a Pallas decode kernel that reads it in
place, int8 included: the heads-major kernel for the contiguous and ring
caches, the paged kernel for the pages. ``attnlab.ops.dispatch.cache_implementation``
picks the path for everything else.

A prefill into empty caches (``as_empty``: ``generate`` and
``generate_requests`` use it) does not go through ``attend``: the layer
attends over the prompt alone, as its uncached forward pass does, and hands
the new K/V to ``store``, which writes them without reading the buffers.

All caches track per-sequence lengths ``lengths_B``: sequence b's next token
sits at position ``lengths_B[b]``. Prompts are therefore right-padded and
every sequence starts at position 0, exactly as if it were decoded alone.

  * ``KVCache``: one contiguous buffer per layer, ``[B, K, S, H]``. Simplest
    and fastest while B x S fits in memory. Heads-major because writing one
    token per sequence into ``[B, S, K, H]`` made XLA:CPU copy the buffer on
    every step (1.3x slower at B=8, measured by tools/bench_decode.py).
  * ``RingKVCache``: ``[B, K, W, H]`` for sliding-window models: memory
    O(window), not O(sequence). Slot ``p % W`` holds position p; the slot
    positions are stored so RoPE and the window mask stay right after
    wrap-around.
  * ``PagedKVCache``: pages ``[P, C, K, H]`` shared by all sequences, a page
    table ``[B, M]`` (page id of the m-th page of sequence b, -1 = none) and
    ``lengths_B``: the layout of ``attnlab.ops.pallas.decode.paged_decode_attention``.
    Pages come from a ``attnlab.decoding.paging.PageAllocator`` free list as
    a sequence grows and go back when it finishes.
  * ``CrossKVCache``: the encoder-decoder's cross-attention K/V, computed once
    per source.

int8 caches (``dtype="int8"``, every self-attention kind): K and V are stored
as int8 with one float32 scale per token and KV head (symmetric:
``scale = max_h |x_h| / 127``, ``q = round(x / scale)``, round-trip error
<= scale / 2), in ``k_scale_*`` / ``v_scale_*`` arrays laid out like the
buffers without H. They are dequantized when read, before attention
(``quantize`` / ``dequantize``), or tile by tile inside the Pallas decode
kernels. Bytes per token and layer: 2 * K * (H + 4),
0.56x bfloat16 at H = 32, 0.52x at H = 128.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from attnlab.config import (
  CACHE_DTYPES,
  CACHE_KINDS,
  ModelConfig,
  cache_dtype_name,
  effective_window,
  positive_count,
)
from attnlab.nn.layers import as_dtype
from attnlab.ops.decode import decode_step_attention
from attnlab.ops.dispatch import attention, cache_implementation
from attnlab.ops.pallas import decode as decode_kernels
from attnlab.ops.reference import reference_attention

SCALE_DTYPE = jnp.float32
INT8_MAX = 127.0


def check_cache_dtype(dtype):
  """The cache dtype (a name or a dtype; None = the model's dtype), or raise ValueError."""
  if dtype is None:
    return None
  name = cache_dtype_name(dtype)
  if name is None:
    raise ValueError(f"cache_dtype={dtype!r} is not one of {', '.join(CACHE_DTYPES)} (or None)")
  return jnp.dtype(name)


def check_sizes(**sizes) -> list[int]:
  """The sizes as Python ints, or a ValueError naming the first that is not a positive
  integer. NumPy integers and concrete 0-d integer arrays are taken, as ints: a narrow one
  would overflow the arithmetic on it. (Until 2026-12-07 a negative size was a broadcast
  error from inside JAX, a float one a shape error, None a TypeError, 0 pages of a paged
  cache a ZeroDivisionError, and True a batch of 1.)"""
  return [positive_count(name, value) for name, value in sizes.items()]


def quantize(x_XH):
  """Symmetric int8 over the last axis: (int8 [..., H], float32 scale [...]).

  ``scale = max |x| / 127`` (1 where x is all zeros), at least float32's smallest normal
  number (below it XLA:CPU flushes the quotient to 0: until 2026-12-06 a vector whose
  largest |x| was under ~1.5e-36 got scale 0 and came back as zeros); ``q = round(x /
  scale)``. A NaN or an infinity in x makes its scale NaN or inf, so the dequantized
  vector is not finite either, as a float cache would keep it (a NaN gave scale 1 and
  rounded the vector to zeros until 2026-12-06).
  """
  x_XH = x_XH.astype(jnp.float32)
  amax_X = jnp.max(jnp.abs(x_XH), axis=-1)
  tiny = jnp.finfo(jnp.float32).tiny
  scale_X = jnp.where(amax_X == 0, 1.0, jnp.maximum(amax_X / INT8_MAX, tiny)).astype(SCALE_DTYPE)
  q_XH = jnp.clip(jnp.round(x_XH / scale_X[..., None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
  return q_XH, scale_X


def dequantize(q_XH, scale_X, dtype=jnp.float32):
  """``q * scale`` in ``dtype``."""
  return (q_XH.astype(jnp.float32) * scale_X[..., None].astype(jnp.float32)).astype(dtype)


def _read(buf, scale, dtype):
  """A buffer as keys / values of ``dtype``: dequantized when it is int8."""
  return buf.astype(dtype) if scale is None else dequantize(buf, scale, dtype)


def _encode(x, buf_dtype, quantized):
  """New keys / values as stored: (values, scales or None)."""
  if quantized:
    return quantize(x)
  return x.astype(buf_dtype), None


def _scales(shape, dtype):
  """Zero scales of a buffer without its H axis, or None for a float buffer."""
  return jnp.zeros(shape[:-1], SCALE_DTYPE) if jnp.dtype(dtype) == jnp.int8 else None


def positions_after(lengths_B, T):
  """Positions [B, T] that continue each sequence of ``lengths_B`` tokens: lengths + 0..T-1."""
  return lengths_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]


def _is_new_BT(num_new_B, T):
  return jnp.arange(T, dtype=jnp.int32)[None, :] < num_new_B[:, None]


def _filled_positions(lengths_B, S):
  """Key positions [B, S] of a buffer whose slot s holds position s: -1 past the length."""
  s_S = jnp.arange(S, dtype=jnp.int32)
  return jnp.where(s_S[None, :] < lengths_B[:, None], s_S[None, :], -1)


def _attend_keys(q_BTNH, k_BSKH, v_BSKH, *, q_positions_BT, kv_positions_BS, causal, window,
                 implementation, dropout_rate, dropout_rng):
  """The queries over keys at explicit positions (-1 = empty slot)."""
  mask_kwargs = dict(causal=causal, window=window, q_positions=q_positions_BT,
                     kv_positions=kv_positions_BS)
  if dropout_rate > 0:
    return reference_attention(q_BTNH, k_BSKH, v_BSKH, dropout_rate=dropout_rate,
                               dropout_rng=dropout_rng, **mask_kwargs)
  return attention(q_BTNH, k_BSKH, v_BSKH, implementation=implementation, **mask_kwargs)


def _xla_decode_step(q_BTNH, *, causal, implementation, dropout_rate) -> bool:
  """Whether a contiguous / ring cache request is one XLA decode step
  (``attnlab.ops.decode``): one new causal query per sequence, no dropout,
  ``implementation="auto"`` (an explicit implementation is honoured:
  "chunked" still writes first and attends with the chunked op)."""
  return (q_BTNH.shape[1] == 1 and causal and dropout_rate == 0 and implementation == "auto")


def _after(x, index_B):
  """``index_B`` unchanged, computed from ``x``: an update at this index waits for ``x``.

  The cache writes of a decode step do not depend on the attention that read
  the old buffer, so XLA may not order the write after the read, and then
  copies the whole buffer to write into (XLA:CPU did: two copies of every
  [B, K, S, H] buffer per step). Taking the index through one element of the
  attention output makes the order a data dependence; the value is the same
  (``min(i, 2**31 - 2 + bit) == i``), so any input works, NaN included.
  """
  low_bit = jax.lax.bitcast_convert_type(x.reshape(-1)[0].astype(jnp.float32), jnp.int32) & 1
  return jnp.minimum(index_B, jnp.iinfo(jnp.int32).max - 1 + low_bit)


def _put_token(buf, new, slot_B, write_B):
  """``buf`` [B, K, S, ...] with ``new`` [B, K, ...] at slot ``slot_B[b]`` of each row
  where ``write_B[b]`` (other rows keep theirs); ``slot_B`` must be in range where
  ``write_B``. An in-place update (one dynamic-update-slice at B = 1)."""
  B, S = buf.shape[0], buf.shape[2]
  slot_B = jnp.clip(slot_B, 0, S - 1)
  new = new.astype(buf.dtype)
  b_B = jnp.arange(B)
  old = buf[b_B, :, slot_B]
  keep = write_B.reshape((B,) + (1,) * (new.ndim - 1))
  return buf.at[b_B, :, slot_B].set(jnp.where(keep, new, old), mode="promise_in_bounds")


def _attend_then_write(q_BTNH, k_BTKH, v_BTKH, bufs, *, q_positions_BT, kv_positions_BS,
                       new_positions_B, slot_B, write_B, window):
  """The decode step of the contiguous and ring caches (one new token per row).

  The new token is encoded as it will be stored; ``decode_step_attention``
  attends over ``bufs`` = (k, v, k_scale, v_scale) [B, K, S, ...] (scales None
  for a float cache) as they are, plus the new token at ``new_positions_B``;
  then the token is written in place at ``slot_B`` where ``write_B``, ordered
  after the reads (``_after``).

  Returns:
    (out [B, 1, N, H], the slot index as written, the four updated buffers).
  """
  k, v, k_scale, v_scale = bufs
  (k_new, ks_new), (v_new, vs_new) = (_encode(x[:, 0], k.dtype, k_scale is not None)
                                      for x in (k_BTKH, v_BTKH))
  dtype = k_BTKH.dtype
  out_BNH = decode_step_attention(
      q_BTNH[:, 0], _read(k_new, ks_new, dtype), _read(v_new, vs_new, dtype), k, v,
      q_positions_B=q_positions_BT[:, 0], new_positions_B=new_positions_B,
      kv_positions_BS=kv_positions_BS, window=window, k_scale_BKS=k_scale, v_scale_BKS=v_scale)
  slot_B = _after(out_BNH, slot_B)
  written = tuple(None if buf is None else _put_token(buf, x, slot_B, write_B)
                  for buf, x in zip(bufs, (k_new, v_new, ks_new, vs_new), strict=True))
  return out_BNH[:, None], slot_B, written


class _SelfAttentionCache:
  """``attend`` for the self-attention caches, through their ``append``."""

  @property
  def kv_heads_and_dim(self) -> tuple[int, int]:
    """(K, H) of the keys this cache holds, each layout its own."""
    raise NotImplementedError

  def attend(self, q_BTNH, k_BTKH, v_BTKH, *, num_new_B, q_positions_BT, causal: bool,
             window: int | None, implementation: str, dropout_rate: float = 0.0,
             dropout_rng=None):
    """Store the new keys/values, attend the new queries over the cache.

    Args:
      q_BTNH: the new queries [B, T, N, H] (RoPE applied).
      k_BTKH, v_BTKH: the new keys / values [B, T, K, H].
      num_new_B: int32 [B]: the first ``num_new_B[b]`` tokens of row b are
        real, the rest right padding (not stored).
      q_positions_BT: the queries' positions [B, T].
      causal, window: the layer's mask.
      implementation: the layer's ``attnlab.attention`` implementation;
        ``cache_implementation`` maps it to the path taken over the cache.
      dropout_rate, dropout_rng: attention dropout (reference op), if any.

    Returns:
      (out_BTNH, updated cache).
    """
    cache, k_BSKH, v_BSKH, kv_positions_BS = self.append(k_BTKH, v_BTKH, num_new_B)
    out_BTNH = _attend_keys(
        q_BTNH, k_BSKH, v_BSKH, q_positions_BT=q_positions_BT, kv_positions_BS=kv_positions_BS,
        causal=causal, window=window, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
        implementation=cache_implementation(implementation, num_queries=q_BTNH.shape[1],
                                            paged=False))
    return out_BTNH, cache


@struct.dataclass
class KVCache(_SelfAttentionCache):
  """Contiguous cache of one layer.

  Attributes:
    k_BKSH, v_BKSH: keys / values [B, K, S, H]; slot s holds position s.
    lengths_B: int32 [B], tokens written per sequence.
    k_scale_BKS, v_scale_BKS: float32 scales of an int8 cache; None otherwise.
    empty: static; set by ``as_empty`` (see there).
  """

  k_BKSH: jax.Array
  v_BKSH: jax.Array
  lengths_B: jax.Array
  k_scale_BKS: jax.Array | None = None
  v_scale_BKS: jax.Array | None = None
  empty: bool = struct.field(pytree_node=False, default=False)

  @property
  def kv_heads_and_dim(self) -> tuple[int, int]:
    return self.k_BKSH.shape[1], self.k_BKSH.shape[3]

  @classmethod
  def init(cls, batch, max_len, num_kv_heads, head_dim, dtype=jnp.float32):
    shape = tuple(check_sizes(batch=batch, num_kv_heads=num_kv_heads, max_len=max_len,
                              head_dim=head_dim))
    batch = shape[0]
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32),
               _scales(shape, dtype), _scales(shape, dtype))

  @property
  def capacity(self) -> int:
    return self.k_BKSH.shape[2]

  def attend(self, q_BTNH, k_BTKH, v_BTKH, *, num_new_B, q_positions_BT, causal: bool,
             window: int | None, implementation: str, dropout_rate: float = 0.0,
             dropout_rng=None):
    """``_SelfAttentionCache.attend``; or, for one new causal query per sequence
    (no dropout): with ``implementation="pallas"``, the heads-major Pallas
    decode kernel over the buffer in place (int8 tiles dequantized in the
    kernel); with "auto", one XLA decode step (``attnlab.ops.decode``) over
    the buffer before the write, then the write in place."""
    if _xla_decode_step(q_BTNH, causal=causal, implementation=implementation,
                        dropout_rate=dropout_rate):
      return self._decode_step(q_BTNH, k_BTKH, v_BTKH, num_new_B, q_positions_BT, window)
    if not (implementation == "pallas" and q_BTNH.shape[1] == 1 and causal
            and dropout_rate == 0):
      return super().attend(q_BTNH, k_BTKH, v_BTKH, num_new_B=num_new_B,
                            q_positions_BT=q_positions_BT, causal=causal, window=window,
                            implementation=implementation, dropout_rate=dropout_rate,
                            dropout_rng=dropout_rng)
    cache, *_ = self.append(k_BTKH, v_BTKH, num_new_B)
    out_BTNH = decode_kernels.decode_attention_heads_major(
        q_BTNH, cache.k_BKSH, cache.v_BKSH, jnp.maximum(cache.lengths_B, 1),
        k_scale_BKS=cache.k_scale_BKS, v_scale_BKS=cache.v_scale_BKS, window=window)
    return out_BTNH, cache

  def _decode_step(self, q_BTNH, k_BTKH, v_BTKH, num_new_B, q_positions_BT, window):
    """Attend over the buffer and the new token, then write the token in place."""
    S = self.capacity
    # Padding and a token past the capacity are neither stored nor seen, as in ``append``.
    write_B = (num_new_B > 0) & (self.lengths_B < S)
    out_B1NH, _, (k, v, ks, vs) = _attend_then_write(
        q_BTNH, k_BTKH, v_BTKH, (self.k_BKSH, self.v_BKSH, self.k_scale_BKS, self.v_scale_BKS),
        q_positions_BT=q_positions_BT, kv_positions_BS=_filled_positions(self.lengths_B, S),
        new_positions_B=jnp.where(write_B, self.lengths_B, -1), slot_B=self.lengths_B,
        write_B=write_B, window=window)
    return out_B1NH, KVCache(k, v, self.lengths_B + num_new_B, ks, vs)

  def store(self, k_BTKH, v_BTKH, num_new_B):
    """The cache with the new tokens written (and nothing read)."""
    return self.append(k_BTKH, v_BTKH, num_new_B)[0]

  def append(self, k_BTKH, v_BTKH, num_new_B):
    """Write the new tokens at their positions; see the module docstring.

    Returns:
      (cache, k_BSKH, v_BSKH, kv_positions_BS): the keys include the new ones.
    """
    B, T = k_BTKH.shape[:2]
    S = self.capacity
    # Padding and tokens past the end go to slot S, which mode="drop" skips.
    slot_BT = jnp.where(_is_new_BT(num_new_B, T), positions_after(self.lengths_B, T), S)
    b_BT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    int8 = self.k_scale_BKS is not None
    (k_new, ks_new), (v_new, vs_new) = (_encode(x, self.k_BKSH.dtype, int8)
                                        for x in (k_BTKH, v_BTKH))
    k = self.k_BKSH.at[b_BT, :, slot_BT].set(k_new, mode="drop")
    v = self.v_BKSH.at[b_BT, :, slot_BT].set(v_new, mode="drop")
    ks = vs = None
    if int8:
      ks = self.k_scale_BKS.at[b_BT, :, slot_BT].set(ks_new, mode="drop")
      vs = self.v_scale_BKS.at[b_BT, :, slot_BT].set(vs_new, mode="drop")
    lengths_B = self.lengths_B + num_new_B
    cache = KVCache(k, v, lengths_B, ks, vs)
    kv_positions_BS = _filled_positions(lengths_B, S)
    dtype = k_BTKH.dtype
    return (cache, jnp.swapaxes(_read(k, ks, dtype), 1, 2), jnp.swapaxes(_read(v, vs, dtype), 1, 2),
            kv_positions_BS)


@struct.dataclass
class RingKVCache(_SelfAttentionCache):
  """Sliding-window cache of one layer: W slots, slot ``p % W`` holds position p.

  Attributes:
    k_BKWH, v_BKWH: keys / values [B, K, W, H].
    positions_BW: int32 position held by each slot, -1 = empty.
    lengths_B: int32 [B], tokens seen per sequence (may exceed W).
    k_scale_BKW, v_scale_BKW: float32 scales of an int8 cache; None otherwise.
    empty: static; set by ``as_empty`` (see there).
  """

  k_BKWH: jax.Array
  v_BKWH: jax.Array
  positions_BW: jax.Array
  lengths_B: jax.Array
  k_scale_BKW: jax.Array | None = None
  v_scale_BKW: jax.Array | None = None
  empty: bool = struct.field(pytree_node=False, default=False)

  @property
  def kv_heads_and_dim(self) -> tuple[int, int]:
    return self.k_BKWH.shape[1], self.k_BKWH.shape[3]

  @classmethod
  def init(cls, batch, window, num_kv_heads, head_dim, dtype=jnp.float32):
    shape = tuple(check_sizes(batch=batch, num_kv_heads=num_kv_heads, window=window,
                              head_dim=head_dim))
    batch, window = shape[0], shape[2]
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
               jnp.full((batch, window), -1, jnp.int32), jnp.zeros((batch,), jnp.int32),
               _scales(shape, dtype), _scales(shape, dtype))

  @property
  def window(self) -> int:
    return self.k_BKWH.shape[2]

  def attend(self, q_BTNH, k_BTKH, v_BTKH, *, num_new_B, q_positions_BT, causal: bool,
             window: int | None, implementation: str, dropout_rate: float = 0.0,
             dropout_rng=None):
    """``_SelfAttentionCache.attend``; or, for one new causal query per sequence
    (no dropout): with "auto", one XLA decode step (``attnlab.ops.decode``)
    over the ring before the write, then the write in place; with "pallas", the
    heads-major Pallas decode kernel over the ring in place (int8 slots
    dequantized in the kernel).

    After the new token is written, the ring holds exactly the last
    ``min(length, W)`` positions, which is what a query under a window of W
    keys sees: the kernel attends over the first ``min(length, W)`` slots
    with no mask (softmax does not care that the slots are out of order).
    """
    if window is None or window > self.window:  # older keys are gone: a silent wrong answer
      raise ValueError(f"a RingKVCache of {self.window} slots keeps the last {self.window} "
                       f"positions: it serves a layer whose window is at most {self.window}, "
                       f"got window={window}")
    if _xla_decode_step(q_BTNH, causal=causal, implementation=implementation,
                        dropout_rate=dropout_rate):
      return self._decode_step(q_BTNH, k_BTKH, v_BTKH, num_new_B, q_positions_BT, window)
    if not (implementation == "pallas" and q_BTNH.shape[1] == 1 and causal
            and window == self.window and dropout_rate == 0):
      return super().attend(q_BTNH, k_BTKH, v_BTKH, num_new_B=num_new_B,
                            q_positions_BT=q_positions_BT, causal=causal, window=window,
                            implementation=implementation, dropout_rate=dropout_rate,
                            dropout_rng=dropout_rng)
    cache = self._write(*self._encode(k_BTKH, v_BTKH), num_new_B)
    out_BTNH = decode_kernels.decode_attention_heads_major(
        q_BTNH, cache.k_BKWH, cache.v_BKWH, jnp.clip(cache.lengths_B, 1, self.window),
        k_scale_BKS=cache.k_scale_BKW, v_scale_BKS=cache.v_scale_BKW)
    return out_BTNH, cache

  def _decode_step(self, q_BTNH, k_BTKH, v_BTKH, num_new_B, q_positions_BT, window):
    """Attend over the ring (before the write) and the new token, then write it in place."""
    new_B = num_new_B > 0
    out_B1NH, slot_B, (k, v, ks, vs) = _attend_then_write(
        q_BTNH, k_BTKH, v_BTKH, (self.k_BKWH, self.v_BKWH, self.k_scale_BKW, self.v_scale_BKW),
        q_positions_BT=q_positions_BT, kv_positions_BS=self.positions_BW,
        new_positions_B=jnp.where(new_B, self.lengths_B, -1),
        slot_B=self.lengths_B % self.window, write_B=new_B, window=window)
    positions_BW = _put_token(self.positions_BW[:, None], self.lengths_B[:, None], slot_B,
                              new_B)[:, 0]
    return out_B1NH, RingKVCache(k, v, positions_BW, self.lengths_B + num_new_B, ks, vs)

  def store(self, k_BTKH, v_BTKH, num_new_B):
    """The ring with the last W real new tokens written (and nothing read)."""
    return self._write(*self._encode(k_BTKH, v_BTKH), num_new_B)

  def _encode(self, k_BTKH, v_BTKH):
    int8 = self.k_scale_BKW is not None
    return tuple(_encode(x, self.k_BKWH.dtype, int8) for x in (k_BTKH, v_BTKH))

  def append(self, k_BTKH, v_BTKH, num_new_B):
    """Attend over (ring before the write) ++ (new tokens), then write the ring.

    A prefill chunk longer than W needs keys that the chunk itself would
    overwrite, so queries see the old ring and the whole chunk; only the last
    W real tokens of the chunk are then kept (no two writes hit one slot).
    """
    T = k_BTKH.shape[1]
    pos_BT = positions_after(self.lengths_B, T)
    new_BT = _is_new_BT(num_new_B, T)
    (k_new, ks_new), (v_new, vs_new) = self._encode(k_BTKH, v_BTKH)
    # The chunk's own keys are read as stored (quantized), like the ring's.
    dtype = k_BTKH.dtype
    k_BSKH = jnp.concatenate([jnp.swapaxes(_read(self.k_BKWH, self.k_scale_BKW, dtype), 1, 2),
                              _read(k_new, ks_new, dtype)], axis=1)
    v_BSKH = jnp.concatenate([jnp.swapaxes(_read(self.v_BKWH, self.v_scale_BKW, dtype), 1, 2),
                              _read(v_new, vs_new, dtype)], axis=1)
    kv_positions_BS = jnp.concatenate([self.positions_BW, jnp.where(new_BT, pos_BT, -1)], axis=1)
    cache = self._write((k_new, ks_new), (v_new, vs_new), num_new_B)
    return cache, k_BSKH, v_BSKH, kv_positions_BS

  def _write(self, k_enc, v_enc, num_new_B):
    """The ring with the last W real new tokens of each row written (encoded K / V)."""
    (k_new, ks_new), (v_new, vs_new) = k_enc, v_enc
    B, T = k_new.shape[:2]
    W = self.window
    pos_BT = positions_after(self.lengths_B, T)
    new_BT = _is_new_BT(num_new_B, T)
    t_BT = jnp.arange(T, dtype=jnp.int32)[None, :]
    kept_BT = new_BT & (t_BT >= num_new_B[:, None] - W)
    slot_BT = jnp.where(kept_BT, pos_BT % W, W)
    b_BT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    k = self.k_BKWH.at[b_BT, :, slot_BT].set(k_new, mode="drop")
    v = self.v_BKWH.at[b_BT, :, slot_BT].set(v_new, mode="drop")
    ks = vs = None
    if ks_new is not None:
      ks = self.k_scale_BKW.at[b_BT, :, slot_BT].set(ks_new, mode="drop")
      vs = self.v_scale_BKW.at[b_BT, :, slot_BT].set(vs_new, mode="drop")
    positions_BW = self.positions_BW.at[b_BT, slot_BT].set(pos_BT, mode="drop")
    return RingKVCache(k, v, positions_BW, self.lengths_B + num_new_B, ks, vs)


@struct.dataclass
class PagedKVCache(_SelfAttentionCache):
  """Paged cache of one layer: pages shared by all sequences of the batch.

  Attributes:
    k_pages_PCKH, v_pages_PCKH: P pages of C slots each.
    page_table_BM: int32 page id of the m-th page of sequence b; -1 = none.
      Position p of sequence b lives in page ``page_table_BM[b, p // C]``
      at slot ``p % C``. Pages are assigned by ``PageAllocator`` before the
      tokens are appended (the same table is in every layer).
    lengths_B: int32 [B], tokens written per sequence.
    k_scale_PCK, v_scale_PCK: float32 scales of an int8 cache (paged like
      the values); None otherwise.
    empty: static; set by ``as_empty`` (see there).
  """

  k_pages_PCKH: jax.Array
  v_pages_PCKH: jax.Array
  page_table_BM: jax.Array
  lengths_B: jax.Array
  k_scale_PCK: jax.Array | None = None
  v_scale_PCK: jax.Array | None = None
  empty: bool = struct.field(pytree_node=False, default=False)

  @property
  def kv_heads_and_dim(self) -> tuple[int, int]:
    return self.k_pages_PCKH.shape[2], self.k_pages_PCKH.shape[3]

  @classmethod
  def init(cls, batch, max_len, num_kv_heads, head_dim, *, page_size, num_pages,
           dtype=jnp.float32):
    batch, max_len, *shape = check_sizes(batch=batch, max_len=max_len, num_pages=num_pages,
                                         page_size=page_size, num_kv_heads=num_kv_heads,
                                         head_dim=head_dim)
    shape = tuple(shape)
    pages_per_seq = -(-max_len // shape[1])
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
               jnp.full((batch, pages_per_seq), -1, jnp.int32), jnp.zeros((batch,), jnp.int32),
               _scales(shape, dtype), _scales(shape, dtype))

  @property
  def page_size(self) -> int:
    return self.k_pages_PCKH.shape[1]

  @property
  def capacity(self) -> int:
    return self.page_table_BM.shape[1] * self.page_size

  def attend(self, q_BTNH, k_BTKH, v_BTKH, *, num_new_B, q_positions_BT, causal: bool,
             window: int | None, implementation: str, dropout_rate: float = 0.0,
             dropout_rng=None):
    """``_SelfAttentionCache.attend``; or, for one new query per sequence and
    ``implementation="pallas"``, the Pallas paged-decode kernel over the pages
    in place (no gather of the whole sequence; int8 pages dequantized in the
    kernel). The kernel is causal and has no dropout: a non-causal request or
    one with dropout takes the parent's path, as on the other caches."""
    path = cache_implementation(implementation, num_queries=q_BTNH.shape[1], paged=True)
    if path != "paged_decode" or not causal or dropout_rate > 0:
      return super().attend(q_BTNH, k_BTKH, v_BTKH, num_new_B=num_new_B,
                            q_positions_BT=q_positions_BT, causal=causal, window=window,
                            implementation=implementation, dropout_rate=dropout_rate,
                            dropout_rng=dropout_rng)
    cache = self.write(k_BTKH, v_BTKH, num_new_B)
    out_BTNH = decode_kernels.paged_decode_attention(
        q_BTNH, cache.k_pages_PCKH, cache.v_pages_PCKH, cache.page_table_BM,
        cache.lengths_B, k_scale_PCK=cache.k_scale_PCK, v_scale_PCK=cache.v_scale_PCK,
        window=window)
    return out_BTNH, cache

  def append(self, k_BTKH, v_BTKH, num_new_B):
    """Write into the sequences' pages, return their keys gathered in order."""
    cache = self.write(k_BTKH, v_BTKH, num_new_B)
    M, C = self.page_table_BM.shape[1], self.page_size
    k_BSKH, v_BSKH = cache.gather(k_BTKH.dtype)
    # A position whose page is missing (its token was dropped by ``write``) is not a
    # key: the gather reads page 0 there.
    P = self.k_pages_PCKH.shape[0]
    has_page_BS = jnp.repeat((self.page_table_BM >= 0) & (self.page_table_BM < P), C, axis=1)
    positions_BS = jnp.where(has_page_BS, _filled_positions(cache.lengths_B, M * C), -1)
    return cache, k_BSKH, v_BSKH, positions_BS

  def store(self, k_BTKH, v_BTKH, num_new_B):
    """The cache with the new tokens written into their pages (and nothing read)."""
    return self.write(k_BTKH, v_BTKH, num_new_B)

  def write(self, k_BTKH, v_BTKH, num_new_B):
    """The cache with the new tokens written into their sequences' pages."""
    B, T = k_BTKH.shape[:2]
    P, C = self.k_pages_PCKH.shape[:2]
    M = self.page_table_BM.shape[1]
    pos_BT = positions_after(self.lengths_B, T)
    m_BT = jnp.minimum(pos_BT // C, M - 1)
    page_BT = jnp.take_along_axis(self.page_table_BM, m_BT, axis=1)
    # A token without a page (padding, or an allocator that ran out) is dropped.
    ok_BT = _is_new_BT(num_new_B, T) & (pos_BT < M * C) & (page_BT >= 0)
    page_BT = jnp.where(ok_BT, page_BT, P)
    int8 = self.k_scale_PCK is not None
    (k_new, ks_new), (v_new, vs_new) = (_encode(x, self.k_pages_PCKH.dtype, int8)
                                        for x in (k_BTKH, v_BTKH))
    k = self.k_pages_PCKH.at[page_BT, pos_BT % C].set(k_new, mode="drop")
    v = self.v_pages_PCKH.at[page_BT, pos_BT % C].set(v_new, mode="drop")
    ks = vs = None
    if int8:
      ks = self.k_scale_PCK.at[page_BT, pos_BT % C].set(ks_new, mode="drop")
      vs = self.v_scale_PCK.at[page_BT, pos_BT % C].set(vs_new, mode="drop")
    return PagedKVCache(k, v, self.page_table_BM, self.lengths_B + num_new_B, ks, vs)

  def gather(self, dtype=None):
    """Keys / values [B, M*C, K, H] in position order, as ``dtype``: by default the pages'
    dtype, float32 for an int8 cache (dequantized). A page the table does not assign (-1,
    or an entry past the pool) reads as zeros: masked, but weighed by 0, and until
    2026-12-04 it read page 0, whose NaN or inf (another sequence's page) came through."""
    B, M = self.page_table_BM.shape
    P, C, K, H = self.k_pages_PCKH.shape
    table_BM = jnp.where(self.page_table_BM >= 0, self.page_table_BM, P)  # P: no page
    read = lambda x: x.at[table_BM].get(mode="fill", fill_value=0)
    k = read(self.k_pages_PCKH).reshape(B, M * C, K, H)
    v = read(self.v_pages_PCKH).reshape(B, M * C, K, H)
    if self.k_scale_PCK is None:
      return (k, v) if dtype is None else (k.astype(dtype), v.astype(dtype))
    dtype = dtype or jnp.float32
    ks = read(self.k_scale_PCK).reshape(B, M * C, K)
    vs = read(self.v_scale_PCK).reshape(B, M * C, K)
    return dequantize(k, ks, dtype), dequantize(v, vs, dtype)


@struct.dataclass
class CrossKVCache:
  """Cross-attention keys/values of the encoder output, computed once per source.

  Attributes:
    k_BSKH, v_BSKH: projected encoder output [B, S, K, H].
    segment_ids_BS: int32 source segment ids (0 = padding, masked).
  """

  k_BSKH: jax.Array
  v_BSKH: jax.Array
  segment_ids_BS: jax.Array

  def attend(self, q_BTNH, *, implementation: str, dropout_rate: float = 0.0,
             dropout_rng=None):
    """The queries [B, T, N, H] over the source; (out_BTNH, this cache unchanged)."""
    B, T = q_BTNH.shape[:2]
    kwargs = dict(causal=False, window=None, q_segment_ids=jnp.ones((B, T), jnp.int32),
                  kv_segment_ids=self.segment_ids_BS)
    if dropout_rate > 0:
      out_BTNH = reference_attention(q_BTNH, self.k_BSKH, self.v_BSKH, dropout_rate=dropout_rate,
                                     dropout_rng=dropout_rng, **kwargs)
    else:
      out_BTNH = attention(q_BTNH, self.k_BSKH, self.v_BSKH, **kwargs, implementation=(
          cache_implementation(implementation, num_queries=T, paged=False)))
    return out_BTNH, self


@struct.dataclass
class BlockCache:
  """The caches of one transformer block: self-attention and (decoders of an
  encoder-decoder) cross-attention."""

  self_attn: KVCache | RingKVCache | PagedKVCache
  cross_attn: CrossKVCache | None = None


# ----------------------------------------------------------------------------
# Whole-model caches: a tuple with one BlockCache per decoder block.
# ----------------------------------------------------------------------------


def init_cache(cfg, kind: str, batch: int, max_len: int, *, page_size: int = 16,
               num_pages: int | None = None, dtype=None):
  """Empty self-attention caches for the decoder blocks of ``cfg``.

  Args:
    cfg: the ``ModelConfig``.
    kind: "contiguous" | "ring" | "paged".
    batch: B.
    max_len: the longest sequence (prompt + generated) a cache must hold;
      the ring ignores it (it holds ``effective_window(cfg)`` positions: the window, or
      ``cfg.max_len`` where the window is wider), though it must be a size, as every one
      here: a positive integer (a NumPy one too).
    page_size, num_pages: C and P of the paged cache; P defaults to enough
      pages for every sequence at ``max_len``. Its page table starts empty (-1):
      give each sequence pages before use (``set_page_table``, or a
      ``attnlab.decoding.paging.PageAllocator`` as ``generate`` does); the layer
      drops a token that has no page, as documented there.
    dtype: cache dtype, one of ``CACHE_DTYPES``; default the model's compute
      dtype. "int8" stores K/V quantized with float32 scales.

  Returns:
    tuple of ``BlockCache``, one per decoder layer.
  """
  if not isinstance(cfg, ModelConfig):  # a model was an AttributeError until 2026-12-07
    raise ValueError(f"init_cache needs a ModelConfig (a model's: model.cfg), got "
                     f"{type(cfg).__name__}")
  batch, max_len = check_sizes(batch=batch, max_len=max_len)
  if kind == "paged" or page_size is not None:  # the other kinds read none (None was taken)
    (page_size,) = check_sizes(page_size=page_size)
  if num_pages is not None:
    (num_pages,) = check_sizes(num_pages=num_pages)
  dtype = check_cache_dtype(dtype) or as_dtype(cfg.dtype)
  dims = (cfg.num_kv_heads, cfg.head_dim)
  if kind in ("contiguous", "paged") and max_len > cfg.max_len:
    # The model's positions end at cfg.max_len (a learned table clips past it, silently):
    # a cache that holds more would decode past them (accepted until 2026-12-04).
    raise ValueError(f"max_len={max_len} is more than the model's ModelConfig.max_len="
                     f"{cfg.max_len}: a cache holds at most the positions the model has")
  if kind == "contiguous":
    make = lambda: KVCache.init(batch, max_len, *dims, dtype=dtype)
  elif kind == "ring":
    if cfg.window is None:
      raise ValueError("cache='ring' needs a sliding-window model (ModelConfig.window), got "
                       "window=None; use cache='contiguous' or 'paged'")
    make = lambda: RingKVCache.init(batch, effective_window(cfg), *dims, dtype=dtype)
  elif kind == "paged":
    if num_pages is None:
      num_pages = batch * math.ceil(max_len / page_size)
    make = lambda: PagedKVCache.init(batch, max_len, *dims, page_size=page_size,
                                     num_pages=num_pages, dtype=dtype)
  else:
    raise ValueError(f"cache={kind!r} is not one of {', '.join(map(repr, CACHE_KINDS))}")
  return tuple(BlockCache(make()) for _ in range(cfg.num_layers))


def cache_lengths(cache):
  """Tokens held per sequence, int32 [B] (every layer agrees)."""
  return cache[0].self_attn.lengths_B


def with_cross(cache, cross_caches):
  """The caches with the per-layer cross-attention K/V filled in."""
  return tuple(blk.replace(cross_attn=c) for blk, c in zip(cache, cross_caches, strict=True))


def set_page_table(cache, page_table_BM, lengths_B=None):
  """The same page table (and optionally lengths) in every layer's paged cache."""
  out = []
  for blk in cache:
    sa = blk.self_attn.replace(page_table_BM=page_table_BM)
    if lengths_B is not None:
      sa = sa.replace(lengths_B=lengths_B)
    out.append(blk.replace(self_attn=sa))
  return tuple(out)


def _check_rows(cache):
  if isinstance(cache[0].self_attn, PagedKVCache):
    raise ValueError("a paged cache has no rows (its pages are shared by the batch); use its "
                     "page table")


def as_empty(cache):
  """The caches with every sequence emptied, flagged (statically) as empty.

  Lengths 0, ring slots unassigned (a paged cache keeps its page table: the
  pages assigned stay assigned). The buffers are kept as they are. The next
  call reads none of them; the decode steps after it read every slot of the
  buffer and weigh the unwritten ones by 0, so stale values must be finite (a
  NaN or inf left there, by a float16 overflow say, would reach the output).
  The decoding loops never hand a sequence stale values: ``take_row`` gives a
  zeroed row and ``zero_pages`` clears each page as it is assigned.
  The next call through the
  model is a prefill that attends over its own tokens only, exactly as the
  uncached forward pass does (the layer's implementation, the new K/V
  before any rounding to the cache dtype), and writes them without reading
  the buffers; the caches it returns are no longer flagged.

  A cache from ``init_cache`` is empty but not flagged, so that it can
  start a ``lax.while_loop`` carry as it is (a flagged cache has another
  pytree structure).
  """
  out = []
  for blk in cache:
    sa = blk.self_attn.replace(lengths_B=jnp.zeros_like(blk.self_attn.lengths_B), empty=True)
    if isinstance(sa, RingKVCache):
      sa = sa.replace(positions_BW=jnp.full_like(sa.positions_BW, -1))
    out.append(blk.replace(self_attn=sa))
  return tuple(out)


def take_row(cache):
  """A row of a contiguous / ring cache, empty (``as_empty``) and zeroed, for a new
  sequence to fill and ``put_row`` into its slot. Zeroed, not the slot's old row: a NaN or
  inf that an earlier sequence left there would reach the new one's outputs through the
  unwritten slots that its decode steps weigh by 0 (``as_empty``)."""
  _check_rows(cache)
  return as_empty(jax.tree.map(lambda x: jnp.zeros((1, *x.shape[1:]), x.dtype), cache))


def zero_pages(cache, pages_E):
  """The caches with the pages ``pages_E`` (int32; ids outside [0, P) are skipped) zeroed,
  values and int8 scales, in every layer: for pages just assigned to a sequence, which hold
  whatever the sequence that freed them wrote (see ``take_row``)."""
  P = cache[0].self_attn.k_pages_PCKH.shape[0]
  pages_E = jnp.where((pages_E >= 0) & (pages_E < P), pages_E, P)  # P: dropped
  zero = lambda x: None if x is None else x.at[pages_E].set(0, mode="drop")
  out = []
  for blk in cache:
    sa = blk.self_attn
    out.append(blk.replace(self_attn=sa.replace(
        k_pages_PCKH=zero(sa.k_pages_PCKH), v_pages_PCKH=zero(sa.v_pages_PCKH),
        k_scale_PCK=zero(sa.k_scale_PCK), v_scale_PCK=zero(sa.v_scale_PCK))))
  return tuple(out)


def put_row(cache, row, b):
  """The cache with sequence ``b`` replaced by the batch-1 cache ``row`` (in place under
  donation: one dynamic-update-slice per buffer)."""
  _check_rows(cache)
  return jax.tree.map(lambda x, r: jax.lax.dynamic_update_slice_in_dim(x, r, b, axis=0), cache,
                      row)


def cache_bytes(cache) -> int:
  """Bytes held by all arrays of a cache."""
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
