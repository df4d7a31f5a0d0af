"""``attnlab decode`` and ``attnlab kv-size``.

``attnlab decode --workdir DIR (--prompt TEXT | --prompts_file F) [...]``
restores a training checkpoint (``attnlab.load_checkpoint``) and prints one
completion per prompt. ``attnlab kv-size --layers L --seq S --kv_heads K
--head_dim H --dtype D [--batch B]`` prints the K/V cache size
2 * B * L * S * K * H * bytes (32 layers, 8192 tokens, 8 KV heads, head dim
128, bfloat16 -> "1.00 GiB").
"""

from __future__ import annotations

import argparse
import sys

from attnlab.cli import CommandError

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1, "int8": 1}


class _Parser(argparse.ArgumentParser):
  """argparse that raises ``CommandError`` (one line, exit 2) instead of exiting."""

  def error(self, message):
    raise CommandError(message)


def format_bytes(n: float) -> str:
  """Binary units with two decimals: 1073741824 -> "1.00 GiB"."""
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if n < 1024 or unit == "TiB":
      return f"{n:.0f} B" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  raise AssertionError("unreachable")


def kv_cache_bytes(*, layers: int, seq: int, kv_heads: int, head_dim: int, dtype: str,
                   batch: int = 1) -> int:
  """Bytes of a K/V cache: 2 (K and V) * B * L * S * K * H * itemsize; int8 adds its
  float32 scale per token and KV head: 2 * B * L * S * K * (H + 4)."""
  if dtype == "int8":
    return 2 * batch * layers * seq * kv_heads * (head_dim + 4)
  return 2 * batch * layers * seq * kv_heads * head_dim * ITEMSIZE[dtype]


def kv_size_main(argv: list[str]) -> int:
  p = _Parser(prog="attnlab kv-size", description="K/V cache size of a model shape.")
  for name in ("layers", "seq", "kv_heads", "head_dim"):
    p.add_argument(f"--{name}", type=int, required=True)
  p.add_argument("--dtype", choices=sorted(ITEMSIZE), default="bfloat16")
  p.add_argument("--batch", type=int, default=1)
  args = p.parse_args(argv)
  for name in ("layers", "seq", "kv_heads", "head_dim", "batch"):
    if getattr(args, name) < 1:
      raise CommandError(f"--{name}={getattr(args, name)} must be a positive integer")
  total = kv_cache_bytes(layers=args.layers, seq=args.seq, kv_heads=args.kv_heads,
                         head_dim=args.head_dim, dtype=args.dtype, batch=args.batch)
  per_token = total // (args.batch * args.seq)
  print(f"{format_bytes(total)} ({total} bytes; {per_token} bytes per token; "
        f"batch {args.batch} x {args.seq} tokens)")
  return 0


def _decode_parser():
  p = _Parser(prog="attnlab decode", description="Generate from a training checkpoint.")
  p.add_argument("--workdir", required=True, help="training workdir (config.gin + checkpoints)")
  p.add_argument("--step", type=int, default=None, help="checkpoint step; default the latest")
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--prompt", help="one prompt (the source of an encoder-decoder)")
  src.add_argument("--prompts_file", help="a file with one prompt per line")
  p.add_argument("--cache", default=None,
                 help="contiguous | ring | paged (default: paged with --slots, else contiguous)")
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--top_k", type=int, default=None)
  p.add_argument("--top_p", type=float, default=None)
  p.add_argument("--beam_size", type=int, default=1)
  p.add_argument("--length_penalty", type=float, default=0.6)
  p.add_argument("--max_new_tokens", type=int, default=64)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--cache_dtype", default=None,
                 help="cached K/V dtype: float32 | bfloat16 | float16 | int8 (per-token, "
                 "per-KV-head float32 scales); default the model's dtype")
  p.add_argument("--slots", type=int, default=None,
                 help="continuous batching over the paged cache with this many slots "
                 "(attnlab.generate_requests); results print as they complete")
  p.add_argument("--page_size", type=int, default=16, help="page size of the paged cache")
  p.add_argument("--num_pages", type=int, default=None, help="pages of the paged cache")
  return p


