"""attnlab: attention and transformers in JAX / Flax NNX."""

from attnlab.config import ModelConfig
from attnlab.nn.transformer import DecoderOnly, EncoderDecoder, build_model, count_params
from attnlab.ops.attention import attention

__all__ = [
    "DecoderOnly",
    "EncoderDecoder",
    "ModelConfig",
    "attention",
    "build_model",
    "count_params",
]
