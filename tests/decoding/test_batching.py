"""Continuous batching: every request as if decoded alone, pages never leaked or shared."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnlab
from attnlab.decoding import batching
from attnlab.decoding.sampling import Sampling, filtered_logits
from attnlab.nn import kv_cache as cache_lib
from tests.decoding.tiny_models import (
  VOCAB,
  decoder_forward,
  decoder_model,
  encdec_model,
  random_tokens,
)

NAME = "gqa_sinusoidal"
C = 4  # page size
LENGTHS = [5, 17, 2, 9, 30, 3, 12]
BUDGETS = [6, 3, 12, 1, 8, 10, 5]


def _prompts():
  return [random_tokens(100 + i, (n,)).tolist() for i, n in enumerate(LENGTHS)]


def _alone(model, prompts, budgets, eos_id):
  """Greedy ``generate`` of each prompt alone (one batched call: rows decode independently),
  cut after eos (one id, or a list of stop ids: the first of any) and at the request's
  budget."""
  width = max(len(p) for p in prompts)
  prompt_BT = np.zeros((len(prompts), width), np.int32)
  for b, p in enumerate(prompts):
    prompt_BT[b, :len(p)] = p
  out_BJ = np.asarray(attnlab.generate(model, prompt_BT, max_new_tokens=max(budgets),
                                       prompt_lengths_B=[len(p) for p in prompts], eos_id=None))
  want = []
  for row, n in zip(out_BJ, budgets, strict=True):
    row = row[:n].tolist()
    stops = [] if eos_id is None else eos_id if isinstance(eos_id, list) else [eos_id]
    hits = [j for j, t in enumerate(row) if t in stops]
    want.append(row[:hits[0] + 1] if hits else row)
  return want


def _check_pages_returned(stats, num_pages):
  # No leak, no sharing: the free list is exactly every page once; no slot holds one.
  assert sorted(stats.free_pages.tolist()) == list(range(num_pages))
  assert (stats.page_table == -1).all()


@pytest.fixture(scope="module")
def case():
  model = decoder_model(NAME, varied=True)
  prompts = _prompts()
  no_eos = _alone(model, prompts, BUDGETS, None)
  # An eos that some request emits in the middle of its budget, not as its first token.
  eos_id = next(t for row in no_eos for t in row[2:-1] if t != row[0])
  return model, prompts, eos_id, _alone(model, prompts, BUDGETS, eos_id), no_eos


def test_each_request_matches_generate_alone_more_requests_than_slots(case):
  model, prompts, eos_id, want, no_eos = case
  before = batching.num_programs()
  done_order, reported = [], {}

  def on_result(i, tokens):
    done_order.append(i)
    reported[i] = tokens.tolist()

  start = time.perf_counter()
  results, stats = batching.serve_requests(
      model, prompts, BUDGETS, slots=3, page_size=C, eos_id=eos_id, decode_chunk=4,
      on_result=on_result)
  assert 0 < stats.seconds <= time.perf_counter() - start
  assert [r.tolist() for r in results] == want
  assert all(r.dtype == np.int32 for r in results)
  assert reported == dict(enumerate(want))  # the callback gets each request's tokens
  # eos did stop a request mid-way
  assert any(2 < len(w) < b and w[-1] == eos_id for w, b in zip(want, BUDGETS, strict=True))
  assert sorted(done_order) == list(range(len(prompts)))
  assert stats.generated == sum(len(w) for w in want)
  # The device calls' share of the wall time is accounted for, and is only a share.
  assert stats.prefill_seconds > 0 and stats.decode_seconds > 0
  assert stats.prefill_seconds + stats.decode_seconds < stats.seconds
  assert 0 < stats.host_seconds < stats.seconds
  # Every slot's pages at the longest request's 37 positions, sized for their bucket, 48.
  assert max(n + b - 1 for n, b in zip(LENGTHS, BUDGETS, strict=True)) == 37
  _check_pages_returned(stats, 3 * 48 // C)
  # A fixed set of programs: one prefill per length bucket, one decode step.
  after = batching.num_programs()
  assert after["prefill"] - before["prefill"] <= len(stats.buckets) <= 3  # 16, 24, 32
  assert after["decode"] - before["decode"] <= 1


@pytest.mark.parametrize("cache, name", [("contiguous", NAME), ("ring", "gqa_rope_window10"),
                                         ("ring", "mqa_rope_window3")])
def test_slot_row_caches_match_generate_alone(cache, name):
  # Every slot owns its rows; a refilled slot must not see its last request's keys
  # (the ring's stale positions included: window 3 < every prompt here).
  model = decoder_model(name, varied=True)
  prompts = _prompts()
  want = _alone(model, prompts, BUDGETS, None)
  before = batching.num_programs()
  results, stats = batching.serve_requests(model, prompts, BUDGETS, slots=3, cache=cache,
                                           eos_id=None, decode_chunk=4)
  assert [r.tolist() for r in results] == want
  assert stats.prefills == len(prompts) > 3 and stats.free_pages is None
  # Every slot holds the bucket (48) of the longest request's 37 positions, no more (a ring
  # its window whatever the requests).
  assert stats.cache_bytes == cache_lib.cache_bytes(
      cache_lib.init_cache(model.cfg, cache, 3, 48))
  after = batching.num_programs()
  assert after["prefill"] - before["prefill"] <= len(stats.buckets)
  assert after["decode"] - before["decode"] <= 1


@pytest.mark.parametrize("cache", ["paged", "contiguous"])
@pytest.mark.parametrize("bucket", [False, True])
def test_no_more_slots_are_allocated_than_requests(case, cache, bucket):
  """Slots beyond the requests that fit would only be allocated: a run gets as many slots
  as those requests, or with ``bucket`` the power of two that holds them (until 2026-12-06
  slots=10**9 for a few requests failed inside JAX allocating the cache), with the same
  tokens and the cache of that many slots: the longest request's positions (19), or their
  bucket (24)."""
  model, prompts, eos_id, want, _ = case
  results, stats = batching.serve_requests(
      model, prompts[:3], BUDGETS[:3], slots=10**9, cache=cache, page_size=C, eos_id=eos_id,
      decode_chunk=4, bucket=bucket)
  slots, max_pos = (4, 24) if bucket else (3, 19)
  assert [r.tolist() for r in results] == want[:3] and stats.slots == slots
  assert max(n + b - 1 for n, b in zip(LENGTHS[:3], BUDGETS[:3], strict=True)) == 19
  kw = {"page_size": C} if cache == "paged" else {}
  assert stats.cache_bytes == cache_lib.cache_bytes(cache_lib.init_cache(
      model.cfg, cache, slots, -(-max_pos // C) * C if cache == "paged" else max_pos, **kw))


@pytest.mark.parametrize("cache", ["paged", "contiguous"])
def test_calls_with_other_requests_share_the_programs(case, cache):
  """A second call whose longest request and number of requests differ from the first's,
  but fall in the same buckets (37 and 33 positions: 48; 7 and 3 requests of 4 slots: 4),
  compiles nothing (until 2026-12-07 it compiled its own prefill and decode programs, as a
  call with bucket=False still does), and each request's tokens are its own."""
  model, prompts, eos_id, want, no_eos = case
  first, stats = batching.serve_requests(model, prompts, BUDGETS, slots=4, cache=cache,
                                         page_size=C, eos_id=eos_id, decode_chunk=4)
  assert [r.tolist() for r in first] == want and stats.slots == 4
  picked, budgets = [prompts[4], prompts[0], prompts[2]], [4, 6, 12]
  assert max(len(p) + b - 1 for p, b in zip(picked, budgets, strict=True)) == 33
  before = batching.num_programs()
  second, stats = batching.serve_requests(model, picked, budgets, slots=4, cache=cache,
                                          page_size=C, eos_id=None, decode_chunk=4)
  assert batching.num_programs() == before and stats.slots == 4
  assert [r.tolist() for r in second] == [no_eos[4][:4], no_eos[0], no_eos[2]]
  exact, stats = batching.serve_requests(model, picked, budgets, slots=4, cache=cache,
                                         page_size=C, eos_id=None, decode_chunk=4, bucket=False)
  after = batching.num_programs()
  assert after["decode"] == before["decode"] + 1 and after["prefill"] > before["prefill"]
  assert stats.slots == 3 and [r.tolist() for r in exact] == [r.tolist() for r in second]


