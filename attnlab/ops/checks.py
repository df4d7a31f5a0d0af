"""The one validator of attention inputs, shared by every path in ``attnlab.ops``.

``attention(...)`` (ops/dispatch.py), the Pallas flash kernel and the Pallas
decode kernels all check their q / k / v, window and segment ids here, so a
bad request gets the same message whichever path it takes (``attention``
also its causal flag and q_offset). It sits below dispatch.py because the
kernels, which dispatch.py imports, call it too.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from attnlab.config import FLOAT32_MAX, is_integer, is_number


def check_query_heads(q_BTNH, *, num_kv_heads: int, head_dim: int, kv_name: str = "k_BSKH"):
  """q is rank 4 and fits keys with ``num_kv_heads`` heads of ``head_dim`` (GQA / MQA)."""
  if q_BTNH.ndim != 4:
    raise ValueError(f"q_BTNH must be rank 4 [B, T, N, H], got shape {q_BTNH.shape}")
  if num_kv_heads < 1:
    raise ValueError(f"{kv_name} has no heads (K={num_kv_heads}): give at least one KV head")
  if head_dim < 1:
    raise ValueError(f"{kv_name} has heads of no dimensions (H={head_dim}): give H >= 1")
  if q_BTNH.shape[3] != head_dim:
    raise ValueError(
        f"head dim of q_BTNH ({q_BTNH.shape[3]}) and of {kv_name} ({head_dim}) must match "
        "(q, k and v share one head_dim H)"
    )
  if q_BTNH.shape[2] % num_kv_heads:
    raise ValueError(
        f"num heads of q_BTNH (N={q_BTNH.shape[2]}) must be a multiple of num_kv_heads of "
        f"{kv_name} (K={num_kv_heads}): each KV head serves G = N / K query heads, so N must be "
        "a multiple of the num kv heads"
    )


def positive_or_none(name: str, value) -> int | None:
  """None, or a positive Python / NumPy int (not a bool); returned as a Python int."""
  if value is not None and (not is_integer(value) or value < 1):
    raise ValueError(f"{name}={value!r} must be a positive integer or None")
  return None if value is None else int(value)


# Widest window the ops take: positions are int32, so a window this wide already covers
# every key whose distance from the query int32 holds.
MAX_WINDOW = 2**31 - 1


def check_window(window) -> int | None:
  """None, or a positive Python / NumPy int (not a bool); returned as a Python int, capped
  at ``MAX_WINDOW`` (the same mask: until 2026-12-04 a window past it was an OverflowError
  naming no argument, and one near it wrapped the Pallas kernels' int32 key ranges to
  empty, which ``masks.key_range`` now computes without leaving int32)."""
  window = positive_or_none("window", window)
  return None if window is None else min(window, MAX_WINDOW)


def python_int(value):
  """A NumPy integer as the Python int it holds; anything else as given (for the callers'
  own checks, which take Python ints: block sizes)."""
  return int(value) if is_integer(value) else value


def check_causal(causal) -> bool:
  """True or False (a NumPy bool too); returned as a Python bool. A string such as
  "false" would otherwise be truthy, and mask as causal."""
  if not isinstance(causal, bool | np.bool_):
    raise ValueError(f"causal={causal!r} must be True or False")
  return bool(causal)


def check_q_offset(q_offset, batch: int, num_queries: int):
  """A Python / NumPy int (returned as a Python int), or an integer array of shape () or
  [B]: a NumPy one returned as int32 (an int8 / int16 array's own dtype overflowed in
  "blocked"'s per-block offsets until 2026-12-06), a JAX one as given (it may be traced
  under jit; every implementation reads it as int32).

  Query t sits at position q_offset + t, an int32: an offset whose last query would pass
  2**31 - 1 is refused when it is a number or a NumPy array (those positions wrapped to
  negative ones until 2026-12-05, so a causal query saw no key); a JAX array is not read.
  """
  if is_integer(q_offset):
    if not -2**31 <= int(q_offset) < 2**31:  # an OverflowError naming nothing until 2026-12-05
      raise ValueError(f"q_offset={q_offset} must be in [-2**31, 2**31): positions are int32")
    _check_last_query(int(q_offset), f"q_offset={q_offset}", num_queries)
    return int(q_offset)
  shape, dtype = getattr(q_offset, "shape", None), getattr(q_offset, "dtype", None)
  if shape is None or dtype is None or not np.issubdtype(dtype, np.integer):
    what = (f"q_offset={q_offset!r}" if shape is None
            else f"q_offset (shape {tuple(shape)}, dtype {dtype})")
    raise ValueError(f"{what} must be an integer or an integer array of shape () or "
                     f"[B] = ({batch},)")
  if tuple(shape) not in ((), (batch,)):
    raise ValueError(f"q_offset shape {tuple(shape)} must be () or [B] = ({batch},)")
  if isinstance(q_offset, np.ndarray) and q_offset.size:
    lowest, highest = int(q_offset.min()), int(q_offset.max())
    if lowest < -2**31:
      raise ValueError(f"q_offset holds {lowest}, below -2**31: positions are int32")
    _check_last_query(highest, f"q_offset holds {highest}, which", num_queries)
  if isinstance(q_offset, np.ndarray):
    return q_offset.astype(np.int32)
  return q_offset


def check_offset_or_positions(q_offset, q_positions) -> None:
  """``q_offset`` is left at 0 when ``q_positions`` is given: explicit positions are the
  queries' positions, and every implementation read the offset only without them (until
  2026-12-07 ``q_offset=4`` beside ``q_positions`` was silently ignored). An offset array
  (JAX or NumPy, zeros too) is refused with them as well: a traced one cannot be read."""
  if q_positions is None or (is_integer(q_offset) and int(q_offset) == 0):
    return
  shape, dtype = getattr(q_offset, "shape", None), getattr(q_offset, "dtype", None)
  what = (f"q_offset={q_offset!r}" if shape is None or dtype is None
          else f"q_offset (shape {tuple(shape)}, dtype {dtype})")
  raise ValueError(f"{what} and q_positions cannot be given together: q_positions are the "
                   "queries' positions (add the offset to them and leave q_offset at 0)")


def _check_last_query(offset: int, what: str, num_queries: int) -> None:
  last = offset + num_queries - 1
  if num_queries and last >= 2**31:
    raise ValueError(f"{what} puts query {num_queries - 1} at position {last}, past "
                     f"2**31 - 1: positions are int32 (give q_offset <= {2**31 - num_queries})")


def check_int32_values(name: str, x) -> None:
  """A NumPy integer array of a wider type than int32 (NumPy's default int64, uint32) whose
  values int32 does not hold is refused: the ops read ids, positions, lengths and page
  numbers as int32, where such a value wrapped (segment ids 1 and 2**32 + 1 were one segment
  for "chunked" and the Pallas kernels and two for "reference" until 2026-12-06). A JAX
  array is not read (it may be traced; without jax_enable_x64 it is int32 already)."""
  if not (isinstance(x, np.ndarray) and x.size and np.issubdtype(x.dtype, np.integer)):
    return
  lowest, highest = int(x.min()), int(x.max())
  for value in (lowest, highest):
    if not -2**31 <= value < 2**31:
      raise ValueError(f"{name} holds {value}, outside int32's range [-2**31, 2**31 - 1]: "
                       "the attention ops read it as int32")


def check_ids_fit_int32(**named) -> None:
  """``check_int32_values`` of each given (not None) segment-id / position array: what
  "reference" and "chunked" check when called directly (the caches call them so), beside
  ``check_qkv``'s full check in ``attention()``."""
  for name, x in named.items():
    if x is not None:
      check_int32_values(name, x)


def _check_ids(name: str, x, shape: tuple, what: str, bool_ok: bool = False):
  """An integer (or, with ``bool_ok``, bool) array of ``shape`` whose values int32 holds
  (``check_int32_values``): float ids were compared as floats by some implementations and
  truncated to int32 by others."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):  # an AttributeError until 2026-12-06
    raise ValueError(f"{name} must be an array {what} (JAX or NumPy), got {type(x).__name__}")
  if tuple(x.shape) != shape:
    raise ValueError(f"{name} shape {tuple(x.shape)} must be {what} = {shape}")
  dtype = np.dtype(x.dtype)
  if not (np.issubdtype(dtype, np.integer) or (bool_ok and dtype == np.bool_)):
    kinds = "an integer or bool" if bool_ok else "an integer"
    raise ValueError(f"{name} must be {kinds} array, got dtype {dtype}")
  check_int32_values(name, x)


def check_qkv(q_BTNH, k_BSKH, v_BSKH, *, causal=False, window=None, q_offset=0,
              q_segment_ids=None, kv_segment_ids=None, q_positions=None, kv_positions=None):
  """Raise ValueError (naming the argument and what is allowed) unless the
  request is floating-point q [B, T, N, H], k = v [B, S, K, H] with N a multiple of K, a
  bool ``causal``, an optional window, an integer ``q_offset`` of shape () or [B] (left at
  0 with ``q_positions``), integer (or bool) segment ids [B, T] / [B, S] given together,
  and integer positions [B, T] / [B, S].

  Returns:
    (causal, window, q_offset) as the implementations take them: NumPy scalars as the
    Python bool / int they hold, a NumPy array offset as int32 (``check_q_offset``).
  """
  for name, x in (("q_BTNH", q_BTNH), ("k_BSKH", k_BSKH), ("v_BSKH", v_BSKH)):
    if not hasattr(x, "ndim") or not hasattr(x, "dtype"):  # an AttributeError until 2026-12-06
      raise ValueError(f"{name} must be an array (JAX or NumPy), got {type(x).__name__}")
  for name, x in (("q_BTNH", q_BTNH), ("k_BSKH", k_BSKH), ("v_BSKH", v_BSKH)):
    if x.ndim != 4:
      raise ValueError(
          f"{name} must be rank 4 (q [B, T, N, H], k and v [B, S, K, H]); got shapes "
          f"{q_BTNH.shape}, {k_BSKH.shape}, {v_BSKH.shape}"
      )
  for name, x in (("q_BTNH", q_BTNH), ("k_BSKH", k_BSKH), ("v_BSKH", v_BSKH)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} must be a floating-point array (float32, bfloat16, float16, "
                       f"...), got dtype {x.dtype}")
  if k_BSKH.shape != v_BSKH.shape:
    raise ValueError(f"k_BSKH shape {k_BSKH.shape} and v_BSKH shape {v_BSKH.shape} must match")
  if q_BTNH.shape[0] != k_BSKH.shape[0]:
    raise ValueError(
        f"batch of q_BTNH ({q_BTNH.shape[0]}) and k_BSKH ({k_BSKH.shape[0]}) must match"
    )
  check_query_heads(q_BTNH, num_kv_heads=k_BSKH.shape[2], head_dim=k_BSKH.shape[3])
  causal = check_causal(causal)
  window = check_window(window)
  q_offset = check_q_offset(q_offset, q_BTNH.shape[0], q_BTNH.shape[1])
  check_offset_or_positions(q_offset, q_positions)
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("q_segment_ids and kv_segment_ids must be given together")
  B, T, S = q_BTNH.shape[0], q_BTNH.shape[1], k_BSKH.shape[1]
  if q_segment_ids is not None:
    _check_ids("q_segment_ids", q_segment_ids, (B, T), "[B, T]", bool_ok=True)
    _check_ids("kv_segment_ids", kv_segment_ids, (B, S), "[B, S]", bool_ok=True)
  if q_positions is not None:
    _check_ids("q_positions", q_positions, (B, T), "[B, T]")
  if kv_positions is not None:
    _check_ids("kv_positions", kv_positions, (B, S), "[B, S]")
  return causal, window, q_offset


def check_scale(scale) -> None:
  """None, a real number (Python or NumPy, not a bool), or a 0-d real array (traced too);
  a concrete one finite in float32 (a NaN, an infinity or a number past float32's range
  gave NaN from some implementations and zeros from others until 2026-12-06)."""
  if scale is None:
    return
  if isinstance(scale, jax.Array | np.ndarray):
    if scale.shape != () or not (jnp.issubdtype(scale.dtype, jnp.floating)
                                 or jnp.issubdtype(scale.dtype, jnp.integer)):
      raise ValueError(f"scale must be one real number (shape ()), got an array of shape "
                       f"{scale.shape} and dtype {scale.dtype}")
  elif not is_number(scale):
    raise ValueError(f"scale={scale!r} must be a real number (or a 0-d array), got "
                     f"{type(scale).__name__}")
  if isinstance(scale, jax.core.Tracer):
    return
  value = float(scale)
  if not abs(value) <= FLOAT32_MAX:  # NaN too
    raise ValueError(f"scale={value!r} must be finite and within float32's range "
                     f"(|scale| <= {FLOAT32_MAX:.7g})")


def scale_value(scale, head_dim: int) -> float:
  """The scores' multiplier as a Python float: ``scale``, or 1 / sqrt(head_dim) by default.

  The Pallas kernels, the chunked op and the decode step take it as a constant of the
  compiled program; a traced scale (a learned temperature under ``jax.jit``) is refused
  by name rather than failing inside ``float``.
  """
  check_scale(scale)
  if scale is None:
    return 1.0 / math.sqrt(head_dim)
  try:
    return float(scale)
  except TypeError:  # jax's ConcretizationTypeError (a traced value) is a TypeError
    raise ValueError(
        f"scale must be a Python number for this implementation (a constant of its compiled "
        f"program), got {type(scale).__name__}: use implementation='reference', 'blocked' "
        "or 'xla' for a traced scale, or multiply q by it"
    ) from None
