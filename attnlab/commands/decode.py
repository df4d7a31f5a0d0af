"""``attnlab decode``: generate from a training checkpoint.

``attnlab decode --workdir DIR (--prompt TEXT | --prompts_file F) [...]``
restores a training checkpoint (``attnlab.load_checkpoint``) and prints one
completion per prompt. Every flag's default is the ``DecodeConfig`` field of
the same name (attnlab/config.py), the one place decoding defaults live.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import numpy as np

from attnlab import config_gin
from attnlab.commands._common import (
  CommandError,
  CommandParser,
  check_workdir_given,
  log_attnlab_info,
  mesh_shape_flag,
  out_of_memory,
)
from attnlab.config import CACHE_DTYPES, CACHE_KINDS, DecodeConfig, is_integer, seed_key
from attnlab.data import pipeline
from attnlab.data.text import utf8_text
from attnlab.data.tokenizer import make_tokenizer
from attnlab.decoding import batching
from attnlab.decoding.generate import (
  MAX_STOP_IDS,
  GenerateInputError,
  PagesExhaustedError,
  PromptTooLongError,
  generate,
)
from attnlab.decoding.sampling import Sampling
from attnlab.extras import MissingDependencyError
from attnlab.training import sharding
from attnlab.training.checkpoint import load_checkpoint


def _decode_parser():
  d = DecodeConfig()
  p = CommandParser(prog="attnlab decode", description="Generate from a training checkpoint.")
  p.add_argument("--workdir", required=True, help="training workdir (config.gin + checkpoints)")
  p.add_argument("--step", type=int, default=None, help="checkpoint step; default the latest")
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--prompt", help="one prompt (the source of an encoder-decoder)")
  src.add_argument("--prompts_file", help="a file with one prompt per line (- reads standard "
                   "input)")
  p.add_argument("--cache", default=None,
                 help=f"{' | '.join(CACHE_KINDS)} (default: paged with --slots, else {d.cache})")
  p.add_argument("--temperature", type=float, default=d.temperature,
                 help=f"0 is greedy; > 0 samples (default {d.temperature})")
  p.add_argument("--top_k", type=int, default=d.top_k,
                 help="sample among the k most likely tokens (needs --temperature > 0; "
                 "default: all)")
  p.add_argument("--top_p", type=float, default=d.top_p,
                 help="sample from the smallest set reaching probability p, in (0, 1] (needs "
                 "--temperature > 0; default: all)")
  p.add_argument("--beam_size", type=int, default=d.beam_size,
                 help=f"beam search of this width, 2 or more (default {d.beam_size}: none; 1 "
                 "decodes greedily)")
  p.add_argument("--length_penalty", type=float, default=None,
                 help=f"alpha of beam search's GNMT length penalty, >= 0 (default "
                 f"{d.length_penalty}; needs --beam_size > 1)")
  p.add_argument("--max_new_tokens", type=int, default=d.max_new_tokens,
                 help=f"tokens generated per prompt at most (default {d.max_new_tokens})")
  p.add_argument("--seed", type=int, default=d.seed,
                 help=f"the sampling seed (default {d.seed})")
  p.add_argument("--cache_dtype", default=None,
                 help=f"cached K/V dtype: {' | '.join(CACHE_DTYPES)} (int8: per-token, "
                 "per-KV-head float32 scales); default the model's dtype")
  p.add_argument("--slots", type=int, default=None,
                 help="continuous batching with this many slots (attnlab.generate_requests; "
                 "--cache paged by default, or contiguous / ring); results print as they "
                 "complete; default: off, one generate call")
  p.add_argument("--page_size", type=int, default=None,
                 help=f"token positions per page of the paged cache (default {d.page_size})")
  p.add_argument("--num_pages", type=int, default=d.num_pages,
                 help="pages of the paged cache (default: enough for every sequence)")
  p.add_argument("--mesh_shape", default=None,
                 help="decode on a (data, fsdp, tensor) device mesh, e.g. 1,1,2: the parameters "
                 "restored in the training layout, the cache's KV heads over tensor (one -1 "
                 "takes the remaining devices); default one device. CPU: more devices with "
                 "XLA_FLAGS=--xla_force_host_platform_device_count=N")
  return p


def _mesh(text: str | None):
  """``--mesh_shape``'s Mesh, None without the flag."""
  shape = mesh_shape_flag(text)
  if shape is None:
    return None
  try:
    return sharding.make_mesh(shape)
  except ValueError as e:
    raise CommandError(f"--mesh_shape: {e}") from None


