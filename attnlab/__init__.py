"""attnlab: attention and transformers in JAX / Flax NNX.

``import attnlab`` imports nothing but this file and ``attnlab.version``
(``attnlab.__version__``): every entry point below is imported from its module on
first use (``attnlab.generate``, ``from attnlab import build_model``), so
``attnlab --help`` answers without loading JAX.
"""

from typing import TYPE_CHECKING

from attnlab.version import __version__ as __version__  # the package root re-exports it

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time, __getattr__ below
  from attnlab.config import ModelConfig
  from attnlab.convert.heads import convert_heads
  from attnlab.decoding.batching import generate_requests
  from attnlab.decoding.generate import generate
  from attnlab.decoding.sampling import Sampling
  from attnlab.nn.transformer import DecoderOnly, EncoderDecoder, build_model, count_params
  from attnlab.ops.dispatch import attention
  from attnlab.training.checkpoint import load_checkpoint

# name -> the module that defines it
_LAZY = {
    "ModelConfig": "attnlab.config",
    "DecoderOnly": "attnlab.nn.transformer",
    "EncoderDecoder": "attnlab.nn.transformer",
    "build_model": "attnlab.nn.transformer",
    "count_params": "attnlab.nn.transformer",
    "attention": "attnlab.ops.dispatch",
    "load_checkpoint": "attnlab.training.checkpoint",
    "generate": "attnlab.decoding.generate",
    "generate_requests": "attnlab.decoding.batching",
    "Sampling": "attnlab.decoding.sampling",
    "convert_heads": "attnlab.convert.heads",
}

# The subpackages and modules, reachable as attributes after a bare ``import
# attnlab``. The first access to one of the JAX layers also loads what ``import
# attnlab`` loaded before its entry points were lazy, so chains such as
# ``attnlab.ops.pallas.flash.flash_attention`` work as they did; the light
# modules (``from attnlab import cli``) load alone.
_LIGHT = ("cli", "commands", "config", "config_gin", "extras", "version")
_SUBMODULES = (*_LIGHT, "convert", "data", "decoding", "nn", "ops", "training")
_LOADED_BEFORE = ("attnlab.config", "attnlab.nn.transformer", "attnlab.ops.dispatch")

__all__ = [
    "DecoderOnly",
    "EncoderDecoder",
    "ModelConfig",
    "Sampling",
    "attention",
    "build_model",
    "convert_heads",
    "count_params",
    "generate",
    "generate_requests",
    "load_checkpoint",
]


def __getattr__(name):
  import importlib

  if name in _LAZY:
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value
  if name in _SUBMODULES:
    for module in () if name in _LIGHT else _LOADED_BEFORE:
      importlib.import_module(module)
    return importlib.import_module(f"attnlab.{name}")
  raise AttributeError(f"module 'attnlab' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(__all__))
