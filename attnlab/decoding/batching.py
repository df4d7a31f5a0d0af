"""Continuous batching: many requests of any lengths through a fixed set of slots.

``generate_requests`` serves a list of prompts (token lists of any lengths,
each with its own token budget) with ``slots`` sequences decoding together
over one ``PagedKVCache`` whose pages come from one ``PageAllocator``.
When a sequence finishes (eos or its budget), its pages go back to the free
list on the device and the next waiting request is prefilled into its slot
while the other slots keep their state (vLLM-style scheduling). A Python
loop on the host does the scheduling; the device runs two kinds of jitted
programs, both compiled once per shape, never per request:

  * ``_prefill``: one request into one slot. The prompt is right-padded to a
    length bucket (16, 24, 32, 48, 64, 96, ...: powers of two and 1.5x
    them, capped at ``cfg.max_len``), so there is one program per bucket.
    The model runs on a batch-1 *view* of the cache (paged: the shared pages
    and that slot's page-table row; contiguous / ring: the slot's row,
    emptied, written back in place), so a prefill costs one prompt, not
    ``slots`` prompts.
  * ``_decode``: up to ``decode_chunk`` steps of every slot at once (one token
    per live slot per step) in a ``lax.while_loop``; with the paged cache,
    pages are allocated as sequences grow and freed when they finish. The
    loop returns early when a slot finishes and a request is waiting, so the
    host can refill it.

Three caches, as in ``generate``. "paged" (the default) admits by pages:
a request is admitted only when the pages it can need at its full budget
(prompt + max_new_tokens - 1 positions) are not promised to the running
requests, so the device allocator never runs dry mid-sequence and nothing is
ever preempted. "contiguous" gives every slot its own [K, S, H] rows, S the
longest request (JetStream-style slots: more memory, as many sequences, no
page gather in the decode step); "ring" (sliding-window models) gives every
slot a ring of ``cfg.window`` positions (``cfg.max_len`` where the window is
wider). With those a request waits only for
a free slot. Requests are admitted in order
(first come, first served); a request that waits for pages blocks the ones
behind it. A request that can never fit (longer than ``cfg.max_len`` or than
the whole cache) is not run: the others are, and then ``UnservableRequests``
names it (with the others' results attached).

By default (``bucket=True``) the cache is sized for the length bucket of the
longest request's positions and the slots for the power of two that holds the
requests (at most ``slots``), so calls with other requests share the programs;
``bucket=False`` sizes both exactly.

``policy="static"`` is the baseline of ``tools/bench_serve.py``: the same
programs, but a new batch is admitted only when every slot of the previous
one has finished (each batch waits for its longest request); its decode calls
do not return early when a slot frees, since nothing could be admitted then.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from attnlab.config import CACHE_KINDS
from attnlab.decoding.generate import (
  GREEDY,
  GenerateInputError,
  _eval_model,
  _prompt_lengths,
  _release,
  _reserve,
  as_key,
  bucket_length,
  check_bucket,
  check_cache_dtype,
  check_model,
  check_page_size,
  check_stop_ids,
  eval_view,
  new_pages,
  positive_int,
  stop_array,
)
from attnlab.decoding.paging import PageAllocator
from attnlab.decoding.sampling import Sampling, is_stop, sample_rows
from attnlab.nn import kv_cache as cache_lib

POLICIES = ("continuous", "static")
# Decode steps per device call by default (at most the model's max_len).
DECODE_CHUNK = 16


class UnservableRequests(RuntimeError):
  """Some requests can never fit; the others were served.

  Attributes:
    errors: {request index: why}.
    results: the list ``generate_requests`` would have returned, with None at
      the requests that could not be served.
  """

  def __init__(self, errors: dict[int, str], results: list):
    self.errors = errors
    self.results = results
    lines = "; ".join(f"request {i}: {why}" for i, why in sorted(errors.items()))
    super().__init__(f"{len(errors)} request(s) can never be served ({lines}); the other "
                     f"{sum(r is not None for r in results)} completed")


@dataclasses.dataclass
class ServeStats:
  """What a ``serve_requests`` run did.

  Attributes:
    generated: tokens generated (all requests).
    decode_steps: batched decode steps run.
    decode_calls: calls of the decode program (each runs up to ``decode_chunk``
      steps; under "continuous" a call also returns after a step in which a
      slot finished while a request waits, so that it can be admitted).
    live_slot_steps: sum over decode steps of the slots that were decoding.
    prefills: prefill calls (one per served request).
    seconds: wall time of the run (compilation included if it happened).
    prefill_seconds, decode_seconds: the part of ``seconds`` from calling the
      prefill / decode programs until their results were on the host (the
      host reads them at once: the first token, the chunk of new tokens); the
      rest is the host's scheduling.
    buckets: prompt-length buckets used (one prefill program each).
    cache_bytes: bytes of the K/V cache the run allocated (values, int8
      scales, page table, lengths; ``kv_cache.cache_bytes``).
    free_pages: the allocator's free page ids after the run (paged cache).
    page_table: the page table [slots, M] after the run (all -1 when every
      request released its pages; paged cache).
  """

  slots: int  # allocated (with ``bucket``, up to 2x the requests, at most ``slots``)
  generated: int = 0
  decode_steps: int = 0
  decode_calls: int = 0
  live_slot_steps: int = 0
  prefills: int = 0
  seconds: float = 0.0
  prefill_seconds: float = 0.0
  decode_seconds: float = 0.0
  buckets: set = dataclasses.field(default_factory=set)
  cache_bytes: int = 0
  free_pages: np.ndarray | None = None
  page_table: np.ndarray | None = None

  @property
  def occupancy(self) -> float:
    """Mean fraction of the slots decoding per decode step."""
    return self.live_slot_steps / max(1, self.decode_steps * self.slots)

  @property
  def host_seconds(self) -> float:
    """The host's scheduling: ``seconds`` outside the prefill and decode calls."""
    return self.seconds - self.prefill_seconds - self.decode_seconds

  @property
  def tokens_per_second(self) -> float:
    return self.generated / max(self.seconds, 1e-9)