def test_page_size_of_a_cache_without_pages_compiles_nothing(case):
  """The contiguous cache has no pages: its calls share programs whatever ``page_size``
  says (until 2026-12-07 a static argument of both programs, so each value compiled its
  own prefill and decode, 1.6-2.0 s a value for a small model). A bad value is still
  refused."""
  model, prompts, eos_id, want, _ = case
  kw = dict(slots=4, cache="contiguous", eos_id=eos_id, decode_chunk=4)
  first, _ = batching.serve_requests(model, prompts, BUDGETS, page_size=C, **kw)
  before = batching.num_programs()
  for page_size in (C + 1, 64):
    results, _ = batching.serve_requests(model, prompts, BUDGETS, page_size=page_size, **kw)
    assert [r.tolist() for r in results] == [r.tolist() for r in first] == want
  assert batching.num_programs() == before
  with pytest.raises(batching.GenerateInputError, match="page_size=0"):
    batching.serve_requests(model, prompts, BUDGETS, page_size=0, **kw)


def test_a_model_in_train_mode_serves_with_the_programs_of_eval_mode(case):
  """A model's mode is part of its pytree structure, and so of the programs' graph; decoding
  runs in eval mode either way, so both modes share programs (until 2026-12-07 each mode
  compiled its own prefill and decode), and the caller's model keeps its mode."""
  from flax import nnx

  shared, prompts, eos_id, want, _ = case
  model = nnx.merge(*nnx.split(shared))  # its own modes; the shared model's stay as they are
  kw = dict(slots=4, cache="paged", page_size=C, eos_id=eos_id, decode_chunk=4)
  model.eval()
  results, _ = batching.serve_requests(model, prompts, BUDGETS, **kw)
  assert [r.tolist() for r in results] == want
  before = batching.num_programs()
  model.train()
  structure = jax.tree.structure(model)
  results, _ = batching.serve_requests(model, prompts, BUDGETS, **kw)
  assert [r.tolist() for r in results] == want
  assert batching.num_programs() == before
  assert jax.tree.structure(model) == structure  # still in train mode


def test_bucket_must_be_a_bool(case):
  model, prompts, *_ = case
  with pytest.raises(ValueError, match=r"bucket='no' must be True or False"):
    attnlab.generate_requests(model, prompts[:1], 2, bucket="no")


