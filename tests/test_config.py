"""ModelConfig validation: every invalid value names its field."""

import pytest

from attnlab import ModelConfig

INVALID = [
    (dict(num_heads=6, num_kv_heads=4), "num_heads=6 must be a multiple of num_kv_heads=4"),
    (dict(head_dim=33, pos="rope"), "head_dim=33"),
    (dict(window=0), "window=0"),
    (dict(window=-3), "window=-3"),
    (dict(pos="alibi"), "pos='alibi'"),
    (dict(norm="batchnorm"), "norm='batchnorm'"),
    (dict(norm_position="sandwich"), "norm_position='sandwich'"),
    (dict(mlp="geglu2"), "mlp='geglu2'"),
    (dict(arch="encoder_only"), "arch='encoder_only'"),
    (dict(d_model=0), "d_model=0"),
    (dict(num_layers=-1), "num_layers=-1"),
    (dict(vocab_size=0), "vocab_size=0"),
    (dict(d_ff=0), "d_ff=0"),
    (dict(num_kv_heads=0), "num_kv_heads=0"),
    (dict(d_model=100, num_heads=8), "d_model=100 must be divisible by num_heads=8"),
    (dict(dtype="float64"), "dtype='float64'"),
    (dict(attention_impl="flash"), "attention_impl='flash'"),
    (dict(dropout_rate=1.0), "dropout_rate=1.0"),
    (dict(pad_id=300), "pad_id=300"),
    (dict(rope_theta=0.0), "rope_theta=0.0"),
    (dict(rope_pairing="quarter"), "rope_pairing='quarter'"),
    (dict(num_encoder_layers=2), "num_encoder_layers=2"),
    (dict(attention_dropout_rate=0.1, attention_impl="chunked"), "attention_dropout_rate"),
    (dict(num_layers=2.5), "num_layers=2.5"),
]


@pytest.mark.parametrize("kwargs,message", INVALID, ids=[m for _, m in INVALID])
def test_invalid_config_raises_value_error_naming_the_field(kwargs, message):
  with pytest.raises(ValueError) as e:
    ModelConfig(**kwargs)
  assert message in str(e.value)


def test_defaults_and_derived_sizes():
  cfg = ModelConfig(d_model=256, num_heads=8, num_kv_heads=2)
  assert cfg.head_dim == 32 and cfg.num_kv_heads == 2
  assert ModelConfig(num_heads=8).num_kv_heads == 8
  # 2 (K and V) * 4 layers * 2 KV heads * 32 dims * 4 bytes.
  assert cfg.kv_cache_bytes_per_token() == 2 * 4 * 2 * 32 * 4


def test_config_is_frozen():
  cfg = ModelConfig()
  with pytest.raises(AttributeError):
    cfg.d_model = 3
