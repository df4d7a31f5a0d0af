"""attnlab: attention and transformers in JAX / Flax NNX.

``import attnlab`` needs only the JAX stack; the checkpointing and decoding
entry points are imported on first use (orbax is heavy and optional for
model-only use).
"""

from attnlab.config import ModelConfig
from attnlab.nn.transformer import DecoderOnly, EncoderDecoder, build_model, count_params
from attnlab.ops.dispatch import attention

_LAZY = {
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

    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'attnlab' has no attribute {name!r}")
