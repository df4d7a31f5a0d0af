"""Shared pytest hooks.

One persistent XLA compilation cache per test session: the programs that
several tests compile alike (the tiny training configs' train step, compiled
again by every resume, every ``attnlab train`` subprocess and every sweep arm)
compile once and are loaded from the cache afterwards. The directory is new
for each session (shared by its xdist workers and the subprocesses they start,
which inherit the environment), so a run never reads programs compiled by an
older checkout. A directory set by the caller in $JAX_COMPILATION_CACHE_DIR is
used as it is. Tests that read what XLA prints while compiling turn the cache
off in their own process (tests/training/remat_check.py).

XLA's backend (LLVM) optimization level 0: the suite's programs are small and
run once or a few times, so on the CPU most of a test's time is LLVM
optimizing code that then runs for microseconds (tests/ops/test_attention.py:
3 min 24 s at the default level, 1 min 20 s at level 0, same results). The
level changes how the machine code is optimized, not what it computes (XLA's
CPU fast-math is off at every level). Flags the caller put in $XLA_FLAGS come
first and are kept; a caller who sets ``--xla_backend_optimization_level``
there gets that level. Subprocesses inherit the flags; the scripts that force
a device count append to them.
"""

import os
import shutil
import tempfile

_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  # xdist gives the controller and every worker the same run id.
  _run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
  _OWN_CACHE = os.path.join(tempfile.gettempdir(), f"attnlab-test-xla-cache-{_run}")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
  # Programs that compile in under 0.1 s are not written: writing one costs ~17 ms.
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")

TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
  """Tests marked ``gpu`` / ``tpu`` are skipped unless JAX's default backend is one."""
  backend = jax.default_backend()
  for marker in ("gpu", "tpu"):
    if backend == marker:
      continue
    skip = pytest.mark.skip(reason=f"needs a {marker.upper()}; the default backend is {backend!r}")
    for item in items:
      if marker in item.keywords:
        item.add_marker(skip)


def pytest_sessionfinish(session):
  """The controller (or the only process) removes the session's cache."""
  if _OWN_CACHE and not hasattr(session.config, "workerinput"):
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)
