"""Blocked flash attention in Pallas: the one entry point and the Triton-style wrapper.

``flash_attention`` computes the same function as ``reference_attention``
without ever holding a [T, S] score matrix, with one of two kernel sets:

  * ``flash_gpu.py``: the Triton-style kernels (forward, dQ, dK/dV). On the CPU
    they run in interpret mode (what the tests run); on a GPU through the
    Triton lowering (NOT YET RUN on a GPU). This module pads T, S (and H for
    Triton) to whole blocks and wraps them in a ``jax.custom_vjp``.
  * ``flash_tpu.py``: the Mosaic kernels, with their own padding, heads-major
    layout and ``custom_vjp``; TPU interpret mode off a TPU (NEVER RUN on a TPU).

``backend`` picks one ("gpu" / "tpu"), or None lets the platform the call is
lowered for decide (``jax.lax.platform_dependent``); see ``flash_attention``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp

from attnlab.ops import checks
from attnlab.ops.pallas import common, flash_gpu, flash_tpu

_forward = common.first_order_only(flash_gpu.forward)
_backward = common.first_order_only(flash_gpu.backward)


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


BACKENDS = ("gpu", "tpu")


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
    interpret=None,
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
    block_q, block_k: tile sizes; default per kernel and head dim. Triton
      kernels: powers of two; TPU kernel: multiples of 128 compiled, of 8
      interpreted. T and S need not be multiples: inputs are padded and the
      padding masked.
    interpret: None: compiled on the kernel's own platform, interpret mode
      elsewhere; True: interpret mode (for "tpu" also a
      ``pltpu.InterpretParams``); False: compiled.
    backend: which kernel.

      * "gpu": the Triton-style kernels (flash_gpu.py), wherever called:
        compiled on a GPU, interpret mode elsewhere.
      * "tpu": the Mosaic kernels (flash_tpu.py), wherever called: compiled
        on a TPU, TPU interpret mode elsewhere.
      * None (the default): the platform the call is LOWERED for decides,
        through ``jax.lax.platform_dependent``: Mosaic compiled for "tpu",
        Triton compiled for "cuda", the Triton-style kernels in interpret
        mode on any other platform. So one jitted call lowers to Mosaic with
        ``.lower(lowering_platforms=("tpu",))`` and to Triton with
        ``("cuda",)`` on any host, and runs interpreted on the CPU.
        platform_dependent traces every branch, which costs the CPU an extra
        trace of four compiled kernels (forward + backward) per call; so when
        the host's default backend is the CPU, None resolves at trace time to
        the interpret-mode Triton-style kernels (what the CPU runs anyway),
        unless the call is traced inside ``cross_platform()`` (what a CPU
        host does to lower the call for TPU or CUDA). With ``interpret`` set,
        None means the kernel of the running platform ("tpu" on a TPU,
        "gpu" elsewhere).

  Returns:
    [B, T, N, H] in the dtype of ``q_BTNH``; a query that sees no key gets
    zeros (and zero gradients).
  """
  causal, window, q_offset = checks.check_qkv(
      q_BTNH, k_BSKH, v_BSKH, causal=causal, window=window, q_offset=q_offset,
      q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
  block_q, block_k = checks.python_int(block_q), checks.python_int(block_k)
  if backend is not None and backend not in BACKENDS:
    raise ValueError(f"backend={backend!r} is not one of {', '.join(map(repr, BACKENDS))} "
                     "or None")
  kw = dict(causal=causal, window=window, q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids, q_offset=q_offset, scale=scale, block_q=block_q,
            block_k=block_k)
  if backend is None and interpret is not None:
    backend = "tpu" if jax.default_backend() == "tpu" else "gpu"
  if backend is None and jax.default_backend() == "cpu" and not _CROSS_PLATFORM.get():
    backend = "gpu"
  if backend == "tpu":
    return flash_tpu.flash_attention_tpu(q_BTNH, k_BSKH, v_BSKH, interpret=interpret, **kw)
  if backend == "gpu":
    return _flash_gpu(q_BTNH, k_BSKH, v_BSKH, interpret=common.resolve_interpret(interpret),
                      **kw)
  if any(isinstance(x, jax.core.Tracer) for x in (q_BTNH, k_BSKH, v_BSKH)):
    # Traced (under jit), every branch is; called eagerly, the running platform's alone
    _check_blocks_for_both(block_q, block_k)
  return jax.lax.platform_dependent(
      q_BTNH, k_BSKH, v_BSKH,
      tpu=functools.partial(flash_tpu.flash_attention_tpu, interpret=False, **kw),
      cuda=functools.partial(_flash_gpu, interpret=False, **kw),
      default=functools.partial(_flash_gpu, interpret=True, **kw),
  )


def _check_blocks_for_both(block_q, block_k) -> None:
  """Under jit, ``platform_dependent`` traces the compiled TPU kernel and the Triton one: block
  sizes must suit both (until 2026-12-07 a GPU host asking for 64 got the TPU kernel's
  refusal, "a positive multiple of 128 (compiled)", without a word of why)."""
  try:
    for name, value in (("block_q", block_q), ("block_k", block_k)):
      common.check_block(name, value)
    flash_tpu.plan(1, 1, block_q=block_q, block_k=block_k, interpret=False)
  except ValueError as e:
    raise ValueError(
        f"{e}: backend=None traces the compiled TPU and Triton kernels both (so that the call "
        "lowers for either), and block sizes must suit both, powers of two that are multiples "
        "of 128; give backend='gpu' or 'tpu' for one kernel's own") from None


# Per thread (and asyncio task): a thread tracing inside cross_platform() does not change
# what a call traced at the same time in another thread takes.
_CROSS_PLATFORM = contextvars.ContextVar("attnlab_flash_cross_platform", default=False)


@contextlib.contextmanager
def cross_platform():
  """Calls traced inside take ``backend=None``'s platform_dependent path even
  on a CPU host, so they can be lowered for TPU or CUDA (see ``flash_attention``).

  Read at trace time: a ``jax.jit`` function already traced outside keeps its
  cached trace, so trace a fresh one inside (``jax.jit(f).trace(...)``).
  """
  token = _CROSS_PLATFORM.set(True)
  try:
    yield
  finally:
    _CROSS_PLATFORM.reset(token)


def _flash_gpu(q_BTNH, k_BSKH, v_BSKH, *, causal, window, q_segment_ids, kv_segment_ids,
               q_offset, scale, block_q, block_k, interpret: bool):
  """The Triton-style kernels with ``interpret`` already resolved: interpret=False
  builds the Triton (compiled) kernels on any host; only lowering them needs CUDA."""
  common.check_block("block_q", block_q)
  common.check_block("block_k", block_k)
  B, T, N, H = q_BTNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  if q_BTNH.size == 0 or S == 0:  # no query (B, T or N = 0), or no key: zeros
    return jnp.zeros(q_BTNH.shape, q_BTNH.dtype)
  scale = checks.scale_value(scale, H)
  blocks, Hp = flash_gpu.plan(T, S, H, block_q=block_q, block_k=block_k, interpret=interpret)
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
      causal=bool(causal), window=window, scale=scale, q_len=T, kv_len=S,
      blocks=blocks, groups=N // K, segments=segments, interpret=interpret)
  out = _flash(st, q, k, v, off_B1, q_seg, kv_seg)
  return out[:, :T, :, :H]
