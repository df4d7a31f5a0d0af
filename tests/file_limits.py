"""``attnlab`` in a process of its own whose files are capped in size (RLIMIT_FSIZE: a write
past the cap fails with EFBIG, as one on a full disk with ENOSPC), for the tests of what a
command does on a full disk."""

import os
import subprocess
import sys

# Sets the cap in the child itself, then runs the module as ``python -m`` does: a
# ``preexec_fn`` would make subprocess fork this (multithreaded, JAX) process, which can
# deadlock.
_RUN_CAPPED = ("import resource, runpy, sys; n = int(sys.argv[1]); "
               "resource.setrlimit(resource.RLIMIT_FSIZE, (n, n)); "
               "sys.argv = sys.argv[2:]; runpy.run_module(sys.argv[0], run_name='__main__', "
               "alter_sys=True)")


def failed_in_one_line(args, limit_bytes: int, timeout: float = 600) -> str:
  """``python -m attnlab.cli ARGS`` with files capped at ``limit_bytes`` (without the
  persistent compilation cache, whose entries pass the cap), checked to exit 1 with one line
  on stderr: that line."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  res = subprocess.run([sys.executable, "-c", _RUN_CAPPED, str(limit_bytes), "attnlab.cli",
                        *map(str, args)], env=env, capture_output=True, text=True,
                       timeout=timeout)
  err = res.stderr.splitlines()
  assert res.returncode == 1 and len(err) == 1, (res.returncode, res.stderr[-3000:])
  return err[0]
