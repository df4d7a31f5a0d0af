"""The flash-attention kernels in the Triton style (Pallas on GPU; interpret mode on CPU).

Forward: one program per (batch, query head, query block) walks the key
blocks with an online softmax (running max ``m``, running sum ``l``, float32
accumulator rescaled by ``exp(m_old - m_new)``) and saves the log-sum-exp per
query. Backward: the probabilities of a tile are recomputed as
``exp(s - lse)`` in two kernels, one for dQ (a program per query block,
looping over key blocks) and one for dK/dV (a program per key block and KV
head, looping over the G query heads of its group and their query blocks).

Layout: the kernels read the caller's [B, T, N, H] / [B, S, K, H] arrays in
place. Query head n reads KV head n // G through the BlockSpec index map, so
K/V are never repeated, and dK/dV of a KV head sum over its G query heads
inside one program (no atomics, no [B, S, N, H] intermediate).

Inside a kernel, ``b`` is a query tile (``block_q`` rows) and ``c`` a key
tile (``block_k`` columns): ``s_bc`` are the scores of one tile.

The interface of a flash kernel module (``attnlab.ops.pallas.flash`` picks
one by backend): ``plan(T, S, H, ...) -> (BlockSizes, padded H)``,
``forward(st, q, k, v, off_B1, q_seg, kv_seg) -> (out, lse_BNT)`` and
``backward(st, residuals, dout) -> (dq, dk, dv)``.

Status: Triton lowering with block sizes, ``num_warps`` and ``num_stages``
per head dim (``gpu_tiles``). NOT YET RUN on a GPU: the tests only lower it
to Triton IR on the CPU (cross-platform lowering); compiling and running it
is ``tools/gpu_check.sh``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from attnlab.ops.pallas.common import (
    BlockSizes,
    FlashStatic,
    compiler_params,
    dot_nn,
    dot_nt,
    dot_tn,
    iota,
    key_blocks,
    next_pow2,
    pair_operand,
    query_blocks,
    tile_mask,
)


def gpu_tiles(head_dim: int) -> BlockSizes:
  """Default blocks and launch settings for the Triton lowering.

  Usual FlashAttention-2 Triton settings for Hopper-class cards; the
  backward's dK/dV program keeps two [block_k, H] float32 accumulators in
  registers, so larger head dims get more warps or smaller blocks. Untested
  on hardware so far: tune with tools/bench_attention.py --gpu.
  """
  if head_dim <= 64:
    return BlockSizes(128, 64, num_warps=4, num_stages=3)
  if head_dim <= 128:
    return BlockSizes(128, 64, num_warps=8, num_stages=2)
  return BlockSizes(64, 32, num_warps=8, num_stages=2)


def plan(T: int, S: int, H: int, *, block_q: int | None, block_k: int | None,
         interpret: bool) -> tuple[BlockSizes, int]:
  """The blocks of a call and the (padded) head dim the kernels see.

  Interpret mode takes larger tiles (fewer sequential grid steps); Triton
  needs every tile dim a power of two and >= 16 for ``tl.dot``, so the head
  dim is zero-padded there. Blocks never exceed the padded length.
  """
  if interpret:
    # Interpret mode: larger tiles mean fewer (sequential) grid steps.
    default, min_block = BlockSizes(128, 128), 1
  else:
    default, min_block = gpu_tiles(H), 16  # Triton's tl.dot needs every tile dim >= 16
  blocks = dataclasses.replace(
      default,
      block_q=max(min_block, min(block_q or default.block_q, next_pow2(T))),
      block_k=max(min_block, min(block_k or default.block_k, next_pow2(S))))
  return blocks, (H if interpret else max(16, next_pow2(H)))


def _segment_refs(st, rest):
  if st.segments:
    return rest[0], rest[1], rest[2:]
  return None, None, rest


def _forward_kernel(off_ref, q_ref, k_ref, v_ref, *rest, st: FlashStatic):
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
    s_bc = jnp.where(tile_mask(st, off, q_idx, j * bk + iota(bk), q_seg, k_seg), s_bc, -jnp.inf)
    m_new = jnp.maximum(m_b, jnp.max(s_bc, axis=1))
    # A row with no key seen yet keeps m = -inf; shift by 0 so exp() gives 0, not NaN.
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha_b = jnp.exp(m_b - m_safe)
    p_bc = jnp.exp(s_bc - m_safe[:, None])
    l_b = alpha_b * l_b + jnp.sum(p_bc, axis=1)
    v_cH = v_ref[keys, :]
    acc_bH = alpha_b[:, None] * acc_bH + dot_nn(p_bc.astype(v_cH.dtype), v_cH)
    return m_new, l_b, acc_bH

  first, last = key_blocks(st, off, i)
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


def _dq_kernel(off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest, st: FlashStatic):
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
    s_bc = jnp.where(tile_mask(st, off, q_idx, j * bk + iota(bk), q_seg, k_seg), s_bc, -jnp.inf)
    p_bc = jnp.exp(s_bc - lse_b[:, None])
    dp_bc = dot_nt(do_bH, v_ref[keys, :])
    ds_bc = p_bc * (dp_bc - delta_b[:, None]) * st.scale
    return dq_bH + dot_nn(pair_operand(ds_bc, q_bH, k_cH), k_cH)

  first, last = key_blocks(st, off, i)
  dq_bH = lax.fori_loop(first, last, body, jnp.zeros(q_bH.shape, jnp.float32))
  dq_ref[...] = dq_bH.astype(dq_ref.dtype)


def _dkv_kernel(off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest, st: FlashStatic):
  q_seg_ref, k_seg_ref, (dk_ref, dv_ref) = _segment_refs(st, rest)
  bq, bk = st.block_q, st.block_k
  j = pl.program_id(2)
  off = off_ref[0]
  k_idx = j * bk + iota(bk)
  k_cH, v_cH = k_ref[...], v_ref[...]
  k_seg = k_seg_ref[...] if st.segments else None
  first, last = query_blocks(st, off, j)

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
      s_bc = jnp.where(tile_mask(st, off, i * bq + iota(bq), k_idx, q_seg, k_seg), s_bc,
                       -jnp.inf)
      p_bc = jnp.exp(s_bc - lse_b[:, None])
      dv_cH = dv_cH + dot_tn(pair_operand(p_bc, do_bH, v_cH), do_bH)
      dp_bc = dot_nt(do_bH, v_cH)
      ds_bc = p_bc * (dp_bc - delta_b[:, None]) * st.scale
      dk_cH = dk_cH + dot_tn(pair_operand(ds_bc, q_bH, k_cH), q_bH)
      return dk_cH, dv_cH

    return lax.fori_loop(first, last, body, carry)

  zeros = jnp.zeros(k_cH.shape, jnp.float32)
  dk_cH, dv_cH = lax.fori_loop(0, st.groups, head, (zeros, zeros))
  dk_ref[...] = dk_cH.astype(dk_ref.dtype)
  dv_ref[...] = dv_cH.astype(dv_ref.dtype)


def forward(st: FlashStatic, q, k, v, off_B1, q_seg, kv_seg):
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
      compiler_params=compiler_params(st.interpret, st.blocks.num_warps, st.blocks.num_stages),
      interpret=st.interpret,
      name="attnlab_flash_forward",
  )(*args)


def backward(st: FlashStatic, res, do):
  q, k, v, off_B1, q_seg, kv_seg, out, lse_BNT = res
  B, Tp, N, H = q.shape
  Sp, K = k.shape[1], k.shape[2]
  G, bq, bk = st.groups, st.block_q, st.block_k
  # D_t = sum_h dO_th O_th, the softmax Jacobian's diagonal term (elementwise, no [T, S]).
  delta_BNT = jnp.einsum("BTNH,BTNH->BNT", do.astype(jnp.float32), out.astype(jnp.float32))
  params = compiler_params(st.interpret, st.blocks.num_warps, st.blocks.num_stages)

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
