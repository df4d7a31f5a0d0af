"""``attnlab kv-size``: the K/V cache size of a model shape.

``attnlab kv-size --layers L --seq S --kv_heads K --head_dim H --dtype D
[--batch B]`` prints 2 * B * L * S * K * H * bytes (32 layers, 8192 tokens,
8 KV heads, head dim 128, bfloat16 -> "1.00 GiB"); int8 adds its float32 scales,
2 * B * L * S * K * 4 bytes.
"""

from __future__ import annotations

from attnlab.commands._common import CommandError, CommandParser
from attnlab.config import DTYPE_BYTES, kv_cache_bytes


def format_bytes(n: float) -> str:
  """Binary units with two decimals: 1073741824 -> "1.00 GiB". The unit is chosen after
  rounding, so 1048575 bytes are "1.00 MiB", not "1024.00 KiB"."""
  if round(n) < 1024:
    return f"{n:.0f} B"
  for unit in ("KiB", "MiB", "GiB"):
    n /= 1024
    if round(n, 2) < 1024:
      return f"{n:.2f} {unit}"
  return f"{n / 1024:.2f} TiB"


def main(argv: list[str]) -> int:
  p = CommandParser(prog="attnlab kv-size",
                    description="K/V cache size of a model shape, in bytes (K and V of every "
                    "layer, and int8's scales), printed in the first unit (B, KiB, MiB, GiB, "
                    "TiB) that holds it under 1024, and in TiB past that.")
  helps = {"layers": "decoder layers", "seq": "tokens cached per sequence",
           "kv_heads": "KV heads (num_kv_heads)", "head_dim": "dimension of one head"}
  for name, help_ in helps.items():
    p.add_argument(f"--{name}", type=int, required=True, help=help_)
  p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16",
                 help="the cache's dtype (default bfloat16)")
  p.add_argument("--batch", type=int, default=1, help="sequences cached (default 1)")
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