def test_requests_wait_for_freed_pages(case):
  model, prompts, eos_id, want, no_eos = case
  need = [batching.pages_needed(n, b, C) for n, b in zip(LENGTHS, BUDGETS, strict=True)]
  num_pages = max(need) + 1  # far fewer than the requests need together
  assert sum(sorted(need)[-2:]) > num_pages
  running = []
  results, stats = batching.serve_requests(
      model, prompts, BUDGETS, slots=4, page_size=C, num_pages=num_pages, eos_id=eos_id,
      decode_chunk=4, on_result=lambda i, toks: running.append(i))
  assert [r.tolist() for r in results] == want
  _check_pages_returned(stats, num_pages)
  assert stats.occupancy < 1.0
  # The pool is num_pages pages of C positions: no more memory than asked for (a page table
  # as wide as the bucket, 48, of the longest request's 37 positions).
  assert stats.cache_bytes == cache_lib.cache_bytes(cache_lib.init_cache(
      model.cfg, "paged", 4, 48, page_size=C, num_pages=num_pages))


def test_a_request_that_never_fits_is_named_and_the_others_complete(case):
  model, prompts, eos_id, want, no_eos = case
  too_long = random_tokens(7, (60,)).tolist()  # 60 + 10 - 1 > max_len = 64
  budgets = [*BUDGETS[:3], 10, *BUDGETS[3:]]
  with pytest.raises(batching.UnservableRequests, match=r"request 3: prompt of 60 tokens .*"
                     r"max_len=64") as err:
    attnlab.generate_requests(model, [*prompts[:3], too_long, *prompts[3:]], budgets,
                              slots=3, page_size=C, eos_id=eos_id, decode_chunk=4)
  got = err.value.results
  assert got[3] is None and list(err.value.errors) == [3]
  assert [r.tolist() for r in got[:3] + got[4:]] == want


def test_a_request_larger_than_the_whole_cache_is_named(case):
  model, prompts, eos_id, *_ = case
  with pytest.raises(batching.UnservableRequests, match=r"request 1: .*num_pages=3"):
    attnlab.generate_requests(model, prompts[:2], [2, 3], slots=2, page_size=C, num_pages=3,
                              eos_id=None)


