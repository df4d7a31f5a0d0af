"""What the Pallas kernels share: block sizes, static settings, tile masks and bounds.

Flash (ops/pallas/flash.py and its kernel modules) and decode
(ops/pallas/decode.py) use these; nothing here launches a kernel.
Block skipping: ``key_blocks`` / ``query_blocks`` take their bounds from
``masks.key_range`` / ``masks.query_range``, the same predicate the reference
op masks with, so a block wholly outside the causal / window band is neither
loaded nor computed; ``tile_mask`` masks inside a visited tile.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from attnlab.ops import masks


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes and launch settings of one kernel call.

  Attributes:
    block_q: queries per program (a power of two).
    block_k: keys per loop step (a power of two).
    num_warps, num_stages: Triton launch settings; None in interpret mode.
  """

  block_q: int
  block_k: int
  num_warps: int | None = None
  num_stages: int | None = None


@dataclasses.dataclass(frozen=True)
class FlashStatic:
  """The static (hashable) settings of one flash call: the ``custom_vjp``'s
  non-differentiable argument, read by the kernels. (Until 2026-12-05 it also named its
  backend, which nothing read: each backend has its own ``custom_vjp``.)"""

  causal: bool
  window: int | None
  scale: float
  q_len: int  # T before padding
  kv_len: int  # S before padding
  blocks: BlockSizes
  groups: int  # G = N / K
  segments: bool
  interpret: bool

  @property
  def block_q(self) -> int:
    return self.blocks.block_q

  @property
  def block_k(self) -> int:
    return self.blocks.block_k


def check_block(name: str, value):
  """Block sizes must be powers of two (Triton tiles are)."""
  if value is None:
    return
  if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
    raise ValueError(f"{name}={value!r} must be a positive power of two")


def resolve_interpret(interpret: bool | None) -> bool:
  """For the Triton-style kernels run on this host: None -> interpret on CPU,
  compile on GPU; compiled off a GPU raises. (flash.py's platform_dependent
  branches skip it: they build a compiled kernel for a platform they are
  lowered for, not run on.)

  Kernels call it as ``common.resolve_interpret`` (a module attribute), so a
  test can force the compiled path on the CPU to lower to Triton IR.
  """
  backend = jax.default_backend()
  if interpret is None:
    interpret = backend not in ("gpu", "tpu")
  if not interpret and backend == "tpu":
    raise ValueError(
        "interpret=False on TPU: the Triton-style Pallas kernels have no Mosaic lowering "
        "(their blocks put the heads axis between the sequence and head dims). Pass "
        "interpret=True, or for flash attention backend='tpu' (or None)."
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


SECOND_ORDER = ("implementation='pallas' (the Pallas flash kernels) is differentiable once, "
                "in reverse mode (jax.grad, jax.vjp); a second derivative (jax.grad of a "
                "gradient, jax.jvp of one: a Hessian-vector product) needs implementation "
                "'blocked', 'chunked', 'reference' or 'xla', and forward mode (jax.jvp, "
                "jax.jacfwd) 'blocked', 'reference' or 'xla'")


def first_order_only(fn):
  """``fn(st, *args)`` (kernel calls inside a ``custom_vjp``) as it is, but differentiating
  it, which only a second derivative of the attention does, raises NotImplementedError
  naming what works instead (``SECOND_ORDER``): JAX's rule for differentiating a
  ``pallas_call`` failed with a bare AssertionError until 2026-12-05."""
  wrapped = jax.custom_jvp(fn, nondiff_argnums=(0,))

  def jvp(st, primals, tangents):
    del st, primals, tangents
    raise NotImplementedError(SECOND_ORDER)

  wrapped.defjvp(jvp)
  return wrapped


def pair_operand(x, a, b):
  """A float32 intermediate (dS, P) as the operand of a product with an input: in the wider
  dtype of the pair ``a``, ``b`` of inputs it stands between (dQ = dS K: q and k), so a
  bfloat16 pair multiplies in bfloat16 and a float32 q over bfloat16 keys in float32 (the
  backward kernels rounded dS to the keys' bfloat16 until 2026-12-06)."""
  return x.astype(jnp.promote_types(a.dtype, b.dtype))


def _one_dtype(a, b):
  """Both operands in their promoted dtype: Triton's dot takes one dtype, so a bfloat16
  query against a float32 (or dequantized int8) tile failed to lower for a GPU until
  2026-12-05; interpret mode and Mosaic took the pair as it was."""
  dtype = jnp.promote_types(a.dtype, b.dtype)
  return a.astype(dtype), b.astype(dtype)


def dot_nt(a, b):
  """a @ b.T with a float32 result (no transpose materialized)."""
  return lax.dot_general(*_one_dtype(a, b), (((1,), (1,)), ((), ())),
                         preferred_element_type=jnp.float32)


def dot_nn(a, b):
  return lax.dot_general(*_one_dtype(a, b), (((1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32)


def dot_tn(a, b):
  """a.T @ b with a float32 result."""
  return lax.dot_general(*_one_dtype(a, b), (((0,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32)


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


def tile_mask(st: FlashStatic, off, q_idx, k_idx, q_seg, k_seg):
  """[bq, bk] True where query index q_idx (position off + q_idx) sees key k_idx."""
  ok = masks.position_mask(
      (off + q_idx)[:, None], k_idx[None, :], causal=st.causal, window=st.window
  )
  # Padding rows and columns are masked here, so padded inputs never leak in.
  ok = ok & (q_idx < st.q_len)[:, None] & (k_idx < st.kv_len)[None, :]
  if st.segments:
    ok = ok & (q_seg[:, None] == k_seg[None, :])
  return ok


def key_blocks(st: FlashStatic, off, i):
  """Key blocks that the queries of query block i can see (from masks.key_range)."""
  rows_end = jnp.minimum((i + 1) * st.block_q, st.q_len)
  empty = rows_end <= i * st.block_q  # a query block made only of padding sees nothing
  # The block's first and last query positions. Both fit int32 (the last query sits at
  # 2**31 - 1 at most); the end after it need not, nor a padding block's first position.
  q_first = off + jnp.minimum(i * st.block_q, st.q_len - 1)
  q_last = off + (rows_end - 1)
  lo, hi = masks.key_range(q_first, q_last, causal=st.causal, window=st.window,
                           kv_len=st.kv_len)
  return block_bounds(lo, jnp.where(empty, lo, hi), st.block_k)


def query_blocks(st: FlashStatic, off, j):
  """Query blocks that see some key of key block j (from masks.query_range)."""
  k_first = j * st.block_k
  k_last = jnp.minimum((j + 1) * st.block_k, st.kv_len) - 1  # < k_first: only padding
  lo, hi = masks.query_range(k_first, k_last, causal=st.causal, window=st.window,
                             q_first=off, q_last=off + (st.q_len - 1))
  return block_bounds(lo, hi, st.block_q)
