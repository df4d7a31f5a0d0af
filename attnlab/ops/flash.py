"""Blocked flash attention in Pallas: forward and FlashAttention-2 backward.

``flash_attention`` computes the same function as ``reference_attention``
without ever holding a [T, S] score matrix: each program owns one block of
``block_q`` queries of one head and walks the key blocks with an online
softmax (running max ``m``, running sum ``l``, float32 accumulator rescaled
by ``exp(m_old - m_new)``). The forward saves the log-sum-exp per query; the
backward recomputes the probabilities of a tile as ``exp(s - lse)`` in two
kernels, one for dQ (a program per query block, looping over key blocks) and
one for dK/dV (a program per key block and KV head, looping over the G query
heads of its group and their query blocks).

Layout: the kernels read the caller's [B, T, N, H] / [B, S, K, H] arrays in
place. Query head n reads KV head n // G through the BlockSpec index map, so
K/V are never repeated, and dK/dV of a KV head sum over its G query heads
inside one program (no atomics, no [B, S, N, H] intermediate).

Block skipping: the loop bounds of every kernel come from ``masks.key_range``
/ ``masks.query_range``, the same predicate the reference op masks with, so a
block wholly outside the causal / window band is neither loaded nor computed.
Inside a visited block the tile is masked with ``masks.position_mask`` plus
the padding and segment-id checks.

Backends:
  * CPU: ``interpret=True`` (the default there); this is what the tests run.
  * GPU: the Triton lowering, with block sizes, ``num_warps`` and
    ``num_stages`` chosen per head dim (``_gpu_tiles``). NOT YET RUN on a
    GPU: the tests only lower it to Triton IR on the CPU (cross-platform
    lowering); compiling and running it is ``tools/gpu_check.sh``.
  * TPU: no Mosaic lowering. The heads axis sits between T and H in the
    blocks, which Mosaic's (8, 128) tiling rule does not accept; compiled use
    raises ``ValueError`` (use ``interpret=True`` or implementation="xla").
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from attnlab.ops import masks

# ----------------------------------------------------------------------------
# Shared by flash.py and decode.py: checks, backend choice, tile matmuls.
# ----------------------------------------------------------------------------


def check_qkv(q_BTNH, k_BSKH, v_BSKH):
  """Raise ValueError (naming the argument) unless q, k, v form a valid GQA request."""
  for name, x in (("q_BTNH", q_BTNH), ("k_BSKH", k_BSKH), ("v_BSKH", v_BSKH)):
    if x.ndim != 4:
      raise ValueError(f"{name} must be rank 4, got shape {x.shape}")
  if k_BSKH.shape != v_BSKH.shape:
    raise ValueError(f"k_BSKH shape {k_BSKH.shape} and v_BSKH shape {v_BSKH.shape} must match")
  if q_BTNH.shape[0] != k_BSKH.shape[0]:
    raise ValueError(
        f"batch of q_BTNH ({q_BTNH.shape[0]}) and k_BSKH ({k_BSKH.shape[0]}) must match"
    )
  if q_BTNH.shape[3] != k_BSKH.shape[3]:
    raise ValueError(
        f"head dim of q_BTNH ({q_BTNH.shape[3]}) and k_BSKH ({k_BSKH.shape[3]}) must match"
    )
  if q_BTNH.shape[2] % k_BSKH.shape[2]:
    raise ValueError(
        f"num heads of q_BTNH ({q_BTNH.shape[2]}) must be a multiple of the num kv heads "
        f"of k_BSKH ({k_BSKH.shape[2]})"
    )


def check_window(window):
  if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                             or window < 1):
    raise ValueError(f"window={window!r} must be a positive integer or None")


def check_block(name: str, value):
  """Block sizes must be powers of two (Triton tiles are)."""
  if value is None:
    return
  if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
    raise ValueError(f"{name}={value!r} must be a positive power of two")


def resolve_interpret(interpret: bool | None) -> bool:
  """None -> interpret on CPU, compile on GPU; TPU compiled has no lowering here."""
  backend = jax.default_backend()
  if interpret is None:
    interpret = backend not in ("gpu", "tpu")
  if not interpret and backend == "tpu":
    raise ValueError(
        "interpret=False on TPU: attnlab's Pallas kernels have no Mosaic lowering (their "
        "blocks put the heads axis between the sequence and head dims). Pass interpret=True "
        "or use implementation='xla'."
    )
  if not interpret and backend != "gpu":
    raise ValueError(f"interpret=False needs a GPU; the default backend is {backend!r}")
  return bool(interpret)


def next_pow2(n: int) -> int:
  return 1 << max(0, (int(n) - 1).bit_length())


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def compiler_params(interpret: bool, num_warps: int | None, num_stages: int | None):
  if interpret:
    return None
  from jax.experimental.pallas import triton as plgpu  # only the GPU path needs it

  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def iota(n: int):
  return lax.broadcasted_iota(jnp.int32, (n,), 0)


def dot_nt(a, b):
  """a @ b.T with a float32 result (no transpose materialized)."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def dot_nn(a, b):
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def dot_tn(a, b):
  """a.T @ b with a float32 result."""
  return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _gpu_tiles(head_dim: int):
  """(block_q, block_k, num_warps, num_stages) for the Triton lowering.

  Usual FlashAttention-2 Triton settings for Hopper-class cards; the
  backward's dK/dV program keeps two [block_k, H] float32 accumulators in
  registers, so larger head dims get more warps or smaller blocks. Untested
  on hardware so far: tune with tools/bench_attention.py --gpu.
  """
  if head_dim <= 64:
    return 128, 64, 4, 3
  if head_dim <= 128:
    return 128, 64, 8, 2
  return 64, 32, 8, 2