def test_static_policy_gives_the_same_tokens_with_lower_occupancy(case):
  model, prompts, eos_id, want, no_eos = case
  results, static = batching.serve_requests(model, prompts, BUDGETS, slots=3, page_size=C,
                                            eos_id=None, policy="static", decode_chunk=4)
  assert [r.tolist() for r in results] == no_eos
  before = batching.num_programs()
  _, cont = batching.serve_requests(model, prompts, BUDGETS, slots=3, page_size=C,
                                    eos_id=None, decode_chunk=4)
  assert batching.num_programs() == before  # a second run of the model compiles nothing
  assert static.decode_steps > cont.decode_steps
  assert static.occupancy < cont.occupancy
  # Static batches of 3 in request order, each running until its longest request is done
  # (the first token comes from the prefill); a batch's decode calls do not return early
  # when one of its requests finishes, since nothing can be admitted before the batch ends.
  batch_steps = [max(BUDGETS[i:i + 3]) - 1 for i in range(0, len(BUDGETS), 3)]
  assert static.decode_steps == sum(batch_steps)
  assert static.decode_calls == sum(-(-n // 4) for n in batch_steps)
  # Continuous batching does return early to refill a freed slot.
  assert cont.decode_calls > -(-cont.decode_steps // 4)


def _sampled_alone(prompt, budget, key, sampling):
  """What sampling request ``key`` must give, from full forward passes (no cache): the
  token drawn while r tokens of the budget remain is ``categorical(fold_in(key, r), ...)``
  of the filtered logits at the last position."""
  forward = decoder_forward(NAME, varied=True)
  seq, out = list(prompt), []
  for r in range(budget, 0, -1):
    tokens_1T = np.zeros((1, 64), np.int32)  # one shape: one compiled forward (causal)
    tokens_1T[0, :len(seq)] = seq
    logits_V = forward(tokens_1T)[0, len(seq) - 1]
    out.append(int(_draw(key, r, logits_V, sampling)))
    seq.append(out[-1])
  return out


@functools.partial(jax.jit, static_argnums=3)  # one program, not one per op
def _draw(key, r, logits_V, sampling):
  return jax.random.categorical(jax.random.fold_in(key, r),
                                filtered_logits(logits_V[None], sampling)[0])


def test_sampled_requests_follow_their_own_keys_whatever_the_schedule(case):
  model, prompts, *_, no_eos = case
  sampling = Sampling(temperature=1.0, top_k=10)
  rng = jax.random.key(7)
  want = [_sampled_alone(p, b, jax.random.fold_in(rng, i), sampling)
          for i, (p, b) in enumerate(zip(prompts, BUDGETS, strict=True))]
  assert want != no_eos  # it does sample
  # Two schedules, two sets of compiled programs: 3 slots of a paged cache too small for
  # them all (requests wait for freed pages), and static batches of 2 in contiguous rows.
  num_pages = max(batching.pages_needed(n, b, C) for n, b in zip(LENGTHS, BUDGETS, strict=True))
  waits = dict(slots=3, num_pages=num_pages + 1)
  static = dict(slots=2, cache="contiguous", policy="static")
  for kwargs in (waits, static,
                 waits | dict(rng=jax.random.key_data(rng)),  # raw key data, as generate takes
                 waits | dict(rng=np.int64(7))):  # an int seed: jax.random.key(7)
    got = attnlab.generate_requests(model, prompts, BUDGETS, page_size=C, eos_id=None,
                                    decode_chunk=4, sampling=sampling, **(dict(rng=rng) | kwargs))
    assert [g.tolist() for g in got] == want, kwargs
  other = attnlab.generate_requests(model, prompts, BUDGETS, page_size=C, eos_id=None,
                                    decode_chunk=4, sampling=sampling, rng=jax.random.key(8),
                                    **waits)
  assert [g.tolist() for g in other] != want
  # eos inside a static batch: the call runs on for the batch's other requests, and the
  # request's tokens stop at its eos. Some token is such an eos for these samples.
  def cut(row, eos_id):
    return row[:row.index(eos_id) + 1] if eos_id in row else row

  def ends_mid_batch(eos_id):
    rows = [cut(w, eos_id) for w in want]
    return any(1 < len(r) < max(map(len, rows[b - b % 2:b - b % 2 + 2])) and r[-1] == eos_id
               for b, r in enumerate(rows))

  eos_id = min(t for row in want for t in row if ends_mid_batch(t))
  got = attnlab.generate_requests(model, prompts, BUDGETS, page_size=C, eos_id=eos_id,
                                  decode_chunk=4, sampling=sampling, rng=rng, **static)
  assert [g.tolist() for g in got] == [cut(w, eos_id) for w in want]


def test_prefill_buckets_hold_the_prompt_with_less_than_half_of_it_as_padding():
  assert [batching.bucket_length(n, 1024) for n in (1, 16, 17, 24, 25, 33, 49, 65, 97, 129, 193)] \
      == [16, 16, 24, 24, 32, 48, 64, 96, 128, 192, 256]
  buckets = {batching.bucket_length(n, 1024) for n in range(1, 1025)}
  assert sorted(buckets) == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
  for n in range(17, 1025):
    assert n <= batching.bucket_length(n, 1024) < 1.5 * n
  assert batching.bucket_length(100, 100) == 100  # capped at max_len
  assert batching.bucket_length(80, 90) == 90


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts=[]), r"^prompts is empty: give at least one request \(a list of token-id "
                       r"lists, or a \[requests, length\] array\)$"),
    (dict(prompts="abc"), "prompts must be a non-empty list of token-id lists, got <class 'str'>"),
    (dict(prompts=[[1, 2], []]), r"prompts\[1\]"),
    (dict(prompts=[[1, 2], np.zeros(0, np.int32)]), r"prompts\[1\] must be a non-empty"),
    (dict(prompts=[[[1, 2]]]), r"prompts\[0\] must be .* shape \(1, 2\)"),
    (dict(prompts=np.ones((2, 1, 2), np.int32)),
     r"prompts as an array must be \[requests, length\], got shape \(2, 1, 2\)"),
    (dict(prompts=np.ones((0, 2), np.int32)), "^prompts is empty"),
    (dict(prompts=np.ones((2, 2), np.float32)), r"prompts\[0\] must be .* dtype float32"),
    (dict(prompts=[[1, 99]]), "token id 99"),
    (dict(prompts=[[1, 61]]), r"token id 61, outside the vocabulary \[0, 61\)"),
    (dict(prompts=[[1, -1]]), "token id -1, outside"),
    (dict(max_new_tokens=[3]), "one per request"),
    (dict(max_new_tokens=np.array([3])), "max_new_tokens has 1 entries; give one per request"),
    (dict(max_new_tokens=np.array([3, 0])), r"max_new_tokens\[1\]=0 must be a positive integer"),
    (dict(max_new_tokens=0), r"^max_new_tokens=0 must be a positive integer"),
    (dict(max_new_tokens=np.array(2.0)), r"^max_new_tokens=2.0 must be a positive integer"),
    (dict(max_new_tokens=np.ones((2, 1), np.int32)),
     r"max_new_tokens must be one int or one per request, got an array of shape \(2, 1\)"),
    (dict(slots=0), "slots=0"),
    (dict(page_size=0), "page_size=0 must be a positive integer"),
    # max_len = 64: a longer page is never filled (2**31 was an OverflowError inside JAX)
    (dict(page_size=65), r"^page_size=65 is more than 64: the model's max_len=64 never fills "
                         r"such a page; give at most 64 \(the smallest power of two >= "
                         r"max_len, 16 at least\)$"),
    (dict(page_size=2**31), r"^page_size=2147483648 is more than 64"),
    (dict(decode_chunk=0), "decode_chunk=0 must be a positive integer"),
    (dict(decode_chunk=10**9), r"^decode_chunk=1000000000 is more than the model's max_len=\d+: "
                               "no request decodes that many steps$"),
    (dict(num_pages=0), "num_pages=0 must be a positive integer"),
    (dict(sampling="greedy"), "sampling must be a Sampling, got str"),
    (dict(cache="ring"), "cache='ring' needs a sliding-window model \\(ModelConfig.window\\), "
                         "got window=None; use cache='paged' or 'contiguous'"),
    (dict(cache="rows"), "cache='rows' is not one of 'contiguous', 'ring', 'paged'"),
    (dict(cache="contiguous", num_pages=4), "num_pages=4 is for cache='paged'"),
    (dict(policy="fifo"), "policy='fifo' is not one of 'continuous', 'static'"),
    # generate's checks of the eos and the rng (an eos outside the vocabulary never ended a
    # request; rng=0 was a TypeError from inside JAX)
    (dict(eos_id=61), r"^eos_id=61 is outside the vocabulary \[0, 61\), or None \(no eos\)$"),
    (dict(eos_id="2"), r"^eos_id='2' must be an integer token id in \[0, 61\)"),
    (dict(eos_id=[]), r"^eos_id holds 0 ids; give 1 to 8 \(or one int, or None for no eos\)$"),
    (dict(eos_id=list(range(9))), r"^eos_id holds 9 ids; give 1 to 8"),
    (dict(eos_id=[2, 61]), r"^eos_id\[1\]=61 is outside the vocabulary \[0, 61\)$"),
    (dict(eos_id=[2, "3"]), r"^eos_id\[1\]='3' must be an integer token id in \[0, 61\)$"),
    (dict(eos_id=np.ones((1, 2), np.int32)), r"^eos_id=array\(\[\[1, 1\]\]"),
    (dict(rng="0"), r"^rng='0' must be a jax.random.key \(or its uint32 key data\), an integer "
                    "seed or None$"),
    (dict(cache_dtype="int4"), "cache_dtype='int4'"),  # a plain ValueError until 2026-12-04
    # Until 2026-12-06 a TypeError after the first request had run, and the results lost:
    (dict(on_result=5), r"^on_result must be a function on_result\(index, tokens\) or None, "
                        "got int$"),
    # ... and a string's characters taken as budgets ("max_new_tokens[0]='1' must be ..."):
    (dict(max_new_tokens="12"), r"^max_new_tokens='12' must be a positive integer or one per "
                                "request$"),
    (dict(prompts=np.array([[3, 4], [0, 0]])), r"^prompt 1 is empty \(all padding, pad_id=0\)"),
    (dict(prompts=np.ones((2, 0), np.int32)), r"^prompts\[0\] must be a non-empty list"),
    # NumPy makes [5, True] the ids [5, 1], which were served (until 2026-12-06)
    (dict(prompts=[[3, 4], [5, True]]), r"^prompts\[1\] holds a bool \(\[5, True\]\): token ids "
                                        "are ints$"),
    (dict(prompts=[[3, 4], (np.True_, 5)]), r"^prompts\[1\] holds a bool"),
    # a 0-d array in a list is its number; a 1-d one is no budget
    (dict(max_new_tokens=[np.array([2, 3]), 2]), r"^max_new_tokens\[0\]=array\(\[2, 3\]\) must "
                                                 "be a positive integer"),
])
def test_bad_arguments_raise_value_error_naming_the_field(kwargs, match):
  """Each one a GenerateInputError (a ValueError), which `attnlab decode` reports as one line."""
  from attnlab.decoding.generate import GenerateInputError

  args = dict(prompts=[[3, 4], [5]], max_new_tokens=2) | kwargs
  with pytest.raises(GenerateInputError, match=match):
    attnlab.generate_requests(decoder_model(NAME, varied=True), args.pop("prompts"),
                              args.pop("max_new_tokens"), **args)


