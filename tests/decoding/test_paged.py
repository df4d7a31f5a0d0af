"""The paged cache: the allocator's invariants and interleaved sequences."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.decoding.generate import _release, _reserve
from attnlab.decoding.paging import PageAllocator
from attnlab.nn import kv_cache as cache_lib
from tests import random_arrays
from tests.decoding.tiny_models import DECODER_CONFIGS, decoder_model, make_cfg, random_tokens

P, B, M, C = 10, 3, 6, 2

_allocate = jax.jit(lambda a, t, l, n: a.allocate(t, l, n, C))
_free = jax.jit(lambda a, t, r: a.free(t, r))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["grow", "free"]),
                          st.lists(st.integers(0, 5), min_size=B, max_size=B)), max_size=25))
def test_allocator_never_hands_out_a_page_twice_and_leaks_none(ops):
  alloc = PageAllocator.init(P)
  table = jnp.full((B, M), -1, jnp.int32)
  lengths = np.zeros(B, np.int32)
  for op, amounts in ops:
    if op == "grow":
      n = np.minimum(np.array(amounts, np.int32), M * C - lengths)
      before = int(alloc.num_free)
      alloc, table = _allocate(alloc, table, jnp.asarray(lengths), jnp.asarray(n))
      need = np.sum(-(-(lengths + n) // C) - (-(-lengths // C)))
      if need <= before:  # served: every sequence now has a page for each token
        lengths = lengths + n
        assert int(alloc.num_free) == before - need
      else:  # refused whole: nothing handed out, and the flag says so
        assert bool(alloc.exhausted) and int(alloc.num_free) == before
    else:
      release = np.array(amounts) % 2 == 1
      alloc, table = _free(alloc, table, jnp.asarray(release))
      lengths = np.where(release, 0, lengths)
    t = np.asarray(table)
    held = t[t >= 0]
    free = np.asarray(alloc.free_P)[: int(alloc.num_free)]
    # Every page is either held by exactly one sequence slot or free: a permutation.
    assert sorted(np.concatenate([held, free]).tolist()) == list(range(P))
    # A sequence holds exactly the pages its length needs, in its first slots.
    np.testing.assert_array_equal((t >= 0).sum(1), -(-lengths // C))


def test_a_new_allocator_holds_every_page_once_and_hands_them_out_in_order():
  alloc = PageAllocator.init(P)
  assert alloc.free_P.shape == (P,) and int(alloc.num_free) == P and not bool(alloc.exhausted)
  alloc, table = _allocate(alloc, jnp.full((B, M), -1, jnp.int32), jnp.zeros(B, jnp.int32),
                           jnp.array([C + 1, 1, 0], jnp.int32))
  np.testing.assert_array_equal(np.asarray(table)[:, :2], [[0, 1], [2, -1], [-1, -1]])


def test_allocator_out_of_pages_is_flagged_and_writes_nothing():
  alloc = PageAllocator.init(2)
  alloc, table = _allocate(alloc, jnp.full((B, M), -1, jnp.int32), jnp.zeros(B, jnp.int32),
                           jnp.array([2, 2, 2], jnp.int32))
  assert bool(alloc.exhausted)
  assert (np.asarray(table) == -1).all()


@pytest.mark.parametrize("impl", ["reference", "chunked", "pallas"])
def test_a_token_without_a_page_is_neither_stored_nor_seen(impl):
  """A row whose next page is missing (an allocator out of pages): its new token is
  dropped, and its queries see the keys stored before it, as if the token had not
  come (the gather reads page 0 where the page is missing; that slot is masked; the
  Pallas paged kernel masks the missing page's tile)."""
  Bq, Mq, Cq, N, K, H = 2, 3, 4, 4, 2, 8
  rng = random_arrays.rng(3)
  cache = cache_lib.PagedKVCache.init(Bq, Mq * Cq, K, H, page_size=Cq, num_pages=6)
  cache = cache.replace(
      # Page 0 is a real page too; page 5, the pool's last, is nobody's.
      page_table_BM=jnp.array([[1, 2, -1], [3, 0, 4]], jnp.int32),
      lengths_B=jnp.array([8, 8], jnp.int32),  # row 0 needs page 2 of its table: missing
      k_pages_PCKH=random_arrays.normal(rng, cache.k_pages_PCKH.shape),
      v_pages_PCKH=random_arrays.normal(rng, cache.v_pages_PCKH.shape))
  q = random_arrays.normal(rng, (Bq, 1, N, H))
  k_new, v_new = (random_arrays.normal(rng, (Bq, 1, K, H)) for _ in range(2))
  kwargs = dict(q_positions_BT=np.array([[8], [8]]), causal=True, window=None,
                implementation=impl)

  @jax.jit  # one program, not one per op
  def outputs(cache, q, k_new, v_new):
    got, got_cache = cache.attend(q, k_new, v_new, num_new_B=jnp.array([1, 1]), **kwargs)
    # The same keys in a contiguous cache, row 0 without its new token.
    k_BSKH, v_BSKH = cache.gather()
    flat = cache_lib.KVCache.init(Bq, Mq * Cq, K, H).replace(
        k_BKSH=jnp.moveaxis(k_BSKH, 1, 2), v_BKSH=jnp.moveaxis(v_BSKH, 1, 2),
        lengths_B=cache.lengths_B)
    want, _ = flat.attend(q, k_new, v_new, num_new_B=jnp.array([0, 1]), **kwargs)
    return got, got_cache, want

  got, got_cache, want = outputs(cache, q, k_new, v_new)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  # Row 0's token is written nowhere (not to page 0, not to the pool's last page, which a
  # -1 index would wrap to); row 1's goes to its third page (4), slot 8 % 4 = 0.
  for got_PCKH, old_PCKH, new_BTKH in ((got_cache.k_pages_PCKH, cache.k_pages_PCKH, k_new),
                                       (got_cache.v_pages_PCKH, cache.v_pages_PCKH, v_new)):
    want_PCKH = np.array(old_PCKH)
    want_PCKH[4, 0] = np.asarray(new_BTKH)[1, 0]
    np.testing.assert_array_equal(np.asarray(got_PCKH), want_PCKH)


def test_interleaved_paged_sequences_equal_each_alone_in_contiguous_cache():
  """Four sequences share three batch rows and a small page pool; rows advance
  on different steps, a finished sequence's row and pages go to the next one."""
  model = decoder_model("gqa_rope_window10")
  cfg = model.cfg
  graphdef, state = nnx.split(model)
  seqs = [random_tokens(10 + i, (n,))[None] for i, n in enumerate([11, 5, 8, 9])]

  def step_fn():
    @jax.jit
    def step(cache, alloc, token_B, live_B):
      m = nnx.merge(graphdef, state)
      if alloc is not None:
        cache, alloc = _reserve(cache, alloc, live_B, C)
      logits, cache = m(token_B[:, None], segment_ids_BT=live_B[:, None], cache=cache)
      return logits[:, 0], cache, alloc

    return step

  # Alone: one sequence per contiguous cache, one token per step.
  alone_step = step_fn()
  want = []
  for seq in seqs:
    cache = cache_lib.init_cache(cfg, "contiguous", 1, 16)
    rows = []
    for t in range(seq.shape[1]):
      logits, cache, _ = alone_step(cache, None, jnp.asarray(seq[:, t]), jnp.ones(1, jnp.int32))
      rows.append(np.asarray(logits[0]))
    want.append(np.stack(rows))

  # Interleaved: 3 rows, 15 pages of 2 slots (the 4 sequences need 18 in all,
  # so pages freed by a finished sequence must be reused).
  num_pages = 15
  cache = cache_lib.init_cache(cfg, "paged", B, 16, page_size=C, num_pages=num_pages)
  alloc = PageAllocator.init(num_pages)
  paged_step = step_fn()
  release = jax.jit(_release)
  rng = np.random.default_rng(0)
  queue = list(range(len(seqs)))
  row_seq = [queue.pop(0) for _ in range(B)]
  pos = [0] * B
  got = [[] for _ in seqs]
  while any(s is not None for s in row_seq):
    live = np.array([s is not None and rng.random() < 0.7 for s in row_seq], np.int32)
    token = np.array([seqs[s][0, pos[r]] if live[r] else 0 for r, s in enumerate(row_seq)],
                     np.int32)
    logits, cache, alloc = paged_step(cache, alloc, jnp.asarray(token), jnp.asarray(live))
    finished = np.zeros(B, bool)
    for r, s in enumerate(row_seq):
      if live[r]:
        got[s].append(np.asarray(logits[r]))
        pos[r] += 1
        if pos[r] == seqs[s].shape[1]:
          finished[r] = True
    if finished.any():
      cache, alloc = release(cache, alloc, jnp.asarray(finished))
      for r in np.flatnonzero(finished):
        row_seq[r], pos[r] = (queue.pop(0) if queue else None), 0
  assert not bool(alloc.exhausted)
  assert int(alloc.num_free) == num_pages  # everything returned
  for s in range(len(seqs)):
    np.testing.assert_allclose(np.stack(got[s]), want[s], atol=1e-5, rtol=1e-5)


def test_reserve_zeroes_each_new_page_of_every_sequence_and_no_other_page():
  """Three sequences take a page each in one decode step, and one row two pages in a
  prefill into a used cache, while row 0 holds page 0 and after it gave page 0 back (which
  it then takes): every page new to a sequence is zeroed in every layer (a page another
  sequence left holds its values: NaN here) and every other page, page 0 held, keeps what
  it held."""
  cfg = decoder_model("mha_rope").cfg
  cache = cache_lib.init_cache(cfg, "paged", B, 8, page_size=C, num_pages=P)
  alloc, table_BM = PageAllocator.init(P).allocate(
      cache[0].self_attn.page_table_BM, jnp.zeros(B, jnp.int32), jnp.array([2, 4, 2]), C)
  np.testing.assert_array_equal(table_BM[:, :2], [[0, -1], [1, 2], [3, -1]])
  cache = cache_lib.set_page_table(cache, table_BM, jnp.array([2, 4, 2], jnp.int32))
  poison = lambda x: x + jnp.nan if x.ndim == 4 else x  # every page of every layer
  cache = tuple(b.replace(self_attn=jax.tree.map(poison, b.self_attn)) for b in cache)
  held = cache, alloc
  released = _release(cache, alloc, jnp.array([True, False, False]))  # page 0 back
  reserve = jax.jit(_reserve, static_argnames=("page_size", "fresh", "one_token"))
  for (cache, alloc), num_new, one_token, want_new in (
      (held, [1, 1, 1], True, [[4], [5], [6]]),
      (held, [3, 0, 1], False, [[4, 5], [], [6]]),
      (released, [1, 1, 1], True, [[0], [4], [5]]),
      (released, [3, 0, 1], False, [[0, 4], [], [5]])):
    old_BM = np.asarray(cache[0].self_attn.page_table_BM)
    got_cache, _ = reserve(cache, alloc, jnp.array(num_new, jnp.int32), page_size=C,
                           one_token=one_token)
    new_BM = np.asarray(got_cache[0].self_attn.page_table_BM)
    assert [sorted(set(n[n >= 0]) - set(o[o >= 0])) for o, n in zip(old_BM, new_BM)] == want_new
    fresh = sorted(p for row in want_new for p in row)
    for layer, blk in enumerate(got_cache):
      for name in ("k_pages_PCKH", "v_pages_PCKH"):
        pages = np.asarray(getattr(blk.self_attn, name))
        zeroed = [p for p in range(P) if not np.isnan(pages[p]).any()]
        assert zeroed == fresh, (num_new, layer, name)
        assert not pages[fresh].any(), (num_new, layer, name)


def test_generate_with_too_few_pages_raises():
  import attnlab

  model = decoder_model("mha_rope")
  prompt = random_tokens(20, (2, 6))
  with pytest.raises(RuntimeError, match=re.escape(
      "the paged cache ran out of pages (num_pages=4, page_size=2); pass a larger num_pages or "
      "fewer / shorter sequences")):
    attnlab.generate(model, prompt, max_new_tokens=8, cache="paged", page_size=2, num_pages=4,
                     eos_id=None)


def test_generate_with_exactly_enough_pages_decodes_like_contiguous():
  """prompt + max_new_tokens - 1 positions per row, in whole pages, and not one page more:
  the loop runs max_new_tokens - 1 steps after the prefill and asks for no page past them."""
  import attnlab

  model = decoder_model("mha_rope")
  prompt = random_tokens(21, (2, 4))
  contiguous = attnlab.generate(model, prompt, max_new_tokens=5, eos_id=None)
  paged = attnlab.generate(model, prompt, max_new_tokens=5, cache="paged", page_size=4,
                           num_pages=4, eos_id=None)
  np.testing.assert_array_equal(np.asarray(paged), np.asarray(contiguous))


def test_more_pages_than_can_be_used_allocate_only_the_worst_case(monkeypatch):
  """``num_pages`` past every row at full length (``generate``) or every slot at the longest
  request (``generate_requests``) allocates that worst case, and decodes as the default does:
  until 2026-12-06 ``num_pages=2**40`` was allocated (an int32 overflow inside JAX in
  ``generate``, an out-of-memory error in ``generate_requests``)."""
  import attnlab

  model = decoder_model("mha_rope")
  prompt = random_tokens(21, (2, 4))
  pools = []
  real_init = cache_lib.PagedKVCache.init
  monkeypatch.setattr(cache_lib.PagedKVCache, "init", lambda *a, num_pages, **kw: (
      pools.append(num_pages) or real_init(*a, num_pages=num_pages, **kw)))
  want = np.asarray(attnlab.generate(model, prompt, max_new_tokens=5, eos_id=None))
  for num_pages in (2**40, 2**31 - 1, 5):
    got = attnlab.generate(model, prompt, max_new_tokens=5, cache="paged", page_size=4,
                           num_pages=num_pages, eos_id=None, bucket=False)
    np.testing.assert_array_equal(np.asarray(got), want)
  # 2 rows x 2 pages of 4 (4 + 5 - 1 = 8 positions): the worst case, and 5 capped to it (one
  # program for the three, traced once: a cache per layer)
  assert pools == [4] * model.cfg.num_layers
  pools.clear()
  for bucket, pages in ((False, 4), (True, 8)):  # 8 positions, or their bucket, 16
    served = attnlab.generate_requests(model, [list(r) for r in prompt], 5, slots=2,
                                       page_size=4, num_pages=2**40, eos_id=None,
                                       bucket=bucket)
    for b in range(2):
      np.testing.assert_array_equal(served[b], want[b])
    assert pools == [pages] * model.cfg.num_layers
    pools.clear()


def test_a_one_layer_model_decodes_paged_like_contiguous():
  """One layer: the page table the loop reserves from and frees into is layer 0's, the only
  one (every layer shares it), with a sequence that stops at its eos and frees its pages."""
  import dataclasses

  import attnlab

  cfg = dataclasses.replace(make_cfg("decoder_only", DECODER_CONFIGS["gqa_sinusoidal"]),
                            num_layers=1)
  model = attnlab.build_model(cfg, rngs=nnx.Rngs(0))
  prompt = random_tokens(22, (2, 4))
  kw = dict(max_new_tokens=9, prompt_lengths_B=[2, 4])
  free = np.asarray(attnlab.generate(model, prompt, eos_id=None, **kw))
  eos = int(free[0, 2])  # row 0 stops at its third token (row 1 may too, later)
  contiguous = np.asarray(attnlab.generate(model, prompt, eos_id=eos, **kw))
  paged = np.asarray(attnlab.generate(model, prompt, eos_id=eos, cache="paged", page_size=4,
                                      **kw))
  np.testing.assert_array_equal(paged, contiguous)
  assert contiguous[0, 2] == eos


def test_allocator_init_takes_a_positive_integer_page_count():
  """Until 2026-12-07 init(2.5) gave the free list [1, 0, -1] (page -1 handed out), init(-1)
  a negative count, init(None) a TypeError naming nothing."""
  for bad in (2.5, -1, 0, None, True, "3"):
    with pytest.raises(ValueError) as e:
      PageAllocator.init(bad)
    assert str(e.value) == f"num_pages={bad!r} must be a positive integer", bad
  alloc = PageAllocator.init(np.int64(3))
  np.testing.assert_array_equal(alloc.free_P, [2, 1, 0])
  assert alloc.free_P.dtype == jnp.int32 and int(alloc.num_free) == 3


def test_free_takes_a_bool_mask_of_the_rows():
  """An int mask cleared the rows and pushed none of their pages (2 & True == 0: the
  pages leaked) until 2026-12-07; refused when traced too."""
  alloc, table = _allocate(PageAllocator.init(P), jnp.full((B, M), -1, jnp.int32),
                           jnp.zeros(B, jnp.int32), jnp.array([3, 1, 0], jnp.int32))
  for mask in (jnp.array([2, 0, 0]), np.array([1, 0, 0]), [1, 0, 0]):
    for free in (PageAllocator.free, _free):
      with pytest.raises(ValueError) as e:
        free(alloc, table, mask)
      assert str(e.value) == ("release_B must be a bool array [B] (True: give the row's pages "
                              "back), got dtype int32"), (mask, free)
  with pytest.raises(ValueError, match=re.escape(
      "release_B shape (2,) must be [B] = (3,), the rows of page_table_BM")):
    alloc.free(table, jnp.array([True, False]))
  freed, cleared = alloc.free(table, [True, False, False])  # a list of bools is a mask
  assert int(freed.num_free) == P - 1 and (np.asarray(cleared)[0] == -1).all()


def test_a_second_free_with_the_stale_table_pushes_nothing():
  """free with the table from before the first free (whose rows it cleared) pushed the pages
  again until 2026-12-07: the free list [.., 0, 1, 0, 1], and two sequences could later
  share a page. Pages already free, outside the pool or twice in the table go back once."""
  alloc, table = _allocate(PageAllocator.init(4), jnp.full((B, M), -1, jnp.int32),
                           jnp.zeros(B, jnp.int32), jnp.array([3, 0, 0], jnp.int32))
  np.testing.assert_array_equal(np.asarray(table)[0, :2], [0, 1])
  release = jnp.array([True, False, False])
  once, cleared = _free(alloc, table, release)
  twice, _ = _free(once, table, release)  # the stale table
  for a in (once, twice):
    assert int(a.num_free) == 4
    assert sorted(np.asarray(a.free_P)[:4].tolist()) == [0, 1, 2, 3]
  np.testing.assert_array_equal(twice.free_P, once.free_P)
  assert (np.asarray(cleared)[0] == -1).all()
  # both pages of the table handed out again to two rows: each to one row
  again, table2 = _allocate(twice, cleared, jnp.zeros(B, jnp.int32),
                            jnp.array([2, 2, 0], jnp.int32))
  held = np.asarray(table2)[np.asarray(table2) >= 0]
  assert len(set(held.tolist())) == len(held) == 2 and int(again.num_free) == 2
  # a row holding a page twice, and an entry past the pool (a missing page): once, none
  odd = jnp.full((B, M), -1, jnp.int32).at[1, :3].set(jnp.array([2, 2, 9]))
  taken = PageAllocator(jnp.array([1, 0, 3, 2], jnp.int32), jnp.int32(2), jnp.bool_(False))
  back, _ = _free(taken, odd, jnp.array([False, True, False]))
  assert int(back.num_free) == 3 and np.asarray(back.free_P)[2] == 2