# ----------------------------------------------------------------------------
# The kernels.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Static:
  causal: bool
  window: int | None
  scale: float
  q_len: int  # T before padding
  kv_len: int  # S before padding
  block_q: int
  block_k: int
  groups: int  # G = N / K
  segments: bool
  interpret: bool
  num_warps: int | None
  num_stages: int | None


def _tile_mask(st: _Static, off, q_idx, k_idx, q_seg, k_seg):
  """[bq, bk] True where query index q_idx (position off + q_idx) sees key k_idx."""
  ok = masks.position_mask(
      (off + q_idx)[:, None], k_idx[None, :], causal=st.causal, window=st.window
  )
  # Padding rows and columns are masked here, so padded inputs never leak in.
  ok = ok & (q_idx < st.q_len)[:, None] & (k_idx < st.kv_len)[None, :]
  if st.segments:
    ok = ok & (q_seg[:, None] == k_seg[None, :])
  return ok


def block_bounds(lo, hi, block):
  """Block indices [lo // block, ceil(hi / block)) covering positions [lo, hi).

  Empty (0, 0) when hi <= lo.
  """
  lo = jnp.asarray(lo, jnp.int32)
  hi = jnp.asarray(hi, jnp.int32)
  empty = hi <= lo
  # lax.div (truncation) is exact here: both are non-negative when not empty.
  first = jnp.where(empty, 0, lax.div(jnp.maximum(lo, 0), block))
  last = jnp.where(empty, 0, lax.div(jnp.maximum(hi, 0) + block - 1, block))
  return first, last


def _key_blocks(st: _Static, off, i):
  """Key blocks that the queries of query block i can see (from masks.key_range)."""
  q_lo = off + i * st.block_q
  q_hi = off + jnp.minimum((i + 1) * st.block_q, st.q_len)
  lo, hi = masks.key_range(q_lo, q_hi, causal=st.causal, window=st.window, kv_len=st.kv_len)
  hi = jnp.where(q_hi > q_lo, hi, lo)  # a query block made only of padding sees nothing
  return block_bounds(lo, hi, st.block_k)