def test_an_encoder_decoder_model_is_refused_by_name():
  with pytest.raises(ValueError, match="needs a decoder-only model, got arch='encoder_decoder'"):
    attnlab.generate_requests(encdec_model("paper_gqa"), [[3, 4]], 2)


def test_prompt_token_ids_at_the_vocabulary_edges_are_served():
  # Every request below fits 2 pages (3 + 4 - 1 positions): one page pool, so one set of
  # compiled serving programs; and every expectation is cut from one generate call.
  model = decoder_model(NAME, varied=True)
  prompts = [[0, 5, 7], [VOCAB - 1, 4]]
  longest = _alone(model, prompts, [4, 4], None)  # greedy, no eos: a prefix for any budget
  cut = lambda budgets: [row[:n] for row, n in zip(longest, budgets, strict=True)]
  got = attnlab.generate_requests(model, prompts, 3, slots=2, page_size=C, eos_id=None)
  assert [r.tolist() for r in got] == cut([3, 3])
  # Budgets as a NumPy array, one per request (NumPy ints), are served as a list would be.
  got = attnlab.generate_requests(model, prompts, np.array([3, 2]), slots=2, page_size=C,
                                  eos_id=None)
  assert [r.tolist() for r in got] == cut([3, 2])
  # Prompts of one length as a [requests, length] array (NumPy or JAX), a row each, as
  # generate takes them (refused until 2026-12-04).
  rows = [[0, 5, 7], [VOCAB - 1, 4, 9]]
  rows_longest = _alone(model, rows, [4, 4], None)
  for array in (np.array(rows), jnp.asarray(rows)):
    got = attnlab.generate_requests(model, array, 3, slots=2, page_size=C, eos_id=None)
    assert [r.tolist() for r in got] == [row[:3] for row in rows_longest]
  # Right-padded with the model's pad_id, as generate reads such an array: a row ends at its
  # last token that is not padding (until 2026-12-06 the padding was part of the prompt).
  assert model.cfg.pad_id == 0
  padded = np.array([[5, 7, 9, 11], [13, 17, 0, 0], [0, 6, 0, 0]])
  unpadded = [[5, 7, 9, 11], [13, 17], [0, 6]]
  want = [row[:3] for row in _alone(model, unpadded, [3] * 3, None)]
  assert [r.tolist() for r in attnlab.generate_requests(
      model, padded, 3, slots=2, page_size=C, eos_id=None)] == want
  assert np.asarray(attnlab.generate(model, padded, max_new_tokens=3, eos_id=None)).tolist() == want
  # ... and as a JAX array, or one budget as a 0-d array of either, or a list of them.
  for budgets, want in ((jnp.array([3, 2]), [3, 2]), (np.array(4), [4, 4]),
                        (jnp.array(3), [3, 3]), ([jnp.int32(2), np.int64(3)], [2, 3])):
    got = attnlab.generate_requests(model, prompts, budgets, slots=2, page_size=C, eos_id=None)
    assert [r.tolist() for r in got] == cut(want)


