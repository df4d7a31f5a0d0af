"""The TPU (Mosaic) flash kernel: TPU interpret mode on the CPU, lowering for ("tpu",).

TPU interpret mode (``pltpu.InterpretParams``) runs the kernel with TPU
semantics (scratch buffers, grid order, block DMAs that are skipped when the
block index does not change) but costs tens of milliseconds per grid step, so
the grid T, S in {1, 7, 128, 200, 513} x H in {64, 128} x G in {1, 2, 8} x
causal x window in {None, 1, 100} x segments x q offsets x dtype is covered by
three hand-picked cases (every value appears; small tiles force multi-block
paths and the band's partial blocks), ~5-10 s of CPU each.

float32 matches the reference to 1e-5. bfloat16 is judged against the
reference computed in float32 on the same (bfloat16-rounded) inputs: the
kernel's error must stay within a small multiple of the bfloat16 reference's
own error.
"""

import dataclasses
import difflib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

try:  # the bare accelerator images may lack hypothesis; the marked tests must still collect
  from hypothesis import Phase, given, settings
  from hypothesis import strategies as st
except ImportError:
  given = None
else:
  NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)

import attnlab
from attnlab.ops.pallas import flash, flash_tpu
from attnlab.ops.pallas.common import BlockSizes
from attnlab.ops.reference import reference_attention
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
from tests.ops.naive import naive_attention_grads

F32, BF16 = jnp.float32, jnp.bfloat16
BF16_MULTIPLE = 3.0  # kernel error <= this x the bf16 reference's error (+ a float32 floor)






NAMES = ("out", "dq", "dk", "dv")


def _check_parity(B, T, S, N, K, H, *, causal, window, segments=None, dtype=F32, q_offset=0,
                  block_q=16, block_k=32, seed=0):
  q, k, v, do, seg = flash_inputs(seed, B, T, S, N, K, H, dtype, segments)
  kw = dict(causal=causal, window=window, q_offset=q_offset, **seg)
  kernel = value_and_grads(lambda q, k, v: flash.flash_attention(
      q, k, v, block_q=block_q, block_k=block_k, backend="tpu", interpret=True, **kw))
  ref = value_and_grads(lambda q, k, v: reference_attention(q, k, v, **kw))

  @jax.jit  # the kernel and the references in one program: one compilation
  def run(q, k, v, do):
    exact = ref(*(x.astype(F32) for x in (q, k, v, do)))  # float32 on the same inputs
    return kernel(q, k, v, do), exact, ref(q, k, v, do) if dtype == BF16 else None

  got, exact, low = run(q, k, v, do)
  for i, name in enumerate(NAMES):
    a = got[i]
    assert a.shape == exact[i].shape and a.dtype == dtype, name
    a, e = np.asarray(a, np.float32), np.asarray(exact[i], np.float32)
    assert np.all(np.isfinite(a)), f"{name}: non-finite values"
    scale = max(1.0, float(np.max(np.abs(e))))
    if dtype == F32:
      np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5 * scale, err_msg=name)
    else:
      ref_err = float(np.max(np.abs(np.asarray(low[i], np.float32) - e)))
      err = float(np.max(np.abs(a - e)))
      assert err <= BF16_MULTIPLE * ref_err + 1e-5 * scale, (
          f"{name}: bf16 kernel error {err:.3g} vs bf16 reference error {ref_err:.3g}")


# (T, S, H, N, K, causal, window, segments, dtype, q_offset, block_q, block_k). Few cases
# (each compiles three interpret-mode kernels, ~5-10 s of CPU), chosen so every value of the
# grid appears, each on several blocks (multi-block bands, partial edge blocks).
CASES = [
    # T = 7 against a 513-key cache: G = 8, non-causal window 100 from q_offset 300 (a band
    # of 3 key blocks of 128 in the middle of 5), H = 128.
    (7, 513, 128, 8, 1, False, 100, None, F32, 300, 8, 128),
    # Packed documents, causal, bfloat16, G = 2, 4 x 4 blocks with partial edges.
    (200, 200, 64, 2, 1, True, None, "packed", BF16, 0, 64, 64),
    # One key, window 1, padded rows (B = 2), q_offset [0, 3] per sequence: rows past the
    # key and the whole second sequence see no key (zeros, zero gradients); T = 128, G = 1.
    (128, 1, 64, 2, 2, True, 1, "pad", F32, (0, 3), 32, 8),
]


