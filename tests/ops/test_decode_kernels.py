"""Parity of the Pallas decode kernels (interpret mode on CPU) with the reference op.

The reference sees the same request as a plain attention call: the T queries
at positions lengths - T .. lengths - 1 (``q_offset``), causal, and the cache
slots at positions >= length empty (``kv_positions = -1``).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab.ops.pallas import common, decode
from tests import random_arrays
from tests.ops.flash_inputs import (
  cuda_target,
  decode_reference,
  far_apart_inputs,
  kernel_dots,
)
from tests.ops.tolerances import assert_bf16_close

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _inputs(seed, B, T, S, N, K, H, dtype):
  rng = random_arrays.rng(seed)
  q = random_arrays.normal(rng, (B, T, N, H), dtype)
  k = random_arrays.normal(rng, (B, S, K, H), dtype)
  v = random_arrays.normal(rng, (B, S, K, H), dtype)
  return q, k, v


def _assert_matches_reference(actual, q, k, v, lengths_B, window):
  """In q's dtype; float32: close to the reference; bfloat16: error within a few times the
  reference's own."""
  assert actual.dtype == q.dtype
  ref = decode_reference(q, k, v, lengths_B, window)
  if q.dtype == jnp.bfloat16:
    f32 = lambda x: x.astype(jnp.float32)
    exact = decode_reference(f32(q), f32(k), f32(v), lengths_B, window)
    assert_bf16_close(actual, ref, exact, "out")
  else:
    _assert_close(actual, ref, jnp.float32)


def _assert_close(actual, expected, dtype):
  tol = TOL[dtype]
  actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  assert np.all(np.isfinite(actual))
  np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol)