def test_requests_at_the_exact_limits_are_served():
  """A request that needs exactly max_len positions, or exactly every page, fits."""
  model = decoder_model(NAME, varied=True)
  prompt = random_tokens(8, (55,)).tolist()  # 55 + 10 - 1 = 64 = max_len positions
  assert model.cfg.max_len == 64
  prompts = [random_tokens(9 + i, (5,)).tolist() for i in range(2)]
  want = _alone(model, [prompt, *prompts], [10, 4, 4], None)  # one generate call for all
  got = attnlab.generate_requests(model, [prompt], 10, page_size=C, eos_id=None)
  assert [r.tolist() for r in got] == want[:1]
  # 5 + 4 - 1 = 8 positions = 2 pages of 4, and the cache holds 2 pages.
  results, stats = batching.serve_requests(model, prompts, 4, slots=2, page_size=C,
                                           num_pages=2, eos_id=None)
  assert [r.tolist() for r in results] == want[1:]
  _check_pages_returned(stats, 2)


def test_a_model_shorter_than_the_default_decode_chunk_is_served():
  """decode_chunk's default is 16 or max_len when that is less (16 refused every model of
  max_len < 16, and ``attnlab decode --slots`` has no flag to change it, until 2026-12-07);
  a decode_chunk the caller gives past max_len is still refused."""
  from flax import nnx

  cfg = attnlab.ModelConfig(arch="decoder_only", vocab_size=40, d_model=16, num_layers=1,
                            num_heads=2, d_ff=32, max_len=8)
  model = attnlab.build_model(cfg, rngs=nnx.Rngs(3))
  prompts, budgets = [[3, 4, 5], [6]], [4, 5]
  want = _alone(model, prompts, budgets, None)
  for cache in ("paged", "contiguous"):
    got = attnlab.generate_requests(model, prompts, budgets, cache=cache, eos_id=None)
    assert [r.tolist() for r in got] == want, cache
  with pytest.raises(ValueError, match="^decode_chunk=9 is more than the model's max_len=8"):
    attnlab.generate_requests(model, prompts, budgets, decode_chunk=9)


def test_numpy_sizes_of_a_narrow_type_are_taken_as_the_ints_they_hold(case):
  """slots, page_size, num_pages and decode_chunk as NumPy scalars of narrow types: the
  checks passed them and the host arithmetic overflowed (np.int8(5) slots x pages wrapped
  negative, a uint64 page size made -7 an OverflowError, a uint8 num_pages overflowed in
  the allocator) until 2026-12-07."""
  model, prompts, eos_id, want, _ = case
  results, stats = batching.serve_requests(
      model, prompts, BUDGETS, slots=np.int8(3), page_size=np.uint64(C),
      num_pages=np.uint8(20), decode_chunk=np.uint8(4), eos_id=eos_id)
  assert [r.tolist() for r in results] == want and stats.slots == 3
  _check_pages_returned(stats, 20)  # of the 30 that 3 slots at the longest request take
  got = attnlab.generate_requests(model, prompts, BUDGETS, slots=np.int8(5), page_size=2,
                                  eos_id=eos_id)
  assert [r.tolist() for r in got] == want
  # generate's num_pages alike.
  row = np.asarray(prompts[0], np.int32)[None]
  np.testing.assert_array_equal(
      attnlab.generate(model, row, max_new_tokens=3, cache="paged", page_size=C,
                       num_pages=np.uint8(4), eos_id=None),
      attnlab.generate(model, row, max_new_tokens=3, eos_id=None))


def test_admission_promises_whole_pages():
  """Two requests of 5 positions need 2 pages of 4 each: with 3 pages they must run one
  after the other (promising 5 / 4 = 1.25 pages each would start both, and the allocator
  would run dry)."""
  model = decoder_model(NAME, varied=True)
  prompts = [random_tokens(11 + i, (3,)).tolist() for i in range(2)]
  results, stats = batching.serve_requests(model, prompts, 3, slots=2, page_size=C,
                                           num_pages=3, eos_id=None, decode_chunk=1)
  assert [r.tolist() for r in results] == _alone(model, prompts, [3, 3], None)
  _check_pages_returned(stats, 3)
  assert stats.live_slot_steps == stats.decode_steps  # never two at once


def test_when_no_request_fits_every_one_is_named():
  model = decoder_model(NAME, varied=True)
  with pytest.raises(batching.UnservableRequests, match="2 request") as err:
    attnlab.generate_requests(model, [[3] * 60, [4] * 62], 10, page_size=C)
  assert err.value.results == [None, None] and sorted(err.value.errors) == [0, 1]


# The prefill decides on the device whether a request is already done (its first token is
# eos, or its budget is one token); it does so in each cache's own branch.
SLOT_CACHES = pytest.mark.parametrize("cache", ["paged", "contiguous"])


