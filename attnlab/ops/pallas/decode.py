"""Pallas decode attention: a few new queries against a long KV cache.

Flash-decoding: with T <= 8 queries there is too little work along T to
fill a GPU, so the cache is split along S instead. Each program owns one
(sequence, KV head, split) and computes a partial softmax over its keys for
all T x G queries of that KV head at once (the G query heads of a group read
each K/V tile once). The partial outputs are combined through their
log-sum-exps: ``out = sum_s exp(lse_s - lse) o_s`` with ``lse = logsumexp_s
lse_s``. Inside a program the T x G queries of a KV head are the rows of
one matrix: letter ``Q`` (Q = T * G, padded on GPU), ``c`` a key tile, ``s``
a split (``o_BKsQH``).

The T queries are the last T tokens of each sequence: query t of sequence b
is at position ``lengths_B[b] - T + t``, causal among themselves (and with
``window``, a sliding window); keys at positions >= ``lengths_B[b]`` are
empty. Loop bounds come from ``masks.key_range``, so splits and tiles past
the length or before the window are never read.

``paged_decode_attention`` reads the same cache through a page table (the
layout of ``attnlab.nn.kv_cache.PagedKVCache``): pages [P, C, K, H] shared
by all sequences, ``page_table_BM[b, m]`` the id of the m-th page of
sequence b. One page is one tile; a table entry < 0 or >= P inside the length is
a missing page: its tile is masked, so its positions are not keys.

``decode_attention_heads_major`` reads the contiguous cache of
``attnlab.nn.kv_cache.KVCache`` ([B, K, S, H]; the ring cache, [B, K, W, H],
goes through it too). It and the paged kernel take int8 caches with one
float32 scale per token and KV head, dequantized tile by tile.

Backends as in ``attnlab.ops.pallas.flash_gpu``: interpret mode on CPU (tested), Triton
on GPU (lowered to Triton IR in the tests, NOT YET RUN on a GPU), no Mosaic
(TPU) lowering.
Forward only: decoding does not differentiate through the cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from attnlab.ops import checks, masks
from attnlab.ops.pallas import common

MAX_QUERIES = 8


def _check_queries(q_BTNH, *, head_dim, num_kv_heads, kv_name, lengths_B, window):
  """The shared q checks (``checks``), then what only the decode kernels need; returns
  ``window`` as a Python int (or None) and ``lengths_B`` as an array."""
  checks.check_query_heads(q_BTNH, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           kv_name=kv_name)
  if not jnp.issubdtype(q_BTNH.dtype, jnp.floating):
    raise ValueError(f"q_BTNH must be a floating-point array (float32, bfloat16, float16, "
                     f"...), got dtype {q_BTNH.dtype}")
  window = checks.check_window(window)
  return window, _check_decode_queries(q_BTNH, lengths_B)


def _check_decode_queries(q_BTNH, lengths_B):
  """What only the decode kernels ask of q (already checked against the cache) and lengths;
  returns ``lengths_B`` as an array."""
  B, T = q_BTNH.shape[:2]
  if not 1 <= T <= MAX_QUERIES:
    raise ValueError(
        f"q_BTNH has T={T} queries; the decode kernels take 1..{MAX_QUERIES} "
        "(use flash_attention for prefill)"
    )
  checks.check_int32_values("lengths_B", lengths_B)  # jnp.asarray wraps an int64 past int32
  lengths_B = jnp.asarray(lengths_B)
  if tuple(lengths_B.shape) != (B,):
    raise ValueError(f"lengths_B shape {lengths_B.shape} must be [B] = ({B},)")
  if not jnp.issubdtype(lengths_B.dtype, jnp.integer):
    raise ValueError(f"lengths_B must be integers, got dtype {lengths_B.dtype}")
  return lengths_B


def _check_lengths_fit(lengths_B, capacity: int, capacity_what: str,
                       num_queries: int) -> None:
  """Concrete lengths (not traced) are 0 or in [T, capacity], T = ``num_queries``: the
  queries' own keys are in the cache, whose ``capacity`` positions are ``capacity_what``;
  0 is an empty slot (the paged cache's idle slots in continuous batching), whose queries
  see no key and give zeros. Until 2026-12-07 a negative length gave zeros, one past the
  capacity an output over keys that did not hold the query's own, and one in [1, T) put
  the first queries at negative positions, where they saw no key (zeros). Traced lengths
  (the jitted decode loop) are not read."""
  if isinstance(lengths_B, jax.core.Tracer):
    return
  values_B = np.asarray(lengths_B)
  low = max(1, num_queries)
  rows = np.flatnonzero((values_B < 0) | (values_B > capacity)
                        | ((values_B > 0) & (values_B < low)))
  if rows.size:
    held = ", ".join(f"lengths_B[{b}]={int(values_B[b])}" for b in rows[:8])
    more = f" (and {rows.size - 8} more)" if rows.size > 8 else ""
    allowed = f"[0, {capacity}]" if low == 1 else f"0 or in [T={low}, {capacity}]"
    raise ValueError(
        f"{held}{more} must be {'in ' if low == 1 else ''}{allowed}: a length counts the "
        f"sequence's tokens in the cache ({capacity_what}), the queries' own included; 0 is "
        "an empty slot")


def _check_scales(k, v, k_scale, v_scale, names, shape) -> bool:
  """Whether the cache ``k`` / ``v`` is int8 (both, or both floating-point); the scales
  must come with int8, of ``shape``."""
  int8 = k.dtype == jnp.int8
  if v.dtype != k.dtype or not (int8 or jnp.issubdtype(k.dtype, jnp.floating)):
    raise ValueError(f"the cache's keys and values must be both floating-point or both int8 "
                     f"(with {names}), got dtypes {k.dtype} and {v.dtype}")
  if int8 != (k_scale is not None) or (k_scale is None) != (v_scale is None):
    raise ValueError(f"{names} go with an int8 cache, and only with one "
                     f"(cache dtype {k.dtype}, scales given: {k_scale is not None})")
  if int8 and (k_scale.shape != shape or v_scale.shape != shape):
    raise ValueError(f"{names} shapes {k_scale.shape} / {v_scale.shape} must be {shape}")
  return int8


def _default_splits(programs: int, num_tiles: int) -> int:
  """Enough splits for about two waves of programs on a 132-SM GPU, >= 4 tiles each."""
  return max(1, min(-(-256 // programs), -(-num_tiles // 4)))


def _query_rows(q_BTNH, num_kv_heads, rows):
  """[B, T, N, H] -> [B, K, rows, H]: row r is query t = r // G of head g = r % G."""
  B, T, N, H = q_BTNH.shape
  G = N // num_kv_heads
  q_BKQH = q_BTNH.reshape(B, T, num_kv_heads, G, H).transpose(0, 2, 1, 3, 4)
  q_BKQH = q_BKQH.reshape(B, num_kv_heads, T * G, H)
  return jnp.pad(q_BKQH, ((0, 0), (0, 0), (0, rows - T * G), (0, 0)))


def _combine_splits(o_BKsQH, lse_BKsQ, q_BTNH):
  """Merge the per-split partial softmaxes through their log-sum-exps."""
  B, T, N, H = q_BTNH.shape
  K = o_BKsQH.shape[1]
  G = N // K
  m_BKQ = jnp.max(lse_BKsQ, axis=2)
  m_BKQ = jnp.where(jnp.isfinite(m_BKQ), m_BKQ, 0.0)  # every split empty: weights 0
  w_BKsQ = jnp.exp(lse_BKsQ - m_BKQ[:, :, None])
  den_BKQ = jnp.sum(w_BKsQ, axis=2)
  out_BKQH = jnp.einsum("BKsQ,BKsQH->BKQH", w_BKsQ, o_BKsQH)
  out_BKQH = out_BKQH / jnp.where(den_BKQ > 0, den_BKQ, 1.0)[..., None]
  out_BKTGH = out_BKQH[:, :, : T * G, :H].reshape(B, K, T, G, H)
  return out_BKTGH.transpose(0, 2, 1, 3, 4).reshape(B, T, N, H).astype(q_BTNH.dtype)


def _split_softmax(q_QH, load_tile, *, length, kv_len, split, tile, tiles_per_split,
                   num_queries, groups, window, scale):
  """Online softmax of the rows of q_QH over the tiles of one split.

  Row r is query r // groups, at position length - num_queries + r // groups;
  rows past num_queries * groups are padding and see nothing. load_tile(j)
  returns the (k, v) tile of global tile index j and whether its keys exist
  (a bool scalar; False masks the whole tile). Returns (o, lse), o
  normalized, lse = -inf for a row that saw no key.
  """
  rows = q_QH.shape[0]
  r = common.iota(rows)
  q_pos = length - num_queries + lax.div(r, groups)
  row_ok = r < num_queries * groups
  lo, hi = masks.key_range(length - num_queries, length - 1, causal=True, window=window,
                           kv_len=kv_len)
  split_lo = split * tiles_per_split * tile
  lo = jnp.maximum(lo, split_lo)
  hi = jnp.minimum(hi, split_lo + tiles_per_split * tile)
  first, last = common.block_bounds(lo, hi, tile)

  def body(j, carry):
    m_Q, l_Q, acc_QH = carry
    k_cH, v_cH, tile_ok = load_tile(j)
    k_idx = j * tile + common.iota(tile)
    key_ok = (k_idx < kv_len) & tile_ok
    ok = masks.position_mask(q_pos[:, None], k_idx[None, :], causal=True, window=window)
    ok = ok & row_ok[:, None] & key_ok[None, :]
    s_Qc = jnp.where(ok, common.dot_nt(q_QH, k_cH) * scale, -jnp.inf)
    # Values no row may see are zeroed: their weight is 0, but 0 x inf / NaN is NaN, and
    # what a missing page's clamped read or the slots past the length hold is another
    # sequence's or stale (until 2026-12-04 one sequence's inf reached its neighbours).
    v_cH = jnp.where(key_ok[:, None], v_cH, jnp.zeros((), v_cH.dtype))
    m_new = jnp.maximum(m_Q, jnp.max(s_Qc, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m_Q - m_safe)
    p_Qc = jnp.exp(s_Qc - m_safe[:, None])
    l_Q = alpha * l_Q + jnp.sum(p_Qc, axis=1)
    acc_QH = alpha[:, None] * acc_QH + common.dot_nn(p_Qc.astype(v_cH.dtype), v_cH)
    return m_new, l_Q, acc_QH

  init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
          jnp.zeros(q_QH.shape, jnp.float32))
  m_Q, l_Q, acc_QH = lax.fori_loop(first, last, body, init)
  seen = l_Q > 0
  l_safe = jnp.where(seen, l_Q, 1.0)
  return acc_QH / l_safe[:, None], jnp.where(seen, m_Q + jnp.log(l_safe), -jnp.inf)


def _decode_kernel(len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, split_len, tile,
                   kv_len_static, **kw):
  s = pl.program_id(2)
  length = len_ref[0]
  base = s * (split_len // tile)  # global index of this split's first tile

  def load_tile(j):
    keys = pl.ds((j - base) * tile, tile)
    return k_ref[keys, :], v_ref[keys, :], True

  o, lse = _split_softmax(q_ref[...], load_tile, length=length,
                          kv_len=jnp.minimum(length, kv_len_static), split=s, tile=tile,
                          tiles_per_split=split_len // tile, **kw)
  o_ref[...] = o
  lse_ref[...] = lse


def _paged_kernel(len_ref, table_ref, q_ref, k_ref, v_ref, *rest, pages_per_split,
                  kv_len_static, int8, **kw):
  if int8:
    ks_ref, vs_ref, o_ref, lse_ref = rest
  else:
    o_ref, lse_ref = rest
  s = pl.program_id(2)
  length = len_ref[0]
  num_pages = k_ref.shape[0]

  def load_tile(m):
    entry = table_ref[m - s * pages_per_split]
    # Clamped so that a bad table entry cannot read outside the pool; a missing page
    # (entry < 0) or one past the pool reads a page of the pool, masked and its values
    # zeroed (_split_softmax).
    page = jnp.clip(entry, 0, num_pages - 1)
    k_cH, v_cH = k_ref[page], v_ref[page]
    if int8:  # dequantize the page: int8 * its per-token float32 scale
      k_cH = k_cH.astype(jnp.float32) * ks_ref[page][:, None]
      v_cH = v_cH.astype(jnp.float32) * vs_ref[page][:, None]
    return k_cH, v_cH, (entry >= 0) & (entry < num_pages)

  o, lse = _split_softmax(q_ref[...], load_tile, length=length,
                          kv_len=jnp.minimum(length, kv_len_static), split=s,
                          tile=k_ref.shape[1], tiles_per_split=pages_per_split, **kw)
  o_ref[...] = o
  lse_ref[...] = lse


def _out_specs(B, K, splits, rows, H):
  out_shape = [jax.ShapeDtypeStruct((B, K, splits, rows, H), jnp.float32),
               jax.ShapeDtypeStruct((B, K, splits, rows), jnp.float32)]
  out_specs = [pl.BlockSpec((None, None, None, rows, H), lambda b, h, s: (b, h, s, 0, 0)),
               pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0))]
  return out_shape, out_specs


def _rows_and_head_dim(q_BTNH, K, interpret):
  T, N, H = q_BTNH.shape[1:]
  rows = T * (N // K)
  if interpret:
    return rows, H
  # Triton: every tile dim a power of two, and >= 16 for tl.dot.
  return max(16, common.next_pow2(rows)), max(16, common.next_pow2(H))


def decode_attention(q_BTNH, k_BSKH, v_BSKH, lengths_B, *, window: int | None = None,
                     scale: float | None = None, num_splits: int | None = None,
                     interpret: bool | None = None):
  """Attention of the last T <= 8 tokens of each sequence over its cache.

  Args:
    q_BTNH: queries [B, T, N, H]; query t of sequence b is at position
      lengths_B[b] - T + t (causal among themselves).
    k_BSKH, v_BSKH: the cache [B, S, K, H]; N must be a multiple of K.
    lengths_B: int [B], tokens in each sequence (the T queries included);
      keys at positions >= lengths_B[b] are ignored. 0 (an empty slot, zeros) or in
      [T, S]; a concrete length outside is refused (taken until 2026-12-07), a traced
      one not read.
    window: sliding window of that many keys, the query's own included.
    scale: multiplier of the scores; default 1/sqrt(H).
    num_splits: splits along S (partial softmaxes combined by log-sum-exp);
      default from the batch, heads and length.
    interpret: Pallas interpret mode; default True on CPU, False on GPU.

  Returns:
    [B, T, N, H] in the dtype of ``q_BTNH``.
  """
  _, window, _ = checks.check_qkv(q_BTNH, k_BSKH, v_BSKH, window=window)
  lengths_B = _check_decode_queries(q_BTNH, lengths_B)
  num_splits = checks.positive_or_none("num_splits", num_splits)
  B, T, N, H = q_BTNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  _check_lengths_fit(lengths_B, S, f"S={S} slots of k_BSKH", T)
  scale = checks.scale_value(scale, H)
  interpret = common.resolve_interpret(interpret)
  if q_BTNH.size == 0 or S == 0:  # no query, or no key: zeros, as attention() gives
    return jnp.zeros(q_BTNH.shape, q_BTNH.dtype)
  rows, Hp = _rows_and_head_dim(q_BTNH, K, interpret)
  tile = min(128 if interpret else 64, max(1 if interpret else 16, common.next_pow2(S)))
  num_tiles = -(-S // tile)
  splits = min(num_splits or _default_splits(B * K, num_tiles), num_tiles)
  tiles_per_split = -(-num_tiles // splits)
  splits = -(-num_tiles // tiles_per_split)  # no empty trailing split
  split_len = tiles_per_split * tile
  Sp = splits * split_len

  q = _query_rows(q_BTNH, K, rows)
  q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, Hp - H)))
  k = jnp.pad(k_BSKH, ((0, 0), (0, Sp - S), (0, 0), (0, Hp - H)))
  v = jnp.pad(v_BSKH, ((0, 0), (0, Sp - S), (0, 0), (0, Hp - H)))
  len_B1 = lengths_B.astype(jnp.int32)[:, None]
  kernel = functools.partial(
      _decode_kernel, split_len=split_len, tile=tile, kv_len_static=S, num_queries=T,
      groups=N // K, window=window, scale=scale,
  )
  out_shape, out_specs = _out_specs(B, K, splits, rows, Hp)
  kv_spec = pl.BlockSpec((None, split_len, None, Hp), lambda b, h, s: (b, s, h, 0))
  o, lse = pl.pallas_call(
      kernel,
      grid=(B, K, splits),
      in_specs=[
          pl.BlockSpec((None, 1), lambda b, h, s: (b, 0)),
          pl.BlockSpec((None, None, rows, Hp), lambda b, h, s: (b, h, 0, 0)),
          kv_spec,
          kv_spec,
      ],
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=common.compiler_params(interpret, 4, 2),
      interpret=interpret,
      name="attnlab_decode",
  )(len_B1, q, k, v)
  return _combine_splits(o, lse, q_BTNH)


def paged_decode_attention(q_BTNH, k_pages_PCKH, v_pages_PCKH, page_table_BM, lengths_B, *,
                           k_scale_PCK=None, v_scale_PCK=None, window: int | None = None,
                           scale: float | None = None, pages_per_split: int | None = None,
                           interpret: bool | None = None):
  """``decode_attention`` over a paged cache.

  Args:
    q_BTNH: queries [B, T, N, H], T <= 8, the last T tokens of each sequence.
    k_pages_PCKH, v_pages_PCKH: the page pool [P, C, K, H] shared by all
      sequences (C slots per page). On GPU, C must be a power of two >= 16.
      Float, or int8 with ``k_scale_PCK`` / ``v_scale_PCK`` (float32
      [P, C, K], paged like the values: slot c of page p, head k is
      ``k_pages_PCKH[p, c, k] * k_scale_PCK[p, c, k]``, dequantized per page
      in the kernel).
    page_table_BM: int [B, M]; page_table_BM[b, m] is the id of the page that
      holds positions [m * C, (m + 1) * C) of sequence b. An entry < 0 or >= P is
      a missing page: its positions are not keys (as in ``PagedKVCache``, whose
      allocator ran out). Entries past the sequence's length are never read.
    lengths_B: int [B], tokens in each sequence (the T queries included), 0 (an
      empty slot, zeros, as the idle slots of continuous batching) or in [T, M * C]; a
      concrete length outside is refused (taken until 2026-12-07), a traced one not
      read.
    window: sliding window of that many keys, the query's own included.
    scale: multiplier of the scores; default 1/sqrt(H).
    pages_per_split: pages per split along the sequence; default from the
      batch, heads and table width.
    interpret: Pallas interpret mode; default True on CPU, False on GPU.

  Returns:
    [B, T, N, H] in the dtype of ``q_BTNH``.
  """
  for name, x in (("k_pages_PCKH", k_pages_PCKH), ("v_pages_PCKH", v_pages_PCKH)):
    if x.ndim != 4:
      raise ValueError(f"{name} must be rank 4 [P, C, K, H], got shape {x.shape}")
  if k_pages_PCKH.shape != v_pages_PCKH.shape:
    raise ValueError(f"k_pages_PCKH shape {k_pages_PCKH.shape} and v_pages_PCKH shape "
                     f"{v_pages_PCKH.shape} must match")
  P, C, K, H = k_pages_PCKH.shape
  int8 = _check_scales(k_pages_PCKH, v_pages_PCKH, k_scale_PCK, v_scale_PCK,
                       "k_scale_PCK / v_scale_PCK", (P, C, K))
  window, lengths_B = _check_queries(q_BTNH, head_dim=H, num_kv_heads=K,
                                     kv_name="k_pages_PCKH", lengths_B=lengths_B, window=window)
  B, T, N, _ = q_BTNH.shape
  # an int64 entry of 2**32 wrapped to page 0 and was read as a page (an entry past the
  # pool is a missing page) until 2026-12-06
  checks.check_int32_values("page_table_BM", page_table_BM)
  page_table_BM = jnp.asarray(page_table_BM)
  if page_table_BM.ndim != 2 or page_table_BM.shape[0] != B:
    raise ValueError(f"page_table_BM shape {page_table_BM.shape} must be [B, M] with B={B}")
  if not jnp.issubdtype(page_table_BM.dtype, jnp.integer):
    raise ValueError(f"page_table_BM must be integers, got dtype {page_table_BM.dtype}")
  M = page_table_BM.shape[1]
  _check_lengths_fit(lengths_B, M * C,
                     f"M * C = {M} pages of page_table_BM x {C} slots = {M * C} positions",
                     q_BTNH.shape[1])
  pages_per_split = checks.positive_or_none("pages_per_split", pages_per_split)
  scale = checks.scale_value(scale, H)
  interpret = common.resolve_interpret(interpret)
  if not interpret and (C < 16 or C & (C - 1)):
    raise ValueError(f"page size C={C} of k_pages_PCKH must be a power of two >= 16 on GPU")
  if q_BTNH.size == 0 or M == 0 or P == 0:  # no query, or no page: zeros
    return jnp.zeros(q_BTNH.shape, q_BTNH.dtype)
  rows, Hp = _rows_and_head_dim(q_BTNH, K, interpret)
  pps = min(pages_per_split or -(-M // _default_splits(B * K, M)), M)
  splits = -(-M // pps)

  q = _query_rows(q_BTNH, K, rows)
  q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, Hp - H)))
  k_pages = jnp.pad(k_pages_PCKH, ((0, 0), (0, 0), (0, 0), (0, Hp - H)))
  v_pages = jnp.pad(v_pages_PCKH, ((0, 0), (0, 0), (0, 0), (0, Hp - H)))
  table = jnp.pad(page_table_BM.astype(jnp.int32), ((0, 0), (0, splits * pps - M)))
  len_B1 = lengths_B.astype(jnp.int32)[:, None]
  kernel = functools.partial(
      _paged_kernel, pages_per_split=pps, kv_len_static=M * C, int8=int8, num_queries=T,
      groups=N // K, window=window, scale=scale,
  )
  out_shape, out_specs = _out_specs(B, K, splits, rows, Hp)
  pages_spec = pl.BlockSpec((P, C, None, Hp), lambda b, h, s: (0, 0, h, 0))
  in_specs = [pl.BlockSpec((None, 1), lambda b, h, s: (b, 0)),
              pl.BlockSpec((None, pps), lambda b, h, s: (b, s)),
              pl.BlockSpec((None, None, rows, Hp), lambda b, h, s: (b, h, 0, 0)),
              pages_spec, pages_spec]
  args = [len_B1, table, q, k_pages, v_pages]
  if int8:
    scale_spec = pl.BlockSpec((P, C, None), lambda b, h, s: (0, 0, h))
    in_specs += [scale_spec, scale_spec]
    args += [k_scale_PCK.astype(jnp.float32), v_scale_PCK.astype(jnp.float32)]
  o, lse = pl.pallas_call(
      kernel,
      grid=(B, K, splits),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=common.compiler_params(interpret, 4, 2),
      interpret=interpret,
      name="attnlab_paged_decode",
  )(*args)
  return _combine_splits(o, lse, q_BTNH)


# ----------------------------------------------------------------------------
# Heads-major: the contiguous cache of attnlab.nn.kv_cache.KVCache, [B, K, S, H],
# optionally int8 with per-token scales [B, K, S] dequantized in the kernel.
# ----------------------------------------------------------------------------


def _heads_major_kernel(len_ref, q_ref, k_ref, v_ref, *rest, split_len, tile, kv_len_static,
                        int8, **kw):
  if int8:
    ks_ref, vs_ref, o_ref, lse_ref = rest
  else:
    o_ref, lse_ref = rest
  s = pl.program_id(2)
  length = len_ref[0]
  base = s * (split_len // tile)

  def load_tile(j):
    keys = pl.ds((j - base) * tile, tile)
    k_cH, v_cH = k_ref[keys, :], v_ref[keys, :]
    if int8:  # dequantize the tile: int8 * its per-token float32 scale
      k_cH = k_cH.astype(jnp.float32) * ks_ref[keys][:, None]
      v_cH = v_cH.astype(jnp.float32) * vs_ref[keys][:, None]
    return k_cH, v_cH, True

  o, lse = _split_softmax(q_ref[...], load_tile, length=length,
                          kv_len=jnp.minimum(length, kv_len_static), split=s, tile=tile,
                          tiles_per_split=split_len // tile, **kw)
  o_ref[...] = o
  lse_ref[...] = lse


def decode_attention_heads_major(q_BTNH, k_BKSH, v_BKSH, lengths_B, *, k_scale_BKS=None,
                                 v_scale_BKS=None, window: int | None = None,
                                 scale: float | None = None, num_splits: int | None = None,
                                 interpret: bool | None = None):
  """``decode_attention`` over a heads-major cache [B, K, S, H] (``KVCache``'s layout).

  Args:
    q_BTNH: queries [B, T, N, H], T <= 8: the last T tokens of each sequence.
    k_BKSH, v_BKSH: the cache [B, K, S, H], float, or int8 with
      ``k_scale_BKS`` / ``v_scale_BKS`` (float32 [B, K, S]: key s of head k
      is ``k_BKSH[b, k, s] * k_scale_BKS[b, k, s]``, dequantized per tile in
      the kernel).
    lengths_B, window, scale, num_splits, interpret: as ``decode_attention`` (lengths 0
      or in [T, S]).

  Returns:
    [B, T, N, H] in the dtype of ``q_BTNH``.
  """
  for name, x in (("k_BKSH", k_BKSH), ("v_BKSH", v_BKSH)):
    if x.ndim != 4:
      raise ValueError(f"{name} must be rank 4 [B, K, S, H], got shape {x.shape}")
  if k_BKSH.shape != v_BKSH.shape:
    raise ValueError(f"k_BKSH shape {k_BKSH.shape} and v_BKSH shape {v_BKSH.shape} must match")
  B, K, S, H = k_BKSH.shape
  int8 = _check_scales(k_BKSH, v_BKSH, k_scale_BKS, v_scale_BKS, "k_scale_BKS / v_scale_BKS",
                       (B, K, S))
  if q_BTNH.ndim == 4 and q_BTNH.shape[0] != B:
    raise ValueError(f"batch of q_BTNH ({q_BTNH.shape[0]}) and of the cache ({B}) must match")
  window, lengths_B = _check_queries(q_BTNH, head_dim=H, num_kv_heads=K, kv_name="k_BKSH",
                                     lengths_B=lengths_B, window=window)
  _check_lengths_fit(lengths_B, S, f"S={S} slots of k_BKSH", q_BTNH.shape[1])
  num_splits = checks.positive_or_none("num_splits", num_splits)
  T, N = q_BTNH.shape[1:3]
  scale = checks.scale_value(scale, H)
  interpret = common.resolve_interpret(interpret)
  if q_BTNH.size == 0 or S == 0:  # no query, or no key: zeros, as attention() gives
    return jnp.zeros(q_BTNH.shape, q_BTNH.dtype)
  rows, Hp = _rows_and_head_dim(q_BTNH, K, interpret)
  tile = min(128 if interpret else 64, max(1 if interpret else 16, common.next_pow2(S)))
  num_tiles = -(-S // tile)
  splits = min(num_splits or _default_splits(B * K, num_tiles), num_tiles)
  tiles_per_split = -(-num_tiles // splits)
  splits = -(-num_tiles // tiles_per_split)
  split_len = tiles_per_split * tile
  Sp = splits * split_len

  q = _query_rows(q_BTNH, K, rows)
  q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, Hp - H)))
  pad = ((0, 0), (0, 0), (0, Sp - S), (0, Hp - H))
  k, v = jnp.pad(k_BKSH, pad), jnp.pad(v_BKSH, pad)
  len_B1 = lengths_B.astype(jnp.int32)[:, None]
  kernel = functools.partial(
      _heads_major_kernel, split_len=split_len, tile=tile, kv_len_static=S, int8=int8,
      num_queries=T, groups=N // K, window=window, scale=scale,
  )
  out_shape, out_specs = _out_specs(B, K, splits, rows, Hp)
  kv_spec = pl.BlockSpec((None, None, split_len, Hp), lambda b, h, s: (b, h, s, 0))
  in_specs = [pl.BlockSpec((None, 1), lambda b, h, s: (b, 0)),
              pl.BlockSpec((None, None, rows, Hp), lambda b, h, s: (b, h, 0, 0)), kv_spec, kv_spec]
  args = [len_B1, q, k, v]
  if int8:
    scale_spec = pl.BlockSpec((None, None, split_len), lambda b, h, s: (b, h, s))
    in_specs += [scale_spec, scale_spec]
    args += [jnp.pad(x.astype(jnp.float32), ((0, 0), (0, 0), (0, Sp - S)))
             for x in (k_scale_BKS, v_scale_BKS)]
  o, lse = pl.pallas_call(
      kernel,
      grid=(B, K, splits),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=common.compiler_params(interpret, 4, 2),
      interpret=interpret,
      name="attnlab_decode_heads_major",
  )(*args)
  return _combine_splits(o, lse, q_BTNH)