def _paginate(k_BSKH, v_BSKH, page_size, seed, spare_pages=3):
  """Scatter a contiguous cache into a shuffled page pool; returns pool + table."""
  B, S, K, H = k_BSKH.shape
  M = -(-S // page_size)
  P = B * M + spare_pages
  table_BM = np.random.default_rng(seed).permutation(P)[: B * M].reshape(B, M).astype(np.int32)

  def pool(x_BSKH):  # in NumPy: no program compiled per shape
    x_BSKH = np.asarray(x_BSKH)
    x_BMCKH = np.pad(x_BSKH, ((0, 0), (0, M * page_size - S), (0, 0), (0, 0))).reshape(
        B, M, page_size, K, H)
    # Unused pages hold garbage: a kernel that read them would not match.
    pool_PCKH = np.full((P, page_size, K, H), 1e4, x_BSKH.dtype)
    pool_PCKH[table_BM] = x_BMCKH
    return jax.device_put(pool_PCKH)

  return pool(k_BSKH), pool(v_BSKH), jax.device_put(table_BM)



def _paginate_int8(k8_BSKH, v8_BSKH, ks_BSK, vs_BSK, page_size, seed):
  """An int8 cache and its scales scattered into shuffled pages (one table for all four):
  (k_pages, v_pages, k_scale_PCK, v_scale_PCK, table_BM). Unused pages hold garbage values
  (100) and huge scales."""
  pools = []
  for x in (k8_BSKH.astype(jnp.float32), v8_BSKH.astype(jnp.float32), ks_BSK[..., None],
            vs_BSK[..., None]):
    pool, _, table_BM = _paginate(x, x, page_size, seed=seed)  # the same table every time
    pools.append(pool)
  to_int8 = lambda pool: jnp.where(pool == 1e4, 100, pool).astype(jnp.int8)
  return to_int8(pools[0]), to_int8(pools[1]), pools[2][..., 0], pools[3][..., 0], table_BM

# (B, T, S, N, K, H, lengths, window, num_splits, dtype)
DECODE_CASES = [
    (3, 1, 300, 8, 8, 32, [300, 17, 1], None, None, jnp.float32),
    (3, 4, 300, 8, 2, 64, [300, 129, 2], None, 3, jnp.float32),  # length < T: rows see nothing
    (2, 8, 513, 8, 1, 32, [513, 64], 100, 4, jnp.float32),
    (2, 2, 200, 4, 2, 128, [7, 200], 16, 1, jnp.bfloat16),
    (4, 3, 1000, 16, 2, 64, [1000, 999, 511, 3], 1, 8, jnp.float32),
    (1, 1, 7, 2, 1, 32, [5], None, None, jnp.bfloat16),
]


@pytest.mark.parametrize("B,T,S,N,K,H,lengths,window,num_splits,dtype", DECODE_CASES)
def test_decode_matches_reference(B, T, S, N, K, H, lengths, window, num_splits, dtype):
  q, k, v = _inputs(B * S + T, B, T, S, N, K, H, dtype)
  lengths_B = jnp.array(lengths, jnp.int32)
  # Slots past each length hold garbage: a kernel that read them would not match.
  k = jnp.where((jnp.arange(S) < lengths_B[:, None])[:, :, None, None], k, 1e4).astype(dtype)
  got = jax.jit(lambda q, k, v, l: decode.decode_attention(
      q, k, v, l, window=window, num_splits=num_splits))(q, k, v, lengths_B)
  _assert_matches_reference(got, q, k, v, lengths_B, window)


# (B, T, S, N, K, H, page_size, lengths, window, pages_per_split, dtype)
PAGED_CASES = [
    (3, 1, 300, 8, 2, 32, 16, [300, 17, 1], None, None, jnp.float32),
    (3, 4, 300, 4, 4, 64, 32, [290, 33, 3], 50, 2, jnp.float32),
    (2, 8, 513, 8, 1, 32, 16, [513, 100], None, 5, jnp.bfloat16),
    (2, 2, 128, 16, 2, 128, 8, [128, 9], 1, 1, jnp.float32),
]


@pytest.mark.parametrize("B,T,S,N,K,H,page_size,lengths,window,pages_per_split,dtype",
                         PAGED_CASES)
def test_paged_decode_matches_reference(B, T, S, N, K, H, page_size, lengths, window,
                                        pages_per_split, dtype):
  q, k, v = _inputs(B * S + T + 1, B, T, S, N, K, H, dtype)
  lengths_B = jnp.array(lengths, jnp.int32)
  k_pages, v_pages, table_BM = _paginate(k, v, page_size, seed=B + S)
  # Table entries past a sequence's last page are unused: mark them -1 as the cache does.
  pages_used_B = -(-lengths_B // page_size)
  table_BM = jnp.where(jnp.arange(table_BM.shape[1]) < pages_used_B[:, None], table_BM, -1)
  got = jax.jit(lambda *a: decode.paged_decode_attention(
      *a, window=window, pages_per_split=pages_per_split))(q, k_pages, v_pages, table_BM,
                                                           lengths_B)
  _assert_matches_reference(got, q, k, v, lengths_B, window)


@pytest.mark.parametrize("int8", [False, True])
def test_paged_decode_masks_missing_pages(int8):
  """A table entry of -1 inside a sequence's length is a missing page (an allocator that
  ran out): its positions are not keys. The reference sees those positions as empty;
  page 0, which a clamped entry would read, holds garbage."""
  from attnlab.ops.reference import reference_attention

  B, T, S, N, K, H, C = 2, 2, 64, 4, 2, 32, 8
  q, k, v = _inputs(11, B, T, S, N, K, H, jnp.float32)
  lengths_B = jnp.array([64, 40], jnp.int32)
  k_pages, v_pages, table_BM = _paginate(k, v, C, seed=5)
  # Row 0 misses its pages 1 and 7 (its queries' own); row 1 its page 2.
  missing_BM = jnp.zeros(table_BM.shape, bool).at[0, 1].set(True).at[0, 7].set(True)
  missing_BM = missing_BM.at[1, 2].set(True)
  # A garbage page 0 in front of the pool: what a clamped -1 entry would read.
  k_pages, v_pages = (jnp.concatenate([jnp.full_like(x[:1], 1e4), x]) for x in (k_pages, v_pages))
  table_BM = jnp.where(missing_BM, -1, table_BM + 1)
  scales = {}
  if int8:
    from attnlab.nn.kv_cache import dequantize, quantize

    (k8, ks), (v8, vs) = quantize(k_pages), quantize(v_pages)
    k_pages, v_pages = k8, v8
    scales = dict(k_scale_PCK=ks, v_scale_PCK=vs)
    k = dequantize(k8, ks)[jnp.maximum(table_BM, 0)].reshape(B, S, K, H)
    v = dequantize(v8, vs)[jnp.maximum(table_BM, 0)].reshape(B, S, K, H)
  got = jax.jit(lambda *a: decode.paged_decode_attention(*a, pages_per_split=2, **scales))(
      q, k_pages, v_pages, table_BM, lengths_B)
  pos_BS = jnp.broadcast_to(jnp.arange(S), (B, S))
  seen_BS = (pos_BS < lengths_B[:, None]) & ~jnp.repeat(missing_BM, C, axis=1)
  want = jax.jit(lambda q, k, v: reference_attention(  # one program, not one per op
      q, k, v, causal=True, q_offset=lengths_B - T,
      kv_positions=jnp.where(seen_BS, pos_BS, -1)))(q, k, v)
  # Row 0's queries lost their own page: they see the 48 keys of its other pages.
  _assert_close(got, want, jnp.float32)


@pytest.mark.parametrize("T,N,K,page_size,lengths,window,pages_per_split", [
    (1, 8, 2, 16, [300, 17, 1], None, None),
    (3, 4, 4, 8, [290, 33, 3], 50, 2),
])
def test_paged_decode_of_int8_pages_matches_reference(T, N, K, page_size, lengths, window,
                                                      pages_per_split):
  """int8 pages with per-token float32 scales, dequantized in the kernel: the reference
  sees the dequantized cache. Unused pages hold garbage values and huge scales."""
  from attnlab.nn.kv_cache import dequantize, quantize

  B, S, H = len(lengths), 300, 32
  q, k, v = _inputs(B * S + T + 5, B, T, S, N, K, H, jnp.float32)
  (k8, ks), (v8, vs) = quantize(k), quantize(v)
  k_pages, v_pages, ks_pages, vs_pages, table_BM = _paginate_int8(k8, v8, ks, vs, page_size,
                                                                  seed=B + S)
  lengths_B = jnp.array(lengths, jnp.int32)
  got = jax.jit(lambda *a: decode.paged_decode_attention(
      *a[:5], k_scale_PCK=a[5], v_scale_PCK=a[6], window=window,
      pages_per_split=pages_per_split))(q, k_pages, v_pages, table_BM, lengths_B, ks_pages,
                                        vs_pages)
  _assert_matches_reference(got, q, dequantize(k8, ks), dequantize(v8, vs), lengths_B, window)


def _in_one_program(calls):
  """{name: fn(*args, **kwargs)} for ``calls`` = {name: (fn, args, kwargs)}, all under one
  jit (one compilation, not one per kernel and op): the arrays are its arguments, the
  rest (window, splits, scale) closed over as given."""
  is_array = lambda x: isinstance(x, jax.Array)
  arrays = {name: (args, {k: x for k, x in kw.items() if is_array(x)})
            for name, (_, args, kw) in calls.items()}

  def run(arrays):
    return {name: fn(*arrays[name][0], **arrays[name][1],
                     **{k: x for k, x in kw.items() if not is_array(x)})
            for name, (fn, _, kw) in calls.items()}

  return jax.jit(run)(arrays)


def _three_kernels(q, k_BSKH, v_BSKH, lengths_B, *, int8=False, page_size=16, **kw):
  """{kernel: output} of the kernels over one cache: ``decode_attention`` on it as it
  is (float only), ``decode_attention_heads_major`` on it transposed and
  ``paged_decode_attention`` on it scattered into shuffled pages. int8: the cache
  quantized per token and KV head; returns the dequantized cache too, for the reference.
  ``kw``: window, scale, splits (``num_splits`` / ``pages_per_split``). The kernels run
  in one program."""
  from attnlab.nn.kv_cache import dequantize, quantize

  splits = kw.pop("splits", None)
  heads_major = lambda x: jnp.swapaxes(x, 1, 2)
  calls = {}
  if int8:
    (k8, ks), (v8, vs) = quantize(k_BSKH), quantize(v_BSKH)
    k_BSKH, v_BSKH = dequantize(k8, ks), dequantize(v8, vs)
    calls["heads_major"] = (decode.decode_attention_heads_major, (
        q, heads_major(k8), heads_major(v8), lengths_B), dict(
            k_scale_BKS=heads_major(ks), v_scale_BKS=heads_major(vs), num_splits=splits, **kw))
    k_pages, v_pages, ks_pages, vs_pages, table_BM = _paginate_int8(k8, v8, ks, vs, page_size,
                                                                    seed=1)
    calls["paged"] = (decode.paged_decode_attention, (
        q, k_pages, v_pages, table_BM, lengths_B), dict(
            k_scale_PCK=ks_pages, v_scale_PCK=vs_pages, pages_per_split=splits, **kw))
  else:
    calls["contiguous"] = (decode.decode_attention, (q, k_BSKH, v_BSKH, lengths_B),
                           dict(num_splits=splits, **kw))
    calls["heads_major"] = (decode.decode_attention_heads_major, (
        q, heads_major(k_BSKH), heads_major(v_BSKH), lengths_B), dict(num_splits=splits, **kw))
    k_pages, v_pages, table_BM = _paginate(k_BSKH, v_BSKH, page_size, seed=1)
    calls["paged"] = (decode.paged_decode_attention, (q, k_pages, v_pages, table_BM, lengths_B),
                      dict(pages_per_split=splits, **kw))
  return _in_one_program(calls), k_BSKH, v_BSKH


@pytest.mark.parametrize("int8", [False, True])
def test_kernel_blocks_stay_in_bounds(monkeypatch, int8):
  """Every block the kernels' index maps select lies inside its array. Interpret mode
  clamps an out-of-bounds block index, so a kernel that asked for one would still
  match the reference here, and read past the array on a GPU; TPU interpret mode
  raises on such a read instead. All three kernels run under it (float; int8 pages /
  tiles with their scales), with several splits and a window, and match the reference."""
  pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
  monkeypatch.setattr(common, "resolve_interpret", lambda interpret: pltpu.InterpretParams())
  B, T, S, N, K, H = 2, 2, 100, 4, 2, 32
  q, k, v = _inputs(3, B, T, S, N, K, H, jnp.float32)
  lengths_B = jnp.array([100, 37], jnp.int32)
  for splits, window in ((None, None), (3, 20)):
    outs, k_ref, v_ref = _three_kernels(q, k, v, lengths_B, int8=int8, splits=splits,
                                        window=window)
    want = decode_reference(q, k_ref, v_ref, lengths_B, window)
    for name, got in outs.items():
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5,
                                 err_msg=f"{name}, splits={splits}, window={window}")


def test_a_bad_page_table_entry_reads_inside_the_pool(monkeypatch):
  """A table entry past the pool (a corrupt table) is clamped to the pool's last page,
  and a missing page (-1) to page 0, so the paged kernel never reads outside the pool
  (TPU interpret mode raises on a read out of bounds). Either is a missing page: each row
  equals the reference with that page's positions empty (until 2026-12-04 the entry past
  the pool read the last page, another sequence's, as its own). The pages they are clamped
  to hold inf and NaN, and row 1's slots past its length NaN: none reaches the output
  (until 2026-12-04 their weight was 0, but 0 x inf is NaN: the whole row came out NaN)."""
  from attnlab.ops.reference import reference_attention

  pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
  monkeypatch.setattr(common, "resolve_interpret", lambda interpret: pltpu.InterpretParams())
  B, T, S, N, K, H, C = 2, 1, 64, 4, 2, 32, 16
  q, k, v = _inputs(0, B, T, S, N, K, H, jnp.float32)
  lengths_B = jnp.array([64, 20], jnp.int32)
  stale_BS = jnp.arange(S)[None, :] >= lengths_B[:, None]
  stale = lambda x: jnp.where(stale_BS[:, :, None, None], jnp.nan, x)
  k_pages, v_pages, table_BM = _paginate(stale(k), stale(v), C, seed=0)
  # Page 0 of the pool holds inf, its last page NaN: the two a bad entry is clamped to.
  edges = lambda x: jnp.concatenate([jnp.full((1, *x.shape[1:]), jnp.inf), x,
                                     jnp.full((1, *x.shape[1:]), jnp.nan)])
  k_pages, v_pages, table_BM = edges(k_pages), edges(v_pages), table_BM + 1
  # Row 1's page 0 is P, the first id past the pool (a kernel that took ids up to P as
  # pages, ``entry <= num_pages``, read the last page as its own: mutation testing).
  table_BM = table_BM.at[0, 1].set(-1).at[1, 0].set(k_pages.shape[0])
  got = jax.jit(decode.paged_decode_attention)(q, k_pages, v_pages, table_BM, lengths_B)
  assert np.all(np.isfinite(np.asarray(got)))
  pos_S = np.arange(S)
  seen_0 = (pos_S < 16) | (pos_S >= 32)
  seen_1 = (pos_S >= 16) & (pos_S < 20)  # row 1: page 0 is past the pool
  want_0, want_1 = jax.jit(lambda q, k, v: (  # one program: one compilation
      reference_attention(q[:1], k[:1], v[:1], causal=True, q_offset=63,
                          kv_positions=jnp.asarray(np.where(seen_0, pos_S, -1)[None])),
      reference_attention(q[1:], k[1:], v[1:], causal=True, q_offset=19,
                          kv_positions=jnp.asarray(np.where(seen_1, pos_S, -1)[None]))))(q, k, v)
  _assert_close(got[:1], want_0, jnp.float32)
  _assert_close(got[1:], want_1, jnp.float32)


def test_tiles_outside_the_key_range_are_not_read():
  """The kernels visit only the tiles (pages) that hold a key the queries see: NaN in
  every tile wholly before the window or past the length would reach the output
  (0 x NaN) if one were visited. Tiles the range only overlaps hold finite garbage
  outside it, which the mask hides. Interpret-mode tiles are 128 keys; pages 16."""
  B, T, S, N, K, H, C, W = 2, 1, 384, 4, 2, 32, 16, 50
  q, k, v = _inputs(5, B, T, S, N, K, H, jnp.float32)
  lengths_B = jnp.array([300, 40], jnp.int32)
  want = decode_reference(q, k, v, lengths_B, W)
  pos_BS = jnp.arange(S)[None, :]
  lo_B1, hi_B1 = jnp.maximum(lengths_B - W, 0)[:, None], lengths_B[:, None]

  def poisoned(tile):
    """k, v with NaN in the tiles wholly outside [lo, hi), 1e4 in the rest outside it."""
    tile_BS = pos_BS // tile
    outside_BS = (tile_BS < lo_B1 // tile) | (tile_BS > (hi_B1 - 1) // tile)
    garbage_BS = jnp.where(outside_BS, jnp.nan, 1e4)
    keep_BS = (pos_BS >= lo_B1) & (pos_BS < hi_B1)
    return [jnp.where(keep_BS[..., None, None], x, garbage_BS[..., None, None]) for x in (k, v)]

  assert np.isnan(np.asarray(poisoned(128)[0])).any()
  kt, vt = poisoned(128)
  k_pages, v_pages, table_BM = _paginate(*poisoned(C), C, seed=2)
  calls = {}
  for splits in (None, 2):
    calls[f"contiguous, splits={splits}"] = (decode.decode_attention, (q, kt, vt, lengths_B),
                                             dict(window=W, num_splits=splits))
    calls[f"heads_major, splits={splits}"] = (decode.decode_attention_heads_major, (
        q, jnp.swapaxes(kt, 1, 2), jnp.swapaxes(vt, 1, 2), lengths_B), dict(
            window=W, num_splits=splits))
    calls[f"paged, splits={splits}"] = (decode.paged_decode_attention, (
        q, k_pages, v_pages, table_BM, lengths_B), dict(window=W, pages_per_split=splits))
  for name, out in _in_one_program(calls).items():
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5,
                               err_msg=name)


@pytest.mark.parametrize("int8", [False, True])
def test_scores_far_apart_across_rows_and_splits(int8):
  """The online softmax keeps one running max per query row, and the splits are merged
  through their log-sum-exps relative to the largest: rows whose scores lie ~100 apart
  (one head of a KV group scaled x40, another x0.01) and log-sum-exps near 100 neither
  underflow nor overflow float32."""
  B, T, S, N, K, H = 2, 2, 300, 4, 2, 32
  q, k, v = _inputs(6, B, T, S, N, K, H, jnp.float32)
  q = q * jnp.array([40.0, 0.01, 1.0, 40.0])[None, None, :, None]
  lengths_B = jnp.array([300, 130], jnp.int32)
  outs, k_ref, v_ref = _three_kernels(q, k, v, lengths_B, int8=int8, splits=3)
  want = decode_reference(q, k_ref, v_ref, lengths_B)
  for name, got in outs.items():
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4,
                               err_msg=name)


