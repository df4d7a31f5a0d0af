"""ModelConfig, DataConfig and TrainConfig validation: every invalid value
names its field."""

import pytest

from attnlab import ModelConfig
from attnlab.config import DataConfig, TrainConfig

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


DATA_INVALID = [
    (dict(task="translate"), "task='translate' is not one of"),
    (dict(seq_len=0), "seq_len=0 must be a positive integer"),
    (dict(batch_size=-1), "batch_size=-1"),
    (dict(batch_size=2.5), "batch_size=2.5"),
    (dict(min_len=0), "min_len=0"),
    (dict(max_len=0, min_len=1), "max_len=0"),
    (dict(vocab_chars=0), "vocab_chars=0"),
    (dict(vocab_chars=27), "vocab_chars=27 must be at most 26"),
    (dict(max_files=-1), "max_files=-1 must be a non-negative integer"),
    (dict(seed=-1), "seed=-1"),
    (dict(validation_percent=100), "validation_percent=100 must be in [0, 100)"),
    (dict(validation_percent=-1), "validation_percent=-1"),
    (dict(min_len=5, max_len=4), "min_len=5 must be <= max_len=4"),
    (dict(tokenizer="bpe"), "tokenizer='bpe' is not one of 'byte', 'sentencepiece'"),
    (dict(tokenizer="sentencepiece"), "tokenizer='sentencepiece' needs tokenizer_model"),
    (dict(task="tsv"), "task='tsv' needs paths"),
]

TRAIN_INVALID = [
    (dict(steps=0), "steps=0 must be a positive integer"),
    (dict(seed=-2), "seed=-2"),
    (dict(optimizer="lion"), "optimizer='lion' is not one of 'adamw', 'adam', 'sgd'"),
    (dict(schedule="linear"), "schedule='linear' is not one of"),
    (dict(learning_rate=0.0), "learning_rate=0.0 must be positive"),
    (dict(learning_rate=float("nan")), "learning_rate=nan"),
    (dict(warmup_steps=-1), "warmup_steps=-1"),
    (dict(schedule="inverse_sqrt", warmup_steps=0), "warmup_steps=0 is not allowed"),
    (dict(min_lr_ratio=1.5), "min_lr_ratio=1.5 must be in [0, 1]"),
    (dict(b1=1.0), "b1=1.0 must be in [0, 1)"),
    (dict(b2=-0.1), "b2=-0.1"),
    (dict(eps=-1e-9), "eps=-1e-09 must be non-negative"),
    (dict(weight_decay=-0.1), "weight_decay=-0.1 must be non-negative"),
    (dict(grad_clip=-1.0), "grad_clip=-1.0 must be non-negative"),
    (dict(label_smoothing=1.0), "label_smoothing=1.0 must be in [0, 1)"),
    (dict(label_smoothing=-0.1), "label_smoothing=-0.1"),
    (dict(grad_accum=0), "grad_accum=0 must be a positive integer"),
    (dict(mesh_shape=(1, 1)), "mesh_shape=(1, 1) must be 3 positive ints"),
    (dict(mesh_shape=(-1, -1, 1)), "mesh_shape=(-1, -1, 1)"),
    (dict(mesh_shape=(0, 1, 1)), "mesh_shape=(0, 1, 1)"),
    (dict(mesh_shape=(2.0, 1, 1)), "mesh_shape=(2.0, 1, 1)"),
    (dict(log_every=-1), "log_every=-1 must be a non-negative integer"),
    (dict(eval_every=-5), "eval_every=-5"),
    (dict(checkpoint_every=-1), "checkpoint_every=-1"),
    (dict(eval_batches=0), "eval_batches=0 must be a positive integer"),
    (dict(keep_checkpoints=0), "keep_checkpoints=0"),
    (dict(on_nonfinite="ignore"), "on_nonfinite='ignore' is not one of 'stop', 'skip'"),
]


@pytest.mark.parametrize("kwargs,message", DATA_INVALID, ids=[m for _, m in DATA_INVALID])
def test_invalid_data_config_names_the_field(kwargs, message):
  with pytest.raises(ValueError) as e:
    DataConfig(**kwargs)
  assert message in str(e.value)


@pytest.mark.parametrize("kwargs,message", TRAIN_INVALID, ids=[m for _, m in TRAIN_INVALID])
def test_invalid_train_config_names_the_field(kwargs, message):
  with pytest.raises(ValueError) as e:
    TrainConfig(**kwargs)
  assert message in str(e.value)


def test_data_and_train_defaults_are_valid_and_frozen():
  dcfg, tcfg = DataConfig(), TrainConfig()
  assert tcfg.mesh_shape == (-1, 1, 1)
  assert TrainConfig(mesh_shape=[2, -1, 1]).mesh_shape == (2, -1, 1)
  assert DataConfig(task="tsv", paths=["a.tsv"]).paths == ("a.tsv",)
  with pytest.raises(AttributeError):
    dcfg.batch_size = 3
  with pytest.raises(AttributeError):
    tcfg.steps = 3