@struct.dataclass
class _SlotState:
  """Per-slot decoding state on the device.

  Attributes:
    token_B: the last token of each slot (fed next).
    active_B: bool, the slot holds a request that is still decoding.
    remaining_B: int32 tokens the slot may still generate.
    key_B: the random key of each slot's request (``_request_key``).
  """

  token_B: jax.Array
  active_B: jax.Array
  remaining_B: jax.Array
  key_B: jax.Array


def generate_requests(model, prompts: Sequence[Sequence[int]], max_new_tokens, *, slots: int = 8,
                      cache: str = "paged", page_size: int = 16, num_pages: int | None = None,
                      cache_dtype=None, sampling: Sampling = GREEDY, rng=None,
                      eos_id: int | Sequence[int] | None = 2,
                      on_result: Callable | None = None,
                      policy: str = "continuous", decode_chunk: int | None = None,
                      bucket: bool = True) -> list[np.ndarray]:
  """Generate for every prompt with continuous batching; results in request order.

  Args:
    model: a decoder-only model (``attnlab.build_model``).
    prompts: token-id lists of any (non-zero) lengths, or a [requests, length] integer
      array (a prompt per row, right-padded with ``cfg.pad_id`` as ``generate`` reads it:
      a row ends at its last token that is not padding; a list keeps every id).
    max_new_tokens: a positive int, or one per request.
    slots: sequences decoding together (at most as many as the requests that fit the
      model: a slot no request could fill is not allocated).
    cache: "paged" | "contiguous" | "ring" (a sliding-window model): see the
      module docstring.
    page_size, num_pages: C and P of the paged cache; P defaults to enough
      pages for every slot at the longest request, and a larger P allocates only
      that many (more are never used). With fewer, requests wait for the pages
      of finished ones. ``num_pages`` is the paged cache's only.
    cache_dtype: dtype of the cached K/V; None = the model's compute dtype.
    sampling: ``Sampling``; greedy by default.
    rng: a ``jax.random.key`` (or an int seed, as in ``generate``) for
      sampling. Request i draws its tokens from its own key
      (``jax.random.fold_in(rng, i)``), so its tokens do not depend on
      ``slots``, ``cache``, ``policy`` or the other requests.
    eos_id: a request stops after emitting it (a token id in [0, vocab_size), or a
      sequence of up to ``MAX_STOP_IDS`` ids: any of them); None = always its budget.
    on_result: called as ``on_result(index, tokens)`` when a request completes, in the
      order they complete (those that end in one decode call by the step they ended at);
      ``tokens`` is a copy of the request's result.
    policy: "continuous", or "static" (a new batch only when all slots are free).
    decode_chunk: decode steps per device call at most, up to the model's max_len; None =
      16, or the model's max_len when that is less.
    bucket: size the cache for the length bucket (``bucket_length``) of the longest
      request's positions and the slots for the power of two that holds the requests
      (at most ``slots``), so that calls with other requests share the compiled programs
      (up to ~1.5x the positions, 16 at least, and 2x the slots of the exact sizes).
      False sizes both exactly: for a caller with one set of requests (a benchmark, the
      CLI).

  Returns:
    one int32 array per request: its new tokens (eos included), at most its budget.

  Raises:
    ValueError: bad arguments (checked before anything runs).
    UnservableRequests: after the others completed, if some request can never
      fit the model or the cache.
  """
  results, _ = serve_requests(model, prompts, max_new_tokens, slots=slots, cache=cache,
                              page_size=page_size, num_pages=num_pages, cache_dtype=cache_dtype,
                              sampling=sampling, rng=rng, eos_id=eos_id, on_result=on_result,
                              policy=policy, decode_chunk=decode_chunk, bucket=bucket)
  return results


