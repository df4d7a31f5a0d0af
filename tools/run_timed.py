"""Run a command and say what its wall time was made of: the CPU time of the command and
its children, and the share of the machine's CPU time that was busy, idle, or stolen by
the hypervisor (Linux /proc/stat) while it ran.

On a shared VM the same suite took 7.5 min one evening and 15 min the next night on the
same box; the steal share is what tells a slow machine from slower code.

    python tools/run_timed.py -- make test VENV=.venv-ci
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time

# /proc/stat's "cpu" line: user nice system idle iowait irq softirq steal guest guest_nice
FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_ticks() -> dict[str, int] | None:
  try:
    with open("/proc/stat") as f:
      values = [int(x) for x in f.readline().split()[1:len(FIELDS) + 1]]
  except (OSError, ValueError):
    return None
  return dict(zip(FIELDS, values, strict=False))


def shares(before: dict[str, int], after: dict[str, int]) -> dict[str, float] | None:
  """busy / idle / steal as fractions of all CPU ticks between two readings; None when no
  tick passed (a command shorter than a tick: "busy 100%" until 2026-12-05)."""
  delta = {k: after[k] - before[k] for k in FIELDS}
  total = sum(delta.values())
  if total <= 0:
    return None
  idle = delta["idle"] + delta["iowait"]
  return dict(busy=(total - idle - delta["steal"]) / total, idle=idle / total,
              steal=delta["steal"] / total)


def minutes(seconds: float) -> str:
  whole = round(seconds)  # 59.6 s is "1 min 0 s", not "0 min 60 s"
  return f"{whole // 60} min {whole % 60} s"


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] in (["-h"], ["--help"]):  # not a command to run (it was run until 2026-12-04)
    print(__doc__.strip() if __doc__ else "usage: python tools/run_timed.py -- COMMAND [ARGS...]")
    return 0
  if argv[:1] == ["--"]:
    argv = argv[1:]
  if not argv:
    sys.exit("usage: python tools/run_timed.py -- COMMAND [ARGS...]")
  before, start = cpu_ticks(), time.perf_counter()
  try:
    rc = subprocess.call(argv)
  except OSError as e:  # no such command: the shell's 127, with the summary line
    print(f"[run_timed] {argv[0]}: {e.strerror or e}", file=sys.stderr)
    rc = 127
  if rc < 0:  # killed by signal N: the shell's 128 + N (sys.exit(-9) exited 247 until
    rc = 128 - rc  # 2026-12-05)
  wall = time.perf_counter() - start
  after = cpu_ticks()
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  line = (f"[run_timed] exit {rc}; wall {minutes(wall)}; CPU of the command "
          f"{minutes(usage.ru_utime + usage.ru_stime)} on {os.cpu_count()} CPUs")
  s = shares(before, after) if before and after else None
  if s is not None:
    line += (f"; machine: busy {s['busy']:.0%}, idle {s['idle']:.0%}, "
             f"stolen by the hypervisor {s['steal']:.0%}")
  elif before and after:
    line += "; machine: no CPU tick passed (too short to say)"
  print(line, file=sys.stderr)
  sys.exit(rc)


if __name__ == "__main__":
  main()