# Backslash, tab, and every character Python's str.splitlines() breaks a line at, as
# Python writes them in a string literal.
_TSV_ESCAPES = str.maketrans({
    "\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r", "\v": "\\v", "\f": "\\f",
    "\x1c": "\\x1c", "\x1d": "\\x1d", "\x1e": "\\x1e", "\x85": "\\x85",
    "\u2028": "\\u2028", "\u2029": "\\u2029"})


def tsv_field(text: str) -> str:
  r"""``text`` as one field of a tab-separated line: backslash, tab, newline and carriage
  return written as ``\\``, ``\t``, ``\n``, ``\r`` (a completion of source code holds them),
  and the other characters ``str.splitlines`` breaks at as ``\v``, ``\f``, ``\x1c``,
  ``\x1d``, ``\x1e``, ``\x85``, ``\u2028``, ``\u2029``: a line of output is one result
  for any line reader."""
  return text.translate(_TSV_ESCAPES)


def printable(text: str) -> str:
  r"""``text`` as stdout can write it: a character its encoding has no bytes for (a C or
  latin-1 locale without UTF-8, ``PYTHONIOENCODING=ascii``) as a Python escape (``\xe9``,
  ``\u2713``), the rest as it is. Until 2026-12-07 decode printed a completion or prompt
  holding one as a UnicodeEncodeError traceback, exit 1, after decoding (with ``--slots``,
  mid-way through the results)."""
  encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
  try:
    text.encode(encoding)
  except UnicodeEncodeError:
    return text.encode(encoding, "backslashreplace").decode(encoding)
  except LookupError:  # a stream naming no codec Python has: it will say so itself
    pass
  return text


def stop_ids(workdir: str, eos_id: int | None, vocab_size: int) -> int | list[int] | None:
  """The ids decoding stops at: the tokenizer's eos, then the ``eos_token_id`` ids of the
  workdir's ``generation_config.json`` (an HF import brings it: Llama 3 lists
  ``<|eot_id|>`` there beside ``<|end_of_text|>``; until 2026-12-04 decode stopped at the
  first alone), those inside the vocabulary, at most ``MAX_STOP_IDS``: one int, a list of
  several, or None for none (``generate``'s ``eos_id``)."""
  ids = [] if eos_id is None else [int(eos_id)]
  path = os.path.join(workdir, config_gin.GENERATION_CONFIG)
  if os.path.isfile(path):
    try:
      with open(path, encoding="utf-8") as f:
        gen = json.load(f)
    except (OSError, ValueError) as e:
      raise CommandError(f"{path} is not readable JSON ({e})") from None
    extra = gen.get("eos_token_id") if isinstance(gen, dict) else None
    for i in extra if isinstance(extra, list) else [extra]:
      if is_integer(i) and 0 <= i < vocab_size and int(i) not in ids:
        ids.append(int(i))
  if len(ids) > MAX_STOP_IDS:  # dropped without a word until 2026-12-06
    source = path if eos_id is None else f"the tokenizer's eos and {path}"
    logging.getLogger(__name__).warning(
        "%s give %d stop ids; decoding stops at the first %d only (%s), not at %s", source,
        len(ids), MAX_STOP_IDS, ids[:MAX_STOP_IDS], ids[MAX_STOP_IDS:])
  ids = ids[:MAX_STOP_IDS]
  return None if not ids else ids[0] if len(ids) == 1 else ids


