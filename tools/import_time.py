"""Start-up cost of a process: the seconds to import numpy, ml_dtypes, jax and the heaviest
attnlab command, each in fresh interpreters (the median of --repeats), with the installed
versions and the CPU model.

Every ``attnlab`` command, every test worker and every subprocess a test starts pays this
once; the ml_dtypes line is why pyproject.toml keeps ml_dtypes below 0.7.

    python tools/import_time.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import statistics
import subprocess
import sys

import _bench

# Each step imports what the one before it did first, so its time is its own share.
STEPS = [("numpy", ""), ("ml_dtypes", "import numpy"), ("jax", "import numpy, ml_dtypes"),
         ("attnlab.commands.train", "import jax")]
PROBE = ("import time; {before}\nt = time.perf_counter(); import {module}\n"
         "print(time.perf_counter() - t)")


def seconds(module: str, before: str) -> float:
  out = subprocess.run([sys.executable, "-c", PROBE.format(module=module, before=before)],
                       capture_output=True, text=True, check=True)
  return float(out.stdout.strip().splitlines()[-1])


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args(argv)
  if args.repeats < 1:
    parser.error(f"--repeats must be >= 1, got {args.repeats}")
  versions = {p: importlib.metadata.version(p) for p in ("numpy", "ml_dtypes", "jax")}
  print(f"CPU: {_bench.cpu_name()}; Python {sys.version.split()[0]}; "
        + ", ".join(f"{p} {v}" for p, v in versions.items()))
  for module, before in STEPS:
    times = [seconds(module, before) for _ in range(args.repeats)]
    print(f"import {module:24s} {statistics.median(times):7.3f} s  (median of {len(times)}; "
          f"min {min(times):.3f}, max {max(times):.3f})")


if __name__ == "__main__":
  main()