def _serve(args, dcfg, model, prompts, ids, tokenizer):
  """``--slots``: continuous batching; prints "index<TAB>prompt<TAB>completion" as each
  request completes, a progress bar and tokens/s on stderr."""
  import time

  import jax

  from attnlab.data.tokenizer import EOS_ID
  from attnlab.decoding import batching
  from attnlab.decoding.sampling import Sampling

  n = len(prompts)
  done = [0, 0]  # requests, tokens
  start = time.perf_counter()

  def on_result(i, tokens):
    done[0] += 1
    done[1] += len(tokens)
    print(f"{i}\t{prompts[i]}\t{tokenizer.decode(tokens)}", flush=True)
    rate = done[1] / max(time.perf_counter() - start, 1e-9)
    bar = "#" * (20 * done[0] // n)
    sys.stderr.write(f"\r[{bar:<20}] {done[0]}/{n} requests, {done[1]} tokens, {rate:.1f} tok/s")
    sys.stderr.flush()

  try:
    batching.generate_requests(
        model, ids, dcfg.max_new_tokens, slots=args.slots, page_size=args.page_size,
        num_pages=args.num_pages, cache_dtype=args.cache_dtype, eos_id=EOS_ID,
        rng=jax.random.key(dcfg.seed),
        sampling=Sampling(temperature=dcfg.temperature, top_k=dcfg.top_k, top_p=dcfg.top_p),
        on_result=on_result)
  except batching.UnservableRequests as e:
    sys.stderr.write("\n")
    print(f"attnlab decode: {e}", file=sys.stderr)
    return 1
  except ValueError as e:
    raise CommandError(str(e)) from None
  sys.stderr.write("\n")
  return 0


def decode_main(argv: list[str]) -> int:
  args = _decode_parser().parse_args(argv)
  from attnlab.config import DecodeConfig

  if args.cache is None:
    args.cache = "paged" if args.slots is not None else "contiguous"
  from attnlab.nn.kv_cache import CACHE_DTYPES

  if args.cache_dtype is not None and args.cache_dtype not in CACHE_DTYPES:
    raise CommandError(f"--cache_dtype={args.cache_dtype} is not one of {', '.join(CACHE_DTYPES)}")
  for name in ("slots", "page_size", "num_pages"):
    value = getattr(args, name)
    if value is not None and value < 1:
      raise CommandError(f"--{name}={value} must be a positive integer")

  try:
    dcfg = DecodeConfig(max_new_tokens=args.max_new_tokens, cache=args.cache,
                        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        beam_size=args.beam_size, length_penalty=args.length_penalty,
                        seed=args.seed)
  except ValueError as e:
    raise CommandError(str(e)) from None
  prompts = _read_prompts(args)

  import jax
  import numpy as np

  import attnlab
  from attnlab.data.tokenizer import BOS_ID, EOS_ID
  from attnlab.decoding.sampling import Sampling

  try:
    model, cfg = attnlab.load_checkpoint(args.workdir, step=args.step)
  except (FileNotFoundError, ValueError) as e:
    raise CommandError(str(e)) from None
  tokenizer = _tokenizer(args.workdir)
  ids = [tokenizer.encode(p) for p in prompts]
  if args.slots is not None:
    if cfg.arch != "decoder_only" or dcfg.beam_size > 1 or dcfg.cache != "paged":
      raise CommandError(f"--slots={args.slots} needs a decoder-only checkpoint, --cache paged "
                         "and no beam search")
    return _serve(args, dcfg, model, prompts, ids, tokenizer)
  width = max(len(x) for x in ids)
  prompt_BT = np.full((len(ids), max(width, 1)), cfg.pad_id, np.int32)
  for b, x in enumerate(ids):
    prompt_BT[b, : len(x)] = x
  lengths_B = np.array([len(x) for x in ids], np.int32)
  kwargs = dict(max_new_tokens=dcfg.max_new_tokens, cache=dcfg.cache, eos_id=EOS_ID,
                cache_dtype=args.cache_dtype,
                bos_id=BOS_ID, rng=jax.random.key(dcfg.seed),
                sampling=Sampling(temperature=dcfg.temperature, top_k=dcfg.top_k,
                                  top_p=dcfg.top_p))
  if cfg.arch == "encoder_decoder":
    if dcfg.beam_size > 1:
      kwargs.update(beam_size=dcfg.beam_size, length_penalty=dcfg.length_penalty)
  else:
    if dcfg.beam_size > 1:
      raise CommandError(f"--beam_size={dcfg.beam_size} needs an encoder-decoder checkpoint; "
                         f"{args.workdir} holds a decoder-only model")
    if (lengths_B == 0).any():
      raise CommandError(f"prompt {int(np.argmax(lengths_B == 0)) + 1} is empty")
    kwargs.update(prompt_lengths_B=lengths_B)
  try:
    out_BL = np.asarray(attnlab.generate(model, prompt_BT, **kwargs))
  except (ValueError, RuntimeError) as e:
    raise CommandError(str(e)) from None
  for prompt, row in zip(prompts, out_BL):
    text = tokenizer.decode(row)
    print(text if len(prompts) == 1 else f"{prompt}\t{text}")
  sys.stdout.flush()
  return 0


def _read_prompts(args) -> list[str]:
  if args.prompt is not None:
    prompts = [args.prompt]
  else:
    try:
      with open(args.prompts_file, encoding="utf-8") as f:
        prompts = [line.rstrip("\n") for line in f if line.strip()]
    except OSError as e:
      raise CommandError(f"cannot read --prompts_file: {e}") from None
    if not prompts:
      raise CommandError(f"--prompts_file {args.prompts_file} holds no prompt")
  if any(p == "" for p in prompts):
    raise CommandError("the prompt is empty: give at least one character")
  return prompts


def _tokenizer(workdir: str):
  """The tokenizer the run trained with (byte-level unless config.gin says otherwise)."""
  import os

  from attnlab.data.tokenizer import make_tokenizer
  from attnlab.training import gin_config

  _, data_cfg, _ = gin_config.read_workdir_config(os.path.join(workdir, "config.gin"))
  return make_tokenizer(data_cfg.tokenizer, data_cfg.tokenizer_model)