def _query_blocks(st: _Static, off, j):
  """Query blocks that see some key of key block j (from masks.query_range)."""
  k_lo = j * st.block_k
  k_hi = jnp.minimum((j + 1) * st.block_k, st.kv_len)
  lo, hi = masks.query_range(
      k_lo, k_hi, causal=st.causal, window=st.window, q_lo=off, q_hi=off + st.q_len
  )
  hi = jnp.where(k_hi > k_lo, hi, lo)
  return block_bounds(lo - off, hi - off, st.block_q)


def _segment_refs(st, rest):
  if st.segments:
    return rest[0], rest[1], rest[2:]
  return None, None, rest


def _forward_kernel(off_ref, q_ref, k_ref, v_ref, *rest, st: _Static):
  q_seg_ref, k_seg_ref, (o_ref, lse_ref) = _segment_refs(st, rest)
  bq, bk = st.block_q, st.block_k
  i = pl.program_id(2)
  off = off_ref[0]
  q_idx = i * bq + iota(bq)
  q_bH = q_ref[...]
  q_seg = q_seg_ref[...] if st.segments else None

  def body(j, carry):
    m_b, l_b, acc_bH = carry
    keys = pl.ds(j * bk, bk)
    k_seg = k_seg_ref[keys] if st.segments else None
    s_bc = dot_nt(q_bH, k_ref[keys, :]) * st.scale
    s_bc = jnp.where(_tile_mask(st, off, q_idx, j * bk + iota(bk), q_seg, k_seg), s_bc, -jnp.inf)
    m_new = jnp.maximum(m_b, jnp.max(s_bc, axis=1))
    # A row with no key seen yet keeps m = -inf; shift by 0 so exp() gives 0, not NaN.
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha_b = jnp.exp(m_b - m_safe)
    p_bc = jnp.exp(s_bc - m_safe[:, None])
    l_b = alpha_b * l_b + jnp.sum(p_bc, axis=1)
    v_cH = v_ref[keys, :]
    acc_bH = alpha_b[:, None] * acc_bH + dot_nn(p_bc.astype(v_cH.dtype), v_cH)
    return m_new, l_b, acc_bH

  first, last = _key_blocks(st, off, i)
  init = (
      jnp.full((bq,), -jnp.inf, jnp.float32),
      jnp.zeros((bq,), jnp.float32),
      jnp.zeros(q_bH.shape, jnp.float32),
  )
  m_b, l_b, acc_bH = lax.fori_loop(first, last, body, init)
  seen = l_b > 0
  l_safe = jnp.where(seen, l_b, 1.0)
  o_ref[...] = (acc_bH / l_safe[:, None]).astype(o_ref.dtype)
  # A row that saw no key gets lse = +inf: its backward probabilities exp(s - lse) are 0.
  lse_ref[...] = jnp.where(seen, m_b + jnp.log(l_safe), jnp.inf)


def _dq_kernel(off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest, st: _Static):
  q_seg_ref, k_seg_ref, (dq_ref,) = _segment_refs(st, rest)
  bq, bk = st.block_q, st.block_k
  i = pl.program_id(2)
  off = off_ref[0]
  q_idx = i * bq + iota(bq)
  q_bH, do_bH = q_ref[...], do_ref[...]
  lse_b, delta_b = lse_ref[...], delta_ref[...]
  q_seg = q_seg_ref[...] if st.segments else None

  def body(j, dq_bH):
    keys = pl.ds(j * bk, bk)
    k_seg = k_seg_ref[keys] if st.segments else None
    k_cH = k_ref[keys, :]
    s_bc = dot_nt(q_bH, k_cH) * st.scale
    s_bc = jnp.where(_tile_mask(st, off, q_idx, j * bk + iota(bk), q_seg, k_seg), s_bc, -jnp.inf)
    p_bc = jnp.exp(s_bc - lse_b[:, None])
    dp_bc = dot_nt(do_bH, v_ref[keys, :])
    ds_bc = p_bc * (dp_bc - delta_b[:, None]) * st.scale
    return dq_bH + dot_nn(ds_bc.astype(k_cH.dtype), k_cH)

  first, last = _key_blocks(st, off, i)
  dq_bH = lax.fori_loop(first, last, body, jnp.zeros(q_bH.shape, jnp.float32))
  dq_ref[...] = dq_bH.astype(dq_ref.dtype)