@SLOT_CACHES
def test_the_first_request_finishing_last_is_waited_for(cache):
  """Request 0 (in slot 0) runs longest: the host loop must not take it for a free slot, nor
  stop looking for free slots at it. Continuous batching starts request 2 in slot 1 when
  request 1 ends (11 decode steps in all: request 0's); static batching waits for request 0
  (11 steps), then runs request 2 (2 more)."""
  model = decoder_model(NAME, varied=True)
  prompts = [random_tokens(12 + i, (4,)).tolist() for i in range(3)]
  budgets = [12, 2, 3]
  for policy, steps in (("continuous", 11), ("static", 13)):
    got, stats = batching.serve_requests(model, prompts, budgets, slots=2, cache=cache,
                                         page_size=C, eos_id=None, policy=policy, decode_chunk=4)
    assert [r.tolist() for r in got] == _alone(model, prompts, budgets, None)
    assert stats.decode_steps == steps, policy


def test_on_result_sees_requests_in_the_order_they_complete():
  """Within one decode call the requests are reported in the order they ended (request 1,
  budget 2, one step in; request 0 five steps later), not in slot order (until 2026-12-06);
  and a request that ends at its prefill (budget 1) frees its slot for the next one before
  any decode call: requests 1-4 here complete before request 0 (until 2026-12-06 a slot so
  freed stayed empty for a whole decode call: request 2 came after 16 steps, 3 and 4 after
  request 0)."""
  model = decoder_model(NAME, varied=True)
  prompts = [random_tokens(40 + i, (4,)).tolist() for i in range(5)]
  def seen(i, tokens, order):
    order.append(i)
    tokens[:] = -1  # the callback's copy: the result keeps its tokens (until 2026-12-06
    # on_result got the very array returned)

  for budgets, want_order in (([6, 2], [1, 0]), ([20, 1, 1, 1, 1], [1, 2, 3, 4, 0])):
    order = []
    got, stats = batching.serve_requests(
        model, prompts[:len(budgets)], budgets, slots=2, page_size=C, eos_id=None,
        decode_chunk=16, on_result=lambda i, tokens, order=order: seen(i, tokens, order))
    assert order == want_order, budgets
    assert [r.tolist() for r in got] == _alone(model, prompts[:len(budgets)], budgets, None)
    assert stats.decode_steps == max(budgets) - 1


@SLOT_CACHES
def test_several_stop_ids_end_each_request_at_the_first_of_them(case, cache):
  """eos_id as a list: each request ends at its first token that is any of them, on the
  device (the decode program's finished flags) and on the host (its tokens cut there);
  one int until 2026-12-04."""
  model, prompts, _, _, no_eos = case
  stops = [no_eos[0][3], no_eos[1][1]]
  want = _alone(model, prompts, BUDGETS, stops)
  assert want != _alone(model, prompts, BUDGETS, None)
  for one in stops:  # each alone stops elsewhere
    assert want != _alone(model, prompts, BUDGETS, one)
  # 3 slots: the programs of the other tests of these requests (the stop ids are traced).
  results, stats = batching.serve_requests(model, prompts, BUDGETS, slots=3, cache=cache,
                                           page_size=C, eos_id=stops, decode_chunk=4)
  assert [r.tolist() for r in results] == want
  assert stats.live_slot_steps == stats.generated - stats.prefills


@SLOT_CACHES
def test_a_request_whose_first_token_is_eos_never_decodes(case, cache):
  """The prefill's token ends the request on the device too: each live slot-step of the
  decode program makes one of the tokens after the first."""
  model, prompts, _, _, no_eos = case
  eos = no_eos[2][0]
  want = _alone(model, prompts, BUDGETS, eos)
  assert want[2] == [eos] and any(len(w) > 1 for w in want)
  results, stats = batching.serve_requests(model, prompts, BUDGETS, slots=3, cache=cache,
                                           page_size=C, eos_id=eos, decode_chunk=4)
  assert [r.tolist() for r in results] == want
  assert stats.live_slot_steps == stats.generated - stats.prefills


def test_stats_add_up_every_device_call(case, monkeypatch):
  """prefill_seconds and decode_seconds sum over all calls (each call here made 5 ms
  longer)."""
  model, prompts, eos_id, want, _ = case
  def slower(fn):
    def call(*args, **kwargs):
      time.sleep(0.005)
      return fn(*args, **kwargs)
    return call

  for name in ("_prefill", "_decode"):
    monkeypatch.setattr(batching, name, slower(getattr(batching, name)))
  _, stats = batching.serve_requests(model, prompts, BUDGETS, slots=3, page_size=C,
                                     eos_id=eos_id, decode_chunk=4)
  assert stats.prefill_seconds >= 0.005 * stats.prefills
  assert stats.decode_seconds >= 0.005 * stats.decode_calls
  assert stats.prefills == len(prompts) and stats.decode_calls > 1


def test_serve_requests_has_the_defaults_of_generate_requests():
  """``serve_requests`` is ``generate_requests`` with its stats: called with defaults (as
  tools/bench_serve.py does) it must serve the same way."""
  import inspect

  defaults = lambda fn: {name: p.default for name, p in inspect.signature(fn).parameters.items()}
  assert defaults(batching.serve_requests) == defaults(attnlab.generate_requests)
  assert defaults(attnlab.generate_requests)["eos_id"] == 2  # as the README says


