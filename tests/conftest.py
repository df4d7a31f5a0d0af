"""Shared pytest hooks."""

import jax
import pytest


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