def _serve(args, dcfg, model, prompts, ids, tokenizer, line_of, stops) -> int:
  """``--slots``: continuous batching; prints "index<TAB>prompt<TAB>completion" (the
  prompt's index among the file's prompts, from 0; both texts ``tsv_field``-escaped) as
  each request completes, and on stderr the progress with tokens/s: a bar rewritten in
  place on a terminal; in a log file (no TTY) a plain line at every tenth of the requests."""
  n = len(prompts)
  done = [0, 0]  # requests, tokens
  start = time.perf_counter()
  tty = sys.stderr.isatty()

  def on_result(i, tokens):
    done[0] += 1
    done[1] += len(tokens)
    if len(tokens) and stops is not None and np.isin(tokens[-1], stops):
      tokens = tokens[:-1]  # as without --slots: the text stops before eos, whatever the
                            # tokenizer's decode does with it (a tokenizer.json may show it)
    if tty and done[0] > 1:  # the bar's line cleared first: on a terminal the result was
      sys.stderr.write("\r\x1b[K")  # printed after it on its line until 2026-12-06
      sys.stderr.flush()
    print(printable(f"{i}\t{tsv_field(prompts[i])}\t{tsv_field(tokenizer.decode(tokens))}"),
          flush=True)
    rate = done[1] / max(time.perf_counter() - start, 1e-9)
    counts = f"{done[0]}/{n} requests, {done[1]} tokens, {rate:.1f} tok/s"
    if tty:
      bar = "#" * (20 * done[0] // n)
      sys.stderr.write(f"\r[{bar:<20}] {counts}")
    elif 10 * done[0] // n > 10 * (done[0] - 1) // n:  # crossed a tenth (every one: n <= 10)
      sys.stderr.write(f"attnlab decode: {counts}\n")
    sys.stderr.flush()

  try:
    batching.generate_requests(
        model, ids, dcfg.max_new_tokens, slots=args.slots, cache=dcfg.cache,
        page_size=dcfg.page_size,
        num_pages=dcfg.num_pages, cache_dtype=args.cache_dtype, eos_id=stops,
        rng=seed_key(dcfg.seed),
        sampling=Sampling(temperature=dcfg.temperature, top_k=dcfg.top_k, top_p=dcfg.top_p),
        on_result=on_result, bucket=False)  # one call: its cache sized exactly
  except batching.UnservableRequests as e:
    if tty and done[0]:  # end the bar's line (none is drawn before a first result)
      sys.stderr.write("\n")
    # Named by their lines in the file, as without --slots (the request index skips blank
    # lines: until 2026-12-04 "request 1" could be line 3).
    why = "; ".join(f"{line_of(i)} (request {i}): {text}" for i, text in sorted(e.errors.items()))
    print(f"attnlab decode: {len(e.errors)} request(s) can never be served ({why}); the other "
          f"{sum(r is not None for r in e.results)} completed", file=sys.stderr)
    return 1
  except GenerateInputError as e:  # checked before any request runs: no bar to end
    raise CommandError(str(e)) from None
  except Exception as e:  # a traceback until 2026-12-06
    oom = out_of_memory(e)
    if oom is None:
      raise
    raise CommandError(f"out of memory serving the requests ({oom}): give fewer --slots, a "
                       "smaller --num_pages or --max_new_tokens") from None
  if tty:
    sys.stderr.write("\n")
  return 0


def main(argv: list[str]) -> int:
  args = _decode_parser().parse_args(argv)
  log_attnlab_info()
  if args.cache is None:
    args.cache = "paged" if args.slots is not None else DecodeConfig().cache
  if args.cache_dtype is not None and args.cache_dtype not in CACHE_DTYPES:
    raise CommandError(f"--cache_dtype={args.cache_dtype} is not one of {', '.join(CACHE_DTYPES)}")
  if args.slots is not None and args.slots < 1:
    raise CommandError(f"--slots={args.slots} must be a positive integer")
  # Flags that would do nothing are refused, as eval refuses them (ignored until 2026-12-04).
  if args.length_penalty is None:
    args.length_penalty = DecodeConfig.length_penalty
  elif args.beam_size == 1:  # "give --beam_size too" when --beam_size 1 was given (12-06)
    raise CommandError(f"--length_penalty is the beam search's: give --beam_size 2 or more "
                       f"(--beam_size {args.beam_size} decodes greedily)")
  if args.page_size is None:
    args.page_size = DecodeConfig.page_size
  elif args.cache != "paged":
    raise CommandError(f"--page_size is the paged cache's, got --cache {args.cache}")
  try:
    dcfg = DecodeConfig(max_new_tokens=args.max_new_tokens, cache=args.cache,
                        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        beam_size=args.beam_size, length_penalty=args.length_penalty,
                        seed=args.seed, page_size=args.page_size, num_pages=args.num_pages)
  except ValueError as e:
    raise CommandError(str(e)) from None
  check_workdir_given(args.workdir)
  prompts, line_of = _read_prompts(args)
  mesh = _mesh(args.mesh_shape)

  try:
    model, cfg = load_checkpoint(args.workdir, step=args.step, mesh=mesh)
  except (FileNotFoundError, ValueError) as e:
    raise CommandError(str(e)) from None
  try:
    data_cfg = _data_config(args.workdir)
    tokenizer = _make_tokenizer(data_cfg)
  except (MissingDependencyError, ValueError, ImportError) as e:
    raise CommandError(str(e)) from None
  ids = [pipeline.prompt_ids(tokenizer, p, cfg.arch, data_cfg.task) for p in prompts]
  stops = stop_ids(args.workdir, tokenizer.eos_id, cfg.vocab_size)
  if args.slots is not None:
    if cfg.arch != "decoder_only" or dcfg.beam_size > 1:
      raise CommandError(f"--slots={args.slots} needs a decoder-only checkpoint and no beam "
                         "search")
    return _serve(args, dcfg, model, prompts, ids, tokenizer, line_of, stops)
  width = max(len(x) for x in ids)
  prompt_BT = np.full((len(ids), max(width, 1)), cfg.pad_id, np.int32)
  for b, x in enumerate(ids):
    prompt_BT[b, : len(x)] = x
  lengths_B = np.array([len(x) for x in ids], np.int32)
  # The special ids are the tokenizer's, whatever DecodeConfig says. An hf_json
  # tokenizer may have no bos (decoder-only models never use it).
  bos_id = 1 if tokenizer.bos_id is None else tokenizer.bos_id
  kwargs = dict(max_new_tokens=dcfg.max_new_tokens, cache=dcfg.cache, eos_id=stops,
                bos_id=bos_id, cache_dtype=args.cache_dtype, page_size=dcfg.page_size,
                num_pages=dcfg.num_pages, bucket=False,  # one call: no program to share
                rng=seed_key(dcfg.seed),
                sampling=Sampling(temperature=dcfg.temperature, top_k=dcfg.top_k,
                                  top_p=dcfg.top_p))
  if dcfg.beam_size > 1:
    kwargs.update(beam_size=dcfg.beam_size, length_penalty=dcfg.length_penalty)
  if (lengths_B == 0).any():
    raise CommandError(f"{line_of(int(np.argmax(lengths_B == 0)))} is empty")
  # Prompt (or source) lengths: a token with the pad id inside a prompt is a token.
  kwargs.update(prompt_lengths_B=lengths_B)
  try:
    out_BJ = np.asarray(generate(model, prompt_BT, **kwargs))
  except (GenerateInputError, PagesExhaustedError) as e:  # input errors (--num_pages too
    message = str(e)                                      # small); a bug keeps its traceback
    if args.prompts_file is not None and isinstance(e, PromptTooLongError):  # also of one
      i = int(np.argmax(lengths_B))  # the batch is as wide as its longest prompt
      message += (f" (the longest is {line_of(i)}, {lengths_B[i]} tokens: "
                  f"{prompts[i][:40]!r})")
    raise CommandError(message) from None
  except Exception as e:  # a traceback until 2026-12-06
    oom = out_of_memory(e)
    if oom is None:
      raise
    raise CommandError(
        f"out of memory decoding {len(prompts)} prompt(s) at once ({oom}): decode fewer at a "
        "time (--slots N serves them N at a time), with a narrower --beam_size or a smaller "
        "--max_new_tokens") from None
  for prompt, row in zip(prompts, out_BJ):
    # Cut before the first stop id: after it the row is pad_id, which may be a real token
    # of the tokenizer.
    (at,) = np.nonzero(np.isin(row, [] if stops is None else stops))
    row = row[:at[0]] if at.size else row
    text = tokenizer.decode(row)
    # --prompt: the text as it is; a prompts file (even of one prompt):
    # "prompt<TAB>completion", one escaped line each.
    print(printable(text if args.prompt is not None
                    else f"{tsv_field(prompt)}\t{tsv_field(text)}"))
  sys.stdout.flush()
  return 0


def _read_prompts(args):
  """The prompts, and a function naming prompt i where it came from ("line N of FILE": blank
  lines are skipped, so prompt i need not be line i + 1)."""
  if args.prompt is not None:
    prompt = args.prompt
    try:
      prompt.encode("utf-8")
    except UnicodeEncodeError:  # bytes the locale's codec could not decode, kept as
      try:  # surrogates: UTF-8 under a C locale without UTF-8 mode is read as it was typed
        prompt = os.fsencode(prompt).decode("utf-8")  # (refused as "not UTF-8" until
      except UnicodeError:                           # 2026-12-07)
        raise CommandError("--prompt is not UTF-8 text (it holds bytes that decode to no "
                           "character)") from None
    prompts, line_of = [prompt], lambda i: "the prompt"
  else:
    # "-": standard input (`... | attnlab decode --prompts_file -`; until 2026-12-07 "No such
    # file or directory: '-'").
    stdin = args.prompts_file == "-"
    name = "- (standard input)" if stdin else args.prompts_file
    try:
      if stdin:
        data = _read_stdin()
      else:
        with open(args.prompts_file, "rb") as f:
          data = f.read()
    except (OSError, ValueError) as e:  # ValueError: a standard input closed in the process
      raise CommandError(f"cannot read --prompts_file: {e}") from None
    try:
      # A byte order mark (Windows editors write one) is not text of the prompt; the bad
      # byte is named by its offset in the file (until 2026-12-06 counted after the mark,
      # and from the start of the 8 KiB chunk a line reader was in).
      text = utf8_text(data)
    except UnicodeDecodeError as e:
      raise CommandError(f"--prompts_file {name} is not UTF-8 text ({e.reason} at "
                         f"byte {e.start})") from None
    numbered = [(n, line) for n, line in enumerate(text.split("\n"), 1) if line.strip()]
    if not numbered:
      raise CommandError(f"--prompts_file {name} holds no prompt")
    prompts = [p for _, p in numbered]
    where = "standard input" if stdin else args.prompts_file
    line_of = lambda i: f"line {numbered[i][0]} of {where}"
  if any(p == "" for p in prompts):
    raise CommandError("the prompt is empty: give at least one character")
  return prompts, line_of


def _read_stdin() -> bytes:
  """The bytes of standard input (``--prompts_file -``): its binary buffer where it has one,
  else its text as UTF-8 (a notebook's stand-in stream)."""
  if sys.stdin is None:
    raise CommandError("--prompts_file -: this process has no standard input")
  buffer = getattr(sys.stdin, "buffer", None)
  return buffer.read() if buffer is not None else sys.stdin.read().encode("utf-8")


def _data_config(workdir: str):
  return config_gin.read_workdir_config(os.path.join(workdir, "config.gin"))[1]


def _tokenizer(workdir: str):
  """The tokenizer the run trained with (byte-level unless config.gin says otherwise)."""
  return _make_tokenizer(_data_config(workdir))


def _make_tokenizer(data_cfg):
  return make_tokenizer(data_cfg.tokenizer, data_cfg.tokenizer_model, bos_id=data_cfg.bos_id,
                        eos_id=data_cfg.eos_id)
