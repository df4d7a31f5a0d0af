"""Parity of the Pallas flash kernel (interpret mode on CPU) with the reference op.

The grid T, S in {1, 7, 128, 200, 513} x H in {32, 64, 128} x G in {1, 2, 4, 8}
x causal x window in {None, 1, 16, 100} x segments x dtype is covered by a
hand-picked covering selection (every value appears, and the combinations
that stress the kernel: T != S, multi-block bands, fully masked rows, query
offsets) instead of the full product. Small tiles (16 / 32) keep interpret
mode fast and force multi-block paths.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

try:  # the bare GPU image may lack hypothesis; the gpu-marked tests must still collect
  from hypothesis import Phase, given, settings
  from hypothesis import strategies as st
except ImportError:
  given = None
else:
  NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)

import attnlab
from attnlab.ops import masks
from attnlab.ops.pallas import common, flash
from attnlab.ops.reference import reference_attention
from tests import random_arrays
from tests.ops.flash_inputs import (
  assert_far_apart_close,
  cuda_target,
  far_apart_inputs,
  flash_inputs,
  kernel_blocks,
  kernel_dots,
  pallas_calls,
  value_and_grads,
)
from tests.ops.naive import naive_attention, naive_attention_grads
from tests.ops.tolerances import assert_bf16_close

TOL = {jnp.float32: 1e-5}  # bfloat16: tolerances.assert_bf16_close (3x the reference's error)






def _assert_close(actual, expected, dtype, what):
  tol = TOL[dtype]
  actual = np.asarray(actual, np.float32)
  expected = np.asarray(expected, np.float32)
  assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
  # Relative to the tensor's scale: gradients summed over hundreds of queries
  # are O(10), and bfloat16 keeps ~3 significant digits.
  scale = max(1.0, float(np.max(np.abs(expected))))
  np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale, err_msg=what)


def _reference_and_f32(kw, q, k, v, do):
  """(reference in the inputs' dtype, reference in float32 on the same rounded inputs)."""
  run = value_and_grads(lambda q, k, v: reference_attention(q, k, v, **kw))
  return run(q, k, v, do), run(*(x.astype(F32) for x in (q, k, v, do)))


def _check_parity(B, T, S, N, K, H, *, causal, window, segments=None, dtype=jnp.float32,
                  q_offset=0, block_q=16, block_k=32, seed=0):
  q, k, v, do, seg = flash_inputs(seed, B, T, S, N, K, H, dtype, segments)
  kw = dict(causal=causal, window=window, q_offset=q_offset, **seg)
  reference = value_and_grads(lambda q, k, v: reference_attention(q, k, v, **kw))
  kernel = value_and_grads(lambda q, k, v: flash.flash_attention(
      q, k, v, block_q=block_q, block_k=block_k, **kw))

  @jax.jit  # the kernel, the reference and (bfloat16) the float32 reference in one program
  def run(q, k, v, do):
    f32 = reference(*(x.astype(F32) for x in (q, k, v, do))) if dtype == BF16 else None
    return kernel(q, k, v, do), reference(q, k, v, do), f32

  got, ref, ref_f32 = run(q, k, v, do)
  for name, a, b, c in zip(("out", "dq", "dk", "dv"), got, ref, ref_f32 or ref):
    assert a.shape == b.shape and a.dtype == b.dtype, name
    if dtype == BF16:
      assert_bf16_close(a, b, c, name)
    else:
      _assert_close(a, b, dtype, name)


F32, BF16 = jnp.float32, jnp.bfloat16
# (T, S, H, N, K, causal, window, segments, dtype, q_offset)
CASES = [
    (128, 128, 128, 4, 1, True, 16, None, F32, 0),
    (200, 200, 32, 8, 1, True, 100, "packed", F32, 0),
    (7, 513, 32, 4, 2, False, 16, None, F32, 0),
    (128, 200, 64, 2, 1, False, 100, None, BF16, 0),
    (200, 1, 128, 1, 1, True, 1, None, F32, 0),  # rows past the one key: fully masked
    (1, 128, 64, 8, 2, True, None, None, F32, 127),  # one decode step at the end of a cache
    (7, 200, 128, 8, 4, True, 100, None, BF16, 193),
    (128, 7, 32, 2, 2, True, None, "pad", BF16, 0),
    (200, 128, 64, 4, 4, False, 1, "pad", F32, 0),
]
SLOW_CASES = [
    (513, 513, 64, 8, 8, True, None, None, BF16, 0),
    (513, 7, 128, 2, 2, False, None, "packed", F32, 0),
    (128, 513, 32, 4, 1, True, 16, "packed", F32, 385),
    (200, 513, 32, 4, 1, True, 100, "pad", BF16, 313),
]


@pytest.mark.parametrize("T,S,H,N,K,causal,window,segments,dtype,q_offset", CASES)
def test_parity(T, S, H, N, K, causal, window, segments, dtype, q_offset):
  _check_parity(2 if segments == "pad" else 1, T, S, N, K, H, causal=causal, window=window,
                segments=segments, dtype=dtype, q_offset=q_offset)


@pytest.mark.slow
@pytest.mark.parametrize("T,S,H,N,K,causal,window,segments,dtype,q_offset", SLOW_CASES)
def test_parity_slow(T, S, H, N, K, causal, window, segments, dtype, q_offset):
  _check_parity(2 if segments == "pad" else 1, T, S, N, K, H, causal=causal, window=window,
                segments=segments, dtype=dtype, q_offset=q_offset, block_q=32, block_k=32)


def test_grid_is_covered():
  """Every value of every grid dimension appears in the selection."""
  cases = CASES + SLOW_CASES
  assert {c[0] for c in cases} | {c[1] for c in cases} >= {1, 7, 128, 200, 513}
  assert {c[2] for c in cases} >= {32, 64, 128}
  assert {c[3] // c[4] for c in cases} >= {1, 2, 4, 8}
  assert {c[5] for c in cases} == {True, False}
  assert {c[6] for c in cases} >= {None, 1, 16, 100}
  assert {c[7] for c in cases} >= {None, "packed", "pad"}
  assert {c[8] for c in cases} == {F32, BF16}


def test_per_batch_offset_and_default_blocks():
  """q_offset as an int [B] array, default tile sizes (one block per axis): interpret
  mode's plan, a query tile of 8 rows (T = 5 rounded up to a power of two; the Triton plan
  would take 16) and one key tile of 64."""
  B, T, S, N, K, H = 2, 5, 40, 4, 2, 32
  q, k, v, do, _ = flash_inputs(1, B, T, S, N, K, H, F32, None)
  off = jnp.array([35, 3], jnp.int32)
  kw = dict(causal=True, window=8, q_offset=off)
  ref = value_and_grads(lambda q, k, v: reference_attention(q, k, v, **kw))(q, k, v, do)
  fn = value_and_grads(lambda q, k, v: flash.flash_attention(q, k, v, **kw))
  blocks = kernel_blocks(fn.trace(q, k, v, do).jaxpr)["attnlab_flash_forward"]
  assert blocks[1:3] == [((8, H), F32), ((64, H), F32)]  # a query tile, a (padded) key row
  got = fn(q, k, v, do)
  for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
    _assert_close(a, b, F32, name)


def test_scores_far_below_zero_keep_their_softmax():
  """Rows whose scores all lie in [-300, -150] next to rows in [150, 300] (S = 24 in tiles
  of 8): each row's running max starts at -inf (forward and backward, against the float64
  formulas). No kernel test had scores that far below 0 until 2026-12-05 (a running max
  started at 0 passed the TPU kernel's tests, and gives such rows 0)."""
  q, k, v, do = far_apart_inputs(1, 8, 24, 2, 1, 64)
  got = value_and_grads(lambda q, k, v: flash.flash_attention(
      q, k, v, block_q=8, block_k=8, interpret=True))(q, k, v, do)
  assert_far_apart_close(got, naive_attention_grads(q, k, v, do))


def test_bfloat16_inputs_are_multiplied_in_bfloat16():
  """With bfloat16 q / k / v every product of the three kernels takes bfloat16 operands
  (float32 accumulation): P and dS are rounded to the inputs' dtype before their products,
  as the reference op rounds them, so Triton runs bfloat16 tensor-core dots. Keeping them
  in float32 is a little closer to the float32 answer, so no parity test sees it. Traced
  only (interpret mode: the GPU kernels' own bodies)."""
  q, k, v, do, _ = flash_inputs(3, 1, 32, 32, 2, 1, 64, jnp.bfloat16, None)
  fn = value_and_grads(lambda q, k, v: flash.flash_attention(q, k, v, causal=True,
                                                             interpret=True))
  dots = kernel_dots(fn.trace(q, k, v, do).jaxpr)
  assert {name: len(pairs) for name, pairs in dots.items()} == {
      "attnlab_flash_forward": 2, "attnlab_flash_dq": 3, "attnlab_flash_dkv": 4}, dots
  assert all(pair == ("bfloat16", "bfloat16") for pairs in dots.values() for pair in pairs), dots


@pytest.mark.parametrize("causal,window,segments", [(True, 24, "packed"), (False, None, "pad")])
def test_kernel_blocks_stay_in_bounds(monkeypatch, causal, window, segments):
  """Every block the three kernels' index maps select (forward, dQ, dK / dV: queries, keys,
  values, offsets, segment ids, lse, delta, outputs) lies inside its array, and so does
  every read inside a block. Interpret mode clamps an out-of-bounds block index, so a kernel
  that asked for one would match the reference here and read past the array on a GPU; TPU
  interpret mode raises on such a read. Forward and gradients under it, GQA, per-row query
  offsets, several blocks on each axis, against the reference."""
  pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
  monkeypatch.setattr(common, "resolve_interpret", lambda interpret: pltpu.InterpretParams())
  B, T, S, N, K, H = 2, 40, 72, 4, 2, 32
  q, k, v, do, seg = flash_inputs(4, B, T, S, N, K, H, F32, segments)
  kw = dict(causal=causal, window=window, q_offset=jnp.array([32, 5], jnp.int32), **seg)
  ref = value_and_grads(lambda q, k, v: reference_attention(q, k, v, **kw))(q, k, v, do)
  got = value_and_grads(lambda q, k, v: flash.flash_attention(q, k, v, block_q=16, block_k=32,
                                                              **kw))(q, k, v, do)
  for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
    _assert_close(a, b, F32, name)


def test_rows_of_one_tile_keep_their_own_softmax_scale():
  """The online softmax keeps a running max per query row: rows of one tile whose scores
  lie ~150 apart (every other query scaled by 60) each keep their probabilities. With one
  max for the whole tile the low rows' exp(s - max) would all underflow to 0.

  Scores that large make float32 itself inexact here (a score of ~150 carries an absolute
  rounding error of ~1e-5, which the softmax turns into relative error of its
  probabilities): the reference op is off the float64 definition by ~1e-5 of the
  tensor's scale too, by an amount that moves with the CPU's instruction set. So the
  kernel is held to a few times the reference op's own float32 error (measured: up to
  3.2x, on dV), against the float64 definition."""
  B, T, S, N, K, H = 1, 32, 64, 2, 1, 32
  q, k, v, do, _ = flash_inputs(5, B, T, S, N, K, H, F32, None)
  q = q * jnp.where(jnp.arange(T) % 2 == 0, 60.0, 1.0)[None, :, None, None]
  kw = dict(causal=False, window=None)
  ref = value_and_grads(lambda q, k, v: reference_attention(q, k, v, **kw))(q, k, v, do)
  got = value_and_grads(lambda q, k, v: flash.flash_attention(q, k, v, block_q=16, block_k=32,
                                                              **kw))(q, k, v, do)
  exact = naive_attention_grads(q, k, v, do)
  np.testing.assert_allclose(exact[0], naive_attention(q, k, v), rtol=1e-12, atol=1e-12)
  for name, a, r, e in zip(("out", "dq", "dk", "dv"), got, ref, exact, strict=True):
    a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
    assert np.all(np.isfinite(a)), name
    err, ref_err = np.max(np.abs(a - e)), np.max(np.abs(r - e))
    # The float64 gradients are right: the float32 reference op agrees with them.
    assert ref_err <= 1e-4 * max(1.0, np.max(np.abs(e))), (name, ref_err)
    assert err <= 4 * ref_err, f"{name}: error {err:.3g} > 4 x the reference op's {ref_err:.3g}"


# ids that are not the "gpu" / "tpu" markers (tests/conftest.py skips those off a device).
@pytest.mark.parametrize("backend", ["gpu", "tpu"], ids=["triton_style", "mosaic"])
def test_called_directly_the_kernel_checks_causal_and_q_offset_and_takes_numpy_ints(backend):
  """``flash_attention`` itself (not only ``attention``) refuses a causal that is not a
  bool and a float q_offset, and takes NumPy ints for the offset, window and blocks (a
  string causal acted as True, a float offset was truncated, a NumPy block was refused)."""
  B, T, S, N, K, H = 1, 8, 16, 2, 1, 8
  q, k, v, _, _ = flash_inputs(2, B, T, S, N, K, H, F32, None)
  with pytest.raises(ValueError, match=r"^causal='false' must be True or False$"):
    flash.flash_attention(q, k, v, causal="false", backend=backend)
  with pytest.raises(ValueError, match=r"^q_offset=1\.5 must be an integer"):
    flash.flash_attention(q, k, v, q_offset=1.5, backend=backend)
  kw = dict(causal=True, window=4, q_offset=3, block_q=8, block_k=8)
  want = jax.jit(lambda q, k, v: flash.flash_attention(q, k, v, backend=backend, **kw))(q, k, v)
  np_kw = dict(causal=np.True_, window=np.int64(4), q_offset=np.int64(3),
               block_q=np.int64(8), block_k=np.int32(8))
  got = jax.jit(lambda q, k, v: flash.flash_attention(q, k, v, backend=backend, **np_kw))(
      q, k, v)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_allclose(want, jax.jit(lambda q, k, v: reference_attention(
      q, k, v, causal=True, window=4, q_offset=3))(q, k, v), atol=1e-5)


def test_plan_of_the_tiles():
  """Interpret mode: 128 x 128 tiles, capped at the next power of two of T and S, the head
  dim as it is. Triton: the per-head-dim settings of ``gpu_tiles``, every tile dim (the head
  dim zero-padded) a power of two and at least 16 (``tl.dot``), warps a power of two."""
  from attnlab.ops.pallas import flash_gpu
  from attnlab.ops.pallas.common import BlockSizes

  assert flash_gpu.plan(1000, 700, 80, block_q=None, block_k=None, interpret=True) == (
      BlockSizes(128, 128), 80)
  assert flash_gpu.plan(5, 40, 8, block_q=None, block_k=None, interpret=True) == (
      BlockSizes(8, 64), 8)
  assert flash_gpu.plan(1, 1, 8, block_q=None, block_k=None, interpret=True) == (
      BlockSizes(1, 1), 8)
  assert flash_gpu.plan(100, 100, 8, block_q=16, block_k=32, interpret=True) == (
      BlockSizes(16, 32), 8)
  pow2 = lambda n: n > 0 and n & (n - 1) == 0
  for H in (1, 8, 16, 17, 32, 63, 64, 65, 80, 128, 129, 256):
    for T, S in ((1, 1), (5, 40), (100, 3000), (4096, 4096)):
      blocks, Hp = flash_gpu.plan(T, S, H, block_q=None, block_k=None, interpret=False)
      tiles = flash_gpu.gpu_tiles(H)
      assert Hp == max(16, 1 << (H - 1).bit_length()), (H, Hp)
      assert (blocks.num_warps, blocks.num_stages) == (tiles.num_warps, tiles.num_stages)
      assert blocks.block_q == max(16, min(tiles.block_q, 1 << max(0, (T - 1).bit_length())))
      assert blocks.block_k == max(16, min(tiles.block_k, 1 << max(0, (S - 1).bit_length())))
      assert all(pow2(n) and n >= 16 for n in (blocks.block_q, blocks.block_k, Hp))
      assert pow2(blocks.num_warps) and blocks.num_stages >= 1
  # Three settings, by head dim: up to 64, up to 128, larger (their values are tuning,
  # for a GPU benchmark to judge); larger head dims never get larger tiles.
  groups = [{flash_gpu.gpu_tiles(h) for h in hs} for hs in ((1, 32, 64), (65, 128), (129, 256))]
  assert [len(g) for g in groups] == [1, 1, 1] and len(set.union(*groups)) == 3
  sizes = [next(iter(g)) for g in groups]
  assert all(a.block_q >= b.block_q and a.block_k >= b.block_k
             for a, b in zip(sizes, sizes[1:]))


def test_each_triton_kernel_gets_the_launch_settings_of_its_head_dim():
  """Compiled for a GPU, forward, dQ and dK / dV each launch with the ``num_warps`` and
  ``num_stages`` that ``gpu_tiles`` gives the head dim (one H of each of its three settings);
  interpreted, with none. Traced only: the settings are the pallas_calls' parameters."""
  from attnlab.ops.pallas import flash_gpu

  for H in (32, 100, 160):
    tiles = flash_gpu.gpu_tiles(H)
    q, k, v, do, seg = flash_inputs(0, 1, 40, 40, 4, 2, H, F32, "packed")
    for interpret in (False, True):
      fn = value_and_grads(functools.partial(
          flash._flash_gpu, causal=True, window=None, q_offset=0, scale=None, block_q=None,
          block_k=None, interpret=interpret, **seg))
      calls = pallas_calls(fn.trace(q, k, v, do).jaxpr)
      assert sorted(str(c.params["name"]) for c in calls) == [
          "attnlab_flash_dkv", "attnlab_flash_dq", "attnlab_flash_forward"]
      for c in calls:
        params = c.params["compiler_params"]
        got = None if params is None else (params.num_warps, params.num_stages)
        assert got == (None if interpret else (tiles.num_warps, tiles.num_stages)), (
            H, interpret, c.params["name"], params)


def test_the_gpu_plans_padded_head_dim_in_interpret_mode(monkeypatch):
  """The Triton plan zero-pads the head dim to a power of two (80 -> 128) with 16 x 16 tiles;
  interpret mode keeps H as it is, so here ``plan`` is made to return the GPU plan and the
  padded path runs on the CPU: forward and gradients equal the reference's (the kernels see
  128-wide blocks). Catches the padded lanes reaching the result, e.g. the default scale
  taken from the padded head dim (1 / sqrt(128) instead of 1 / sqrt(80))."""
  from attnlab.ops.pallas import flash_gpu

  real = flash_gpu.plan
  monkeypatch.setattr(flash_gpu, "plan", lambda T, S, H, *, block_q, block_k, interpret: real(
      T, S, H, block_q=16, block_k=16, interpret=False))
  assert flash_gpu.plan(20, 37, 80, block_q=None, block_k=None, interpret=True)[1] == 128
  q, k, v, do, seg = flash_inputs(0, 1, 20, 37, 2, 1, 80, F32, "packed")
  kw = dict(causal=True, q_offset=17, **seg)
  fn = value_and_grads(lambda q, k, v: flash.flash_attention(q, k, v, interpret=True, **kw))
  blocks = kernel_blocks(fn.trace(q, k, v, do).jaxpr)
  assert blocks["attnlab_flash_forward"][1] == ((16, 128), F32)  # a query tile, padded
  want = value_and_grads(lambda q, k, v: reference_attention(q, k, v, **kw))(q, k, v, do)
  for name, a, b in zip(("out", "dq", "dk", "dv"), fn(q, k, v, do), want, strict=True):
    assert a.shape == b.shape, name
    _assert_close(a, b, F32, name)


@pytest.mark.parametrize("segments", [False, True])
def test_the_three_kernels_and_their_blocks(segments):
  """Forward and backward are three named kernels reading these blocks (squeezed axes
  dropped): the per-row query offset one int; queries, dO and outputs a query tile of every
  head; K and V a whole (padded) row of one KV head in the query-tile kernels, a key tile
  in dK / dV, whose program holds the G query heads of its group over the whole row. The
  arrays they are cut from are padded to whole tiles and no further."""
  B, T, S, N, K, H, bq, bk = 2, 40, 72, 4, 2, 32, 16, 32
  q, k, v, do, seg = flash_inputs(0, B, T, S, N, K, H, F32, "packed" if segments else None)
  fn = lambda q, k, v: flash.flash_attention(q, k, v, causal=True, block_q=bq, block_k=bk,
                                             **seg)
  jaxpr = value_and_grads(fn).trace(q, k, v, do).jaxpr
  blocks = kernel_blocks(jaxpr)
  arrays = kernel_blocks(jaxpr, arrays=True)
  i32 = jnp.int32
  whole = [((B, 1), i32), ((B, 48, N, H), F32), ((B, 96, K, H), F32), ((B, 96, K, H), F32)]
  whole_segs = [((B, 48), i32), ((B, 96), i32)] if segments else []
  assert arrays["attnlab_flash_forward"] == [
      *whole, *whole_segs, ((B, 48, N, H), F32), ((B, N, 48), F32)]
  Tp, Sp, G = 48, 96, N // K  # padded to whole tiles
  f32, i32 = jnp.float32, jnp.int32
  off, Q, ROW_KV, ROW = ((1,), i32), ((bq, H), f32), ((Sp, H), f32), ((bq,), f32)
  segs = [((bq,), i32), ((Sp,), i32)] if segments else []
  assert blocks["attnlab_flash_forward"] == [off, Q, ROW_KV, ROW_KV, *segs, Q, ROW]
  assert blocks["attnlab_flash_dq"] == [off, Q, ROW_KV, ROW_KV, Q, ROW, ROW, *segs, Q]
  GQ, GROW, KV = ((Tp, G, H), f32), ((G, Tp), f32), ((bk, H), f32)
  segs = [((Tp,), i32), ((bk,), i32)] if segments else []
  assert blocks["attnlab_flash_dkv"] == [off, GQ, KV, KV, GQ, GROW, GROW, *segs, KV, KV]


def test_defaults_and_an_explicit_scale():
  """Called with no mask arguments the kernel attends to every key (not causal) with scores
  scaled by 1 / sqrt(H); ``scale=`` replaces that factor, in the forward and the gradients."""
  q, k, v, do, _ = flash_inputs(7, 1, 24, 40, 4, 2, 32, F32, None)
  kws = (dict(), dict(scale=0.3))

  @jax.jit  # every call in one program: one compilation, not one per call (or op)
  def run(q, k, v, do):
    pairs = [(value_and_grads(lambda q, k, v, kw=kw: flash.flash_attention(
        q, k, v, block_q=16, block_k=16, **kw))(q, k, v, do),
              value_and_grads(lambda q, k, v, kw=kw: reference_attention(q, k, v, **kw))(
                  q, k, v, do)) for kw in kws]
    return pairs, (reference_attention(q, k, v, causal=True), flash.flash_attention(q, k, v),
                   flash.flash_attention(q, k, v, scale=0.3))

  pairs, (causal, default, scaled) = run(q, k, v, do)
  for kw, (got, ref) in zip(kws, pairs, strict=True):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
      _assert_close(a, b, F32, f"{name} {kw}")
  assert not np.allclose(default, causal, atol=1e-3)
  assert not np.allclose(scaled, default, atol=1e-3)


def test_dispatcher_reaches_pallas():
  q, k, v, _, _ = flash_inputs(2, 1, 33, 33, 4, 2, 32, F32, None)
  got, ref = jax.jit(lambda q, k, v: (  # one program: one compilation
      attnlab.attention(q, k, v, causal=True, window=9, implementation="pallas"),
      reference_attention(q, k, v, causal=True, window=9)))(q, k, v)
  _assert_close(got, ref, F32, "out")


def test_fully_masked_rows_are_zero_with_zero_grads():
  """Segments that share nothing: every query sees no key."""
  q, k, v, do, _ = flash_inputs(3, 1, 20, 24, 2, 1, 32, F32, None)
  seg = dict(q_segment_ids=jnp.ones((1, 20), jnp.int32),
             kv_segment_ids=jnp.full((1, 24), 2, jnp.int32))
  out, dq, dk, dv = value_and_grads(lambda q, k, v: flash.flash_attention(
      q, k, v, block_q=16, block_k=16, **seg))(q, k, v, do)
  for x in (out, dq, dk, dv):
    assert np.all(np.asarray(x) == 0)


if given is not None:

  @settings(max_examples=5, deadline=None, derandomize=True,
            phases=NO_SHRINK)  # each example compiles kernels: report the first failure as is
  @given(
      T=st.integers(5, 40), S=st.integers(5, 40), H=st.sampled_from([8, 16]),
      K=st.sampled_from([1, 2]), G=st.sampled_from([1, 2, 3]), causal=st.booleans(),
      window=st.one_of(st.none(), st.integers(1, 24)), q_offset=st.integers(0, 30),
      segments=st.sampled_from([None, "packed"]),
      block_q=st.sampled_from([2, 4]), block_k=st.sampled_from([2, 4]),
  )
  def test_random_shapes(T, S, H, K, G, causal, window, q_offset, segments, block_q, block_k):
    """Random requests on the multi-block path: tiles of 2-4 against 5-40 positions."""
    assert -(-T // block_q) >= 2 and -(-S // block_k) >= 2  # several blocks on both axes
    _check_parity(1, T, S, K * G, K, H, causal=causal, window=window, q_offset=q_offset,
                  segments=segments, block_q=block_q, block_k=block_k, seed=T * 97 + S)


@pytest.mark.parametrize("causal,window", [(True, None), (False, 3), (True, 3), (False, None),
                                           (False, 10), (True, 10)])
def test_block_ranges_match_the_predicate(causal, window):
  """key_range / query_range bound exactly the positions position_mask allows. A window of
  10 reaches from the last keys past the last query (query_range's clamp at q_hi: 3 never
  does, so a query range cut 2 short there passed until 2026-12-05)."""
  kv_len, q_start, q_stop = 23, 4, 30
  qs, ks = np.arange(q_start, q_stop), np.arange(kv_len)
  allowed = np.asarray(masks.position_mask(qs[:, None], ks[None, :], causal=causal,
                                           window=window))
  for lo, hi in itertools.combinations(range(q_start, q_stop + 1), 2):
    k_lo, k_hi = masks.key_range(lo, hi - 1, causal=causal, window=window, kv_len=kv_len)
    seen = np.flatnonzero(allowed[lo - q_start:hi - q_start].any(axis=0))
    if seen.size:
      assert int(k_lo) == seen.min() and int(k_hi) == seen.max() + 1
    else:
      assert int(k_hi) <= int(k_lo)
  for lo, hi in itertools.combinations(range(kv_len + 1), 2):
    r_lo, r_hi = masks.query_range(lo, hi - 1, causal=causal, window=window, q_first=q_start,
                                   q_last=q_stop - 1)
    seen = np.flatnonzero(allowed[:, lo:hi].any(axis=1))  # query indices
    if seen.size:
      assert int(r_lo) == seen.min() and int(r_hi) == seen.max() + 1
    else:
      assert (int(r_lo), int(r_hi)) == (0, 0)


def _bad(**over):
  args = dict(q=jnp.zeros((1, 8, 4, 32)), k=jnp.zeros((1, 8, 2, 32)), v=jnp.zeros((1, 8, 2, 32)))
  kw = {k: over.pop(k) for k in list(over) if k not in args}
  args.update(over)
  return lambda: flash.flash_attention(args["q"], args["k"], args["v"], **kw)


@pytest.mark.parametrize("call,match", [
    (_bad(k=jnp.zeros((1, 8, 2, 16)), v=jnp.zeros((1, 8, 2, 16))), "head dim of q_BTNH"),
    (_bad(k=jnp.zeros((1, 8, 3, 32)), v=jnp.zeros((1, 8, 3, 32))), "multiple of the num kv"),
    (_bad(v=jnp.zeros((1, 9, 2, 32))), "v_BSKH"),
    (_bad(block_q=24), "block_q=24"),
    (_bad(block_k=0), "block_k=0"),
    (_bad(window=0), "window=0"),
    (_bad(q_segment_ids=jnp.zeros((1, 7), jnp.int32),
          kv_segment_ids=jnp.zeros((1, 8), jnp.int32)), "q_segment_ids shape"),
    (_bad(q_segment_ids=jnp.zeros((1, 8), jnp.int32),
          kv_segment_ids=jnp.zeros((2, 8), jnp.int32)), "kv_segment_ids shape"),
    (_bad(q_segment_ids=jnp.zeros((1, 8), jnp.int32)), "given together"),
])
def test_bad_input_raises(call, match):
  with pytest.raises(ValueError, match=match):
    call()


@pytest.mark.parametrize("block,why", [(64, "must be a positive multiple of 128 (compiled)"),
                                       (384, "must be a positive power of two")])
def test_blocks_of_a_call_that_lowers_for_both_kernels_must_suit_both(block, why, monkeypatch):
  """backend=None on a GPU or TPU host, under jit, traces both compiled kernels: a block size
  one of them refuses is named with the reason (the other kernel's refusal came alone until
  2026-12-07). Called eagerly, only the running platform's kernel runs, and takes its own."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # what a GPU host reads
  q, k, v = (jax.random.normal(jax.random.key(i), (1, 8, 2, 32)) for i in range(3))
  with pytest.raises(ValueError) as e:
    jax.jit(lambda q, k, v: flash.flash_attention(q, k, v, block_q=block, block_k=128))(q, k, v)
  assert str(e.value) == (
      f"block_q={block} {why}: backend=None traces the compiled TPU and Triton kernels both (so "
      "that the call lowers for either), and block sizes must suit both, powers of two that are "
      "multiples of 128; give backend='gpu' or 'tpu' for one kernel's own")
  with pytest.raises(ValueError, match="^block_k=96 must be a positive power of two: backend"):
    jax.jit(lambda q, k, v: flash.flash_attention(q, k, v, block_q=128, block_k=96))(q, k, v)
  if block == 64:  # eagerly, here the CPU's kernel (the Triton-style one, interpreted)
    np.testing.assert_array_equal(
        flash.flash_attention(q, k, v, block_q=64, block_k=64),
        flash.flash_attention(q, k, v, block_q=64, block_k=64, backend="gpu", interpret=True))


@pytest.mark.parametrize("H,dtype,kv_dtype", [(64, BF16, BF16), (80, F32, F32),
                                              (64, BF16, F32)])
def test_triton_lowering(H, dtype, kv_dtype, monkeypatch):
  """The GPU path lowers to Triton IR (on CPU, by cross-platform lowering).

  This runs the Pallas -> Triton lowering rules (power-of-two tiles,
  supported primitives, dot shapes) for forward + backward. It does not run
  Triton's compiler to PTX nor the kernel: that needs a GPU (tools/gpu_check.sh).
  """
  pytest.importorskip("jax._src.lib.triton")
  monkeypatch.setattr(common, "resolve_interpret", lambda interpret: False)
  B, T, S, N, K = 2, 300, 700, 8, 2
  q, k, v, do, seg = flash_inputs(0, B, T, S, N, K, H, dtype, "packed")
  # A bfloat16 query over float32 keys and values (Triton's dot takes one dtype: this
  # failed to lower until 2026-12-05).
  k, v = k.astype(kv_dtype), v.astype(kv_dtype)
  fn = value_and_grads(lambda q, k, v: flash.flash_attention(
      q, k, v, causal=True, window=200, q_offset=jnp.array([400, 0]), **seg))
  with cuda_target():
    text = fn.trace(q, k, v, do).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("triton") >= 3  # forward, dq and dk/dv kernels


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, 24)])
def test_triton_lowering_of_every_mask_kind(causal, window, monkeypatch):
  """Non-causal without a window (an encoder's, cross-attention's) lowers too: its key range
  came from two Python ints whose Triton select took the condition's type, and the
  comparison after it failed to lower ("('i1', 'i32')") until 2026-12-07."""
  pytest.importorskip("jax._src.lib.triton")
  monkeypatch.setattr(common, "resolve_interpret", lambda interpret: False)
  q, k, v, do, _ = flash_inputs(1, 1, 40, 72, 2, 1, 32, BF16, None)
  fn = value_and_grads(lambda q, k, v: flash.flash_attention(q, k, v, causal=causal,
                                                             window=window))
  with cuda_target():
    text = fn.trace(q, k, v, do).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("triton") >= 3


@pytest.mark.gpu
@pytest.mark.parametrize("H,G,causal,window", [(64, 1, True, None), (128, 4, True, 256),
                                               (64, 2, False, None), (80, 1, True, None)])
def test_gpu_compiled_matches_reference(H, G, causal, window):
  """Triton-compiled kernel (interpret=False), bfloat16, against the reference."""
  B, T, S, K = 2, 1000, 1000, 2
  q, k, v, do, _ = flash_inputs(4, B, T, S, K * G, K, H, BF16, None)
  kw = dict(causal=causal, window=window)
  ref, ref_f32 = _reference_and_f32(kw, q, k, v, do)
  got = value_and_grads(lambda q, k, v: flash.flash_attention(q, k, v, interpret=False, **kw))(
      q, k, v, do)
  for name, a, b, c in zip(("out", "dq", "dk", "dv"), got, ref, ref_f32):
    assert_bf16_close(a, b, c, name)


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_model_pallas_equals_reference(arch, monkeypatch):
  """Same logits and parameter gradients with attention_impl="pallas" as "reference"."""
  from flax import nnx

  calls = []
  kernel = flash.flash_attention

  def counting_kernel(*args, **kwargs):
    calls.append(1)
    return kernel(*args, **kwargs)

  monkeypatch.setattr(flash, "flash_attention", counting_kernel)

  def build(impl):
    cfg = attnlab.ModelConfig(
        arch=arch, vocab_size=64, d_model=64, num_layers=1, num_heads=4, num_kv_heads=2,
        head_dim=16, d_ff=128, window=12 if arch == "decoder_only" else None,
        attention_impl=impl,
    )
    return attnlab.build_model(cfg, rngs=nnx.Rngs(0))

  tokens = random_arrays.randint(5, (2, 37), 1, 64)
  src = tokens.at[1, 30:].set(0)  # padded source row: the encoder masks pad_id=0

  @nnx.jit
  def logits_and_grads(model):
    def loss(model):
      logits = model(tokens) if arch == "decoder_only" else model(src, tokens)
      return jnp.mean(jnp.square(logits)), logits

    (_, logits), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    return logits, grads

  ref_model, pallas_model = build("reference"), build("pallas")
  ref_logits, ref_grads = logits_and_grads(ref_model)
  assert not calls
  logits, grads = logits_and_grads(pallas_model)
  assert calls, "the pallas model did not reach flash_attention"
  _assert_close(logits, ref_logits, F32, "logits")
  ref_leaves = jax.tree_util.tree_leaves_with_path(nnx.state(ref_grads))
  leaves = jax.tree_util.tree_leaves(nnx.state(grads))
  assert len(ref_leaves) == len(leaves) > 0
  for (path, expected), actual in zip(ref_leaves, leaves):
    _assert_close(actual, expected, F32, jax.tree_util.keystr(path))


@pytest.mark.parametrize("backend", ["gpu", "tpu"], ids=["triton_style", "mosaic"])
def test_a_second_derivative_is_refused_by_name_and_the_first_still_matches(backend):
  """A Hessian-vector product (jax.jvp of jax.grad) or a gradient of a gradient through the
  kernels raised a bare AssertionError from JAX's pallas_call rule until 2026-12-05; the
  error now names the implementations that take one. The first derivative is unchanged."""
  q, k, v, _, _ = flash_inputs(2, 1, 24, 24, 2, 1, 8, F32, None)

  def loss(impl):
    if impl == "flash":
      return lambda q: flash.flash_attention(q, k, v, causal=True, backend=backend).sum()
    return lambda q: attnlab.attention(q, k, v, causal=True, implementation=impl).sum()

  np.testing.assert_allclose(jax.jit(jax.grad(loss("flash")))(q),
                             jax.jit(jax.grad(loss("reference")))(q), rtol=1e-5, atol=1e-5)
  hvp = lambda f: jax.jvp(jax.grad(f), (q,), (q,))
  for second in (hvp, lambda f: jax.grad(lambda x: jax.grad(f)(x).sum())(q)):
    with pytest.raises(NotImplementedError) as e:
      second(loss("flash"))
    assert str(e.value) == common.SECOND_ORDER
  if backend == "tpu":  # what the message offers works (once: it does not depend on backend)
    want = jax.jit(jax.grad(lambda x: jax.grad(loss("reference"))(x).sum()))(q)
    for impl in ("blocked", "chunked", "xla"):
      jax.jit(lambda q, impl=impl: jax.jvp(jax.grad(loss(impl)), (q,), (q,)))(q)
      np.testing.assert_allclose(
          jax.jit(jax.grad(lambda x, impl=impl: jax.grad(loss(impl))(x).sum()))(q), want,
          rtol=1e-4, atol=1e-4, err_msg=impl)
    # forward mode: JAX refuses it for a custom_vjp function (pallas, chunked), as the
    # message and the README say; the others take it
    want = jax.jvp(loss("reference"), (q,), (q,))[1]
    for impl in ("blocked", "xla"):
      np.testing.assert_allclose(jax.jvp(loss(impl), (q,), (q,))[1], want, rtol=1e-5, err_msg=impl)
    for impl in ("pallas", "chunked"):
      with pytest.raises(TypeError, match="can't apply forward-mode autodiff"):
        jax.jvp(loss(impl), (q,), (q,))


TOP = 2**31 - 1
# (q_offset, causal, window): the offsets at both ends of what check_q_offset accepts (the
# last query at 2**31 - 1; the first at -2**31) and one per row.
INT32_EDGES = [
    (2**31 - 12, False, None), (2**31 - 12, True, None), (2**31 - 12, True, TOP),
    (-2**31, False, 4), (-2**31, False, TOP), (np.array([2**31 - 12, -2**31]), False, TOP)]


def _attention_under_mask(q, k, v, mask_BTS):
  """Softmax attention under an explicit [B, T, S] mask (GQA by repetition); a row that
  sees no key gives zeros."""
  G = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
  s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
  m = mask_BTS[:, None]
  p = jax.nn.softmax(jnp.where(m, s, -jnp.inf), axis=-1, where=m)
  return jnp.einsum("bnts,bsnh->btnh", jnp.where(m, p, 0.0), v)


@pytest.mark.parametrize("q_offset, causal, window", INT32_EDGES,
                         ids=["top", "top-causal", "top-causal-widest", "bottom-window4",
                              "bottom-widest", "per-row"])
def test_every_implementation_at_the_int32_edges_of_q_offset(q_offset, causal, window):
  """At the highest q_offset accepted (2**31 - T) and the lowest (-2**31), every
  implementation, the kernels' gradients included, equals attention under a mask computed
  in Python ints. Until 2026-12-06 the kernels' last query block there saw no key (its end,
  2**31, wrapped: zeros and zero gradients), and without causal a key 2**31 positions from
  its query was seen by every implementation (the difference wrapped)."""
  B, T, S = 2, 12, 20
  offsets = np.broadcast_to(np.asarray(q_offset, np.int64), (B,))
  q_pos, k_pos = offsets[:, None, None] + np.arange(T)[None, :, None], np.arange(S)
  mask = np.ones((B, T, S), bool)
  if causal:
    mask &= k_pos <= q_pos
  if window is not None:
    mask &= (q_pos - k_pos < window) & ((k_pos - q_pos < window) | causal)
  q, k, v, do, _ = flash_inputs(3, B, T, S, 4, 2, 8, F32, None)
  want = _attention_under_mask(q, k, v, jnp.asarray(mask))
  want_grads = jax.vjp(lambda *a: _attention_under_mask(*a, jnp.asarray(mask)), q, k, v)[1](do)
  kw = dict(causal=causal, window=window, q_offset=q_offset)
  for impl in ("reference", "blocked", "chunked", "xla", "pallas"):
    got = jax.jit(lambda q, k, v, impl=impl: attnlab.attention(
        q, k, v, implementation=impl, **kw))(q, k, v) if impl != "blocked" else \
        attnlab.attention(q, k, v, implementation=impl, **kw)
    _assert_close(got, want, F32, impl)
  for backend in ("gpu", "tpu"):
    out, vjp = jax.vjp(lambda *a, backend=backend: flash.flash_attention(
        *a, block_q=8, block_k=8, backend=backend, interpret=True, **kw), q, k, v)
    _assert_close(out, want, F32, backend)
    for name, g, w in zip(["dq", "dk", "dv"], jax.jit(vjp)(do), want_grads, strict=True):
      _assert_close(g, w, F32, f"{backend} {name}")