def _check_requests(cfg, prompts, max_new_tokens):
  if isinstance(prompts, np.ndarray | jax.Array):  # [requests, length]: a prompt per row, as
    if prompts.ndim != 2:                            # generate takes them (refused until
      raise GenerateInputError(                      # 2026-12-04)
          f"prompts as an array must be [requests, length], got shape {prompts.shape}")
    rows = np.asarray(prompts)
    if np.issubdtype(rows.dtype, np.integer) and rows.size:
      # Right-padded with cfg.pad_id, as generate reads them: a row ends at its last token
      # that is not padding (until 2026-12-06 the padding was part of the prompt).
      lengths = _prompt_lengths(cfg, rows, None)
      prompts = [row[:n] for row, n in zip(rows, lengths, strict=True)]
    else:  # the per-row checks below name what is wrong
      prompts = list(rows)
  if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence):
    raise GenerateInputError(
        f"prompts must be a non-empty list of token-id lists, got {type(prompts)}")
  if not prompts:
    raise GenerateInputError("prompts is empty: give at least one request (a list of token-id "
                             "lists, or a [requests, length] array)")
  for i, p in enumerate(prompts):
    # NumPy makes [5, True] the ids [5, 1] (read so until 2026-12-06; all bools are refused
    # by their dtype below)
    if isinstance(p, list | tuple) and any(isinstance(t, bool | np.bool_) for t in p):
      raise GenerateInputError(f"prompts[{i}] holds a bool ({p!r}): token ids are ints")
  prompts = [np.asarray(p) for p in prompts]
  for i, p in enumerate(prompts):
    if p.ndim != 1 or p.size == 0 or not np.issubdtype(p.dtype, np.integer):
      raise GenerateInputError(f"prompts[{i}] must be a non-empty list of int token ids, got dtype "
                       f"{p.dtype} and shape {p.shape}")
    bad = (p < 0) | (p >= cfg.vocab_size)
    if bad.any():
      raise GenerateInputError(f"prompts[{i}] holds token id {int(p[np.argmax(bad)])}, outside the "
                       f"vocabulary [0, {cfg.vocab_size})")
  if isinstance(max_new_tokens, np.ndarray | jax.Array):
    budgets = np.asarray(max_new_tokens)
    if budgets.ndim > 1:
      raise GenerateInputError(f"max_new_tokens must be one int or one per request, got an "
                               f"array of shape {budgets.shape}")
    # One budget per request, or one for all (a 0-d array), as Python numbers.
    max_new_tokens = budgets.tolist()
  if isinstance(max_new_tokens, str | bytes):
    raise GenerateInputError(f"max_new_tokens={max_new_tokens!r} must be a positive integer or "
                             "one per request")
  if isinstance(max_new_tokens, Sequence):
    budgets = [b.item() if isinstance(b, np.ndarray | jax.Array | np.generic) and np.ndim(b) == 0
               else b for b in max_new_tokens]  # 0-d arrays as their numbers, as one is
    if len(budgets) != len(prompts):
      raise GenerateInputError(f"max_new_tokens has {len(budgets)} entries; give one per request "
                       f"({len(prompts)}) or one int")
  else:  # one for all, named as given (it was named max_new_tokens[0] until 2026-12-04)
    budgets = [positive_int("max_new_tokens", max_new_tokens)] * len(prompts)
  for i, n in enumerate(budgets):
    positive_int(f"max_new_tokens[{i}]", n)
  return [p.astype(np.int32) for p in prompts], [int(n) for n in budgets]