def _dkv_kernel(off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest, st: _Static):
  q_seg_ref, k_seg_ref, (dk_ref, dv_ref) = _segment_refs(st, rest)
  bq, bk = st.block_q, st.block_k
  j = pl.program_id(2)
  off = off_ref[0]
  k_idx = j * bk + iota(bk)
  k_cH, v_cH = k_ref[...], v_ref[...]
  k_seg = k_seg_ref[...] if st.segments else None
  first, last = _query_blocks(st, off, j)

  def head(g, carry):
    # The G query heads of this KV head all read the same K/V block: their
    # contributions to dK/dV are summed here, in registers.
    def body(i, carry):
      dk_cH, dv_cH = carry
      rows = pl.ds(i * bq, bq)
      q_bH, do_bH = q_ref[rows, g, :], do_ref[rows, g, :]
      lse_b, delta_b = lse_ref[g, rows], delta_ref[g, rows]
      q_seg = q_seg_ref[rows] if st.segments else None
      s_bc = dot_nt(q_bH, k_cH) * st.scale
      s_bc = jnp.where(_tile_mask(st, off, i * bq + iota(bq), k_idx, q_seg, k_seg), s_bc,
                       -jnp.inf)
      p_bc = jnp.exp(s_bc - lse_b[:, None])
      dv_cH = dv_cH + dot_tn(p_bc.astype(do_bH.dtype), do_bH)
      dp_bc = dot_nt(do_bH, v_cH)
      ds_bc = p_bc * (dp_bc - delta_b[:, None]) * st.scale
      dk_cH = dk_cH + dot_tn(ds_bc.astype(q_bH.dtype), q_bH)
      return dk_cH, dv_cH

    return lax.fori_loop(first, last, body, carry)

  zeros = jnp.zeros(k_cH.shape, jnp.float32)
  dk_cH, dv_cH = lax.fori_loop(0, st.groups, head, (zeros, zeros))
  dk_ref[...] = dk_cH.astype(dk_ref.dtype)
  dv_ref[...] = dv_cH.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------
# pallas_call wrappers and the custom VJP.
# ----------------------------------------------------------------------------