@pytest.mark.parametrize("int8", [False, True])
def test_scale_multiplies_the_scores(int8):
  """``scale=`` replaces 1 / sqrt(H) as the scores' multiplier, in every kernel."""
  B, T, S, N, K, H = 2, 1, 60, 4, 2, 16
  q, k, v = _inputs(4, B, T, S, N, K, H, jnp.float32)
  lengths_B = jnp.array([60, 23], jnp.int32)
  outs, k_ref, v_ref = _three_kernels(q, k, v, lengths_B, int8=int8, scale=0.9)
  want = decode_reference(q, k_ref, v_ref, lengths_B, scale=0.9)
  # 0.9 is far from 1 / sqrt(16) = 0.25: a kernel that kept the default would not match.
  assert np.abs(np.asarray(want - decode_reference(q, k_ref, v_ref, lengths_B))).max() > 0.1
  for name, got in outs.items():
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5,
                               err_msg=name)


@pytest.mark.parametrize("int8", [False, True])
def test_the_gpu_padded_head_dim_and_rows_in_interpret_mode(monkeypatch, int8):
  """On a GPU the kernels zero-pad the head dim (80 -> 128) and the query rows (T * G -> a
  power of two >= 16) for Triton; interpret mode pads neither, so here
  ``_rows_and_head_dim`` is made to return the GPU shapes and all three kernels (float; int8
  pages / tiles) run the padded path on the CPU against the reference. Catches the padded
  lanes reaching the result, e.g. a scale corrected by the padding (H / Hp) ** 0.5."""
  real, padded = decode._rows_and_head_dim, []

  def gpu_shapes(q_BTNH, K, interpret):
    rows, Hp = real(q_BTNH, K, False)
    padded.append((rows, Hp))
    return rows, Hp

  monkeypatch.setattr(decode, "_rows_and_head_dim", gpu_shapes)
  B, T, S, N, K, H = 2, 2, 40, 4, 2, 80
  q, k, v = _inputs(5, B, T, S, N, K, H, jnp.float32)
  lengths_B = jnp.array([40, 13], jnp.int32)
  outs, k_ref, v_ref = _three_kernels(q, k, v, lengths_B, int8=int8, splits=2, window=20)
  assert padded == [(16, 128)] * len(outs) and len(outs) == (2 if int8 else 3)
  want = decode_reference(q, k_ref, v_ref, lengths_B, 20)
  for name, got in outs.items():
    assert got.shape == q.shape, name
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5,
                               err_msg=name)