@pytest.mark.parametrize("T,S,H,N,K,causal,window,segments,dtype,q_offset,bq,bk", CASES)
def test_parity(T, S, H, N, K, causal, window, segments, dtype, q_offset, bq, bk):
  B = 2 if segments == "pad" else 1
  if isinstance(q_offset, tuple):
    q_offset = jnp.array(q_offset, jnp.int32)
  _check_parity(B, T, S, N, K, H, causal=causal, window=window, segments=segments, dtype=dtype,
                q_offset=q_offset, block_q=bq, block_k=bk)


def test_grid_is_covered():
  """Every value of every grid dimension appears in the selection."""
  cases = CASES
  assert {c[0] for c in cases} | {c[1] for c in cases} >= {1, 7, 128, 200, 513}
  assert {c[2] for c in cases} >= {64, 128}
  assert {c[3] // c[4] for c in cases} >= {1, 2, 8}
  assert {c[5] for c in cases} == {True, False}
  assert {c[6] for c in cases} >= {None, 1, 100}
  assert {c[7] for c in cases} >= {None, "packed", "pad"}
  assert {c[8] for c in cases} == {F32, BF16}
  assert any(c[9] != 0 for c in cases) and any(isinstance(c[9], tuple) for c in cases)
  # Several query and key blocks in some case, and T, S not multiples of the blocks.
  assert any(c[0] > c[10] and c[1] > c[11] for c in cases)
  assert any(c[0] % c[10] and c[1] % c[11] for c in cases)


def test_queries_that_see_no_key_give_zeros_and_zero_gradients():
  """Exactly zero output and dQ for rows that see no key, and no dK / dV from them.

  Row 0 sees its keys (documents 1 and 2 against keys of document 1 and 2),
  row 1's queries (document 1) face only keys of document 2: every output and
  every gradient of row 1 is exactly 0, and row 0's are not.
  """
  q, k, v, do, _ = flash_inputs(3, 2, 16, 24, 2, 1, 16, F32, None)
  seg = dict(q_segment_ids=jnp.array([[1] * 8 + [2] * 8, [1] * 16], jnp.int32),
             kv_segment_ids=jnp.array([[1] * 12 + [2] * 12, [2] * 24], jnp.int32))
  out, dq, dk, dv = value_and_grads(lambda q, k, v: flash.flash_attention(
      q, k, v, block_q=8, block_k=16, backend="tpu", interpret=True, **seg))(q, k, v, do)
  for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
    x = np.asarray(x)
    assert np.all(x[1] == 0), name
    assert np.all(np.isfinite(x[0])) and np.any(x[0] != 0), name


if given is not None:

  @settings(max_examples=3, deadline=None, derandomize=True,
            phases=NO_SHRINK)  # each example compiles kernels: report the first failure as is
  @given(
      T=st.integers(9, 24), S=st.integers(9, 24), H=st.sampled_from([16, 32]),
      K=st.sampled_from([1, 2]), G=st.sampled_from([1, 3]), causal=st.booleans(),
      window=st.one_of(st.none(), st.integers(1, 16)), q_offset=st.integers(0, 20),
      segments=st.sampled_from([None, "packed"]), block_k=st.sampled_from([8, 16]),
  )
  def test_random_shapes(T, S, H, K, G, causal, window, q_offset, segments, block_k):
    """Random requests in TPU interpret mode: query tiles of 8 and key tiles of 8 or 16, so
    several blocks on both axes and partial edge blocks (3 examples a run: each compiles
    three interpret-mode kernels)."""
    _check_parity(1, T, S, K * G, K, H, causal=causal, window=window, q_offset=q_offset,
                  segments=segments, block_q=8, block_k=block_k, seed=T * 97 + S)


def test_empty_lengths_give_zeros():
  """No queries, keys, batch rows or query heads (the last two an IndexError of the TPU
  interpreter until 2026-12-04)."""
  for B, T, S, N in ((1, 0, 5, 2), (1, 3, 0, 2), (0, 3, 5, 2), (1, 3, 5, 0)):
    for dtype in (F32, BF16):
      out = flash.flash_attention(jnp.ones((B, T, N, 64), dtype), jnp.ones((B, S, 1, 64), dtype),
                                  jnp.ones((B, S, 1, 64), dtype), backend="tpu")
      assert out.shape == (B, T, N, 64) and out.dtype == dtype and not np.any(np.asarray(out))


def test_scale_per_sequence_q_offsets_gqa_groups_and_padded_keys_reach_the_kernels():
  """A given ``scale`` replaces 1/sqrt(H), forward and backward. In the same call each
  sequence places its band by its own q_offset ([0, 6], causal window 5, T = 16 in tiles
  of 8): both rows see keys (in test_parity's per-row case the second row sees none, so
  its backward is zero whatever offset the backward kernels read), so the dQ and dK/dV
  kernels and their index maps must each read row b's offset, not row 0's.

  Two KV heads of two query heads each (no test_parity case has K > 1 and G > 1), so the
  dK/dV grid must walk each KV head's own group (query heads 2h, 2h + 1, not h, h + 2);
  and S = 13 in tiles of 8: row 1's queries at positions 13..19 would see the three
  zero-padded keys (scores 0 in the softmax) unless the kernels mask keys past S (the
  other cases' padded keys lie past every query's causal or window reach)."""
  q, k, v, do, _ = flash_inputs(5, 2, 16, 13, 4, 2, 64, F32, None)
  kw = dict(causal=True, scale=0.3, window=5, q_offset=jnp.array([0, 6], jnp.int32))
  got, want = jax.jit(lambda *a: (  # one program: one compilation
      value_and_grads(lambda q, k, v: flash.flash_attention(
          q, k, v, block_q=8, block_k=8, backend="tpu", interpret=True, **kw))(*a),
      value_and_grads(lambda q, k, v: reference_attention(q, k, v, **kw))(*a)))(q, k, v, do)
  for name, a, b in zip(NAMES, got, want, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)


# ----------------------------------------------------------------------------
# Block skipping: NaN in blocks that must be neither fetched nor computed.
# ----------------------------------------------------------------------------


def test_masked_blocks_are_not_visited():
  """Causal window 20, T = S = 128 in tiles of 16: each query block sees 3 key blocks.

  NaN K/V in key blocks 0 and 7 and NaN Q/dO in query blocks 0 and 7. Rows
  48..111 and keys 48..79 see none of them, so out / dq there and dk / dv
  there are finite only if the kernels never compute on a NaN block (with the
  DMA clamp the grid steps past the band keep the last visible block in VMEM;
  with ``pl.when`` they do no compute). The control (neither) must produce
  NaN: ``test_masked_blocks_control``.
  """
  out, dq, dk, dv = _nan_blocks_run({})
  for name, x in (("out", out[:, 48:112]), ("dq", dq[:, 48:112]), ("dk", dk[:, 48:80]),
                  ("dv", dv[:, 48:80])):
    assert np.all(np.isfinite(np.asarray(x))), name


def test_masked_blocks_control():
  """Without the clamp and without pl.when the NaN blocks are reached (the test can fail)."""
  out, dq, dk, dv = _nan_blocks_run(dict(clamp_dma=False, skip_compute=False))
  assert not np.all(np.isfinite(np.asarray(out[:, 96:112])))  # query block 6 reads key block 7
  assert not np.all(np.isfinite(np.asarray(dv[:, 64:80])))  # key block 4 reads query block 7


def test_a_query_block_that_sees_no_key_computes_nothing():
  """Every query sits past the keys' reach (q_offset 100, causal window 4, T = S = 16 in
  tiles of 8), so every query block's key range and every key block's query range is
  empty: those steps map to block ``first`` (fetched once) and must never compute on it.
  With every input NaN, out and each gradient are exactly 0 only if no step computes (a
  masked tile still multiplies its zero probabilities by the NaN values)."""
  nan = jnp.full((1, 16, 1, 64), jnp.nan, F32)
  got = value_and_grads(lambda q, k, v: flash_tpu.flash_attention_tpu(
      q, k, v, causal=True, window=4, q_offset=100, block_q=8, block_k=8, interpret=True))(
      nan, nan, nan, nan)
  for name, x in zip(NAMES, got, strict=True):
    assert np.all(np.asarray(x) == 0), name


def test_scores_far_below_zero_keep_their_softmax():
  """Rows whose scores all lie in [-300, -150] next to rows in [150, 300] (S = 24 in tiles
  of 8): each row's running max starts at -inf, so a far-negative row is still its own
  softmax, forward and backward, against the float64 formulas. Until 2026-12-05 no kernel
  test had scores that far below 0: a running max started at 0 passed them all (a hand
  break), and gives such rows 0."""
  q, k, v, do = far_apart_inputs(1, 8, 24, 2, 1, 64)
  got = value_and_grads(lambda q, k, v: flash_tpu.flash_attention_tpu(
      q, k, v, block_q=8, block_k=8, interpret=True))(q, k, v, do)
  assert_far_apart_close(got, naive_attention_grads(q, k, v, do))


def test_bfloat16_inputs_are_multiplied_in_bfloat16():
  """With bfloat16 q / k / v every product of the three kernels takes bfloat16 operands
  (float32 accumulation): the probabilities and dS are rounded to the inputs' dtype before
  their products, as the reference op rounds them, and the MXU runs bfloat16 matmuls. A
  kernel that kept them in float32 is a little closer to the float32 answer, so no parity
  test sees it (a hand break of the forward's P V product passed them all). Traced only."""
  q, k, v, do, _ = flash_inputs(3, 1, 16, 16, 2, 1, 64, jnp.bfloat16, None)
  fn = value_and_grads(lambda q, k, v: flash_tpu.flash_attention_tpu(
      q, k, v, causal=True, block_q=8, block_k=8, interpret=True))
  dots = kernel_dots(fn.trace(q, k, v, do).jaxpr)
  bf16 = ("bfloat16", "bfloat16")
  assert {name: len(pairs) for name, pairs in dots.items()} == {
      "attnlab_flash_tpu_forward": 2, "attnlab_flash_tpu_dq": 3, "attnlab_flash_tpu_dkv": 4}, dots
  assert all(pair == bf16 for pairs in dots.values() for pair in pairs), dots


def _nan_blocks_run(debug):
  q, k, v, do, _ = flash_inputs(5, 1, 128, 128, 1, 1, 64, F32, None)
  nan = jnp.float32(jnp.nan)
  k = k.at[:, :16].set(nan).at[:, 112:].set(nan)
  v = v.at[:, :16].set(nan).at[:, 112:].set(nan)
  q = q.at[:, :16].set(nan).at[:, 112:].set(nan)
  do = do.at[:, :16].set(nan).at[:, 112:].set(nan)
  return value_and_grads(lambda q, k, v: flash_tpu.flash_attention_tpu(
      q, k, v, causal=True, window=20, block_q=16, block_k=16, interpret=True, _debug=debug))(
      q, k, v, do)


def test_window_grid_is_the_band():
  """With a window the key axis of the grid is the band's width, not S."""
  st = flash_tpu.TpuStatic(causal=True, window=256, scale=1.0, q_len=4096,
                           kv_len=4096, blocks=BlockSizes(128, 128), groups=1, segments=False,
                           interpret=False)
  assert (st.nq, st.nk, st.k_steps, st.q_steps) == (32, 32, 4, 4)
  full = dataclasses.replace(st, window=None)
  assert (full.k_steps, full.q_steps) == (32, 32)


def test_span_blocks_is_the_most_blocks_a_span_touches():
  """k_steps / q_steps size the grid by ``_span_blocks``: one block too few drops keys of
  the band at some alignment; compared with counting the blocks at every alignment."""
  for block in range(1, 9):
    for span in range(1, 5 * block + 3):
      touched = max((o + span - 1) // block - o // block + 1 for o in range(block))
      for n_blocks in (1, touched - 1, touched, touched + 2):
        if n_blocks >= 1:
          assert flash_tpu._span_blocks(span, block, n_blocks) == min(n_blocks, touched), (
              span, block, n_blocks)


def test_window_steps_are_the_most_blocks_the_band_touches():
  """k_steps (q_steps) is the most key (query) blocks that one query (key) block sees
  through the window at any alignment, counted from the mask (written out here in NumPy):
  one step too few drops the band's last block at some q_offset (``_span_blocks`` alone is
  checked above; this checks the span each property hands it)."""
  def mask(q_pos, k_pos, causal, w):
    ok = q_pos - k_pos < w
    return ok & (k_pos <= q_pos) if causal else ok & (k_pos - q_pos < w)

  for causal in (True, False):
    for bq, bk in ((8, 8), (8, 16), (16, 8), (24, 16)):
      for w in (*range(1, 20), 33, 40):
        L = 4 * (bq + bk + 2 * w)  # the band in the middle: never clipped at 0 or L
        st = flash_tpu.TpuStatic(causal=causal, window=w, scale=1.0, q_len=L,
                                 kv_len=L, blocks=BlockSizes(bq, bk), groups=1,
                                 segments=False, interpret=False)
        pos = np.arange(L)
        key_steps = query_steps = 0
        for a in range(max(bq, bk)):  # every alignment of a block against the other axis
          q_pos = L // 2 + a + np.arange(bq)  # one query block: which key blocks it sees
          seen = mask(q_pos[:, None], pos[None, :], causal, w).any(0)
          key_steps = max(key_steps, len(np.unique(pos[seen] // bk)))
          k_pos = L // 2 + a + np.arange(bk)  # one key block: which query blocks see it
          seen = mask(pos[:, None], k_pos[None, :], causal, w).any(1)
          query_steps = max(query_steps, len(np.unique(pos[seen] // bq)))
        assert (st.k_steps, st.q_steps) == (key_steps, query_steps), (causal, bq, bk, w)


def test_step_block_clamps_skipped_steps_to_the_last_visible_block():
  """Steps past the visible range [first, last) map to block last - 1 (the pipeline sees an
  unchanged index and fetches nothing); an empty range maps every step to ``first``; no
  step maps past the array."""
  st = flash_tpu.TpuStatic(causal=True, window=8, scale=1.0, q_len=64,
                           kv_len=64, blocks=BlockSizes(8, 8), groups=1, segments=False,
                           interpret=False)
  blocks = lambda first, last, n: [int(flash_tpu._step_block(st, first, last, s, n))
                                   for s in range(5)]
  assert blocks(2, 4, 8) == [2, 3, 3, 3, 3]
  assert blocks(6, 8, 8) == [6, 7, 7, 7, 7]
  assert blocks(3, 3, 8) == [3, 3, 3, 3, 3]  # empty range: fetched once, never used
  assert blocks(6, 9, 8) == [6, 7, 7, 7, 7]  # never past n_blocks - 1
  # Without the clamp (the block-skipping test's control) a step runs on past the range.
  free = dataclasses.replace(st, clamp_dma=False)
  assert [int(flash_tpu._step_block(free, 2, 4, s, 8)) for s in range(5)] == [2, 3, 4, 5, 6]


def test_plan_defaults_caps_and_refuses_tiles():
  """Tiles: 128 by default in interpret mode, 512 compiled, capped at the padded lengths;
  a size that is not a positive int multiple of 8 (interpret) / 128 (compiled) is refused,
  naming the mode."""
  plan = flash_tpu.plan
  assert plan(1000, 2000, block_q=None, block_k=None, interpret=True) == BlockSizes(128, 128)
  assert plan(1000, 2000, block_q=None, block_k=None, interpret=False) == BlockSizes(512, 512)
  assert plan(20, 5, block_q=None, block_k=None, interpret=True) == BlockSizes(24, 8)
  assert plan(20, 5, block_q=None, block_k=None, interpret=False) == BlockSizes(128, 128)
  assert plan(300, 300, block_q=16, block_k=40, interpret=True) == BlockSizes(16, 40)
  for kw, interpret, message in [
      (dict(block_q=16.0), True,
       r"block_q=16.0 must be a positive multiple of 8 \(interpret mode\)"),
      (dict(block_k=True), True, r"block_k=True must be a positive multiple of 8 \(interpret"),
      (dict(block_k=12), True, r"block_k=12 must be a positive multiple of 8"),
      (dict(block_q=0), True, r"block_q=0 must be a positive multiple of 8"),
      (dict(block_q=64), False, r"block_q=64 must be a positive multiple of 128 \(compiled\)"),
  ]:
    with pytest.raises(ValueError, match=message):
      plan(64, 64, **{"block_q": None, "block_k": None, **kw}, interpret=interpret)


def test_lanes_widens_lane_replicated_statistics_to_any_width():
  x = jnp.arange(3 * flash_tpu.LANES, dtype=F32).reshape(3, flash_tpu.LANES)
  for width in (8, flash_tpu.LANES, 200, 2 * flash_tpu.LANES, 300):
    got = np.asarray(flash_tpu._lanes(x, width))
    assert got.shape == (3, width), width
    np.testing.assert_array_equal(got, np.asarray(x)[:, np.arange(width) % flash_tpu.LANES])


# ----------------------------------------------------------------------------
# Lowering for TPU (Mosaic) and the platform dispatch.
# ----------------------------------------------------------------------------

LOWERING = [  # (H, dtype, block_q, block_k, segments)
    (128, BF16, 128, 256, True),
]


@pytest.mark.parametrize("H,dtype,bq,bk,segments", LOWERING)
def test_tpu_lowering(H, dtype, bq, bk, segments):
  """Forward and backward lower to Mosaic (tpu_custom_call) with the listed blocks.

  Cross-platform lowering on the CPU applies Pallas-TPU's lowering rules
  (block shapes, supported primitives); Mosaic's own compilation and the run
  need a TPU (tools/tpu_check.sh).
  """
  B, T, S, N, K = 2, 300, 700, 8, 2
  q, k, v, do, seg = flash_inputs(0, B, T, S, N, K, H, dtype, "packed" if segments else None)
  fn = lambda q, k, v: flash.flash_attention(
      q, k, v, causal=True, window=200, q_offset=jnp.array([400, 0]), backend="tpu",
      interpret=False, block_q=bq, block_k=bk, **seg)
  fwd = jax.jit(fn).trace(q, k, v).lower(lowering_platforms=("tpu",)).as_text()
  assert fwd.count("tpu_custom_call") == 1
  both = value_and_grads(fn).trace(q, k, v, do)
  assert both.lower(lowering_platforms=("tpu",)).as_text().count("tpu_custom_call") == 3
  blocks = kernel_blocks(both.jaxpr)
  Q, KV, ROW = ((bq, H), dtype), ((bk, H), dtype), ((1, bq), jnp.float32)
  segs = [((1, bq), jnp.int32), ((1, bk), jnp.int32)] if segments else []
  # The forward's residual call saves the lane-replicated log-sum-exp.
  assert blocks["attnlab_flash_tpu_forward"] == [
      Q, KV, KV, *segs, Q, ((bq, 128), jnp.float32)]
  assert blocks["attnlab_flash_tpu_dq"] == [Q, KV, KV, Q, ROW, ROW, *segs, Q]
  assert blocks["attnlab_flash_tpu_dkv"] == [Q, KV, KV, Q, ROW, ROW, *segs, KV, KV]


def test_compiled_blocks_must_be_lane_multiples():
  q, k, v, _, _ = flash_inputs(0, 1, 8, 8, 2, 1, 64, F32, None)
  with pytest.raises(ValueError, match="block_q=64 must be a positive multiple of 128"):
    flash.flash_attention(q, k, v, backend="tpu", interpret=False, block_q=64, block_k=128)


def _pallas_attention(q, k, v):
  return attnlab.attention(q, k, v, causal=True, window=100, implementation="pallas")


def test_one_call_lowers_to_mosaic_for_tpu_and_triton_for_cuda():
  """The same attnlab.attention(implementation="pallas") function, jitted: Mosaic when
  lowered for TPU, Triton when lowered for CUDA (traced inside cross_platform(),
  since on a CPU host backend=None otherwise resolves to the interpreted kernel; for CUDA
  traced again within a target GPU, which newer jax reads at trace time)."""
  pytest.importorskip("jax._src.lib.triton")
  q, k, v, _, _ = flash_inputs(0, 1, 300, 300, 4, 2, 64, BF16, None)
  with flash.cross_platform():  # a fresh function: jit caches traces per function
    traced = jax.jit(lambda q, k, v: _pallas_attention(q, k, v)).trace(q, k, v)
  names = set(kernel_blocks(traced.jaxpr))  # platform_dependent traces every branch
  assert {"attnlab_flash_tpu_forward", "attnlab_flash_forward"} <= names
  tpu_text = traced.lower(lowering_platforms=("tpu",)).as_text()
  assert "tpu_custom_call" in tpu_text and "triton" not in tpu_text
  # Traced again for CUDA within the target GPU (newer jax reads it when tracing too).
  with flash.cross_platform(), cuda_target():
    cuda_text = jax.jit(lambda q, k, v: _pallas_attention(q, k, v)).trace(q, k, v).lower(
        lowering_platforms=("cuda",)).as_text()
  assert "triton" in cuda_text and "tpu_custom_call" not in cuda_text


def test_model_pallas_lowers_to_mosaic_for_tpu():
  """ModelConfig(attention_impl="pallas"): the model's attention lowers to Mosaic for TPU."""
  from flax import nnx

  cfg = attnlab.ModelConfig(vocab_size=64, d_model=64, num_layers=1, num_heads=2,
                            num_kv_heads=1, head_dim=64, d_ff=64, attention_impl="pallas")
  model = attnlab.build_model(cfg, rngs=nnx.Rngs(0))
  graph, state = nnx.split(model)
  tokens = jnp.ones((1, 16), jnp.int32)
  with flash.cross_platform():
    traced = jax.jit(lambda state, x: nnx.merge(graph, state)(x)).trace(state, tokens)
  assert traced.lower(lowering_platforms=("tpu",)).as_text().count("tpu_custom_call") == 1


def test_cpu_default_is_the_interpreted_triton_kernel():
  """On a CPU host backend=None traces only the interpret-mode Triton-style kernel
  (no platform_dependent: no extra traces; it matches the reference); traced inside
  cross_platform() the same call traces every branch. cross_platform() is read at
  trace time, so a jitted function traced before keeps its trace: use a fresh jit."""
  if jax.default_backend() != "cpu":
    pytest.skip("checks the CPU resolution of backend=None")
  q, k, v, _, _ = flash_inputs(1, 1, 40, 40, 4, 2, 64, F32, None)
  fn = jax.jit(_pallas_attention)
  assert set(kernel_blocks(fn.trace(q, k, v).jaxpr)) == {"attnlab_flash_forward"}
  ref = jax.jit(lambda q, k, v: reference_attention(q, k, v, causal=True, window=100))(q, k, v)
  np.testing.assert_allclose(fn(q, k, v), ref, rtol=1e-5, atol=1e-5)
  with flash.cross_platform():
    names = set(kernel_blocks(jax.jit(lambda *a: _pallas_attention(*a)).trace(q, k, v).jaxpr))
  assert names == {"attnlab_flash_forward", "attnlab_flash_tpu_forward"}


def test_cross_platform_is_per_thread_and_nests():
  """A thread tracing inside cross_platform() leaves another thread's trace on the CPU
  path; leaving a nested block keeps the outer one's setting."""
  import threading

  if jax.default_backend() != "cpu":
    pytest.skip("checks the CPU resolution of backend=None")
  q, k, v, _, _ = flash_inputs(1, 1, 40, 40, 4, 2, 64, F32, None)
  names = lambda: set(kernel_blocks(
      jax.jit(lambda *a: _pallas_attention(*a)).trace(q, k, v).jaxpr))
  entered, traced, seen = threading.Event(), threading.Event(), {}

  def inside():
    with flash.cross_platform():
      entered.set()
      traced.wait(timeout=60)  # the other thread traces while this one is inside
      with flash.cross_platform():
        pass
      seen["inside, after a nested block"] = names()
    seen["after"] = names()

  thread = threading.Thread(target=inside)
  thread.start()
  try:
    assert entered.wait(timeout=60)
    seen["other thread"] = names()
  finally:
    traced.set()
    thread.join(timeout=120)
  both = {"attnlab_flash_forward", "attnlab_flash_tpu_forward"}
  assert seen == {"other thread": {"attnlab_flash_forward"},
                  "inside, after a nested block": both, "after": {"attnlab_flash_forward"}}


def test_interpret_set_picks_the_kernel_of_the_running_platform():
  """backend=None with ``interpret`` set: the running platform's kernel (on a CPU host the
  Triton-style one, interpreted), not platform_dependent, even inside cross_platform();
  interpret=False with the Triton-style kernels needs a GPU and says so."""
  if jax.default_backend() != "cpu":
    pytest.skip("checks the CPU host's choice")
  q, k, v, _, _ = flash_inputs(2, 1, 40, 40, 4, 2, 64, F32, None)
  call = lambda q, k, v: flash.flash_attention(q, k, v, causal=True, interpret=True)
  fn = jax.jit(call)
  assert set(kernel_blocks(fn.trace(q, k, v).jaxpr)) == {"attnlab_flash_forward"}
  with flash.cross_platform():  # a fresh function: jit keeps the trace of the one above
    traced = jax.jit(lambda *a: call(*a)).trace(q, k, v)
  assert set(kernel_blocks(traced.jaxpr)) == {"attnlab_flash_forward"}
  np.testing.assert_allclose(fn(q, k, v), jax.jit(lambda q, k, v: reference_attention(
      q, k, v, causal=True))(q, k, v), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="interpret=False needs a GPU"):
    flash.flash_attention(q, k, v, backend="gpu", interpret=False)


def test_a_cross_platform_call_runs_interpreted_on_the_cpu():
  """A call traced inside cross_platform() holds every platform's kernel; run on the CPU it
  takes the default branch, the Triton-style kernels in interpret mode, forward and
  backward, with every argument passed through."""
  if jax.default_backend() != "cpu":
    pytest.skip("runs the CPU branch")
  q, k, v, do, seg = flash_inputs(3, 2, 40, 40, 4, 2, 64, F32, "packed")
  kw = dict(causal=True, window=9, q_offset=3, scale=0.2, **seg)
  with flash.cross_platform():  # one program with the reference: one compilation
    got, want = jax.jit(lambda *a: (
        value_and_grads(lambda q, k, v: flash.flash_attention(q, k, v, **kw))(*a),
        value_and_grads(lambda q, k, v: reference_attention(q, k, v, **kw))(*a)))(q, k, v, do)
  for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)
  # The other branches get the arguments too (the CPU runs none of them): each branch is,
  # equation for equation, the program that the direct call of its platform traces: the
  # kernels' grids and bodies, and what reaches their operands (q_offset, the segment ids,
  # the padding and layout of q, k and v).
  fwd = lambda **how: lambda q, k, v: flash.flash_attention(q, k, v, **how, **kw)
  with flash.cross_platform():
    closed = jax.jit(fwd()).trace(q, k, v).jaxpr
  (cond,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "cond"]
  assert cond.params["branches_platforms"] == (("tpu",), ("cuda",), None)
  assert cond.invars[1:] == closed.jaxpr.constvars + closed.jaxpr.invars
  cuda = lambda q, k, v: flash._flash_gpu(q, k, v, block_q=None, block_k=None,
                                          interpret=False, **kw)
  for branch, direct in zip(cond.params["branches"], (
      fwd(backend="tpu", interpret=False), cuda, fwd(backend="gpu", interpret=True))):
    direct = jax.jit(direct).trace(q, k, v).jaxpr
    assert len(pallas_calls(branch)) == 1 and len(direct.consts) == len(closed.consts) == 2
    for a, b in zip(direct.consts, closed.consts, strict=True):
      np.testing.assert_array_equal(a, b)
    got, want = str(branch), _consts_as_arguments(str(direct))
    assert got == want, "\n".join(list(difflib.unified_diff(
        want.splitlines(), got.splitlines(), "direct", "branch", lineterm="", n=1))[:24])


def _consts_as_arguments(text):
  """A closed jaxpr's text with its constants read as its first arguments (as a branch of
  a cond takes them): `{ lambda a b; c d.` -> `{ lambda ; a b c d.`."""
  return re.sub(r"^\{ lambda ([^;]+); ", r"{ lambda ; \1 ", text, count=1, flags=re.M)


def _bad(**over):
  args = dict(q=jnp.zeros((1, 8, 4, 64)), k=jnp.zeros((1, 8, 2, 64)), v=jnp.zeros((1, 8, 2, 64)))
  kw = {k: over.pop(k) for k in list(over) if k not in args}
  args.update(over)
  kw.setdefault("backend", "tpu")
  return lambda: flash.flash_attention(args["q"], args["k"], args["v"], **kw)


@pytest.mark.parametrize("call,match", [
    (_bad(k=jnp.zeros((1, 8, 2, 32)), v=jnp.zeros((1, 8, 2, 32))), "head dim of q_BTNH"),
    (_bad(k=jnp.zeros((1, 8, 3, 64)), v=jnp.zeros((1, 8, 3, 64))), "multiple of the num kv"),
    (_bad(v=jnp.zeros((1, 9, 2, 64))), "v_BSKH"),
    (_bad(block_q=12, block_k=8), "block_q=12 must be a positive multiple of 8"),
    (_bad(block_q=8, block_k=0), "block_k=0"),
    (_bad(window=0), "window=0"),
    (_bad(q_offset=jnp.zeros((3,), jnp.int32)), r"q_offset shape \(3,\) must be \(\) or \[B\]"),
    (_bad(q_offset=jnp.zeros((1, 1), jnp.int32)), r"q_offset shape \(1, 1\) must be"),
    (_bad(interpret="yes"), "interpret='yes'"),
    (_bad(q_segment_ids=jnp.zeros((1, 7), jnp.int32),
          kv_segment_ids=jnp.zeros((1, 8), jnp.int32)), "q_segment_ids shape"),
    (_bad(q_segment_ids=jnp.zeros((1, 8), jnp.int32)), "given together"),
    (_bad(backend="cpu"), "backend='cpu' is not one of 'gpu', 'tpu' or None"),
])
def test_bad_input_raises(call, match):
  with pytest.raises(ValueError, match=match):
    call()


# ----------------------------------------------------------------------------
# On a TPU: the compiled kernel (tools/tpu_check.sh runs these).
# ----------------------------------------------------------------------------


@pytest.mark.tpu
@pytest.mark.parametrize("H,G,causal,window,segments", [
    (64, 1, True, None, None), (128, 4, True, 256, None), (128, 2, False, None, "packed"),
    (64, 8, True, 100, "pad"),
])
def test_tpu_compiled_matches_reference(H, G, causal, window, segments):
  """Mosaic-compiled kernel (interpret=None on a TPU), bfloat16, T = S = 1000."""
  B, T, K = 2, 1000, 2
  q, k, v, do, seg = flash_inputs(4, B, T, T, K * G, K, H, BF16, segments)
  kw = dict(causal=causal, window=window, **seg)
  ref = value_and_grads(lambda q, k, v: reference_attention(q, k, v, **kw))
  exact, low = ref(*[x.astype(F32) for x in (q, k, v, do)]), ref(q, k, v, do)
  got = value_and_grads(lambda q, k, v: flash.flash_attention(q, k, v, backend="tpu", **kw))(
      q, k, v, do)
  for name, a, e, lo in zip(NAMES, got, exact, low):
    a, e, lo = (np.asarray(x, np.float32) for x in (a, e, lo))
    assert np.all(np.isfinite(a)), name
    scale = max(1.0, float(np.max(np.abs(e))))
    assert np.max(np.abs(a - e)) <= BF16_MULTIPLE * np.max(np.abs(lo - e)) + 1e-5 * scale, name


@pytest.mark.tpu
def test_tpu_dispatch_picks_mosaic():
  q, k, v, _, _ = flash_inputs(1, 1, 512, 512, 4, 2, 128, BF16, None)
  text = jax.jit(_pallas_attention).lower(q, k, v).as_text()
  assert "tpu_custom_call" in text
