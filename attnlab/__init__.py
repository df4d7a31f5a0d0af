"""attnlab: attention and transformers in JAX / Flax NNX.

``import attnlab`` imports nothing but this file: every entry point below is
imported from its module on first use (``attnlab.generate``, ``from attnlab
import build_model``), so ``attnlab --help`` answers without loading JAX.
"""

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
  if name in _LAZY:
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value
  raise AttributeError(f"module 'attnlab' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(__all__))
