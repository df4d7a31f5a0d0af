"""``attention(...)``: validate a request, pick an implementation, run it.

The implementations, each in its own module:

  * ``reference`` (ops/reference.py): one grouped einsum, the whole [T, S]
    score matrix, float32 softmax. The definition every other path is tested
    against.
  * ``blocked`` (ops/reference.py): the reference math over query blocks,
    each against only the key range its mask can see.
  * ``chunked`` (ops/chunked.py): pure-JAX online softmax over key blocks
    with a FlashAttention-2 style custom VJP; memory O(T x block).
  * ``xla`` / ``cudnn`` (ops/jax_nn.py): ``jax.nn.dot_product_attention``.
  * ``pallas`` (ops/pallas/flash.py): the blocked Pallas flash kernel.

The policies live here too: ``auto_implementation`` (what "auto" means on a
backend for a length) and ``cache_implementation`` (the path a request over a
KV cache takes). Softmax statistics and accumulators are float32 whatever the
input dtype, and a query that sees no key returns zeros (with zero, finite
gradients), never NaN.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from attnlab.config import IMPLEMENTATIONS
from attnlab.ops import checks
from attnlab.ops.chunked import chunked_attention
from attnlab.ops.jax_nn import jax_nn_attention
from attnlab.ops.pallas import flash
from attnlab.ops.reference import blocked_attention, reference_attention


def attention(
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
    implementation: str = "reference",
    q_positions=None,
    kv_positions=None,
):
  """Multi-head (MHA / GQA / MQA) scaled dot-product attention.

  Args:
    q_BTNH: queries [B, T, N, H].
    k_BSKH: keys [B, S, K, H]; N must be a multiple of K.
    v_BSKH: values [B, S, K, H].
    causal: a query at position t sees keys at positions <= t (True or False;
      a NumPy bool too).
    window: sliding window of that many keys, the query's own included (a
      Python or NumPy int).
    q_segment_ids: integer or bool [B, T]; with ``kv_segment_ids`` [B, S] a query
      sees only keys of its own segment (packing; 0 marks padding).
    q_offset: int or int [B]: position of the first query, for queries that
      are the tail of a longer sequence (decoding against a cache). A Python
      or NumPy int, or an integer array of shape () or [B] (traced too; "blocked"
      cuts its blocks when traced, so it takes a NumPy array, not a JAX one).
    scale: multiplier of the scores; default 1/sqrt(H).
    implementation: "reference" | "blocked" | "chunked" | "xla" | "cudnn" | "pallas" |
      "auto" (see ``auto_implementation``).
    q_positions, kv_positions: explicit int [B, T] / [B, S] positions, for
      caches whose slots are not in order (a ring buffer); a negative key
      position marks an empty slot. Supported by "reference" and "chunked" ("auto"
      takes one of them for such a request). ``q_positions`` replaces ``q_offset``,
      which must then be left at 0 (every implementation refuses another; until
      2026-12-07 "reference", "chunked" and "auto" ignored it).

  Returns:
    [B, T, N, H] in the dtype of ``q_BTNH``.
  """
  # NumPy scalars come back as Python ones: "blocked" unrolls over a Python int offset.
  causal, window, q_offset = checks.check_qkv(
      q_BTNH, k_BSKH, v_BSKH, causal=causal, window=window, q_offset=q_offset,
      q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, q_positions=q_positions,
      kv_positions=kv_positions)
  checks.check_scale(scale)
  if scale is None:
    scale = 1.0 / math.sqrt(q_BTNH.shape[-1])
  if implementation == "auto":
    implementation = auto_implementation(q_BTNH.shape[1], k_BSKH.shape[1])
    # Key ranges known when traced: an int offset, or a NumPy one per row ("blocked" reads
    # the union of the rows' ranges); not a JAX array or explicit positions.
    static = (isinstance(q_offset, int | np.ndarray) and q_positions is None
              and kv_positions is None)
    if implementation == "chunked" and not _is_constant(scale):
      # A traced scale (a learned temperature), which "chunked" compiles in: query blocks
      # bound the memory too; the reference where blocks cannot be cut (a traced offset).
      implementation = "blocked" if static else "reference"
    elif implementation == "blocked" and not (static and (causal or window is not None)):
      implementation = "reference"  # no band to skip, or no static key ranges
    elif implementation == "xla" and not (
        q_positions is None and kv_positions is None
        and q_BTNH.dtype == k_BSKH.dtype == v_BSKH.dtype):
      # GPU / TPU: jax.nn takes neither explicit positions nor mixed dtypes (refused there
      # until 2026-12-04 under "auto"); the online softmax takes both.
      implementation = "chunked" if _is_constant(scale) else "reference"
  kwargs = dict(
      causal=causal,
      window=window,
      q_segment_ids=q_segment_ids,
      kv_segment_ids=kv_segment_ids,
      q_offset=q_offset,
      scale=scale,
  )
  if implementation in ("reference", "chunked"):
    fn = reference_attention if implementation == "reference" else chunked_attention
    return fn(q_BTNH, k_BSKH, v_BSKH, q_positions=q_positions, kv_positions=kv_positions,
              **kwargs)
  if q_positions is not None or kv_positions is not None:
    raise ValueError(
        f"q_positions/kv_positions are supported by implementation='reference' or "
        f"'chunked', not {implementation!r}"
    )
  if implementation == "blocked":
    return blocked_attention(q_BTNH, k_BSKH, v_BSKH, **kwargs)
  if implementation in ("xla", "cudnn"):
    return jax_nn_attention(q_BTNH, k_BSKH, v_BSKH, implementation=implementation, **kwargs)
  if implementation == "pallas":
    return flash.flash_attention(q_BTNH, k_BSKH, v_BSKH, **kwargs)
  raise ValueError(
      f"implementation={implementation!r} is not one of {', '.join(map(repr, IMPLEMENTATIONS))}"
      " or 'auto'"
  )


def auto_implementation(q_len: int, kv_len: int, backend: str | None = None) -> str:
  """The implementation "auto" resolves to for a backend and a length."""
  backend = backend or jax.default_backend()
  if backend == "gpu":
    # Not "pallas" yet: the Triton path of ops/pallas/flash_gpu.py has never been
    # compiled or run on a GPU (only interpret mode on CPU is tested). Switch
    # to "pallas" for long sequences once tools/gpu_check.sh passes on a card.
    return "xla"
  if backend == "tpu":
    # Not "pallas" yet: "pallas" lowers to the Mosaic kernel of ops/pallas/flash_tpu.py
    # there, which has never been compiled or run on a TPU (TPU interpret mode and
    # lowering on the CPU only). Switch once tools/tpu_check.sh passes on a TPU.
    return "xla"
  # XLA:CPU: query blocks against only their visible keys (causal / window)
  # while [T, S] scores fit in memory comfortably; past that, the online
  # softmax bounds memory. tools/bench_attention.py measures the choice.
  return "blocked" if q_len * kv_len <= 2048 * 2048 else "chunked"


def cache_implementation(implementation: str, *, num_queries: int, paged: bool) -> str:
  """The path a request against a KV cache takes, for a layer's ``implementation``.

  Cache slots are not in position order (ring) or not all filled, so the
  request needs explicit positions: only "reference" and "chunked" take them.
  "chunked" even when the scores would fit: 240 decode steps at B=8 over a
  255-slot cache took 0.25-0.29 s with it, 0.40-0.48 s with "reference"
  (XLA:CPU, the tools/bench_decode.py model), and the same time at B=1.
  One new query against a paged cache with "pallas" reads the pages in place
  ("paged_decode": ``attnlab.ops.pallas.decode.paged_decode_attention``), with no
  gather of the whole sequence. (The contiguous and ring caches send their
  "pallas" decode steps to the heads-major kernel, and their "auto" decode steps
  to ``attnlab.ops.decode.decode_step_attention``, themselves: ``KVCache.attend``,
  ``RingKVCache.attend``.)
  """
  if paged and implementation == "pallas" and num_queries == 1:
    return "paged_decode"
  return "reference" if implementation == "reference" else "chunked"


def _is_constant(scale) -> bool:
  """Whether ``scale`` is a number known at trace time (not a traced value)."""
  try:
    float(scale)
  except TypeError:  # jax's ConcretizationTypeError (a traced value) is a TypeError
    return False
  return True
