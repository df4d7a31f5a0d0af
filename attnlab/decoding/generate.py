"""Generation: prefill the prompt in one pass, then one token per step.

``generate`` checks its inputs in Python, then runs one jitted function:
prefill (the whole prompt through the model, K/V written to the cache) and a
``lax.while_loop`` whose body feeds the last token of every sequence, appends
its K/V, and picks the next token. The loop compiles once per shape and
static setting (``eos_id`` and ``bos_id`` are traced, so changing them does
not recompile; greedy ignores the sampling filters, so every greedy setting
shares one program) and ends early when every sequence has emitted ``eos_id``.

Prompts of a decoder-only model are RIGHT-padded with ``cfg.pad_id``: row b
holds its ``prompt_lengths_B[b]`` tokens at positions 0.. and padding after
them. Each sequence then continues at its own length, with exactly the
positions it would have if decoded alone; the padding is never cached.

An encoder-decoder takes the source (right-padded, with its lengths in
``prompt_lengths_B``; or, without them, padded anywhere with ``cfg.pad_id``,
which is masked); its source is encoded once, the cross-attention K/V are
cached, and the target starts from ``bos_id``. With ``beam_size`` either model
runs beam search (``beam_search``; each beam a row of the cache).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnlab.config import (
  CACHE_KINDS,
  DecodeConfig,
  is_integer,
  is_number,
  positive_count,
  seed_key,
)
from attnlab.decoding.beam import beam_search
from attnlab.decoding.paging import PageAllocator
from attnlab.decoding.sampling import Sampling, is_stop, sample
from attnlab.nn import kv_cache as cache_lib


class PagesExhaustedError(RuntimeError):
  """The paged cache ran out of pages: ``num_pages`` is too small for these sequences."""


class GenerateInputError(ValueError):
  """Bad arguments to ``generate`` (the prompt, the cache, the lengths, the beam).

  ``attnlab decode`` reports these as bad input (one line, exit 2); any other
  error out of ``generate`` is a bug and propagates with its traceback.
  """


class PromptTooLongError(GenerateInputError):
  """The prompt (or source) is too long for the model or the cache: an encoder-decoder's
  source longer than ``max_len``; a decoder-only batch whose longest prompt plus
  ``max_new_tokens - 1`` exceeds ``max_len`` or ``cache_len`` (the prompt and the budget
  share the positions; an encoder-decoder's budget alone is a plain GenerateInputError).

  A subclass, so that a caller holding several prompts (``attnlab decode
  --prompts_file``) can name the one that made the batch too wide.
  """


GREEDY = Sampling(temperature=0.0)
_DEFAULTS = DecodeConfig()  # the one home of the decoding defaults
MIN_BUCKET = 16


def bucket_length(n: int, max_len: int) -> int:
  """The prefill length bucket of an n-token prompt, capped at max_len: the least of
  16, 24, 32, 48, 64, 96, ... (powers of two and 1.5x them) that holds it.

  ``generate`` pads a prompt (or source) to its bucket and ``generate_requests`` each
  prefill, so prompts of many widths share a few compiled programs. A prompt over 16
  tokens is padded by less than half its length (powers of two alone pad by up to its
  length again): tools/bench_prefill_buckets.py measures the prefills of
  tools/bench_serve.py's prompts both ways (1.20x and 1.25x faster with these, paged and
  contiguous, 2026-12-01 on the 2-core AMD EPYC box), for up to twice the programs to
  compile.
  """
  p = max(MIN_BUCKET, 1 << (n - 1).bit_length())
  bucket = 3 * p // 4 if p > MIN_BUCKET and n <= 3 * p // 4 else p
  return min(bucket, max(max_len, n))


def _capacity(max_new_tokens: int, most: int) -> int:
  """The token buffer of a sampling program for ``max_new_tokens``: its bucket, as far as
  ``most`` allows (never less than ``max_new_tokens``)."""
  return max(max_new_tokens, min(bucket_length(max_new_tokens, most), most))


def _pad_width(array_BT, width: int, value: int):
  """``array_BT`` right-padded with ``value`` to ``width`` (>= its width) columns."""
  return np.pad(array_BT, ((0, 0), (0, width - array_BT.shape[1])), constant_values=value)


def generate(model, prompt_BT, *, max_new_tokens: int = _DEFAULTS.max_new_tokens,
             cache: str = _DEFAULTS.cache, sampling: Sampling = GREEDY, rng=None,
             prompt_lengths_B=None, eos_id: int | Sequence[int] | None = 2, bos_id: int = 1,
             beam_size: int | None = None, length_penalty: float = _DEFAULTS.length_penalty,
             page_size: int = _DEFAULTS.page_size, num_pages: int | None = _DEFAULTS.num_pages,
             cache_len: int | None = None, cache_dtype=None, bucket: bool = True):
  """Generate up to ``max_new_tokens`` tokens per sequence.

  Args:
    model: a ``DecoderOnly`` or ``EncoderDecoder``.
    prompt_BT: int [B, T]. Decoder-only: right-padded prompts. Encoder-decoder:
      the source (see ``prompt_lengths_B``).
    max_new_tokens: tokens generated per sequence at most.
    cache: "contiguous" | "ring" (needs ``cfg.window``) | "paged".
    sampling: ``Sampling(temperature, top_k, top_p)``; temperature 0 = greedy.
    rng: a ``jax.random.key`` (or its raw uint32 key data), or an int seed
      (``attnlab.config.seed_key(seed)``); the same key gives the same tokens.
    prompt_lengths_B: int [B] prompt lengths (decoder-only) or source lengths
      (encoder-decoder): the rows are right-padded and the first
      ``prompt_lengths_B[b]`` tokens of row b are its own, ``cfg.pad_id`` among
      them too (a tokenizer's real token may have that id). Default: a
      decoder-only prompt up to and including the last token that is not
      ``cfg.pad_id``; an encoder-decoder's source every token that is not
      ``cfg.pad_id``.
    eos_id: a sequence stops after emitting it (the rest of its row is
      ``cfg.pad_id``); a token id in [0, vocab_size), a sequence of up to
      ``MAX_STOP_IDS`` of them (a stop at any: Llama 3's ``<|end_of_text|>`` and
      ``<|eot_id|>``), or None = always ``max_new_tokens``.
    bos_id: first target token of an encoder-decoder (a decoder-only model's prompt holds
      its own: checked as a token id or None, read nowhere).
    beam_size: runs beam search of that width (an encoder-decoder's from
      ``bos_id``, a decoder-only model's from each prompt; without an eos a
      beam of 1 is greedy); None samples with ``sampling``.
    length_penalty: GNMT alpha for beam search (a finite number >= 0): a
      finished hypothesis scores log P / ((5 + length) / 6)^alpha; None is the default.
      Another value than the default without ``beam_size`` is refused (it would do nothing).
    page_size, num_pages: C and P of the paged cache. P defaults to enough
      for every sequence at full length, and a larger P allocates only that many
      (more are never used); with fewer, pages freed by finished sequences are
      reused, and running out raises ``RuntimeError``.
    cache_len: capacity of a contiguous / paged cache per sequence; default
      the prompt width + max_new_tokens - 1 (the last token is never fed back).
    cache_dtype: dtype of the cached K/V ("float32", "bfloat16", "float16",
      "int8"); None = the model's compute dtype. "int8" stores K/V quantized
      with one float32 scale per token and KV head (every cache kind).
    bucket: pad the prompt (an encoder-decoder's source) to its length bucket
      (``bucket_length``; a decoder-only prompt as far as the cache has room) and, without
      beam search, size the token buffer and the default cache for the bucket of
      ``max_new_tokens`` (the loop still stops at it), so that calls with prompts of many
      widths and many budgets share a compiled program. False keeps the shapes given: for
      a caller whose calls are all of one shape (evaluation, a benchmark), which the
      padding only slows.

  Returns:
    int32 [B, max_new_tokens]: the generated tokens (eos included).
  """
  cfg = check_model(model, "generate").cfg
  try:
    prompt_BT = np.asarray(prompt_BT)
  except ValueError:  # numpy's "inhomogeneous shape" (a plain ValueError until 2026-12-06)
    try:
      why = f"its rows have lengths {[len(row) for row in prompt_BT]}"
    except TypeError:
      why = "its rows are not all sequences of one length"
    raise GenerateInputError(
        f"prompt_BT is not a [B, T] array ({why}): give one, rows right-padded with pad_id="
        f"{cfg.pad_id} (attnlab.generate_requests takes a list of prompts of any lengths)"
    ) from None
  max_new_tokens = _check_prompt(cfg, prompt_BT, max_new_tokens)
  # Token ids (checked within the vocabulary) as int32 whatever the caller's dtype: a uint16
  # or uint8 prompt compiled a program of its own until 2026-12-07.
  prompt_BT = prompt_BT.astype(np.int32, copy=False)
  model = eval_view(model)
  rng = as_key(rng)
  if cache not in CACHE_KINDS:
    raise GenerateInputError(
        f"cache={cache!r} is not one of {', '.join(map(repr, CACHE_KINDS))}")
  if cache == "ring" and cfg.window is None:
    # beam search takes no paged cache: offering it there sent the user to a second refusal
    # (until 2026-12-06)
    other = "cache='contiguous'" if beam_size is not None else "cache='contiguous' or 'paged'"
    raise GenerateInputError("cache='ring' needs a sliding-window model (ModelConfig.window), got "
                             f"window=None; use {other}")
  if beam_size is not None:
    beam_size = positive_int("beam_size", beam_size)
    most = (2**31 - 1) // cfg.vocab_size
    if beam_size > most:  # JAX's top_k refused the int32 overflow, naming no argument
      raise GenerateInputError(
          f"beam_size={beam_size} times the vocabulary ({cfg.vocab_size}) is more candidates "
          f"than a step can rank (2**31 - 1, int32 indices): give beam_size <= {most}")
  if not isinstance(sampling, Sampling):
    raise GenerateInputError(f"sampling must be a Sampling, got {type(sampling).__name__}")
  if cache == "paged":
    page_size = check_page_size(page_size, cfg.max_len)
  else:  # the other caches have no pages: one program whatever page_size says (None too)
    if page_size is not None:
      positive_int("page_size", page_size)
    page_size = _DEFAULTS.page_size
  if cache_len is not None:
    if cache == "ring":
      raise GenerateInputError(f"cache_len={cache_len!r} is for cache='contiguous' or 'paged'; "
                               "a ring holds the model's window")
    cache_len = positive_int("cache_len", cache_len)
  if num_pages is not None:
    if cache != "paged":
      raise GenerateInputError(f"num_pages={num_pages} is for cache='paged', got cache={cache!r}")
    # As an int: a NumPy uint8 reached PageAllocator.init and overflowed there (until
    # 2026-12-07).
    num_pages = positive_int("num_pages", num_pages)
  bucket = check_bucket(bucket)
  B, T = prompt_BT.shape
  if beam_size is not None and sampling != GREEDY:
    raise GenerateInputError(f"beam search (beam_size={beam_size}) is deterministic: sampling="
                             f"{sampling} is not used with it; give one or the other")
  # Arguments that would do nothing are refused, as `attnlab decode` refuses its flags (until
  # 2026-12-07 both were ignored without a word, unchecked).
  length_penalty = length_penalty_for(beam_size, length_penalty)
  if cfg.arch == "decoder_only" and bos_id is not None:
    check_token_id("bos_id", bos_id, cfg.vocab_size)  # read nowhere: the prompt holds its bos
  if sampling.greedy:
    sampling = GREEDY  # (Sampling refuses filters at temperature 0): one program for all
  # Traced, not static, and of one width: new stop ids do not recompile.
  eos = jnp.asarray(stop_array(check_stop_ids(eos_id, cfg.vocab_size)))
  cache_dtype = check_cache_dtype(cache_dtype)
  static = dict(max_new_tokens=max_new_tokens, kind=cache, page_size=page_size,
                cache_dtype=None if cache_dtype is None else str(cache_dtype))

  if cfg.arch == "encoder_decoder":
    src_seg_BS = _source_segment_ids(cfg, prompt_BT, prompt_lengths_B)
    if prompt_BT.shape[1] > cfg.max_len:
      # Padding past the last source token takes no position: where it alone would not
      # fit, it is cut, as a decoder-only prompt's (refused until 2026-12-04).
      used = int(np.flatnonzero(src_seg_BS.any(0))[-1]) + 1
      if used > cfg.max_len:
        raise PromptTooLongError(f"the source has {used} positions, more than the model's "
                                 f"max_len={cfg.max_len}")
      prompt_BT, src_seg_BS = prompt_BT[:, :used], src_seg_BS[:, :used]
    if bucket:  # sources of many widths share a program (padding is segment 0)
      width = bucket_length(prompt_BT.shape[1], cfg.max_len)
      prompt_BT = _pad_width(prompt_BT, width, cfg.pad_id)
      src_seg_BS = _pad_width(src_seg_BS, width, 0)
    bos_id = check_token_id("bos_id", bos_id, cfg.vocab_size)
    # Budgets of many sizes share a program: its buffer (and default cache) is their bucket.
    capacity = (_capacity(max_new_tokens, cfg.max_len) if bucket and beam_size is None
                else max_new_tokens)
    cache_len = _check_cache_len(cfg, cache_len, max_new_tokens, "max_new_tokens",
                                 GenerateInputError, default=capacity)
    static["max_new_tokens"] = capacity
    num_pages = _num_pages(cache, num_pages, B, cache_len, page_size)
    if beam_size is not None:
      length_penalty = _check_beam(cache, length_penalty, max_new_tokens)
      return _beam_encoder_decoder(model, jnp.asarray(prompt_BT), jnp.asarray(src_seg_BS), eos,
                                   jnp.int32(bos_id),
                                   beam_size=beam_size, length_penalty=np.float32(length_penalty),
                                   cache_len=cache_len, **static)
    tokens_BT, exhausted = _sample_encoder_decoder(
        model, jnp.asarray(prompt_BT), jnp.asarray(src_seg_BS), rng, eos, jnp.int32(bos_id),
        sampling=sampling, budget=jnp.int32(max_new_tokens),
        cache_len=cache_len, num_pages=num_pages, **static)
  else:
    lengths_B = _prompt_lengths(cfg, prompt_BT, prompt_lengths_B)
    # The last generated token is never fed back, so it needs no cache slot. Padding past
    # the longest prompt takes no position: where it alone would not fit, it is cut.
    room = cfg.max_len if cache_len is None else min(cfg.max_len, cache_len)
    if T + max_new_tokens - 1 > room and int(lengths_B.max()) < T:
      T = int(lengths_B.max())
      prompt_BT = prompt_BT[:, :T]
    if bucket:  # where the cache has room: prompts of many widths share a program
      # (each row's own length is passed; padding past it takes no position)
      T = max(T, min(bucket_length(T, cfg.max_len), room - (max_new_tokens - 1)))
      prompt_BT = _pad_width(prompt_BT, T, cfg.pad_id)
    # Budgets of many sizes share a program, room allowing (as for the encoder-decoder).
    capacity = (_capacity(max_new_tokens, room - T + 1) if bucket and beam_size is None
                else max_new_tokens)
    cache_len = _check_cache_len(cfg, cache_len, T + max_new_tokens - 1,
                                 "the prompt plus max_new_tokens", PromptTooLongError,
                                 default=T + capacity - 1)
    static["max_new_tokens"] = capacity
    num_pages = _num_pages(cache, num_pages, B, cache_len, page_size)
    if beam_size is not None:
      length_penalty = _check_beam(cache, length_penalty, max_new_tokens)
      return _beam_decoder_only(model, jnp.asarray(prompt_BT), jnp.asarray(lengths_B), eos,
                                beam_size=beam_size, length_penalty=np.float32(length_penalty),
                                cache_len=cache_len, **static)
    tokens_BT, exhausted = _sample_decoder_only(
        model, jnp.asarray(prompt_BT), jnp.asarray(lengths_B), rng, eos,
        sampling=sampling, budget=jnp.int32(max_new_tokens), cache_len=cache_len,
        num_pages=num_pages, **static)
  if bool(exhausted):
    raise PagesExhaustedError(
        f"the paged cache ran out of pages (num_pages={num_pages}, page_size={page_size}); "
        "pass a larger num_pages or fewer / shorter sequences")
  return tokens_BT if tokens_BT.shape[1] == max_new_tokens else tokens_BT[:, :max_new_tokens]


# ----------------------------------------------------------------------------
# Input checks (concrete, before anything is traced).
# ----------------------------------------------------------------------------


def check_cache_dtype(cache_dtype):
  """``kv_cache.check_cache_dtype``, its refusal raised as a GenerateInputError."""
  try:
    return cache_lib.check_cache_dtype(cache_dtype)
  except ValueError as e:
    raise GenerateInputError(str(e)) from None


def positive_int(name, value) -> int:
  """``value`` as an int; a GenerateInputError unless it is a positive integer (not a bool):
  ``config.check_positive``'s rule and message. A concrete 0-d integer array counts as its
  number (``generate``'s ``max_new_tokens=jnp.int32(3)`` was refused until 2026-12-07, as
  "Array(3) must be a positive integer", while ``generate_requests`` took it):
  ``config.positive_count``, the caches' and the allocator's reading of a size."""
  try:
    return positive_count(name, value)
  except ValueError as e:
    raise GenerateInputError(str(e)) from None


def check_bucket(bucket) -> bool:
  """``bucket`` of ``generate`` / ``generate_requests``: True or False (a NumPy bool too)."""
  if not isinstance(bucket, bool | np.bool_):
    raise GenerateInputError(f"bucket={bucket!r} must be True or False")
  return bool(bucket)


def check_page_size(page_size, max_len: int) -> int:
  """``page_size`` as an int; a GenerateInputError unless it is a positive integer of at
  most the smallest power of two >= ``max_len`` (the model's; 16 at least, the default and
  the GPU kernel's smallest page). A longer page is never filled; until 2026-12-06 a huge
  one allocated that many slots per sequence (an OverflowError from inside JAX past 2**31)."""
  page_size = positive_int("page_size", page_size)
  most = max(16, 1 << (max_len - 1).bit_length())
  if page_size > most:
    raise GenerateInputError(
        f"page_size={page_size} is more than {most}: the model's max_len={max_len} never fills "
        f"such a page; give at most {most} (the smallest power of two >= max_len, 16 at least)")
  return page_size


# The stop ids a decode program takes: up to this many, padded with -1 (no token), so that
# one compiled program serves one eos or several.
MAX_STOP_IDS = 8


def check_stop_ids(eos_id, vocab_size) -> tuple[int, ...]:
  """``eos_id`` as the token ids a sequence stops at: None -> (), one id -> (id,), a
  non-empty list / tuple / 1-D array of at most ``MAX_STOP_IDS`` ids; each in
  [0, vocab_size). A GenerateInputError otherwise."""
  if isinstance(eos_id, list | tuple | np.ndarray | jax.Array) and np.ndim(eos_id) == 1:
    values = list(eos_id) if isinstance(eos_id, list | tuple) else np.asarray(eos_id).tolist()
    ids = [check_token_id(f"eos_id[{i}]", v, vocab_size) for i, v in enumerate(values)]
    if not 1 <= len(ids) <= MAX_STOP_IDS:
      raise GenerateInputError(f"eos_id holds {len(ids)} ids; give 1 to {MAX_STOP_IDS} (or one "
                               "int, or None for no eos)")
    return tuple(dict.fromkeys(ids))
  eos_id = check_token_id("eos_id", eos_id, vocab_size, none_means="no eos")
  return () if eos_id is None else (eos_id,)


def stop_array(ids: tuple[int, ...]) -> np.ndarray:
  """int32 [MAX_STOP_IDS]: ``ids`` padded with -1, which matches no token."""
  return np.array(list(ids) + [-1] * (MAX_STOP_IDS - len(ids)), np.int32)


def _scalar_int(value):
  """A concrete 0-d integer array (``np.array(2)``, ``jnp.int32(2)``) as a Python int; any
  other value as it is (until 2026-12-04 such an eos or seed was refused as "not an
  integer")."""
  if (isinstance(value, np.ndarray | jax.Array) and not isinstance(value, jax.core.Tracer)
      and value.shape == () and jnp.issubdtype(value.dtype, jnp.integer)):
    return int(value)
  return value


def check_token_id(name, value, vocab_size, *, none_means: str | None = None) -> int | None:
  """``value`` as an int; a GenerateInputError unless it is a token id in [0, vocab_size)
  (or None, where ``none_means`` says what None does)."""
  if value is None and none_means is not None:
    return None
  value = _scalar_int(value)
  or_none = "" if none_means is None else f", or None ({none_means})"
  if not is_integer(value):
    raise GenerateInputError(f"{name}={value!r} must be an integer token id in "
                             f"[0, {vocab_size}){or_none}")
  if not 0 <= value < vocab_size:
    raise GenerateInputError(f"{name}={value!r} is outside the vocabulary [0, {vocab_size})"
                             + or_none)
  return int(value)


def check_model(model, caller: str):
  """``model``; a GenerateInputError unless it is a ``DecoderOnly`` or ``EncoderDecoder`` (an
  AttributeError on ``model.cfg`` until 2026-12-07: ``load_checkpoint``'s (model, cfg) pair
  given whole, say)."""
  # By the classes' names and module, not the class objects: a notebook's reload of
  # attnlab.nn.transformer makes new classes, of which the models built before are no
  # instances (a subclass of either is a model too).
  if not any(c.__module__ == "attnlab.nn.transformer"
             and c.__name__ in ("DecoderOnly", "EncoderDecoder") for c in type(model).__mro__):
    pair = (" (load_checkpoint returns (model, cfg): give its first item)"
            if isinstance(model, tuple) else "")
    raise GenerateInputError(
        f"{caller} needs a model (a DecoderOnly or EncoderDecoder: build_model(cfg, rngs=...) "
        f"or load_checkpoint(workdir)[0]), got {type(model).__name__}{pair}")
  return model


def length_penalty_for(beam_size, length_penalty):
  """``length_penalty`` as a decode with ``beam_size`` uses it: None is the default; another
  value than the default (in float32) without a beam a GenerateInputError (it would do
  nothing). ``generate`` and ``evaluate_workdir`` read it so."""
  if length_penalty is None:  # the default (a wrapper's "unset")
    return _DEFAULTS.length_penalty
  if beam_size is None and not _same_number(length_penalty, _DEFAULTS.length_penalty):
    raise GenerateInputError(f"length_penalty={length_penalty!r} is the beam search's: give "
                             "beam_size too")
  return length_penalty


def _same_number(value, number: float) -> bool:
  """Whether ``value`` (a Python or NumPy number, or a concrete 0-d array) is ``number`` in
  float32, the precision it is used in (``np.float32(0.6)`` is the default 0.6)."""
  value = _scalar_float(value)
  return is_number(value) and np.float32(value) == np.float32(number)


def _scalar_float(value):
  """A concrete 0-d real array (``jnp.float32(0.6)``) as a Python float; any other value as
  it is (``jnp`` scalars were refused as length penalties until 2026-12-07, NumPy's taken)."""
  if (isinstance(value, np.ndarray | jax.Array) and not isinstance(value, jax.core.Tracer)
      and value.shape == () and (jnp.issubdtype(value.dtype, jnp.floating)
                                 or jnp.issubdtype(value.dtype, jnp.integer))):
    return float(value)
  return value


def _check_prompt(cfg, prompt_BT, max_new_tokens) -> int:
  """Checks the prompt; returns max_new_tokens as an int."""
  max_new_tokens = positive_int("max_new_tokens", max_new_tokens)
  if prompt_BT.ndim != 2 or not np.issubdtype(prompt_BT.dtype, np.integer):
    raise GenerateInputError(f"prompt must be an int array [B, T], got dtype {prompt_BT.dtype} and "
                             f"shape {prompt_BT.shape}")
  if prompt_BT.shape[0] == 0 or prompt_BT.shape[1] == 0:
    raise GenerateInputError(
        f"the prompt is empty (shape {prompt_BT.shape}): give at least one token")
  bad = (prompt_BT < 0) | (prompt_BT >= cfg.vocab_size)
  if bad.any():
    b, t = np.argwhere(bad)[0]
    raise GenerateInputError(f"token id {int(prompt_BT[b, t])} at [{b}, {t}] is outside the "
                             f"vocabulary [0, {cfg.vocab_size})")
  return max_new_tokens


MAX_LP_FACTOR = 2.0**64  # the largest length-penalty factor (a divisor of the scores)


def _check_beam(cache, length_penalty, max_new_tokens) -> float:
  """``length_penalty`` (a number) checked for a beam search of ``max_new_tokens``."""
  # an alpha of inf or nan: scores 0 or nan; a string: a TypeError from the comparison
  length_penalty = _scalar_float(length_penalty)
  if not is_number(length_penalty) or not 0 <= length_penalty < float("inf"):
    raise GenerateInputError(f"length_penalty={length_penalty!r} must be a finite number >= 0")
  # GNMT's ((5 + n) / 6) ** alpha for the longest output divides the scores (log P <= 0) in
  # float32, where a quotient below the smallest normal number is flushed to 0: past an
  # overflow every finished score was -0 and the first to finish won (until 2026-12-06), and
  # a factor near 1e38 already flushes any score. At most 2**64 (MAX_LP_FACTOR), a score
  # stays itself for every |log P| >= 2**64 x 1.2e-38 = 2e-19. The bound printed is rounded
  # down, so it is accepted.
  if max_new_tokens > 1:
    most = math.log(MAX_LP_FACTOR) / math.log((5 + max_new_tokens) / 6) * (1 - 1e-9)
    if length_penalty > most:
      raise GenerateInputError(
          f"length_penalty={length_penalty!r} makes the penalty ((5 + n) / 6) ** alpha of an "
          f"output of {max_new_tokens} tokens larger than 2**64, past which float32 scores "
          f"underflow: give at most {math.floor(most * 1000) / 1000}")
  if cache == "paged":
    raise GenerateInputError("beam search reorders whole cache rows: use cache='contiguous' or "
                             "'ring' with beam_size")
  return length_penalty


def _source_segment_ids(cfg, src_BS, lengths_B):
  """int32 [B, S]: 1 on an encoder-decoder's source tokens, 0 on its padding.

  With ``lengths_B`` the source is right-padded and row b's first ``lengths_B[b]``
  positions are its tokens (``cfg.pad_id`` among them too: a tokenizer's real token
  may have that id, as the training batches allow); without, every token that is
  not ``cfg.pad_id``.
  """
  if lengths_B is None:
    real_BS = src_BS != cfg.pad_id
    if not real_BS.any(axis=1).all():
      raise GenerateInputError(f"source {int(np.argmin(real_BS.any(axis=1)))} is empty (all "
                               f"padding, pad_id={cfg.pad_id}): give at least one token")
  else:
    lengths_B = _prompt_lengths(cfg, src_BS, lengths_B, what="source")
    real_BS = np.arange(src_BS.shape[1])[None, :] < lengths_B[:, None]
  return real_BS.astype(np.int32)


def _prompt_lengths(cfg, prompt_BT, prompt_lengths_B, what="prompt"):
  B, T = prompt_BT.shape
  if prompt_lengths_B is None:
    real_BT = prompt_BT != cfg.pad_id
    lengths_B = np.where(real_BT.any(1), T - np.argmax(real_BT[:, ::-1], axis=1), 0)
  else:
    lengths_B = np.asarray(prompt_lengths_B)
    if lengths_B.shape != (B,) or not np.issubdtype(lengths_B.dtype, np.integer):
      raise GenerateInputError(f"prompt_lengths_B (shape {lengths_B.shape}, dtype "
                               f"{lengths_B.dtype}) must be integers [B] = ({B},)")
    if (lengths_B > T).any():
      raise GenerateInputError(
          f"prompt_lengths_B={lengths_B.tolist()} exceeds the prompt width T={T}")
  if (lengths_B < 1).any():
    b = int(np.argmax(lengths_B < 1))
    why = (f"all padding, pad_id={cfg.pad_id}" if prompt_lengths_B is None else
           f"prompt_lengths_B[{b}]={int(lengths_B[b])}")
    raise GenerateInputError(f"{what} {b} is empty ({why}): give at least one token")
  return lengths_B.astype(np.int32)


def _check_cache_len(cfg, cache_len, needed, what, error, *, default):
  """``cache_len`` checked against the ``needed`` slots; ``default`` (>= needed, <= max_len
  once needed fits) where it is None."""
  if needed > cfg.max_len:
    raise error(f"{what} needs {needed} positions, more than the model's max_len={cfg.max_len}")
  if cache_len is None:
    return default
  if needed > cache_len:
    raise error(f"{what} needs {needed} cache slots, more than cache_len={cache_len}")
  # No position past max_len is ever written: a longer cache_len holds max_len slots
  # (init_cache refuses more since 2026-12-04).
  return min(cache_len, cfg.max_len)


def _num_pages(kind, num_pages, rows, cache_len, page_size):
  """P of a paged cache: ``num_pages``, at most the pages every row at ``cache_len`` takes
  (the default). More are never used: until 2026-12-06 ``num_pages=2**40`` failed inside
  JAX (an int32 overflow; 2**31 - 1 allocating terabytes)."""
  if kind != "paged":
    return None
  most = rows * -(-cache_len // page_size)
  return most if num_pages is None else min(num_pages, most)


# ----------------------------------------------------------------------------
# The jitted loops.
# ----------------------------------------------------------------------------


def as_key(rng):
  """A typed ``jax.random`` key: ``rng`` as given, raw uint32 key data wrapped, an int seed
  as ``attnlab.config.seed_key(seed)`` (``jax.random.key(seed)`` with all 64 bits kept),
  key(0) if None; a GenerateInputError for anything else."""
  if rng is None:
    return jax.random.key(0)
  rng = _scalar_int(rng)
  if is_integer(rng):
    if not -2**63 <= int(rng) < 2**63:  # jax.random.key's range (an OverflowError past it)
      raise GenerateInputError(f"rng={rng!r}: an integer seed must be in [-2**63, 2**63)")
    return seed_key(rng)
  if isinstance(rng, jax.Array | np.ndarray):
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
      if rng.shape != ():
        raise GenerateInputError(f"rng must be one key (shape ()), got a key array of shape "
                                 f"{rng.shape}: give one key; a call draws every row from it")
      return rng
    if rng.dtype == np.uint32:
      want = jax.random.key_data(jax.random.key(0)).shape
      if rng.shape != want:
        raise GenerateInputError(f"rng (uint32 key data of shape {rng.shape}) must be one "
                                 f"key's data, of shape {want}")
      return jax.random.wrap_key_data(jnp.asarray(rng))
  what = (f"rng (an array of dtype {rng.dtype})" if isinstance(rng, jax.Array | np.ndarray)
          else f"rng={rng!r}")
  raise GenerateInputError(f"{what} must be a jax.random.key (or its uint32 key data), an "
                           "integer seed or None")


@functools.lru_cache(maxsize=32)
def _eval_structure(treedef):
  """The pytree structure of a model of structure ``treedef`` put in eval mode (its
  leaves do not matter: placeholders)."""
  copy = jax.tree.unflatten(treedef, [0] * treedef.num_leaves)
  copy.eval()
  return jax.tree.structure(copy)


def eval_view(model):
  """``model`` in eval mode: itself when it is, else a module of the same arrays in eval
  mode (the caller's model keeps its mode). A module's mode (its ``deterministic`` flags)
  is part of its pytree structure, so of a jitted program's cache key: until 2026-12-07 a
  model in train mode (as ``build_model`` makes one) and one in eval mode (as
  ``load_checkpoint`` returns) each compiled their own decoding programs, which compute
  the same thing (decoding sets eval mode inside the trace). ~0.2-0.4 ms a call."""
  leaves, treedef = jax.tree.flatten(model)
  structure = _eval_structure(treedef)
  return model if structure == treedef else jax.tree.unflatten(structure, leaves)


def _in_eval_mode(model):
  """The traced copy of the model that a jitted function received, without dropout.

  ``generate`` hands the model itself to ``jax.jit`` (an NNX module is a pytree,
  flattened by jax; ``nnx.split`` on every call walked the module graph in Python:
  tools/bench_generate_call.py). Inside the trace the
  module is a copy rebuilt from its leaves, so setting its eval mode leaves the
  caller's model as it was.
  """
  model.eval()  # no dropout while decoding
  return model


def _eval_model(graphdef, state):
  """``_in_eval_mode`` of the model merged from ``nnx.split``'s parts (inside a trace)."""
  return _in_eval_mode(nnx.merge(graphdef, state))


def _sampling_loop(forward, cache, alloc, first_logits_BV, rng, *, max_new_tokens, eos_id,
                   sampling, page_size, pad_id, budget=None):
  """Sample the first token from ``first_logits_BV``, then step until done.

  ``forward(tokens_BT, segment_ids_BT, cache) -> (logits_BTV, cache)``; ``eos_id``
  is the traced ``stop_array`` of the stop ids; ``budget`` (traced, at most
  ``max_new_tokens``; default ``max_new_tokens``) the tokens to make: the rest of the
  buffer stays ``pad_id``.
  Returns (tokens [B, max_new_tokens], exhausted).
  """
  budget = max_new_tokens if budget is None else budget
  B = first_logits_BV.shape[0]
  paged = alloc is not None

  def draw(logits_BV, rng):
    # Greedy never reads the key: no threefry in the program, which is
    # expensive for XLA:CPU to compile (~0.5 s per split on a 2-core machine).
    if sampling.greedy:
      return sample(logits_BV, None, sampling), rng
    rng, sub = jax.random.split(rng)
    return sample(logits_BV, sub, sampling), rng

  token_B, rng = draw(first_logits_BV, rng)
  out_BJ = jnp.full((B, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(token_B)
  done_B = is_stop(token_B, eos_id)
  if paged:
    cache, alloc = _release(cache, alloc, done_B)

  def cond(carry):
    step, _, done_B, *_ = carry
    return (step < budget) & ~jnp.all(done_B)

  def body(carry):
    step, token_B, done_B, out_BJ, cache, alloc, rng = carry
    live_B = (~done_B).astype(jnp.int32)
    if paged:
      cache, alloc = _reserve(cache, alloc, live_B, page_size, one_token=True)
    logits_BTV, cache = forward(token_B[:, None], live_B[:, None], cache)
    sampled_B, rng = draw(logits_BTV[:, 0], rng)
    next_B = jnp.where(done_B, pad_id, sampled_B)
    out_BJ = out_BJ.at[:, step].set(next_B)
    finished_B = ~done_B & is_stop(next_B, eos_id)
    if paged:
      cache, alloc = _release(cache, alloc, finished_B)
    return step + 1, next_B, done_B | finished_B, out_BJ, cache, alloc, rng

  carry = (jnp.int32(1), token_B, done_B, out_BJ, cache, alloc, rng)
  _, _, _, out_BJ, _, alloc, _ = jax.lax.while_loop(cond, body, carry)
  return out_BJ, (alloc.exhausted if paged else jnp.bool_(False))


def _reserve(cache, alloc, num_new_B, page_size, *, fresh=False, one_token=False):
  """Pages for ``num_new_B`` more tokens per sequence, in every layer's table, zeroed
  (``kv_cache.zero_pages``: a page that a finished sequence gave back holds its values).

  ``fresh``: the pool is still all zeros (the prefill of a new cache): nothing to clear.
  ``one_token``: ``num_new_B`` is at most 1 (a decode step), so a sequence gets at most one
  page: one page per sequence is cleared, not the whole table's worth.
  """
  old_BM = cache[0].self_attn.page_table_BM
  alloc, table_BM = alloc.allocate(old_BM, cache_lib.cache_lengths(cache), num_new_B, page_size)
  cache = cache_lib.set_page_table(cache, table_BM)
  if not fresh:
    new_BM = new_pages(old_BM, table_BM)  # -1 where no page is new
    pages = jnp.max(new_BM, axis=1) if one_token else new_BM.reshape(-1)
    cache = cache_lib.zero_pages(cache, pages)
  return cache, alloc


def new_pages(old_BM, new_BM):
  """int32 [B, M]: the page ids ``new_BM`` assigns that ``old_BM`` did not (-1 elsewhere)."""
  return jnp.where((old_BM < 0) & (new_BM >= 0), new_BM, -1)


def _release(cache, alloc, finished_B):
  """Return the pages of finished sequences to the free list."""
  alloc, table_BM = alloc.free(cache[0].self_attn.page_table_BM, finished_B)
  lengths_B = jnp.where(finished_B, 0, cache_lib.cache_lengths(cache))
  return cache_lib.set_page_table(cache, table_BM, lengths_B), alloc


def _new_cache(cfg, kind, batch, cache_len, page_size, num_pages, cache_dtype=None):
  cache = cache_lib.init_cache(cfg, kind, batch, cache_len, page_size=page_size,
                               num_pages=num_pages, dtype=cache_dtype)
  alloc = PageAllocator.init(num_pages) if kind == "paged" else None
  return cache, alloc


def _prefill(model, prompt_BT, lengths_B, cache):
  """The whole prompt through a decoder-only model in one pass, its K/V into ``cache``
  (padding, t >= length, is not cached): (the last prompt token's logits [B, V], cache)."""
  cache = cache_lib.as_empty(cache)  # the prefill attends over the prompt alone
  T = prompt_BT.shape[1]
  segment_ids_BT = (jnp.arange(T)[None, :] < lengths_B[:, None]).astype(jnp.int32)
  logits_B1V, cache = model(prompt_BT, segment_ids_BT=segment_ids_BT, cache=cache,
                            logits_at_B=lengths_B - 1)  # the last prompt token's only
  return logits_B1V[:, 0], cache


def _sample_decoder_only_impl(model, prompt_BT, lengths_B, rng, eos_id, *, max_new_tokens,
                              kind, page_size, sampling, cache_len, num_pages, cache_dtype,
                              budget=None):
  model = _in_eval_mode(model)
  cfg = model.cfg
  B = prompt_BT.shape[0]
  cache, alloc = _new_cache(cfg, kind, B, cache_len, page_size, num_pages, cache_dtype)
  if alloc is not None:
    cache, alloc = _reserve(cache, alloc, lengths_B, page_size, fresh=True)
  last_BV, cache = _prefill(model, prompt_BT, lengths_B, cache)
  forward = lambda tokens_BT, seg_BT, cache: model(tokens_BT, segment_ids_BT=seg_BT, cache=cache)
  return _sampling_loop(forward, cache, alloc, last_BV, rng, max_new_tokens=max_new_tokens,
                        eos_id=eos_id, sampling=sampling, page_size=page_size, pad_id=cfg.pad_id,
                        budget=budget)


def _beam_decoder_only_impl(model, prompt_BT, lengths_B, eos_id, *, max_new_tokens, kind,
                            page_size, beam_size, length_penalty, cache_len, cache_dtype):
  model = _in_eval_mode(model)
  cfg = model.cfg
  B, Z = prompt_BT.shape[0], beam_size
  # The prompts are prefilled once, as greedy decoding prefills them; then every row of
  # the cache is copied for each beam (rows X = b * Z + z), and the first tokens are
  # chosen from the last prompt token's logits.
  cache, _ = _new_cache(cfg, kind, B, cache_len, page_size, None, cache_dtype)
  last_BV, cache = _prefill(model, prompt_BT, lengths_B, cache)
  cache = jax.tree.map(lambda x: jnp.repeat(x, Z, axis=0), cache)
  log_probs = lambda logits_XV: jax.nn.log_softmax(logits_XV.astype(jnp.float32), axis=-1)

  def step_fn(tokens_X, cache):
    logits_X1V, cache = model(tokens_X[:, None], cache=cache)
    return log_probs(logits_X1V[:, 0]), cache

  return beam_search(step_fn, cache, batch=B, beam_size=Z, max_len=max_new_tokens,
                     first_log_probs_XV=log_probs(jnp.repeat(last_BV, Z, axis=0)),
                     eos_id=eos_id, length_penalty=length_penalty, pad_id=cfg.pad_id)


def _decoder_forward(model):
  def forward(tokens_BT, seg_BT, cache):
    return model.decode(tokens_BT, None, src_segment_ids_BS=None, tgt_segment_ids_BT=seg_BT,
                        cache=cache)

  return forward


def _sample_encoder_decoder_impl(model, src_BS, src_seg_BS, rng, eos_id, bos_id, *,
                                 max_new_tokens, kind, page_size, sampling, cache_len, num_pages,
                                 cache_dtype, budget=None):
  model = _in_eval_mode(model)
  cfg = model.cfg
  B = src_BS.shape[0]
  cache, alloc = _new_cache(cfg, kind, B, cache_len, page_size, num_pages, cache_dtype)
  # The source is encoded once.
  cache = cache_lib.with_cross(cache, model.cross_cache(src_BS, src_segment_ids_BS=src_seg_BS))
  forward = _decoder_forward(model)
  ones_B1 = jnp.ones((B, 1), jnp.int32)
  if alloc is not None:
    cache, alloc = _reserve(cache, alloc, ones_B1[:, 0], page_size, fresh=True)
  # The bos step as a prefill (over an emptied cache): it attends to its own K/V as computed,
  # not as rounded to a bfloat16 or int8 cache, as the uncached forward pass does.
  logits_B1V, cache = forward(jnp.broadcast_to(bos_id, (B, 1)), ones_B1,
                              cache_lib.as_empty(cache))
  return _sampling_loop(forward, cache, alloc, logits_B1V[:, 0], rng,
                        max_new_tokens=max_new_tokens, eos_id=eos_id, sampling=sampling,
                        page_size=page_size, pad_id=cfg.pad_id, budget=budget)


def _beam_encoder_decoder_impl(model, src_BS, src_seg_BS, eos_id, bos_id, *, max_new_tokens,
                               kind, page_size, beam_size, length_penalty, cache_len,
                               cache_dtype):
  model = _in_eval_mode(model)
  cfg = model.cfg
  B, Z = src_BS.shape[0], beam_size
  cross_B = model.cross_cache(src_BS, src_segment_ids_BS=src_seg_BS)
  forward = _decoder_forward(model)
  log_probs = lambda logits_XV: jax.nn.log_softmax(logits_XV.astype(jnp.float32), axis=-1)
  without_cross = lambda cache: tuple(block.replace(cross_attn=None) for block in cache)
  # The bos step once per source, as a prefill (as greedy decoding runs it: its own K/V as
  # computed, not rounded to the cache dtype); then every row is copied for each beam.
  cache, _ = _new_cache(cfg, kind, B, cache_len, page_size, None, cache_dtype)
  logits_B1V, cache = forward(jnp.full((B, 1), bos_id, jnp.int32), jnp.ones((B, 1), jnp.int32),
                              cache_lib.as_empty(cache_lib.with_cross(cache, cross_B)))
  # Beams are rows X = b * Z + z; every beam of a source shares its cross K/V.
  repeat = lambda tree: jax.tree.map(lambda x: jnp.repeat(x, Z, axis=0), tree)
  cross, cache = repeat(cross_B), repeat(without_cross(cache))

  def step_fn(tokens_X, self_cache):
    # The cross K/V stay out of the beam state: reordering beams of one source
    # would only shuffle identical copies.
    logits_X1V, cache = forward(tokens_X[:, None], None, cache_lib.with_cross(self_cache, cross))
    return log_probs(logits_X1V[:, 0]), without_cross(cache)

  return beam_search(step_fn, cache, batch=B, beam_size=Z, max_len=max_new_tokens,
                     first_log_probs_XV=log_probs(jnp.repeat(logits_B1V[:, 0], Z, axis=0)),
                     eos_id=eos_id, length_penalty=length_penalty, pad_id=cfg.pad_id)


# The compiled programs. Jitted here rather than decorated so that tools/mutation.sh reaches
# their bodies (mutmut leaves decorated functions alone).
_CACHE_ARGS = ("max_new_tokens", "kind", "page_size", "cache_len", "cache_dtype")
_sample_decoder_only = jax.jit(_sample_decoder_only_impl,
                               static_argnames=_CACHE_ARGS + ("sampling", "num_pages"))
_sample_encoder_decoder = jax.jit(_sample_encoder_decoder_impl,
                                  static_argnames=_CACHE_ARGS + ("sampling", "num_pages"))
# length_penalty is traced (until 2026-12-07 static: each alpha compiled its own search).
_beam_encoder_decoder = jax.jit(_beam_encoder_decoder_impl,
                                static_argnames=_CACHE_ARGS + ("beam_size",))
_beam_decoder_only = jax.jit(_beam_decoder_only_impl, static_argnames=_CACHE_ARGS + ("beam_size",))