def test_scores_far_below_zero_keep_their_softmax():
  """Query rows whose scores all lie in [-300, -150] next to rows in [150, 300], over two
  splits (of two 16-slot pages in the paged kernel): each row's running max starts at
  -inf and the splits combine by their own maxima, so a far-negative row is still its own
  softmax in each kernel. No kernel test had scores that far below 0 until 2026-12-05 (a
  running max started at 0 passed the TPU flash kernel's tests, and gives such rows 0)."""
  q, k, v, _ = far_apart_inputs(2, 2, 64, 4, 2, 32)
  lengths_B = jnp.array([64, 37], jnp.int32)
  k_pages, v_pages, table_BM = _paginate(k, v, 16, seed=2)
  heads_major = lambda x: jnp.swapaxes(x, 1, 2)
  outs = _in_one_program({  # the kernels and the reference: one compilation
      "contiguous": (decode.decode_attention, (q, k, v, lengths_B), dict(num_splits=2)),
      "heads_major": (decode.decode_attention_heads_major, (
          q, heads_major(k), heads_major(v), lengths_B), dict(num_splits=2)),
      "paged": (decode.paged_decode_attention, (q, k_pages, v_pages, table_BM, lengths_B),
                dict(pages_per_split=2)),
      "want": (decode_reference, (q, k, v, lengths_B), {}),
  })
  want = np.asarray(outs.pop("want"))
  # The splits are combined by their log-sum-exps, near +-300 here, where float32's
  # spacing is 2**-15: weights with a relative error of ~3e-5, hence 1e-4.
  for name, got in outs.items():
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4, err_msg=name)


def test_lengths_past_2_to_the_24_are_exact():
  """Lengths are int32 all the way into the kernels: past 2**24 float32 no longer holds every
  integer (2**24 + 1 rounds to 2**24), so a kernel handed its lengths as float32 would shift
  the window by one there. A cache of 16 slots, lengths past it (the slots past S are simply
  not there), and a window that reaches back to slots 4 / 5 of row 0 only: row 0 is at
  2**24 + 1, row 1 at 2**31 - 1, the highest int32 (its window reaches no slot). A mutant
  that cast the lengths with ``astype(None)`` (float32) passed the parity tests, whose
  lengths are all far below 2**24."""
  B, T, S, N, K, H, C = 2, 2, 16, 4, 2, 32, 8
  q, k, v = _inputs(8, B, T, S, N, K, H, jnp.float32)
  lengths_B = jnp.array([2**24 + 1, 2**31 - 1], jnp.int32)
  W = 2**24 - 4  # row 0's queries (2**24 - 1, 2**24) see slots 4.. and 5..
  k_pages, v_pages, table_BM = _paginate(k, v, C, seed=1)
  heads_major = lambda x: jnp.swapaxes(x, 1, 2)
  outs = _in_one_program({  # the kernels and the references: one compilation
      "contiguous": (decode.decode_attention, (q, k, v, lengths_B), dict(window=W)),
      "heads_major": (decode.decode_attention_heads_major, (
          q, heads_major(k), heads_major(v), lengths_B), dict(window=W)),
      "paged": (decode.paged_decode_attention, (q, k_pages, v_pages, table_BM, lengths_B),
                dict(window=W)),
      "want": (decode_reference, (q, k, v, lengths_B), dict(window=W)),
  })
  want = np.asarray(outs.pop("want"))
  for name, got in outs.items():
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5, err_msg=name)


