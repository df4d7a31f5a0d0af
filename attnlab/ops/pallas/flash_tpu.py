"""Blocked flash attention for TPU (Pallas / Mosaic): forward and FlashAttention-2 backward.

``flash_attention_tpu`` computes the same function as the reference op
(``reference_attention``) in the TPU style:

  * Layout: q, k, v are transposed at the boundary to heads-major
    ``[B, N, T, H]`` / ``[B, K, S, H]``, so every block's last two dims are
    (sequence block, H): the sequence block is a multiple of 8 sublanes (of
    128 when compiled) and H is the whole last dim, which is what Mosaic tiles
    ((8, 128) rule). The transposes are plain XLA ops around the kernels.
  * Forward: grid (batch, head, query block, key step), the key axis
    "arbitrary". The running max ``m``, running sum ``l`` (both
    ``[block_q, 128]``, the value replicated over the lanes) and the output
    accumulator ``[block_q, H]`` are float32 VMEM scratch that lives across
    the key steps; the last key step normalizes and writes the output and the
    log-sum-exp (lane-replicated ``[B, N, T, 128]``, lane 0 kept).
  * Backward: a dQ kernel (the forward's grid) and a dK/dV kernel with grid
    (batch, KV head, key block, query step) whose query steps walk the G query
    heads of the KV head and their query blocks, so dK/dV of a KV head sum over
    its group in VMEM scratch (no atomics, no ``[B, N, S, H]`` intermediate).
    It computes the scores transposed (``[block_k, block_q]``), so the saved
    log-sum-exp and ``delta = rowsum(dO * O)`` enter as lane-dense rows.
  * GQA: query head n reads KV head ``lax.div(n, G)`` through the index maps;
    K/V are never repeated.
  * Block skipping, from ``masks.key_range`` / ``masks.query_range`` (the same
    predicate the reference masks with): key step j of query block i is key
    block ``first(i) + j``; steps past the last visible block do no compute
    (``pl.when``) and their index map is clamped to the last visible block, so
    the pipeline sees an unchanged block index and issues no DMA. With a
    sliding window the key axis of the grid is only as long as the most key
    blocks a query block can see (likewise the query axis of dK/dV), so a
    window costs grid steps in proportion to the band, not to S.
  * ``q_offset`` (int or int [B]) is scalar-prefetched into SMEM: the index
    maps and the kernels read it to place the band per sequence.
  * Any T and S: padded to the block sizes; padded queries and keys are
    masked. A query that sees no key returns zeros (log-sum-exp +inf, so its
    backward probabilities are 0).

Where it runs: compiled (Mosaic) on a TPU; elsewhere in TPU interpret mode
(``pltpu.InterpretParams()``: TPU memory spaces, scratch, grid order and DMA
semantics emulated on the CPU). On this project's CPU-only machines it has
been checked in interpret mode and by lowering for ``("tpu",)`` only; it has
never run on a TPU (``tools/tpu_check.sh`` is the check to run on one).

Shared with the Triton kernels (``ops/pallas/common.py``): ``BlockSizes``,
``FlashStatic`` (extended here by ``TpuStatic``), the block ranges
``key_blocks`` / ``query_blocks`` and the dot helpers; the inputs are checked by
``ops/checks.py``. Called through ``attnlab.ops.pallas.flash.flash_attention``
(``backend="tpu"``, or ``backend=None`` lowered for TPU).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attnlab.ops import checks, masks
from attnlab.ops.pallas.common import (
    BlockSizes,
    FlashStatic,
    dot_nn,
    dot_nt,
    first_order_only,
    key_blocks,
    pair_operand,
    query_blocks,
    round_up,
)

LANES = 128  # TPU vector lanes: the last dim of a tile
SUBLANES = 8  # TPU sublanes: the second-to-last dim of a 32-bit tile
COMPILED_BLOCK = 512  # default block_q / block_k compiled (capped at the padded length)
INTERPRET_BLOCK = 128  # default in interpret mode (fewer sequential grid steps)


def resolve_interpret(interpret):
  """None -> compiled on a TPU, TPU interpret mode elsewhere; True -> InterpretParams()."""
  if interpret is None:
    interpret = jax.default_backend() != "tpu"
  if isinstance(interpret, pltpu.InterpretParams):
    return interpret
  if interpret is True:
    return pltpu.InterpretParams()
  if interpret is False:
    return False
  raise ValueError(f"interpret={interpret!r} must be None, a bool or a pltpu.InterpretParams")


def _span_blocks(span: int, block: int, n_blocks: int) -> int:
  """Most blocks of ``block`` that a run of ``span`` positions can touch (any alignment)."""
  return min(n_blocks, (span - 1 + block - 1) // block + 1)


@dataclasses.dataclass(frozen=True)
class TpuStatic(FlashStatic):
  """``FlashStatic`` (``interpret``: False or a hashable ``pltpu.InterpretParams``) plus
  the grid extents and two debug switches for the block-skipping test (both True
  in normal use)."""

  clamp_dma: bool = True  # skipped steps map to an already-fetched block
  skip_compute: bool = True  # skipped steps do no compute

  @property
  def nq(self) -> int:
    return round_up(self.q_len, self.block_q) // self.block_q

  @property
  def nk(self) -> int:
    return round_up(self.kv_len, self.block_k) // self.block_k

  @property
  def k_steps(self) -> int:
    """Key steps per query block: all key blocks, or the most a window band touches."""
    if self.window is None:
      return self.nk
    w = self.window
    span = self.block_q + w - 1 if self.causal else self.block_q + 2 * w - 2
    return _span_blocks(span, self.block_k, self.nk)

  @property
  def q_steps(self) -> int:
    """Query steps per (key block, query head) in dK/dV."""
    if self.window is None:
      return self.nq
    w = self.window
    span = self.block_k + w - 1 if self.causal else self.block_k + 2 * w - 2
    return _span_blocks(span, self.block_q, self.nq)


def _step_block(st: TpuStatic, first, last, step, n_blocks):
  """The block a grid step fetches: first + step, clamped into the visible range.

  A step past the range maps to the last visible block (the pipeline sees the
  previous step's index and does not fetch again); with an empty range every
  step maps to block ``first`` (fetched once, never used).
  """
  blk = first + step
  if st.clamp_dma:
    blk = jnp.minimum(blk, jnp.maximum(last - 1, first))
  return jnp.minimum(blk, n_blocks - 1)


def _run(st: TpuStatic, blk, last):
  return blk < last if st.skip_compute else blk >= 0


def _lanes(x_bL, width: int):
  """Lane-replicated [rows, 128] statistics -> [rows, width]."""
  if width == LANES:
    return x_bL
  if width < LANES:
    return x_bL[:, :width]
  reps = -(-width // LANES)
  x = jnp.tile(x_bL, (1, reps))
  return x if width == reps * LANES else x[:, :width]


def _tile_mask(st: TpuStatic, off, q_start, k_start, shape, q_axis: int, q_seg, k_seg):
  """Which (query, key) pairs of a tile attend; queries along ``q_axis`` of ``shape``.

  Positions come from 2-D iotas (Mosaic has no 1-D iota); padding rows and
  columns are masked here, so padded inputs never leak in.
  """
  q_idx = q_start + lax.broadcasted_iota(jnp.int32, shape, q_axis)
  k_idx = k_start + lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis)
  ok = masks.position_mask(off + q_idx, k_idx, causal=st.causal, window=st.window)
  ok = ok & (q_idx < st.q_len) & (k_idx < st.kv_len)
  if st.segments:
    ok = ok & (q_seg == k_seg)
  return ok


# ----------------------------------------------------------------------------
# Kernels.
# ----------------------------------------------------------------------------


def _forward_kernel(off_ref, q_ref, k_ref, v_ref, *rest, st: TpuStatic, save_lse: bool):
  if st.segments:
    qs_ref, ks_ref, *rest = rest
  if save_lse:
    o_ref, lse_ref, m_ref, l_ref, acc_ref = rest
  else:
    o_ref, m_ref, l_ref, acc_ref = rest
  bq, bk = st.block_q, st.block_k
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  off = off_ref[b]
  first, last = key_blocks(st, off, i)
  kb = first + j

  @pl.when(j == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(_run(st, kb, last))
  def _step():
    q_bH, k_cH, v_cH = q_ref[...], k_ref[...], v_ref[...]
    s_bc = dot_nt(q_bH, k_cH) * st.scale
    q_seg = k_seg = None
    if st.segments:
      q_seg, k_seg = jnp.expand_dims(qs_ref[0], -1), ks_ref[...]
    ok = _tile_mask(st, off, i * bq, kb * bk, (bq, bk), 0, q_seg, k_seg)
    s_bc = jnp.where(ok, s_bc, -jnp.inf)
    m_prev = m_ref[...]
    m_new = jnp.maximum(m_prev, jnp.max(s_bc, axis=1, keepdims=True))  # [bq, 128]
    # A row with no key seen yet keeps m = -inf; shift by 0 so exp() gives 0, not NaN.
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m_prev - m_safe)
    p_bc = jnp.exp(s_bc - _lanes(m_safe, bk))
    l_ref[...] = alpha * l_ref[...] + jnp.sum(p_bc, axis=1, keepdims=True)
    m_ref[...] = m_new
    pv_bH = dot_nn(p_bc.astype(v_cH.dtype), v_cH)
    acc_ref[...] = _lanes(alpha, acc_ref.shape[1]) * acc_ref[...] + pv_bH

  @pl.when(j == st.k_steps - 1)
  def _finish():
    l_bL = l_ref[...]
    seen = l_bL > 0
    l_safe = jnp.where(seen, l_bL, 1.0)
    o_ref[...] = (acc_ref[...] / _lanes(l_safe, acc_ref.shape[1])).astype(o_ref.dtype)
    if save_lse:
      # A row that saw no key gets lse = +inf: its backward probabilities are 0.
      lse_ref[...] = jnp.where(seen, m_ref[...] + jnp.log(l_safe), jnp.inf)


def _dq_kernel(off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest, st: TpuStatic):
  if st.segments:
    qs_ref, ks_ref, *rest = rest
  dq_ref, acc_ref = rest
  bq, bk = st.block_q, st.block_k
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  off = off_ref[b]
  first, last = key_blocks(st, off, i)
  kb = first + j

  @pl.when(j == 0)
  def _init():
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(_run(st, kb, last))
  def _step():
    q_bH, k_cH, v_cH, do_bH = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
    s_bc = dot_nt(q_bH, k_cH) * st.scale
    q_seg = k_seg = None
    if st.segments:
      q_seg, k_seg = jnp.expand_dims(qs_ref[0], -1), ks_ref[...]
    ok = _tile_mask(st, off, i * bq, kb * bk, (bq, bk), 0, q_seg, k_seg)
    s_bc = jnp.where(ok, s_bc, -jnp.inf)
    p_bc = jnp.exp(s_bc - jnp.expand_dims(lse_ref[0], -1))
    dp_bc = dot_nt(do_bH, v_cH)
    ds_bc = p_bc * (dp_bc - jnp.expand_dims(delta_ref[0], -1)) * st.scale
    acc_ref[...] += dot_nn(pair_operand(ds_bc, q_bH, k_cH), k_cH)

  @pl.when(j == st.k_steps - 1)
  def _finish():
    dq_ref[...] = acc_ref[...].astype(dq_ref.dtype)


def _dkv_kernel(off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest, st: TpuStatic):
  if st.segments:
    qs_ref, ks_ref, *rest = rest
  dk_ref, dv_ref, dk_acc, dv_acc = rest
  bq, bk = st.block_q, st.block_k
  b, j, t = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  off = off_ref[b]
  first, last = query_blocks(st, off, j)
  qb = first + lax.rem(t, st.q_steps)

  @pl.when(t == 0)
  def _init():
    dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
    dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

  @pl.when(_run(st, qb, last))
  def _step():
    q_bH, k_cH, v_cH, do_bH = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
    # Transposed tile [bk, bq]: lse and delta are rows, broadcast over sublanes.
    s_cb = dot_nt(k_cH, q_bH) * st.scale
    q_seg = k_seg = None
    if st.segments:
      q_seg, k_seg = qs_ref[...], jnp.expand_dims(ks_ref[0], -1)
    ok = _tile_mask(st, off, qb * bq, j * bk, (bk, bq), 1, q_seg, k_seg)
    s_cb = jnp.where(ok, s_cb, -jnp.inf)
    p_cb = jnp.exp(s_cb - lse_ref[...])
    dv_acc[...] += dot_nn(pair_operand(p_cb, do_bH, v_cH), do_bH)
    dp_cb = dot_nt(v_cH, do_bH)
    ds_cb = p_cb * (dp_cb - delta_ref[...]) * st.scale
    dk_acc[...] += dot_nn(pair_operand(ds_cb, q_bH, k_cH), q_bH)

  @pl.when(t == st.groups * st.q_steps - 1)
  def _finish():
    dk_ref[...] = dk_acc[...].astype(dk_ref.dtype)
    dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


# ----------------------------------------------------------------------------
# pallas_call wrappers and the custom VJP. Arrays here are heads-major and
# padded: q [B, N, Tp, H], k / v [B, K, Sp, H], segment ids [B, 1, Tp] /
# [B, 1, Sp], q offsets [B] (scalar-prefetched).
# ----------------------------------------------------------------------------


def _params(semantics):
  return pltpu.CompilerParams(dimension_semantics=semantics)


_SEMANTICS = ("parallel", "parallel", "parallel", "arbitrary")


def _q_major_specs(st: TpuStatic, H: int):
  """BlockSpecs of the (b, n, i, j) grid: q-side blocks and the clamped k-side blocks."""
  bq, bk, G = st.block_q, st.block_k, st.groups

  def kv_block(b, i, j, off_ref):
    first, last = key_blocks(st, off_ref[b], i)
    return _step_block(st, first, last, j, st.nk)

  q_spec = pl.BlockSpec((None, None, bq, H), lambda b, n, i, j, off: (b, n, i, 0))
  kv_spec = pl.BlockSpec(
      (None, None, bk, H), lambda b, n, i, j, off: (b, lax.div(n, G), kv_block(b, i, j, off), 0)
  )
  row_spec = pl.BlockSpec((None, None, 1, bq), lambda b, n, i, j, off: (b, n, 0, i))
  seg_specs = [
      pl.BlockSpec((None, 1, bq), lambda b, n, i, j, off: (b, 0, i)),
      pl.BlockSpec((None, 1, bk), lambda b, n, i, j, off: (b, 0, kv_block(b, i, j, off))),
  ]
  return q_spec, kv_spec, row_spec, seg_specs


def _forward(st: TpuStatic, q, k, v, off_B, q_seg, kv_seg, *, save_lse: bool):
  B, N, Tp, H = q.shape
  q_spec, kv_spec, _, seg_specs = _q_major_specs(st, H)
  in_specs = [q_spec, kv_spec, kv_spec]
  args = [q, k, v]
  if st.segments:
    in_specs += seg_specs
    args += [q_seg, kv_seg]
  out_specs = [q_spec]
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
  if save_lse:
    out_specs.append(pl.BlockSpec((None, None, st.block_q, LANES),
                                  lambda b, n, i, j, off: (b, n, i, 0)))
    out_shape.append(jax.ShapeDtypeStruct((B, N, Tp, LANES), jnp.float32))
  outs = pl.pallas_call(
      functools.partial(_forward_kernel, st=st, save_lse=save_lse),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(B, N, st.nq, st.k_steps),
          in_specs=in_specs,
          out_specs=out_specs,
          scratch_shapes=[
              pltpu.VMEM((st.block_q, LANES), jnp.float32),  # m
              pltpu.VMEM((st.block_q, LANES), jnp.float32),  # l
              pltpu.VMEM((st.block_q, H), jnp.float32),  # acc
          ],
      ),
      out_shape=out_shape,
      compiler_params=_params(_SEMANTICS),
      interpret=st.interpret,
      name="attnlab_flash_tpu_forward",
  )(off_B, *args)
  if not save_lse:
    return outs[0], None
  out, lse_BNTL = outs
  return out, lse_BNTL[:, :, None, :, 0]  # [B, N, 1, Tp]: lane-dense rows for the backward


def _backward(st: TpuStatic, res, do):
  q, k, v, off_B, q_seg, kv_seg, out, lse_BN1T = res
  B, N, Tp, H = q.shape
  K, Sp = k.shape[1], k.shape[2]
  G, bq, bk = st.groups, st.block_q, st.block_k
  # D_t = sum_h dO_th O_th, the softmax Jacobian's diagonal term (elementwise, no [T, S]).
  delta_BN1T = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)[:, :, None]
  seg_args = [q_seg, kv_seg] if st.segments else []

  q_spec, kv_spec, row_spec, seg_specs = _q_major_specs(st, H)
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, st=st),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(B, N, st.nq, st.k_steps),
          in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
          + (seg_specs if st.segments else []),
          out_specs=q_spec,
          scratch_shapes=[pltpu.VMEM((bq, H), jnp.float32)],
      ),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=_params(_SEMANTICS),
      interpret=st.interpret,
      name="attnlab_flash_tpu_dq",
  )(off_B, q, k, v, do, lse_BN1T, delta_BN1T, *seg_args)

  # dK/dV: grid (b, KV head h, key block j, query step t); step t is query
  # head h * G + t // q_steps and query block first(j) + t % q_steps.
  def q_block(b, j, t, off_ref):
    first, last = query_blocks(st, off_ref[b], j)
    return _step_block(st, first, last, lax.rem(t, st.q_steps), st.nq)

  def q_head(h, t):
    return h * G + lax.div(t, st.q_steps)

  dq_side = pl.BlockSpec((None, None, bq, H),
                         lambda b, h, j, t, off: (b, q_head(h, t), q_block(b, j, t, off), 0))
  dk_side = pl.BlockSpec((None, None, bk, H), lambda b, h, j, t, off: (b, h, j, 0))
  drow = pl.BlockSpec((None, None, 1, bq),
                      lambda b, h, j, t, off: (b, q_head(h, t), 0, q_block(b, j, t, off)))
  dseg = [pl.BlockSpec((None, 1, bq), lambda b, h, j, t, off: (b, 0, q_block(b, j, t, off))),
          pl.BlockSpec((None, 1, bk), lambda b, h, j, t, off: (b, 0, j))]
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, st=st),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(B, K, Sp // bk, G * st.q_steps),
          in_specs=[dq_side, dk_side, dk_side, dq_side, drow, drow]
          + (dseg if st.segments else []),
          out_specs=[dk_side, dk_side],
          scratch_shapes=[pltpu.VMEM((bk, H), jnp.float32), pltpu.VMEM((bk, H), jnp.float32)],
      ),
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=_params(_SEMANTICS),
      interpret=st.interpret,
      name="attnlab_flash_tpu_dkv",
  )(off_B, q, k, v, do, lse_BN1T, delta_BN1T, *seg_args)
  return dq, dk, dv


_forward_out = first_order_only(functools.partial(_forward, save_lse=False))
_forward_lse = first_order_only(functools.partial(_forward, save_lse=True))
_backward_once = first_order_only(_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st, q, k, v, off_B, q_seg, kv_seg):
  return _forward_out(st, q, k, v, off_B, q_seg, kv_seg)[0]


def _flash_fwd(st, q, k, v, off_B, q_seg, kv_seg):
  out, lse_BN1T = _forward_lse(st, q, k, v, off_B, q_seg, kv_seg)
  return out, (q, k, v, off_B, q_seg, kv_seg, out, lse_BN1T)


def _flash_bwd(st, res, do):
  dq, dk, dv = _backward_once(st, res, do)
  return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def plan(T: int, S: int, *, block_q: int | None, block_k: int | None,
         interpret) -> BlockSizes:
  """The tiles of a call: multiples of 128 compiled (default 512), of 8 in
  interpret mode (default 128), capped at the padded lengths."""
  multiple = SUBLANES if interpret else LANES
  for name, value in (("block_q", block_q), ("block_k", block_k)):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 1 or value % multiple):
      raise ValueError(f"{name}={value!r} must be a positive multiple of {multiple} "
                       f"({'interpret mode' if interpret else 'compiled'})")
  default = INTERPRET_BLOCK if interpret else COMPILED_BLOCK
  return BlockSizes(min(block_q or default, round_up(max(T, 1), multiple)),
                    min(block_k or default, round_up(max(S, 1), multiple)))


@functools.partial(jax.jit, static_argnums=(0,))
def _flash_jit(st, q, k, v, off_B, q_seg, kv_seg):
  return _flash(st, q, k, v, off_B, q_seg, kv_seg)


def flash_attention_tpu(q_BTNH, k_BSKH, v_BSKH, *, causal: bool = False,
                        window: int | None = None, q_segment_ids=None, kv_segment_ids=None,
                        q_offset=0, scale: float | None = None, block_q: int | None = None,
                        block_k: int | None = None, interpret=None,
                        _debug: dict | None = None):
  """Flash attention, TPU variant (Pallas / Mosaic), differentiable; reference semantics.

  The public entry point is ``attnlab.ops.pallas.flash.flash_attention(...,
  backend="tpu")`` (same arguments); this is it minus the backend pick.

  Args:
    q_BTNH, k_BSKH, v_BSKH, causal, window, q_segment_ids, kv_segment_ids,
      q_offset, scale: as ``flash_attention``.
    block_q, block_k: tile sizes (``plan``); T and S need not be multiples.
    interpret: None: compiled on a TPU, TPU interpret mode elsewhere; True
      (or a ``pltpu.InterpretParams``): TPU interpret mode; False: the Mosaic
      kernel (runs only on a TPU; lowers anywhere with
      ``lowering_platforms=("tpu",)``).
    _debug: test-only overrides of ``clamp_dma`` / ``skip_compute``.

  Returns:
    [B, T, N, H] in the dtype of ``q_BTNH``; a query that sees no key gets
    zeros (and zero gradients).
  """
  causal, window, q_offset = checks.check_qkv(
      q_BTNH, k_BSKH, v_BSKH, causal=causal, window=window, q_offset=q_offset,
      q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
  block_q, block_k = checks.python_int(block_q), checks.python_int(block_k)
  B, T, N, H = q_BTNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  interpret = resolve_interpret(interpret)
  blocks = plan(T, S, block_q=block_q, block_k=block_k, interpret=interpret)
  if q_BTNH.size == 0 or S == 0:  # no query (B, T or N = 0), or no key: zeros
    return jnp.zeros(q_BTNH.shape, q_BTNH.dtype)
  bq, bk = blocks.block_q, blocks.block_k
  Tp, Sp = round_up(T, bq), round_up(S, bk)
  # Heads-major at the boundary (see the module doc); padded rows are masked.
  q = jnp.pad(jnp.swapaxes(q_BTNH, 1, 2), ((0, 0), (0, 0), (0, Tp - T), (0, 0)))
  k = jnp.pad(jnp.swapaxes(k_BSKH, 1, 2), ((0, 0), (0, 0), (0, Sp - S), (0, 0)))
  v = jnp.pad(jnp.swapaxes(v_BSKH, 1, 2), ((0, 0), (0, 0), (0, Sp - S), (0, 0)))
  segments = q_segment_ids is not None
  q_seg = kv_seg = None
  if segments:
    q_seg = jnp.pad(q_segment_ids.astype(jnp.int32), ((0, 0), (0, Tp - T)))[:, None, :]
    kv_seg = jnp.pad(kv_segment_ids.astype(jnp.int32), ((0, 0), (0, Sp - S)))[:, None, :]
  off_B = jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32), (B,))
  st = TpuStatic(
      causal=bool(causal), window=window,
      scale=checks.scale_value(scale, H), q_len=T, kv_len=S,
      blocks=blocks, groups=N // K, segments=segments, interpret=interpret, **(_debug or {}))
  out_BNTH = _flash_jit(st, q, k, v, off_B, q_seg, kv_seg)
  return jnp.swapaxes(out_BNTH[:, :, :T], 1, 2)