def _forward(st: _Static, q, k, v, off_B1, q_seg, kv_seg):
  B, Tp, N, H = q.shape
  Sp = k.shape[1]
  G, bq = st.groups, st.block_q
  in_specs = [
      pl.BlockSpec((None, 1), lambda b, n, i: (b, 0)),
      pl.BlockSpec((None, bq, None, H), lambda b, n, i: (b, i, n, 0)),
      pl.BlockSpec((None, Sp, None, H), lambda b, n, i: (b, 0, n // G, 0)),
      pl.BlockSpec((None, Sp, None, H), lambda b, n, i: (b, 0, n // G, 0)),
  ]
  args = [off_B1, q, k, v]
  if st.segments:
    in_specs += [pl.BlockSpec((None, bq), lambda b, n, i: (b, i)),
                 pl.BlockSpec((None, Sp), lambda b, n, i: (b, 0))]
    args += [q_seg, kv_seg]
  return pl.pallas_call(
      functools.partial(_forward_kernel, st=st),
      grid=(B, N, Tp // bq),
      in_specs=in_specs,
      out_specs=[
          pl.BlockSpec((None, bq, None, H), lambda b, n, i: (b, i, n, 0)),
          pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct(q.shape, q.dtype),
          jax.ShapeDtypeStruct((B, N, Tp), jnp.float32),
      ],
      compiler_params=compiler_params(st.interpret, st.num_warps, st.num_stages),
      interpret=st.interpret,
      name="attnlab_flash_forward",
  )(*args)


def _backward(st: _Static, res, do):
  q, k, v, off_B1, q_seg, kv_seg, out, lse_BNT = res
  B, Tp, N, H = q.shape
  Sp, K = k.shape[1], k.shape[2]
  G, bq, bk = st.groups, st.block_q, st.block_k
  # D_t = sum_h dO_th O_th, the softmax Jacobian's diagonal term (elementwise, no [T, S]).
  delta_BNT = jnp.einsum("BTNH,BTNH->BNT", do.astype(jnp.float32), out.astype(jnp.float32))
  params = compiler_params(st.interpret, st.num_warps, st.num_stages)

  dq_specs = [
      pl.BlockSpec((None, 1), lambda b, n, i: (b, 0)),
      pl.BlockSpec((None, bq, None, H), lambda b, n, i: (b, i, n, 0)),
      pl.BlockSpec((None, Sp, None, H), lambda b, n, i: (b, 0, n // G, 0)),
      pl.BlockSpec((None, Sp, None, H), lambda b, n, i: (b, 0, n // G, 0)),
      pl.BlockSpec((None, bq, None, H), lambda b, n, i: (b, i, n, 0)),
      pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i)),
      pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i)),
  ]
  args = [off_B1, q, k, v, do, lse_BNT, delta_BNT]
  seg_args = []
  if st.segments:
    dq_specs += [pl.BlockSpec((None, bq), lambda b, n, i: (b, i)),
                 pl.BlockSpec((None, Sp), lambda b, n, i: (b, 0))]
    seg_args = [q_seg, kv_seg]
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, st=st),
      grid=(B, N, Tp // bq),
      in_specs=dq_specs,
      out_specs=pl.BlockSpec((None, bq, None, H), lambda b, n, i: (b, i, n, 0)),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=params,
      interpret=st.interpret,
      name="attnlab_flash_dq",
  )(*args, *seg_args)

  # dK/dV: one program per (batch, KV head, key block); the G query heads of
  # the group are the block [kh * G, kh * G + G) of the N axis.
  dkv_specs = [
      pl.BlockSpec((None, 1), lambda b, h, j: (b, 0)),
      pl.BlockSpec((None, Tp, G, H), lambda b, h, j: (b, 0, h, 0)),
      pl.BlockSpec((None, bk, None, H), lambda b, h, j: (b, j, h, 0)),
      pl.BlockSpec((None, bk, None, H), lambda b, h, j: (b, j, h, 0)),
      pl.BlockSpec((None, Tp, G, H), lambda b, h, j: (b, 0, h, 0)),
      pl.BlockSpec((None, G, Tp), lambda b, h, j: (b, h, 0)),
      pl.BlockSpec((None, G, Tp), lambda b, h, j: (b, h, 0)),
  ]
  if st.segments:
    dkv_specs += [pl.BlockSpec((None, Tp), lambda b, h, j: (b, 0)),
                  pl.BlockSpec((None, bk), lambda b, h, j: (b, j))]
  kv_spec = pl.BlockSpec((None, bk, None, H), lambda b, h, j: (b, j, h, 0))
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, st=st),
      grid=(B, K, Sp // bk),
      in_specs=dkv_specs,
      out_specs=[kv_spec, kv_spec],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=params,
      interpret=st.interpret,
      name="attnlab_flash_dkv",
  )(*args, *seg_args)
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st, q, k, v, off_B1, q_seg, kv_seg):
  return _forward(st, q, k, v, off_B1, q_seg, kv_seg)[0]


def _flash_fwd(st, q, k, v, off_B1, q_seg, kv_seg):
  out, lse_BNT = _forward(st, q, k, v, off_B1, q_seg, kv_seg)
  return out, (q, k, v, off_B1, q_seg, kv_seg, out, lse_BNT)


def _flash_bwd(st, res, do):
  dq, dk, dv = _backward(st, res, do)
  return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    *,
    causal: bool = False,
    window: int | None = None,
    q_segment_ids=None,
    kv_segment_ids=None,
    q_offset=0,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    interpret: bool | None = None,
):
  """Flash attention (Pallas), differentiable, with the reference op's semantics.

  Args:
    q_BTNH: queries [B, T, N, H].
    k_BSKH: keys [B, S, K, H]; N must be a multiple of K (GQA / MQA).
    v_BSKH: values [B, S, K, H].
    causal: a query at position t sees keys at positions <= t.
    window: sliding window of that many keys, the query's own included.
    q_segment_ids, kv_segment_ids: optional int [B, T] and [B, S]; a query
      sees only keys with its segment id.
    q_offset: int or int [B]: position of the first query (queries that are
      the tail of a longer sequence); keys are at positions 0..S-1.
    scale: multiplier of the scores; default 1/sqrt(H).
    block_q, block_k: tile sizes (powers of two); default per backend and
      head dim. T and S need not be multiples: inputs are padded and the
      padding masked.
    interpret: run the kernels in Pallas interpret mode; default True on
      CPU, False (Triton) on GPU.

  Returns:
    [B, T, N, H] in the dtype of ``q_BTNH``; a query that sees no key gets
    zeros (and zero gradients).
  """
  check_qkv(q_BTNH, k_BSKH, v_BSKH)
  check_window(window)
  check_block("block_q", block_q)
  check_block("block_k", block_k)
  B, T, N, H = q_BTNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("q_segment_ids and kv_segment_ids must be given together")
  if q_segment_ids is not None:
    if tuple(q_segment_ids.shape) != (B, T):
      raise ValueError(f"q_segment_ids shape {q_segment_ids.shape} must be [B, T] = {(B, T)}")
    if tuple(kv_segment_ids.shape) != (B, S):
      raise ValueError(f"kv_segment_ids shape {kv_segment_ids.shape} must be [B, S] = {(B, S)}")
  if T == 0 or S == 0:
    return jnp.zeros(q_BTNH.shape, q_BTNH.dtype)
  scale = 1.0 / math.sqrt(H) if scale is None else float(scale)
  interpret = resolve_interpret(interpret)

  if interpret:
    # Interpret mode: larger tiles mean fewer (sequential) grid steps.
    default_q, default_k, num_warps, num_stages = 128, 128, None, None
    min_block = 1
  else:
    default_q, default_k, num_warps, num_stages = _gpu_tiles(H)
    min_block = 16  # Triton's tl.dot needs every tile dim >= 16
  bq = max(min_block, min(block_q or default_q, next_pow2(T)))
  bk = max(min_block, min(block_k or default_k, next_pow2(S)))

  q, k, v = q_BTNH, k_BSKH, v_BSKH
  Hp = H if interpret else max(16, next_pow2(H))
  Tp, Sp = round_up(T, bq), round_up(S, bk)
  # Zero padding: padded head-dim lanes add 0 to every score and output
  # lane; padded rows / keys are masked in the kernels.
  q = jnp.pad(q, ((0, 0), (0, Tp - T), (0, 0), (0, Hp - H)))
  k = jnp.pad(k, ((0, 0), (0, Sp - S), (0, 0), (0, Hp - H)))
  v = jnp.pad(v, ((0, 0), (0, Sp - S), (0, 0), (0, Hp - H)))
  segments = q_segment_ids is not None
  q_seg = kv_seg = None
  if segments:
    q_seg = jnp.pad(q_segment_ids.astype(jnp.int32), ((0, 0), (0, Tp - T)))
    kv_seg = jnp.pad(kv_segment_ids.astype(jnp.int32), ((0, 0), (0, Sp - S)))
  off_B1 = jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32), (B,))[:, None]
  st = _Static(
      causal=bool(causal), window=window, scale=scale, q_len=T, kv_len=S, block_q=bq,
      block_k=bk, groups=N // K, segments=segments, interpret=interpret,
      num_warps=num_warps, num_stages=num_stages,
  )
  out = _flash(st, q, k, v, off_B1, q_seg, kv_seg)
  return out[:, :T, :, :H]