def test_a_bfloat16_cache_is_multiplied_in_bfloat16():
  """Over a bfloat16 cache each kernel's P V product takes bfloat16 operands (float32
  accumulation), the probabilities rounded to the cache's dtype as the reference op rounds
  them: Triton's bfloat16 tensor-core dot on a GPU. Found by mutation testing: the
  probabilities kept in float32, or the masked values' zero fill made in float32 (which
  promotes the whole value tile), passed every parity test, the result being a little
  closer to the float32 answer, and would make the GPU run float32 dots. With a bfloat16
  query the QK^T product is bfloat16 too; a float32 query promotes the keys (Triton's dot
  takes one dtype). Traced only: nothing is compiled."""
  l_B = jnp.array([40, 5])
  pages, table = jnp.ones((6, 16, 2, 32), jnp.bfloat16), jnp.zeros((2, 3), jnp.int32)
  k = jnp.ones((2, 40, 2, 32), jnp.bfloat16)
  run = lambda q, k, pages: (
      decode.decode_attention(q, k, k, l_B),
      decode.decode_attention_heads_major(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(k, 1, 2), l_B),
      decode.paged_decode_attention(q, pages, pages, table, l_B))
  kernels = ("attnlab_decode", "attnlab_decode_heads_major", "attnlab_paged_decode")
  for q_dtype, qk in (("bfloat16", "bfloat16"), ("float32", "float32")):
    q = jnp.ones((2, 2, 4, 32), q_dtype)
    dots = kernel_dots(jax.jit(run).trace(q, k, pages).jaxpr)
    want = [(qk, qk), ("bfloat16", "bfloat16")]  # Q K^T, then P V
    assert dots == dict.fromkeys(kernels, want), q_dtype