@SLOT_CACHES
def test_requests_that_end_at_their_prefill_leave_no_slot_busy(case, cache):
  """A budget of one token ends at the prefill: with more such requests than slots, every
  one is served and no decode step runs."""
  model, prompts, *_, no_eos = case
  prompts = prompts[:5]
  results, stats = batching.serve_requests(model, prompts, 1, slots=2, cache=cache,
                                           page_size=C, eos_id=None)
  assert [r.tolist() for r in results] == [row[:1] for row in no_eos[:5]]  # generate's
  assert stats.decode_steps == 0 and stats.prefills == 5
  if cache == "paged":
    _check_pages_returned(stats, 2 * -(-max(len(p) for p in prompts) // C))


def _poisoned_init(monkeypatch, pages_from=0):
  """``init_cache`` whose float buffers hold NaN (paged: pages ``pages_from`` on), as a
  sequence that overflowed (float16, say) leaves its pages and rows to the next one."""
  real = cache_lib.init_cache

  def poisoned(*args, **kw):
    def nan(x):
      if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
      return x.at[pages_from:].set(jnp.nan) if x.ndim == 4 and pages_from else x + jnp.nan

    return tuple(b.replace(self_attn=jax.tree.map(nan, b.self_attn)) for b in real(*args, **kw))

  monkeypatch.setattr(cache_lib, "init_cache", poisoned)


@pytest.mark.parametrize("cache", ["paged", "contiguous"])
def test_a_sequence_never_reads_what_an_earlier_one_left(case, monkeypatch, cache):
  """Every cache buffer starts as NaN: the results equal the clean run's, since each page
  is zeroed when a request gets it and each slot row when a request is prefilled into it
  (until 2026-12-04 the stale values were weighted by 0, and 0 x NaN reached the logits:
  one overflowing request poisoned every later one in its pages or slot)."""
  model, prompts, eos_id, want, no_eos = case
  _poisoned_init(monkeypatch)
  results = attnlab.generate_requests(model, prompts, BUDGETS, slots=3, cache=cache,
                                      page_size=C, eos_id=None, decode_chunk=4)
  assert [r.tolist() for r in results] == no_eos


def test_generate_zeroes_a_page_it_assigns_while_decoding(monkeypatch):
  """``generate`` with a paged cache: pages taken in the decode loop (a page freed by a
  finished sequence, in general) are zeroed; here every page past the prefill's holds NaN."""
  model = decoder_model(NAME, varied=True)
  prompt_BT = np.asarray([random_tokens(7, (6,)).tolist(), random_tokens(8, (6,)).tolist()])
  kw = dict(prompt_lengths_B=[3, 6], eos_id=None, cache="paged", page_size=C)
  want = np.asarray(attnlab.generate(model, prompt_BT, max_new_tokens=9, **kw))
  _poisoned_init(monkeypatch, pages_from=3)  # the prefill takes pages 0, 1, 2
  # Another max_new_tokens: a program of its own, traced with the poisoned init_cache.
  got = np.asarray(attnlab.generate(model, prompt_BT, max_new_tokens=11, **kw))
  np.testing.assert_array_equal(got[:, :9], want)


def test_a_request_up_to_max_len_fits_pages_that_round_past_it():
  """max_len 64 with pages of 24: a request needing 63 positions takes 3 pages (72 slots).
  The cache is made for the positions, not the rounded slots, which init_cache now refuses
  past max_len (2026-12-04); the result equals generate's."""
  model = decoder_model("mha_rope")
  assert model.cfg.max_len == 64
  prompt = np.random.default_rng(3).integers(3, model.cfg.vocab_size, 60).tolist()
  got = attnlab.generate_requests(model, [prompt, prompt[:5]], 4, slots=2, cache="paged",
                                  page_size=24, eos_id=None)
  # generate of both, right-padded (rows decode independently): one compiled program.
  padded = np.array([prompt, prompt[:5] + [0] * 55])
  want = attnlab.generate(model, padded, max_new_tokens=4, prompt_lengths_B=[60, 5], eos_id=None)
  for g, w in zip(got, np.asarray(want), strict=True):
    np.testing.assert_array_equal(g, w)


def test_checked_requests_are_int32_rows_from_id_0_to_the_last_id():
  """The edges of the vocabulary are ids (0 included, the model's pad id too), and every
  prompt comes back as int32 whatever it was given as (a list, int64), with one budget each."""
  cfg = decoder_model("mha_rope").cfg
  prompts, budgets = batching._check_requests(
      cfg, [[0, cfg.vocab_size - 1], np.array([5], np.int64)], 3)
  assert [p.dtype for p in prompts] == [np.int32, np.int32] and budgets == [3, 3]
  assert [p.tolist() for p in prompts] == [[0, cfg.vocab_size - 1], [5]]


def test_serve_stats_derive_occupancy_host_time_and_rate_from_their_counts():
  """What bench_serve and ``decode --slots`` report: the mean share of slots decoding per
  step, the wall time outside the device calls, tokens per wall second; an empty run
  reports 0, not a ZeroDivisionError."""
  stats = batching.ServeStats(slots=4, generated=10, decode_steps=5, live_slot_steps=12,
                              seconds=2.0, prefill_seconds=0.5, decode_seconds=1.25)
  assert (stats.occupancy, stats.host_seconds, stats.tokens_per_second) == (0.6, 0.25, 5.0)
  empty = batching.ServeStats(slots=4)
  assert (empty.occupancy, empty.host_seconds, empty.tokens_per_second) == (0.0, 0.0, 0.0)