def serve_requests(model, prompts, max_new_tokens, *, slots=8, cache="paged", page_size=16,
                   num_pages=None, cache_dtype=None, sampling=GREEDY, rng=None, eos_id=2,
                   on_result=None, policy="continuous", decode_chunk=None, bucket=True):
  """``generate_requests`` that also returns its ``ServeStats``: (results, stats)."""
  cfg = check_model(model, "generate_requests").cfg
  if cfg.arch != "decoder_only":
    raise GenerateInputError(f"generate_requests needs a decoder-only model, got arch={cfg.arch!r}")
  prompts, budgets = _check_requests(cfg, prompts, max_new_tokens)
  # The sizes as Python ints: NumPy scalars of a narrow type overflowed in the host
  # arithmetic below (np.int8(5) slots x 41 pages wrapped negative) until 2026-12-07.
  slots = positive_int("slots", slots)
  if cache == "paged":
    page_size = check_page_size(page_size, cfg.max_len)
  else:  # the other caches have no pages: one set of programs whatever page_size says
    if page_size is not None:  # (None too, as init_cache takes it)
      positive_int("page_size", page_size)  # (until 2026-12-07 each value compiled its own)
    page_size = 16
  if decode_chunk is None:  # the default fits every model (16 refused one of max_len 12
    decode_chunk = min(DECODE_CHUNK, cfg.max_len)  # until 2026-12-07)
  decode_chunk = positive_int("decode_chunk", decode_chunk)
  if decode_chunk > cfg.max_len:  # a static shape: 10**9 failed inside JAX, allocating
    raise GenerateInputError(f"decode_chunk={decode_chunk} is more than the model's max_len="
                             f"{cfg.max_len}: no request decodes that many steps")
  if on_result is not None and not callable(on_result):
    raise GenerateInputError(f"on_result must be a function on_result(index, tokens) or None, "
                             f"got {type(on_result).__name__}")
  if cache not in CACHE_KINDS:
    raise GenerateInputError(f"cache={cache!r} is not one of {', '.join(map(repr, CACHE_KINDS))}")
  if cache == "ring" and cfg.window is None:
    raise GenerateInputError("cache='ring' needs a sliding-window model (ModelConfig.window), got "
                             "window=None; use cache='paged' or 'contiguous'")
  paged = cache == "paged"
  if policy not in POLICIES:
    raise GenerateInputError(f"policy={policy!r} is not one of {', '.join(map(repr, POLICIES))}")
  if not isinstance(sampling, Sampling):
    raise GenerateInputError(f"sampling must be a Sampling, got {type(sampling).__name__}")
  stop_ids = check_stop_ids(eos_id, cfg.vocab_size)
  rng = as_key(rng)
  if num_pages is not None:
    if not paged:
      raise GenerateInputError(f"num_pages={num_pages} is for cache='paged', got cache={cache!r}")
    num_pages = positive_int("num_pages", num_pages)
  bucket = check_bucket(bucket)
  cache_dtype = check_cache_dtype(cache_dtype)
  n = len(prompts)
  # Positions a request needs: the last generated token is never fed back.
  need_pos = [len(p) + b - 1 for p, b in zip(prompts, budgets, strict=True)]
  errors = {}
  for i in range(n):
    if need_pos[i] > cfg.max_len:
      errors[i] = (f"prompt of {len(prompts[i])} tokens + max_new_tokens {budgets[i]} needs "
                   f"{need_pos[i]} positions, more than the model's max_len={cfg.max_len}")
  ok = [i for i in range(n) if i not in errors]
  # No more slots than requests that can run: a slot none can fill would only be allocated
  # (until 2026-12-06 slots=10**9 for one request failed inside JAX, allocating its cache).
  runnable = max(1, len(ok))
  max_pos = max([need_pos[i] for i in ok], default=1)
  if bucket:  # shapes shared by other calls' requests: their programs are these (until
    # 2026-12-07 each call with a new longest request or fewer requests compiled its own)
    runnable = 1 << (runnable - 1).bit_length()
    max_pos = bucket_length(max_pos, cfg.max_len)
  slots = min(slots, runnable)
  M = -(-max_pos // page_size)
  # More pages than every slot's longest request takes are never used (until 2026-12-06
  # num_pages=2**40 was allocated: an out-of-memory error inside JAX).
  P = slots * M if num_pages is None else min(num_pages, slots * M)
  # Pages a request is promised at admission (none for the per-slot caches).
  pages_of = {i: -(-need_pos[i] // page_size) if paged else 0 for i in ok}
  for i in ok:
    if pages_of[i] > P:
      errors[i] = (f"prompt of {len(prompts[i])} tokens + max_new_tokens {budgets[i]} needs "
                   f"{pages_of[i]} pages of {page_size}, more than the whole cache "
                   f"(num_pages={P})")
  ok = [i for i in ok if i not in errors]

  if sampling.greedy:
    sampling = GREEDY
  # Host scalars go to the programs as numpy values: a jnp scalar is a device
  # computation of its own, and these are passed every call.
  eos = stop_array(stop_ids)
  graphdef, state = nnx.split(eval_view(model))  # one set of programs for either mode
  graphdef = _interned(graphdef)  # hashed once per run, not per device call
  if paged:
    kv_cache = cache_lib.init_cache(cfg, "paged", slots, max_pos, page_size=page_size,
                                    num_pages=P, dtype=cache_dtype)
    alloc = PageAllocator.init(P)
  else:  # every slot holds the longest request
    kv_cache = cache_lib.init_cache(cfg, cache, slots, max_pos, dtype=cache_dtype)
    alloc = None
  slot_state = _SlotState(jnp.zeros((slots,), jnp.int32), jnp.zeros((slots,), bool),
                          jnp.zeros((slots,), jnp.int32), jax.random.split(rng, slots))
  results: list = [None] * n
  stats = ServeStats(slots=slots, cache_bytes=cache_lib.cache_bytes(kv_cache))
  waiting = collections.deque(ok)
  slot_req = [-1] * slots
  slot_tokens: list[list[int]] = [[] for _ in range(slots)]
  promised = 0  # pages promised to the running requests
  start = time.perf_counter()

  def finish(s):
    nonlocal promised
    i = slot_req[s]
    results[i] = np.asarray(slot_tokens[s], np.int32)
    stats.generated += len(slot_tokens[s])
    promised -= pages_of[i]
    slot_req[s] = -1
    slot_tokens[s] = []
    if on_result is not None:  # its own copy: a callback that edits it leaves the result
      on_result(i, results[i].copy())

  def cut(s, new):
    """(the slot's new tokens up to its request's end, whether the request ends there)."""
    i = slot_req[s]
    new = new[:budgets[i] - len(slot_tokens[s])]
    (at_eos,) = np.nonzero(np.isin(new, stop_ids))
    new = new[:at_eos[0] + 1] if at_eos.size else new
    return new, bool(at_eos.size) or len(slot_tokens[s]) + len(new) >= budgets[i]

  def take(s, new, done):
    slot_tokens[s].extend(new.tolist())
    if done:
      finish(s)

  while waiting or any(r >= 0 for r in slot_req):
    may_admit = policy == "continuous" or all(r < 0 for r in slot_req)
    # Until no free slot can take the next request: under "continuous" a slot freed by a
    # request that ended at its prefill (a budget of 1, eos first) takes the next one before
    # any decode call (until 2026-12-06 it stayed empty for a whole decode call); a static
    # batch is the next `slots` requests, whatever they do.
    s = 0
    while s < slots:
      if not (may_admit and waiting and slot_req[s] < 0):
        s += 1
        continue
      i = waiting[0]
      if promised + pages_of[i] > P:
        break  # first come, first served: wait for pages
      waiting.popleft()
      promised += pages_of[i]
      slot_req[s] = i
      T = bucket_length(len(prompts[i]), cfg.max_len)
      stats.buckets.add(T)
      stats.prefills += 1
      prompt_1T = np.zeros((1, T), np.int32)
      prompt_1T[0, :len(prompts[i])] = prompts[i]
      t0 = time.perf_counter()
      kv_cache, alloc, slot_state, first = _prefill(
          graphdef, state, kv_cache, alloc, slot_state, prompt_1T, np.int32(len(prompts[i])),
          np.int32(s), np.int32(budgets[i]), rng, np.int32(i), eos, sampling=sampling,
          page_size=page_size)
      first = np.asarray(first).reshape(1)
      stats.prefill_seconds += time.perf_counter() - t0
      take(s, *cut(s, first))
      if policy == "static":  # under "continuous" a slot this freed is offered again
        s += 1
    if not any(r >= 0 for r in slot_req):
      continue
    # Return early for a freed slot only if it can be refilled: under "static" no request
    # is admitted before every slot is free, and the loop stops by itself then.
    refill = bool(waiting) and policy == "continuous"
    t0 = time.perf_counter()
    kv_cache, alloc, slot_state, *out = _decode(
        graphdef, state, kv_cache, alloc, slot_state, eos, np.bool_(refill),
        steps=decode_chunk, sampling=sampling, page_size=page_size)
    out_BK, steps, live_steps = jax.device_get(out)  # one transfer
    stats.decode_seconds += time.perf_counter() - t0
    stats.decode_steps += int(steps)
    stats.decode_calls += 1
    stats.live_slot_steps += int(live_steps)
    if steps == 0:  # no slot live on the device, yet the host holds requests: never loop
      raise AssertionError(f"the decode program ran no step for requests "
                           f"{[i for i in slot_req if i >= 0]} that the host still runs")
    # Every live slot's tokens, the requests that completed in this call in the order they
    # completed (the step of their last token; slot order in a tie), so that on_result sees
    # them as they ended (until 2026-12-06 in slot order).
    cuts = {s: cut(s, out_BK[s, :steps]) for s in range(slots) if slot_req[s] >= 0}
    for s in sorted(cuts, key=lambda s: (len(cuts[s][0]) if cuts[s][1] else steps + 1, s)):
      take(s, *cuts[s])
  stats.seconds = time.perf_counter() - start
  if paged:
    stats.free_pages = np.asarray(alloc.free_P)[:int(alloc.num_free)]
    stats.page_table = np.asarray(kv_cache[0].self_attn.page_table_BM)
    if bool(alloc.exhausted):  # admission promises every page a request can need
      raise AssertionError("the page allocator ran dry despite admission control")
  if errors:
    raise UnservableRequests(errors, results)
  return results, stats


class _StaticGraph:
  """A graphdef as a ``jit`` static argument whose hash is computed once.

  Hashing an NNX graphdef walks the whole module tree (~1 ms for a small
  model on a 2-core machine), and ``jit`` hashes its static arguments on
  every call; ``_interned`` hands out one object per graph, so the cache
  lookup is a stored hash and an identity check.
  """

  __slots__ = ("graphdef", "_hash")

  def __init__(self, graphdef):
    self.graphdef = graphdef
    self._hash = hash(graphdef)

  def __hash__(self):
    return self._hash

  def __eq__(self, other):
    return self is other or (isinstance(other, _StaticGraph) and self._hash == other._hash
                             and self.graphdef == other.graphdef)


@functools.lru_cache(maxsize=16)
def _interned(graphdef) -> _StaticGraph:
  return _StaticGraph(graphdef)


def _request_key(rng, request):
  """The key request ``request`` draws all its tokens from: its token that is
  drawn while ``r`` tokens of its budget remain uses ``fold_in(key, r)``."""
  return jax.random.fold_in(rng, request)


def _draw(logits_BV, key_B, remaining_B, sampling):
  keys_B = None if sampling.greedy else jax.vmap(jax.random.fold_in)(key_B, remaining_B)
  return sample_rows(logits_BV, keys_B, sampling)


def _prefill_impl(graphdef, state, kv_cache, alloc, slot_state, prompt_1T, length, slot, budget,
                  rng, request, eos, *, sampling, page_size):
  """Prefill request ``request`` into ``slot``; returns (cache, alloc, slot_state, first token)."""
  model = _eval_model(graphdef.graphdef, state)
  T = prompt_1T.shape[1]
  key = _request_key(rng, request)
  draw = lambda logits_11V: _draw(logits_11V[:, 0], key[None], budget[None], sampling)[0]
  segment_ids_1T = (jnp.arange(T)[None, :] < length).astype(jnp.int32)
  if alloc is None:  # contiguous / ring: the slot's own row, emptied, then put back
    logits_11V, row = model(prompt_1T, segment_ids_BT=segment_ids_1T,
                            cache=cache_lib.take_row(kv_cache), logits_at_B=length[None] - 1)
    kv_cache = cache_lib.put_row(kv_cache, row, slot)
    token = draw(logits_11V)
    done = is_stop(token, eos) | (budget <= 1)
    return kv_cache, alloc, _start_slot(slot_state, slot, token, done, budget, key), token
  table_BM = kv_cache[0].self_attn.page_table_BM
  row_1M = jax.lax.dynamic_slice_in_dim(table_BM, slot, 1, axis=0)
  zero_1 = jnp.zeros((1,), jnp.int32)
  alloc, new_row_1M = alloc.allocate(row_1M, zero_1, length[None], page_size)
  kv_cache = cache_lib.zero_pages(kv_cache, new_pages(row_1M, new_row_1M).reshape(-1))
  row_1M = new_row_1M
  # A batch-1 view: the shared pages, this slot's table row.
  view = cache_lib.as_empty(cache_lib.set_page_table(kv_cache, row_1M, zero_1))
  logits_11V, view = model(prompt_1T, segment_ids_BT=segment_ids_1T, cache=view,
                           logits_at_B=length[None] - 1)
  token = draw(logits_11V)
  table_BM = jax.lax.dynamic_update_slice_in_dim(table_BM, row_1M, slot, axis=0)
  lengths_B = cache_lib.cache_lengths(kv_cache).at[slot].set(length)
  kv_cache = cache_lib.set_page_table(view, table_BM, lengths_B)
  done = is_stop(token, eos) | (budget <= 1)
  is_slot_B = jnp.arange(table_BM.shape[0]) == slot
  kv_cache, alloc = _release(kv_cache, alloc, is_slot_B & done)
  return kv_cache, alloc, _start_slot(slot_state, slot, token, done, budget, key), token


def _start_slot(slot_state, slot, token, done, budget, key):
  return _SlotState(slot_state.token_B.at[slot].set(token),
                    slot_state.active_B.at[slot].set(~done),
                    slot_state.remaining_B.at[slot].set(budget - 1),
                    slot_state.key_B.at[slot].set(key))


def _finish(kv_cache, alloc, finished_B):
  """Finished sequences of the paged cache give their pages back. A slot's own rows need
  nothing: its next prefill starts from a zeroed row (``kv_cache.take_row``)."""
  if alloc is None:
    return kv_cache, alloc
  return _release(kv_cache, alloc, finished_B)


def _decode_impl(graphdef, state, kv_cache, alloc, slot_state, eos, stop_on_finish, *, steps,
                 sampling, page_size):
  """Up to ``steps`` decode steps of every live slot.

  Stops early when no slot is live, or (``stop_on_finish``) after a step in
  which a slot finished. Returns (cache, alloc, slot_state, tokens [B, steps],
  steps run, live slot-steps).
  """
  model = _eval_model(graphdef.graphdef, state)
  pad_id = model.cfg.pad_id
  B = slot_state.token_B.shape[0]

  def cond(carry):
    i, st, *_, finished_any = carry
    return (i < steps) & jnp.any(st.active_B) & ~(stop_on_finish & finished_any)

  def body(carry):
    i, st, out_BK, kv_cache, alloc, live_steps, _ = carry
    live_B = st.active_B.astype(jnp.int32)
    if alloc is not None:
      kv_cache, alloc = _reserve(kv_cache, alloc, live_B, page_size, one_token=True)
    logits_B1V, kv_cache = model(st.token_B[:, None], segment_ids_BT=live_B[:, None],
                                 cache=kv_cache)
    sampled_B = _draw(logits_B1V[:, 0], st.key_B, st.remaining_B, sampling)
    next_B = jnp.where(st.active_B, sampled_B, pad_id)
    out_BK = out_BK.at[:, i].set(next_B)
    remaining_B = st.remaining_B - live_B
    finished_B = st.active_B & (is_stop(next_B, eos) | (remaining_B <= 0))
    kv_cache, alloc = _finish(kv_cache, alloc, finished_B)
    st = _SlotState(next_B, st.active_B & ~finished_B, remaining_B, st.key_B)
    return (i + 1, st, out_BK, kv_cache, alloc, live_steps + jnp.sum(live_B),
            jnp.any(finished_B))

  out_BK = jnp.full((B, steps), pad_id, jnp.int32)
  carry = (jnp.int32(0), slot_state, out_BK, kv_cache, alloc, jnp.int32(0), jnp.bool_(False))
  i, slot_state, out_BK, kv_cache, alloc, live_steps, _ = jax.lax.while_loop(cond, body, carry)
  return kv_cache, alloc, slot_state, out_BK, i, live_steps


# The two programs. Jitted here rather than decorated so that tools/mutation.sh reaches their
# bodies (mutmut leaves decorated functions alone).
_prefill = jax.jit(_prefill_impl, static_argnums=(0,), static_argnames=("sampling", "page_size"),
                   donate_argnames=("kv_cache",))
_decode = jax.jit(_decode_impl, static_argnums=(0,),
                  static_argnames=("steps", "sampling", "page_size"), donate_argnames=("kv_cache",))


def num_programs() -> dict[str, int]:
  """Compiled programs held by the jit caches of the two step functions."""
  return {"prefill": _prefill._cache_size(), "decode": _decode._cache_size()}


def pages_needed(prompt_len: int, max_new_tokens: int, page_size: int) -> int:
  """Pages a request holds at most: prompt + max_new_tokens - 1 positions."""
  return math.ceil((prompt_len + max_new_tokens - 1) / page_size)