def test_splits_do_not_change_the_result():
  q, k, v = _inputs(7, 2, 3, 400, 8, 2, 32, jnp.float32)
  lengths_B = jnp.array([400, 250], jnp.int32)
  run = jax.jit(lambda n: decode.decode_attention(q, k, v, lengths_B, num_splits=n),
                static_argnums=0)
  one = run(1)
  for n in (3, 5):
    np.testing.assert_allclose(np.asarray(run(n)), np.asarray(one), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("call,match", [
    (lambda: decode.decode_attention(jnp.zeros((1, 9, 4, 32)), jnp.zeros((1, 16, 2, 32)),
                                     jnp.zeros((1, 16, 2, 32)), jnp.array([16])),
     r"q_BTNH has T=9 queries; the decode kernels take 1..8 \(use flash_attention for "
     r"prefill\)"),
    (lambda: decode.decode_attention(jnp.zeros((1, 1, 4, 32)), jnp.zeros((1, 16, 2, 16)),
                                     jnp.zeros((1, 16, 2, 16)), jnp.array([16])), "head dim"),
    (lambda: decode.decode_attention(jnp.zeros((1, 1, 3, 32)), jnp.zeros((1, 16, 2, 32)),
                                     jnp.zeros((1, 16, 2, 32)), jnp.array([16])), "multiple"),
    (lambda: decode.decode_attention(jnp.zeros((1, 1, 4, 32)), jnp.zeros((1, 16, 2, 32)),
                                     jnp.zeros((1, 16, 2, 32)), jnp.array([16, 3])),
     "lengths_B"),
    (lambda: decode.decode_attention(jnp.zeros((1, 1, 4, 32)), jnp.zeros((1, 16, 2, 32)),
                                     jnp.zeros((1, 16, 2, 32)), jnp.array([16]), num_splits=0),
     "num_splits=0"),
    (lambda: decode.paged_decode_attention(jnp.zeros((2, 1, 4, 32)), jnp.zeros((5, 16, 2, 32)),
                                           jnp.zeros((5, 16, 2, 32)),
                                           jnp.zeros((3, 2), jnp.int32), jnp.array([3, 3])),
     "page_table_BM"),
    (lambda: decode.paged_decode_attention(jnp.zeros((1, 1, 4, 32)), jnp.zeros((5, 16, 2, 32)),
                                           jnp.zeros((5, 8, 2, 32)),
                                           jnp.zeros((1, 2), jnp.int32), jnp.array([3])),
     "v_pages_PCKH"),
    (lambda: decode.paged_decode_attention(jnp.zeros((1, 1, 4, 32), jnp.float32),
                                           jnp.zeros((5, 16, 2, 32), jnp.int8),
                                           jnp.zeros((5, 16, 2, 32), jnp.int8),
                                           jnp.zeros((1, 2), jnp.int32), jnp.array([3])),
     r"k_scale_PCK / v_scale_PCK go with an int8 cache, and only with one \(cache dtype int8, "
     "scales given: False"),
    (lambda: decode.paged_decode_attention(jnp.zeros((1, 1, 4, 32), jnp.float32),
                                           jnp.zeros((5, 16, 2, 32), jnp.int8),
                                           jnp.zeros((5, 16, 2, 32), jnp.int8),
                                           jnp.zeros((1, 2), jnp.int32), jnp.array([3]),
                                           k_scale_PCK=jnp.ones((5, 16, 2)),
                                           v_scale_PCK=jnp.ones((5, 16))),
     r"must be \(5, 16, 2\)"),
])
def test_bad_input_raises(call, match):
  with pytest.raises(ValueError, match=match):
    call()


_Q = jnp.zeros((1, 1, 4, 32))
_LEN = jnp.array([3])
_TABLE = jnp.zeros((1, 2), jnp.int32)
_POOL = jnp.zeros((5, 16, 2, 32))  # P, C, K, H
_ROWS = jnp.zeros((1, 2, 16, 32))  # B, K, S, H


def _paged(**kw):
  return decode.paged_decode_attention(_Q, _POOL, _POOL, _TABLE, _LEN, **kw)


def _paged_kv(k_pages, v_pages, **kw):
  return decode.paged_decode_attention(_Q, k_pages, v_pages, _TABLE, _LEN, **kw)


def _heads_major(**kw):
  return decode.decode_attention_heads_major(_Q, _ROWS, _ROWS, _LEN, **kw)


@pytest.mark.parametrize("call,match", [
    # Each kernel names its own cache argument in the shared checks' messages.
    (lambda: decode.decode_attention(_Q, jnp.zeros((1, 16, 2, 16)), jnp.zeros((1, 16, 2, 16)),
                                     _LEN), r"head dim of q_BTNH \(32\) and of k_BSKH \(16\)"),
    (lambda: decode.paged_decode_attention(_Q, jnp.zeros((5, 16, 3, 32)), jnp.zeros((5, 16, 3, 32)),
                                           _TABLE, _LEN),
     r"multiple of num_kv_heads of k_pages_PCKH \(K=3\)"),
    (lambda: decode.decode_attention_heads_major(_Q, jnp.zeros((1, 2, 16, 8)),
                                                 jnp.zeros((1, 2, 16, 8)), _LEN),
     r"head dim of q_BTNH \(32\) and of k_BKSH \(8\)"),
    # A window of no key, in each kernel.
    (lambda: decode.decode_attention(_Q, jnp.zeros((1, 16, 2, 32)), jnp.zeros((1, 16, 2, 32)),
                                     _LEN, window=0), "window=0 must be a positive integer"),
    (lambda: _paged(window=0), "window=0 must be a positive integer"),
    (lambda: _heads_major(window=0), "window=0 must be a positive integer"),
    (lambda: _paged(pages_per_split=0), "pages_per_split=0 must be a positive integer"),
    (lambda: _heads_major(num_splits=0), "num_splits=0 must be a positive integer"),
    (lambda: _heads_major(num_splits=True), "num_splits=True must be a positive integer"),
    (lambda: _paged(pages_per_split=2.0), "pages_per_split=2.0 must be a positive integer"),
    # The caches' own shapes.
    (lambda: decode.paged_decode_attention(_Q, jnp.zeros((16, 2, 32)), jnp.zeros((5, 16, 2, 32)),
                                           _TABLE, _LEN),
     r"k_pages_PCKH must be rank 4 \[P, C, K, H\], got shape \(16, 2, 32\)"),
    (lambda: decode.paged_decode_attention(_Q, jnp.zeros((5, 16, 2, 32)), jnp.zeros((16, 2, 32)),
                                           _TABLE, _LEN),
     r"v_pages_PCKH must be rank 4 \[P, C, K, H\], got shape \(16, 2, 32\)"),
    (lambda: decode.decode_attention_heads_major(_Q, jnp.zeros((2, 16, 32)),
                                                 jnp.zeros((1, 2, 16, 32)), _LEN),
     r"k_BKSH must be rank 4 \[B, K, S, H\], got shape \(2, 16, 32\)"),
    (lambda: decode.decode_attention_heads_major(_Q, jnp.zeros((1, 2, 16, 32)),
                                                 jnp.zeros((2, 16, 32)), _LEN),
     r"v_BKSH must be rank 4 \[B, K, S, H\], got shape \(2, 16, 32\)"),
    (lambda: decode.decode_attention_heads_major(_Q, jnp.zeros((1, 2, 16, 32)),
                                                 jnp.zeros((1, 2, 8, 32)), _LEN),
     r"k_BKSH shape \(1, 2, 16, 32\) and v_BKSH shape \(1, 2, 8, 32\) must match"),
    (lambda: decode.decode_attention_heads_major(jnp.zeros((2, 1, 4, 32)),
                                                 jnp.zeros((1, 2, 16, 32)),
                                                 jnp.zeros((1, 2, 16, 32)), jnp.array([3, 3])),
     r"batch of q_BTNH \(2\) and of the cache \(1\) must match"),
    (lambda: decode.decode_attention_heads_major(jnp.zeros((1, 4, 32)), jnp.zeros((1, 2, 16, 32)),
                                                 jnp.zeros((1, 2, 16, 32)), _LEN),
     r"q_BTNH must be rank 4"),
    # Until 2026-12-04: a float k with an int8 v weighed v by probabilities cast to int8 (0 or
    # 1), an int8 k with a float v multiplied v by its scale, an int32 cache or q was taken,
    # float lengths and page tables were truncated, a list of lengths an AttributeError.
    (lambda: decode.decode_attention_heads_major(_Q, _ROWS, _ROWS.astype(jnp.int8), _LEN),
     r"the cache's keys and values must be both floating-point or both int8 \(with "
     r"k_scale_BKS / v_scale_BKS\), got dtypes float32 and int8"),
    (lambda: _paged_kv(_POOL.astype(jnp.int8), _POOL, k_scale_PCK=jnp.ones((5, 16, 2)),
                       v_scale_PCK=jnp.ones((5, 16, 2))),
     r"got dtypes int8 and float32"),
    (lambda: _paged_kv(_POOL.astype(jnp.int32), _POOL.astype(jnp.int32)),
     r"got dtypes int32 and int32"),
    (lambda: decode.decode_attention_heads_major(_Q.astype(jnp.int32), _ROWS, _ROWS, _LEN),
     r"q_BTNH must be a floating-point array \(float32, bfloat16, float16, \.\.\.\), got dtype "
     "int32"),
    (lambda: decode.paged_decode_attention(_Q, _POOL, _POOL, _TABLE, jnp.array([3.7])),
     r"lengths_B must be integers, got dtype float32"),
    (lambda: decode.decode_attention(_Q, jnp.zeros((1, 16, 2, 32)), jnp.zeros((1, 16, 2, 32)),
                                     jnp.array([3.0])), r"lengths_B must be integers"),
    (lambda: decode.paged_decode_attention(_Q, _POOL, _POOL, _TABLE.astype(jnp.float32), _LEN),
     r"page_table_BM must be integers, got dtype float32"),
    # NumPy int64 past int32: wrapped by jnp.asarray until 2026-12-06 (a page 2**32, past the
    # pool, was read as page 0; a length 2**32 + 3 as 3)
    (lambda: decode.paged_decode_attention(
        _Q, _POOL, _POOL, np.asarray(_TABLE, np.int64) + 2**32, _LEN),
     r"page_table_BM holds 4294967\d\d\d, outside int32's range \[-2\*\*31, 2\*\*31 - 1\]: the "
     "attention ops read it as int32"),
    (lambda: decode.paged_decode_attention(_Q, _POOL, _POOL, _TABLE, np.array([2**32 + 3])),
     r"lengths_B holds 4294967299, outside int32's range"),
    (lambda: decode.decode_attention(_Q, jnp.zeros((1, 16, 2, 32)), jnp.zeros((1, 16, 2, 32)),
                                     np.array([2**32 + 3])), r"lengths_B holds 4294967299"),
    (lambda: decode.decode_attention_heads_major(_Q, _ROWS, _ROWS, np.array([-2**31 - 1])),
     r"lengths_B holds -2147483649, outside int32's range"),
])
def test_bad_input_names_the_argument(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_numpy_ints_are_taken_like_python_ints():
  """A NumPy window / split count (read from an array) was refused as not an integer."""
  q, k, _ = _inputs(21, 1, 2, 32, 4, 2, 32, jnp.float32)
  lengths_B = jnp.array([20])
  pages = k.reshape(2, 16, 2, 32)  # the cache as 2 pages of 16: page m holds [16 m, 16 m + 16)
  table = jnp.array([[0, 1]], jnp.int32)
  rows = jnp.swapaxes(k, 1, 2)
  calls = [
      (lambda **kw: decode.decode_attention(q, k, k, lengths_B, **kw), "num_splits"),
      (lambda **kw: decode.paged_decode_attention(q, pages, pages, table, lengths_B, **kw),
       "pages_per_split"),
      (lambda **kw: decode.decode_attention_heads_major(q, rows, rows, lengths_B, **kw),
       "num_splits"),
  ]
  # Lengths as a list or a NumPy array are taken as the array they hold.
  lengths_as = ([20], np.array([20], np.int64), lengths_B)
  wants, gots, by_lengths = jax.jit(lambda: (  # every call in one program (all closed over)
      [call(window=5, **{splits: 2}) for call, splits in calls],
      [call(window=np.int64(5), **{splits: np.int32(2)}) for call, splits in calls],
      [decode.decode_attention(q, k, k, lengths, num_splits=2) for lengths in lengths_as]))()
  for want, got in zip(wants, gots, strict=True):
    np.testing.assert_array_equal(got, want)
    _assert_matches_reference(want, q, k, k, lengths_B, 5)
  for got in by_lengths[:2]:
    np.testing.assert_array_equal(got, by_lengths[2])


def test_interpret_false_off_a_gpu_is_refused():
  """``interpret=`` reaches ``common.resolve_interpret`` in each kernel: interpret=False (the
  compiled Triton kernel) on a CPU host raises, where a kernel that passed None on instead
  would run interpreted and hide it (and on a GPU ignore an ``interpret=True``)."""
  if jax.default_backend() != "cpu":
    pytest.skip("checks the CPU host's refusal")
  calls = {
      "contiguous": lambda: decode.decode_attention(
          _Q, jnp.zeros((1, 16, 2, 32)), jnp.zeros((1, 16, 2, 32)), _LEN, interpret=False),
      "paged": lambda: _paged(interpret=False),
      "heads_major": lambda: _heads_major(interpret=False),
  }
  refused = {}
  for name, call in calls.items():
    try:
      call()
    except ValueError as e:
      refused[name] = str(e)
  assert refused == dict.fromkeys(
      calls, "interpret=False needs a GPU; the default backend is 'cpu'")


@pytest.mark.parametrize("page_size", [8, 24])
def test_gpu_path_refuses_a_page_size_triton_cannot_tile(monkeypatch, page_size):
  """Compiled (not interpreted), the paged kernel needs pages of a power of two >= 16
  slots; checked before anything is lowered, so it raises off a GPU too."""
  monkeypatch.setattr(common, "resolve_interpret", lambda interpret: False)
  pages = jnp.zeros((5, page_size, 2, 32))
  with pytest.raises(ValueError, match=f"page size C={page_size} of k_pages_PCKH must be a "
                                       "power of two >= 16 on GPU"):
    decode.paged_decode_attention(_Q, pages, pages, _TABLE, _LEN)


@pytest.mark.parametrize("H,dtype", [(64, jnp.bfloat16), (80, jnp.float32)])
def test_triton_lowering(H, dtype, monkeypatch):
  """Both decode kernels lower to Triton IR (on CPU, by cross-platform lowering).

  Checks the Pallas -> Triton lowering rules only; compiling and running the
  kernels needs a GPU (tools/gpu_check.sh).
  """
  pytest.importorskip("jax._src.lib.triton")
  monkeypatch.setattr(common, "resolve_interpret", lambda interpret: False)
  B, T, S, N, K, C = 2, 3, 700, 8, 2, 16
  q, k, v = _inputs(0, B, T, S, N, K, H, dtype)
  lengths_B = jnp.array([700, 5], jnp.int32)
  k_pages, v_pages, table_BM = _paginate(k, v, C, seed=0)
  for fn, args in ((decode.decode_attention, (q, k, v, lengths_B)),
                   (decode.paged_decode_attention, (q, k_pages, v_pages, table_BM, lengths_B))):
    with cuda_target():
      lowered = jax.jit(functools.partial(fn, window=50)).trace(*args).lower(
          lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()


def test_triton_lowering_of_the_heads_major_and_int8_kernels(monkeypatch):
  """The heads-major kernel (float and int8) and the paged kernel over int8 pages lower
  to Triton IR too (Pallas -> Triton rules only; running them needs a GPU)."""
  pytest.importorskip("jax._src.lib.triton")
  from attnlab.nn.kv_cache import quantize

  monkeypatch.setattr(common, "resolve_interpret", lambda interpret: False)
  B, T, S, N, K, H, C = 2, 1, 300, 8, 2, 64, 16
  q, k, v = _inputs(0, B, T, S, N, K, H, jnp.float32)
  lengths_B = jnp.array([300, 5], jnp.int32)
  k_BKSH, v_BKSH = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  (k8, ks), (v8, vs) = quantize(k_BKSH), quantize(v_BKSH)
  k_pages, v_pages, table_BM = _paginate(k, v, C, seed=0)
  (kp8, kps), (vp8, vps) = quantize(k_pages), quantize(v_pages)
  calls = [
      (decode.decode_attention_heads_major, (q, k_BKSH, v_BKSH, lengths_B), {}),
      (decode.decode_attention_heads_major, (q, k8, v8, lengths_B),
       dict(k_scale_BKS=ks, v_scale_BKS=vs)),
      (decode.paged_decode_attention, (q, kp8, vp8, table_BM, lengths_B),
       dict(k_scale_PCK=kps, v_scale_PCK=vps)),
  ]
  # The same with a bfloat16 query (a bfloat16 model's cache of float32 or int8): Triton's
  # dot takes one dtype, and these failed to lower until 2026-12-05.
  calls += [(fn, (args[0].astype(jnp.bfloat16), *args[1:]), kw) for fn, args, kw in calls]
  for fn, args, kw in calls:
    with cuda_target():
      lowered = jax.jit(functools.partial(fn, window=50, **kw)).trace(*args).lower(
          lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("H,G", [(64, 8), (128, 4)])
def test_gpu_compiled_decode_matches_reference(H, G):
  B, T, S, K, C = 4, 2, 4096, 2, 16
  q, k, v = _inputs(11, B, T, S, K * G, K, H, jnp.bfloat16)
  lengths_B = jnp.array([4096, 3000, 17, 1], jnp.int32)
  got = jax.jit(lambda *a: decode.decode_attention(*a, interpret=False))(q, k, v, lengths_B)
  _assert_matches_reference(got, q, k, v, lengths_B, None)
  k_pages, v_pages, table_BM = _paginate(k, v, C, seed=3)
  got = jax.jit(lambda *a: decode.paged_decode_attention(*a, interpret=False))(
      q, k_pages, v_pages, table_BM, lengths_B)
  _assert_matches_reference(got, q, k, v, lengths_B, None)
  # The heads-major kernel, which the contiguous and ring caches run with
  # attention_impl="pallas" (not compiled by this check until 2026-12-05), over a bfloat16
  # cache and over an int8 one (a bfloat16 query against dequantized float32 keys).
  from attnlab.nn.kv_cache import dequantize, quantize

  k_BKSH, v_BKSH = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  heads_major = jax.jit(lambda *a, **kw: decode.decode_attention_heads_major(
      *a, interpret=False, **kw))
  _assert_matches_reference(heads_major(q, k_BKSH, v_BKSH, lengths_B), q, k, v, lengths_B, None)
  (k8, ks), (v8, vs) = quantize(k_BKSH), quantize(v_BKSH)
  got = heads_major(q, k8, v8, lengths_B, k_scale_BKS=ks, v_scale_BKS=vs)
  back = lambda x8, s: jnp.swapaxes(dequantize(x8, s, jnp.bfloat16), 1, 2)
  _assert_matches_reference(got, q, back(k8, ks), back(v8, vs), lengths_B, None)


def test_no_keys_or_no_queries_give_zeros():
  """A cache of no slots (S = 0), a page table of no pages (M = 0), a pool of no pages or no
  sequences (B = 0): zeros of the queries' shape, as attention() gives for no keys (each a
  ZeroDivisionError of the split count until 2026-12-04), in the queries' dtype: a bfloat16
  query over a float32 cache gets bfloat16 zeros (mutation testing: zeros of the default
  dtype, float32, passed while every query here was float32)."""
  no = jnp.zeros((0,), jnp.int32)
  table, pool = jnp.zeros((1, 2), jnp.int32), jnp.ones((5, 16, 2, 32))
  calls = [
      # no slots hold no token: a length of 0 (3 is refused since 2026-12-07)
      lambda q: decode.decode_attention(q, jnp.ones((1, 0, 2, 32)), jnp.ones((1, 0, 2, 32)),
                                        _LEN * 0),
      lambda q: decode.decode_attention_heads_major(q, jnp.ones((1, 2, 0, 32)),
                                                    jnp.ones((1, 2, 0, 32)), _LEN * 0),
      lambda q: decode.paged_decode_attention(q, pool, pool, jnp.zeros((1, 0), jnp.int32),
                                              _LEN * 0),
      lambda q: decode.paged_decode_attention(q, pool[:0], pool[:0], table, _LEN),
      lambda q: decode.decode_attention(q[:0], jnp.ones((0, 16, 2, 32)),
                                        jnp.ones((0, 16, 2, 32)), no),
      lambda q: decode.paged_decode_attention(q[:0], pool, pool, table[:0], no),
  ]
  for dtype in (jnp.float32, jnp.bfloat16):
    q = jnp.ones((1, 1, 4, 32), dtype)
    for i, call in enumerate(calls):
      out = call(q)
      want = (0, 1, 4, 32) if i >= 4 else q.shape
      assert out.shape == want and out.dtype == dtype and not np.any(np.asarray(out)), (i, dtype)


def _each_layout(q, k_BSKH, pool, table):
  """{what the lengths' refusal names as the cache: a call of the lengths} for the three
  decode kernels over the cache ``k_BSKH`` (keys and values alike; [B, 8, K, H]), its
  heads-major copy and the page ``pool`` / ``table`` (2 pages of 4 slots a row)."""
  k_BKSH = jnp.swapaxes(k_BSKH, 1, 2)
  return {
      "S=8 slots of k_BSKH": lambda l: decode.decode_attention(q, k_BSKH, k_BSKH, l),
      "S=8 slots of k_BKSH": lambda l: decode.decode_attention_heads_major(q, k_BKSH, k_BKSH, l),
      "M * C = 2 pages of page_table_BM x 4 slots = 8 positions":
          lambda l: decode.paged_decode_attention(q, pool, pool, table, l),
  }


def test_concrete_lengths_outside_the_cache_are_refused_and_traced_ones_are_not_read():
  """Until 2026-12-07 a negative length gave zeros, and one past the cache (S slots, or the
  table's M pages x C slots) an output for a query whose own key was not in the cache.
  0 is an empty slot (the paged cache's idle slots in continuous batching): zeros."""
  q = jnp.ones((3, 1, 4, 32))
  k_BSKH = jnp.ones((3, 8, 2, 32))
  pool, table = jnp.ones((5, 4, 2, 32)), jnp.zeros((3, 2), jnp.int32)  # M * C = 8
  for what, call in _each_layout(q, k_BSKH, pool, table).items():
    for lengths, held in [([8, 0, -3], "lengths_B[2]=-3"), ([100, 1, 9], "lengths_B[0]=100, "
                                                           "lengths_B[2]=9")]:
      for as_array in (jnp.array, np.array):
        with pytest.raises(ValueError) as e:
          call(as_array(lengths, np.int32))
        assert str(e.value) == (f"{held} must be in [0, 8]: a length counts the sequence's "
                                f"tokens in the cache ({what}), the queries' own included; 0 "
                                "is an empty slot"), (what, lengths)
    out = call(jnp.array([8, 0, 1], jnp.int32))  # the edges: full, empty, one token
    assert not np.asarray(out[1]).any() and np.asarray(out[0]).all(), what
    # traced: not read (the jitted decode loop is unchanged); -3 gives zeros as before
    traced = jax.jit(call)(jnp.array([8, -3, 1], jnp.int32))
    np.testing.assert_array_equal(traced[0], out[0], err_msg=what)
    assert not np.asarray(traced[1]).any(), what


def test_concrete_lengths_shorter_than_the_queries_are_refused():
  """The T queries of a row are its last T tokens, at positions length - T .. length - 1:
  a length in [1, T) put the first of them at negative positions, where they saw no key
  (zeros), until 2026-12-07. 0 (an empty slot) and T on are taken; traced lengths are not
  read."""
  q = jnp.asarray(np.random.default_rng(0).normal(size=(3, 3, 4, 32)), jnp.float32)
  k_BSKH = jnp.asarray(np.random.default_rng(1).normal(size=(3, 8, 2, 32)), jnp.float32)
  pool = jnp.reshape(k_BSKH, (6, 4, 2, 32))
  table = jnp.arange(6, dtype=jnp.int32).reshape(3, 2)  # row b's pages hold k_BSKH[b]
  for what, call in _each_layout(q, k_BSKH, pool, table).items():
    for lengths, held in [([2, 0, 5], "lengths_B[0]=2"),
                          ([1, 9, 3], "lengths_B[0]=1, lengths_B[1]=9")]:
      with pytest.raises(ValueError) as e:
        call(np.array(lengths, np.int32))
      assert str(e.value) == (f"{held} must be 0 or in [T=3, 8]: a length counts the "
                              f"sequence's tokens in the cache ({what}), the queries' own "
                              "included; 0 is an empty slot"), (what, lengths)
    out = call(jnp.array([3, 0, 8], jnp.int32))  # the edges: the queries alone, empty, full
    assert not np.asarray(out[1]).any(), what
    want = decode_reference(q, k_BSKH, k_BSKH, jnp.array([3, 3, 8], jnp.int32), None)
    np.testing.assert_allclose(out[0::2], want[0::2], rtol=2e-5, atol=2e-5, err_msg=what)
    traced = jax.jit(call)(jnp.array([3, 2, 8], jnp.int32))  # traced: not read
    np.testing.assert_allclose(traced[0::2], want[0::2], rtol=2e-5, atol=2e-5, err_msg=what)
