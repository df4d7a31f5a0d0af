"""Shared pytest hooks."""

import jax
import pytest


def pytest_collection_modifyitems(config, items):
  """Tests marked ``gpu`` are skipped unless JAX's default backend is a GPU."""
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason=f"needs a GPU; the default backend is {jax.default_backend()!r}")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
