"""Blocked flash attention in Pallas: the differentiable wrapper and the backend pick.

``flash_attention`` computes the same function as ``reference_attention``
without ever holding a [T, S] score matrix. This module validates the
request, pads T, S (and H where the backend needs it) to whole blocks, and
wraps the kernels of one backend module in a ``jax.custom_vjp``; the
kernels themselves live in sibling modules:

  * ``flash_gpu.py``: the Triton-style kernels (forward, dQ, dK/dV). On CPU
    they run in interpret mode (the default there; what the tests run); on a
    GPU through the Triton lowering (NOT YET RUN on a GPU).

A backend is one entry of ``KERNELS``: a module with ``plan``, ``forward``
and ``backward`` (see flash_gpu.py). A new one (e.g. a Mosaic TPU module)
is imported here and added to ``KERNELS``; ``default_backend`` is the one
place that picks the kernel module for the running platform.

TPU: the GPU kernels have no Mosaic lowering (the heads axis sits between T
and H in their blocks, which Mosaic's (8, 128) tiling rule does not accept);
compiled use there raises ``ValueError`` (use ``interpret=True`` or
implementation="xla").
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from attnlab.ops import checks
from attnlab.ops.pallas import common, flash_gpu

# The kernel modules by backend name.
KERNELS = {"gpu": flash_gpu}


def default_backend() -> str:
  """The kernel module for the running platform: "gpu" (the Triton-style
  kernels; interpret mode off a GPU)."""
  return "gpu"


def _kernels(backend: str | None):
  if backend is not None and backend not in KERNELS:
    raise ValueError(
        f"backend={backend!r} is not one of {', '.join(map(repr, sorted(KERNELS)))} or None")
  return KERNELS[backend or default_backend()]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st, q, k, v, off_B1, q_seg, kv_seg):
  return KERNELS[st.backend].forward(st, q, k, v, off_B1, q_seg, kv_seg)[0]


def _flash_fwd(st, q, k, v, off_B1, q_seg, kv_seg):
  out, lse_BNT = KERNELS[st.backend].forward(st, q, k, v, off_B1, q_seg, kv_seg)
  return out, (q, k, v, off_B1, q_seg, kv_seg, out, lse_BNT)


def _flash_bwd(st, res, do):
  dq, dk, dv = KERNELS[st.backend].backward(st, res, do)
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
    backend: str | None = None,
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
    backend: the kernel module, a key of ``KERNELS`` ("gpu": the
      Triton-style kernels of ops/pallas/flash_gpu.py); default from
      ``default_backend()``.

  Returns:
    [B, T, N, H] in the dtype of ``q_BTNH``; a query that sees no key gets
    zeros (and zero gradients).
  """
  checks.check_qkv(q_BTNH, k_BSKH, v_BSKH, window=window, q_segment_ids=q_segment_ids,
                   kv_segment_ids=kv_segment_ids)
  common.check_block("block_q", block_q)
  common.check_block("block_k", block_k)
  kernels = _kernels(backend)
  B, T, N, H = q_BTNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  if T == 0 or S == 0:
    return jnp.zeros(q_BTNH.shape, q_BTNH.dtype)
  scale = 1.0 / math.sqrt(H) if scale is None else float(scale)
  interpret = common.resolve_interpret(interpret)
  blocks, Hp = kernels.plan(T, S, H, block_q=block_q, block_k=block_k, interpret=interpret)
  bq, bk = blocks.block_q, blocks.block_k

  q, k, v = q_BTNH, k_BSKH, v_BSKH
  Tp, Sp = common.round_up(T, bq), common.round_up(S, bk)
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
  st = common.FlashStatic(
      backend=backend or default_backend(), causal=bool(causal), window=window, scale=scale,
      q_len=T, kv_len=S, blocks=blocks, groups=N // K, segments=segments, interpret=interpret)
  out = _flash(st, q, k, v, off_B1, q_seg, kv_seg)
  return out[:, :T, :, :H]
