"""Config validation: every invalid value raises a ``ValueError`` whose whole message names
the field, the value and what is allowed; the values at the edges of what is allowed are
accepted; and the defaults each config resolves."""

import re

import jax
import numpy as np
import pytest

from attnlab import ModelConfig
from attnlab.config import DataConfig, DecodeConfig, Sweep, TrainConfig, kv_cache_bytes
from attnlab.config_gin import operative_config


# What check_float32_range says of a value outside float32's normal range (its exact edges).
def _outside_float32(name_value: str, why: str) -> str:
  return (f"{name_value} must be within float32's normal range [1.1754943508222875e-38, "
          f"3.4028234663852886e+38]: {why}")


NORMS = "the norms compute in float32, where it would be 0 or inf (every output 0)"
ADAM = ("Adam divides by sqrt(v) + eps in float32, where it would be 0 (a nan update) or inf "
        "(no update)")
LR = "the schedule computes in float32, where it would be inf (a nan update) or 0 (no update)"
DECAY = ("AdamW multiplies the parameters by it in float32, where it would be inf (a nan "
         "update) or 0 (no decay; weight_decay=0 says that)")
CLIP = ("the gradient norm is compared with it in float32, where it would be inf or 0; "
        "grad_clip=0 turns clipping off")
UPTRAIN = ("the uptraining runs' learning_rate, which computes in float32, where it would be inf "
           "or 0")

INVALID = [
    (dict(num_heads=6, num_kv_heads=4),
     'num_heads=6 must be a multiple of num_kv_heads=4'),
    (dict(head_dim=33, pos='rope'),
     "head_dim=33 must be even with pos='rope'"),
    (dict(d_model=12, num_heads=4, pos='rope'),  # named a field the user never set
     "head_dim=3 (d_model=12 / num_heads=4; head_dim not given) must be even with pos='rope'"),
    (dict(window=0),
     'window=0 must be a positive integer'),
    (dict(window=-3),
     'window=-3 must be a positive integer'),
    (dict(pos='alibi'),
     "pos='alibi' is not one of 'rope', 'sinusoidal', 'learned', 'none'"),
    (dict(norm='batchnorm'),
     "norm='batchnorm' is not one of 'rmsnorm', 'layernorm'"),
    (dict(norm_position='sandwich'),
     "norm_position='sandwich' is not one of 'pre', 'post'"),
    (dict(mlp='geglu2'),
     "mlp='geglu2' is not one of 'relu', 'gelu', 'swiglu'"),
    (dict(arch='encoder_only'),
     "arch='encoder_only' is not one of 'decoder_only', 'encoder_decoder'"),
    (dict(d_model=0),
     'd_model=0 must be a positive integer'),
    (dict(num_layers=-1),
     'num_layers=-1 must be a positive integer'),
    (dict(vocab_size=0),
     'vocab_size=0 must be a positive integer'),
    (dict(d_ff=0),
     'd_ff=0 must be a positive integer'),
    (dict(num_kv_heads=0),
     'num_kv_heads=0 must be a positive integer'),
    (dict(d_model=100, num_heads=8),
     'd_model=100 must be divisible by num_heads=8 when head_dim is not given'),
    (dict(dtype='float64'),
     "dtype='float64' is not one of 'float32', 'bfloat16', 'float16'"),
    (dict(attention_impl='flash'),
     "attention_impl='flash' is not one of 'auto', 'reference', 'blocked', 'chunked', 'xla', "
     "'cudnn', 'pallas'"),
    (dict(dropout_rate=1.0),
     'dropout_rate=1.0 must be in [0, 1)'),
    (dict(pad_id=300),
     'pad_id=300 must be in [0, vocab_size=259)'),
    (dict(rope_theta=0.0),
     'rope_theta=0.0 must be positive'),
    # inf frequencies, a nan loss at the first step, until 2026-12-05 (found by an audit)
    (dict(rope_theta=1e-300),
     "rope_theta=1e-300 is too small: RoPE's highest frequency, rope_theta ** -(32 - 2) / 32, "
     "times the last position (max_len=2048) overflows float32 (RoPE's base is 10000 in the "
     "paper)"),
    # At the edge: 2048 x 2.7e-38 ** -(30 / 32) overflows float32 (2048 x 2.71e-38 ** ... not).
    (dict(rope_theta=2.7e-38),
     "rope_theta=2.7e-38 is too small: RoPE's highest frequency, rope_theta ** -(32 - 2) / 32, "
     "times the last position (max_len=2048) overflows float32 (RoPE's base is 10000 in the "
     "paper)"),
    # The angle is position x frequency: 1e37 x 512 positions overflows (a review found it).
    (dict(d_model=256, num_heads=1, rope_theta=5e-38, max_len=512),
     "rope_theta=5e-38 is too small: RoPE's highest frequency, rope_theta ** -(256 - 2) / 256, "
     "times the last position (max_len=512) overflows float32 (RoPE's base is 10000 in the "
     "paper)"),
    (dict(rope_pairing='quarter'),
     "rope_pairing='quarter' is not one of 'half', 'adjacent'"),
    (dict(num_encoder_layers=2),
     "num_encoder_layers=2 is only allowed with arch='encoder_decoder'"),
    (dict(attention_dropout_rate=0.1, attention_impl='chunked'),
     "attention_dropout_rate=0.1 needs attention_impl='reference', got attention_impl='chunked'"),
    (dict(num_layers=2.5),
     'num_layers=2.5 must be a positive integer'),
    (dict(d_model=30, num_heads=4),
     'd_model=30 must be divisible by num_heads=4 when head_dim is not given'),
    (dict(pos='sinusoidal', d_model=33, num_heads=1),
     "d_model=33 must be even with pos='sinusoidal'"),
    (dict(norm_eps=0.0),
     'norm_eps=0.0 must be positive'),
    (dict(norm_eps=-1e-06),
     'norm_eps=-1e-06 must be positive'),
    # 0 or inf in float32: every norm's output 0, a model that learned nothing (until 2026-12-06)
    (dict(norm_eps=1e39),
     _outside_float32('norm_eps=1e+39', NORMS)),
    (dict(norm_eps=1e-40),
     _outside_float32('norm_eps=1e-40', NORMS)),
    # LayerNorm over one feature is 0 whatever the input (accepted until 2026-12-06)
    (dict(norm="layernorm", d_model=1, num_heads=1, num_kv_heads=1, head_dim=2),
     "norm='layernorm' over d_model=1 feature is always 0 (x - mean(x)): the model could not "
     "see its input; give d_model >= 2 or norm='rmsnorm'"),
    (dict(use_bias=None),
     'use_bias=None must be True or False'),
    (dict(qkv_bias='yes'),
     "qkv_bias='yes' must be True, False or None (= use_bias)"),
    (dict(o_bias=1),
     'o_bias=1 must be True, False or None (= use_bias)'),
    (dict(attention_dropout_rate=1.0),
     'attention_dropout_rate=1.0 must be in [0, 1)'),
    (dict(param_dtype='int8'),
     "param_dtype='int8' is not one of 'float32', 'bfloat16', 'float16'"),
    (dict(pad_id=259),
     'pad_id=259 must be in [0, vocab_size=259)'),
    (dict(pad_id=-1),
     'pad_id=-1 must be in [0, vocab_size=259)'),
    (dict(pad_id='0'),
     "pad_id='0' must be in [0, vocab_size=259)"),
    # gin reads 'false' as a string: truthy, so it would switch the option on.
    (dict(scale_embeddings='false'),
     "scale_embeddings='false' must be True or False"),
    (dict(tie_embeddings=0),
     'tie_embeddings=0 must be True or False'),
    (dict(remat=None),
     'remat=None must be True or False'),
    (dict(rope_theta=float("nan")),
     'rope_theta=nan must be a finite number'),
    (dict(norm_eps=float("inf")),
     'norm_eps=inf must be a finite number'),
    (dict(rope_theta='1e4'),
     "rope_theta='1e4' must be a number"),
    (dict(dropout_rate=True),
     'dropout_rate=True must be a number'),
    (dict(pos=5),
     'pos=5 must be a string'),
    (dict(max_len=0),
     'max_len=0 must be a positive integer'),
    (dict(attention_dropout_rate=0.1, attention_impl='xla'),
     "attention_dropout_rate=0.1 needs attention_impl='reference', got attention_impl='xla'"),
    (dict(head_dim=0),
     'head_dim=0 must be a positive integer'),
    (dict(num_heads=0),
     'num_heads=0 must be a positive integer'),
]

DATA_INVALID = [
    (dict(task='translate'),
     "task='translate' is not one of 'lm', 'copy', 'reverse', 'sort', 'add', 'tsv'"),
    (dict(seq_len=0),
     'seq_len=0 must be a positive integer'),
    (dict(batch_size=-1),
     'batch_size=-1 must be a positive integer'),
    (dict(batch_size=2.5),
     'batch_size=2.5 must be a positive integer'),
    (dict(min_len=0),
     'min_len=0 must be a positive integer'),
    (dict(max_len=0, min_len=1),
     'max_len=0 must be a positive integer'),
    (dict(vocab_chars=0),
     'vocab_chars=0 must be a positive integer'),
    (dict(task='copy', vocab_chars=27),
     'vocab_chars=27 must be at most 26'),
    (dict(task='add', max_len=38),
     "max_len=38 does not fit task='add': its operands have 1 to max_len // 2 digits, at most "
     "18; use 2 <= max_len <= 37"),
    (dict(task='add', max_len=1),  # taken as 1 digit until 2026-12-04
     "max_len=1 does not fit task='add': its operands have 1 to max_len // 2 digits, at most "
     "18; use 2 <= max_len <= 37"),
    (dict(max_files=-1),
     'max_files=-1 must be a non-negative integer'),
    (dict(seed=-1),
     'seed=-1 must be an integer in [0, 2**63 - 1]'),
    (dict(seed=2**63),  # past jax.random.key's int64: an OverflowError at use before 2026-12-04
     f'seed={2**63} must be an integer in [0, 2**63 - 1]'),
    (dict(validation_percent=100),
     'validation_percent=100 must be an integer in [0, 100)'),
    (dict(validation_percent=-1),
     'validation_percent=-1 must be an integer in [0, 100)'),
    (dict(validation_percent=2.5),
     'validation_percent=2.5 must be an integer in [0, 100)'),
    (dict(validation_percent='5'),
     "validation_percent='5' must be an integer in [0, 100)"),
    # A lone string would be iterated character by character.
    (dict(paths='train.tsv'),
     "paths='train.tsv' must be a list of strings, e.g. ('train.tsv',)"),
    (dict(paths=5),
     "paths=5 must be a list of strings, e.g. ('a',)"),
    (dict(paths=('a.txt', 3)),
     "paths=('a.txt', 3) must be a list of strings, e.g. ('a',)"),
    (dict(loss_on_prompt='false'),
     "loss_on_prompt='false' must be True or False"),
    (dict(tokenizer_model=5),
     'tokenizer_model=5 must be a string'),
    (dict(task='sort', min_len=5, max_len=4),
     'min_len=5 must be <= max_len=4'),
    (dict(tokenizer='bpe'),
     "tokenizer='bpe' is not one of 'byte', 'sentencepiece', 'hf_json'"),
    (dict(tokenizer='sentencepiece'),
     "tokenizer='sentencepiece' needs tokenizer_model (a .model path)"),
    (dict(task='tsv'),
     "task='tsv' needs paths=('train.tsv', ['valid.tsv'])"),
    (dict(seed=True),
     'seed=True must be an integer in [0, 2**63 - 1]'),
    (dict(seed=1.5),
     'seed=1.5 must be an integer in [0, 2**63 - 1]'),
    (dict(tokenizer='hf_json'),
     "tokenizer='hf_json' needs tokenizer_model (a tokenizer.json path)"),
    (dict(bos_id=1),
     "bos_id=1 is only allowed with tokenizer='hf_json' (the 'byte' tokenizer fixes bos=1, eos=2)"),
    (dict(eos_id=5),
     "eos_id=5 is only allowed with tokenizer='hf_json' (the 'byte' tokenizer fixes bos=1, eos=2)"),
    (dict(tokenizer='hf_json', tokenizer_model='t.json', bos_id=-1),
     'bos_id=-1 must be a non-negative integer'),
    (dict(tokenizer='hf_json', tokenizer_model='t.json', eos_id=2.0),
     'eos_id=2.0 must be a non-negative integer'),
    (dict(tokenizer='sentencepiece', tokenizer_model='m.model', eos_id=2),
     "eos_id=2 is only allowed with tokenizer='hf_json' (the 'sentencepiece' tokenizer fixes "
     "bos=1, eos=2)"),
]

DATA_INVALID += [
    (dict(task="add", min_len=1),
     "min_len=1 does not apply to task='add' (its operands are decimal numbers of 1 to "
     "max_len // 2 digits); leave it at 3"),
    (dict(task="add", vocab_chars=3),
     "vocab_chars=3 does not apply to task='add' (its operands are decimal numbers of 1 to "
     "max_len // 2 digits); leave it at 10"),
    # ignored until 2026-12-06 (found by a review): a synthetic task trained on its own data
    # beside paths, a byte tokenizer beside a model file that did not exist
    (dict(task="reverse", paths=("pairs.tsv",)),
     "paths=('pairs.tsv',) does not apply to task='reverse' (its examples are drawn from seed, "
     "min_len, max_len and vocab_chars); leave it at ()"),
    (dict(task="copy", validation_percent=50),
     "validation_percent=50 does not apply to task='copy' (its examples are drawn from seed, "
     "min_len, max_len and vocab_chars); leave it at 5"),
    (dict(task="sort", max_files=3),
     "max_files=3 does not apply to task='sort' (its examples are drawn from seed, min_len, "
     "max_len and vocab_chars); leave it at 0"),
    (dict(task="add", paths=["a.txt"]),
     "paths=('a.txt',) does not apply to task='add' (its operands are decimal numbers of 1 to "
     "max_len // 2 digits); leave it at ()"),
    (dict(task="lm", vocab_chars=5),
     "vocab_chars=5 does not apply to task='lm' (a language model reads the text files of "
     "paths); leave it at 10"),
    (dict(min_len=2),
     "min_len=2 does not apply to task='lm' (a language model reads the text files of paths); "
     "leave it at 3"),
    (dict(max_len=40),
     "max_len=40 does not apply to task='lm' (a language model reads the text files of "
     "paths); leave it at 12"),
    (dict(task="tsv", paths=["a.tsv"], max_files=3),
     "max_files=3 does not apply to task='tsv' (it reads the pairs of the files in paths); "
     "leave it at 0"),
    (dict(task="tsv", paths=["a.tsv"], min_len=1),
     "min_len=1 does not apply to task='tsv' (it reads the pairs of the files in paths); "
     "leave it at 3"),
    (dict(tokenizer_model="no_such.model"),
     "tokenizer_model='no_such.model' is read by tokenizer='sentencepiece' or 'hf_json'; the "
     "'byte' tokenizer has no model file: set DataConfig.tokenizer, or leave tokenizer_model "
     "unset"),
    # ignored until 2026-12-04 (found by a review)
    (dict(task="lm", loss_on_prompt=True),
     "loss_on_prompt=True does not apply to task='lm' (a language model is trained on every "
     "token); it is for a decoder-only pair task"),
]

TRAIN_INVALID = [
    (dict(steps=0),
     'steps=0 must be a positive integer'),
    (dict(seed=-2),
     'seed=-2 must be an integer in [0, 2**63 - 1]'),
    (dict(seed=2**63),
     f'seed={2**63} must be an integer in [0, 2**63 - 1]'),
    (dict(optimizer='lion'),
     "optimizer='lion' is not one of 'adamw', 'adam', 'sgd'"),
    (dict(schedule='linear'),
     "schedule='linear' is not one of 'inverse_sqrt', 'cosine', 'constant'"),
    (dict(learning_rate=0.0),
     'learning_rate=0.0 must be positive'),
    (dict(learning_rate=float("nan")),
     'learning_rate=nan must be a finite number'),
    # inf in float32: a NaN first update reported at "learning rate nan" (until 2026-12-06)
    (dict(learning_rate=1e39),
     _outside_float32('learning_rate=1e+39', LR)),
    (dict(learning_rate=1e-46),
     _outside_float32('learning_rate=1e-46', LR)),
    (dict(grad_clip=float("inf")),  # config.gin would say inf, which gin cannot read back
     'grad_clip=inf must be a finite number'),
    # int32 in the train state and the schedule: an OverflowError traceback at the first step
    # until 2026-12-05 (found by an audit).
    (dict(warmup_steps=2**31), 'warmup_steps=2147483648 must be below 2**31'),
    (dict(steps=2**31), 'steps=2147483648 must be below 2**31'),
    (dict(warmup_steps=-1),
     'warmup_steps=-1 must be a non-negative integer'),
    (dict(schedule='inverse_sqrt', warmup_steps=0),
     "warmup_steps=0 is not allowed with schedule='inverse_sqrt'"),
    (dict(min_lr_ratio=1.5),
     'min_lr_ratio=1.5 must be in [0, 1]'),
    (dict(b1=1.0),
     'b1=1.0 must be in [0, 1)'),
    (dict(b2=-0.1),
     'b2=-0.1 must be in [0, 1)'),
    # 1.0 in float32, where optax computes: b2's updates were all 0, b1's nan (until
    # 2026-12-07, found by a review)
    (dict(b2=0.99999999),
     'b2=0.99999999 is 1 in float32, where the optimizer computes (Adam\'s bias correction '
     '1 - b2**t would be 0): give at most 0.9999999'),
    (dict(b1=0.999999999, optimizer="sgd", weight_decay=0.0),
     'b1=0.999999999 is 1 in float32, where the optimizer computes (SGD\'s momentum would '
     'never decay): give at most 0.9999999'),
    (dict(eps=-1e-09),
     'eps=-1e-09 must be non-negative'),
    (dict(weight_decay=-0.1),
     'weight_decay=-0.1 must be non-negative'),
    (dict(grad_clip=-1.0),
     'grad_clip=-1.0 must be non-negative'),
    (dict(eps=0.0),
     "eps=0.0 must be positive with optimizer='adamw': Adam divides by sqrt(v) + eps, and a "
     "parameter whose gradient is always 0 (an unused embedding row) would become nan"),
    (dict(optimizer='adam', eps=0.0),
     "eps=0.0 must be positive with optimizer='adam': Adam divides by sqrt(v) + eps, and a "
     "parameter whose gradient is always 0 (an unused embedding row) would become nan"),
    # 0 in float32: the nan above, reported as a non-finite update (until 2026-12-06)
    (dict(eps=1e-40),
     _outside_float32('eps=1e-40', ADAM)),
    (dict(optimizer='adam', eps=1e39),
     _outside_float32('eps=1e+39', ADAM)),
    # inf in float32: a non-finite first update after the run's folder was made (until
    # 2026-12-06); 0 there: no decay
    (dict(weight_decay=1e39),
     _outside_float32('weight_decay=1e+39', DECAY)),
    (dict(weight_decay=1e-40),
     _outside_float32('weight_decay=1e-40', DECAY)),
    (dict(grad_clip=1e39),
     _outside_float32('grad_clip=1e+39', CLIP)),
    (dict(grad_clip=1e-40),
     _outside_float32('grad_clip=1e-40', CLIP)),
    (dict(optimizer='adam', weight_decay=0.5),
     "weight_decay=0.5 is applied by optimizer='adamw' only; got optimizer='adam'"),
    (dict(optimizer='sgd', weight_decay=0.1),
     "weight_decay=0.1 is applied by optimizer='adamw' only; got optimizer='sgd'"),
    (dict(mesh_shape=5),
     "mesh_shape=5 must be 3 positive ints (data, fsdp, tensor), at most one -1, e.g. "
     "(1, -1, 1)"),
    # a set in its iteration order, a dict as its keys (until 2026-12-06)
    (dict(mesh_shape={4, 1, 2}),
     "mesh_shape={1, 2, 4} must be 3 positive ints (data, fsdp, tensor), at most one -1, e.g. "
     "(1, -1, 1)"),
    (dict(mesh_shape={2: 0, 1: 0, 4: 0}),
     "mesh_shape={2: 0, 1: 0, 4: 0} must be 3 positive ints (data, fsdp, tensor), at most one "
     "-1, e.g. (1, -1, 1)"),
    (dict(mesh_shape=["a", 1, 2]),
     "mesh_shape=['a', 1, 2] must be 3 positive ints (data, fsdp, tensor), at most one -1"),
    (dict(mesh_shape="1,1,1"),
     "mesh_shape='1,1,1' must be 3 positive ints (data, fsdp, tensor), at most one -1, e.g. "
     "(1, -1, 1)"),
    (dict(label_smoothing=1.0),
     'label_smoothing=1.0 must be in [0, 1)'),
    (dict(label_smoothing=-0.1),
     'label_smoothing=-0.1 must be in [0, 1)'),
    (dict(grad_accum=0),
     'grad_accum=0 must be a positive integer'),
    (dict(mesh_shape=(1, 1)),
     'mesh_shape=(1, 1) must be 3 positive ints (data, fsdp, tensor), at most one -1'),
    (dict(mesh_shape=(-1, -1, 1)),
     'mesh_shape=(-1, -1, 1) must be 3 positive ints (data, fsdp, tensor), at most one -1'),
    (dict(mesh_shape=(0, 1, 1)),
     'mesh_shape=(0, 1, 1) must be 3 positive ints (data, fsdp, tensor), at most one -1'),
    (dict(mesh_shape=(2.0, 1, 1)),
     'mesh_shape=(2.0, 1, 1) must be 3 positive ints (data, fsdp, tensor), at most one -1'),
    (dict(log_every=-1),
     'log_every=-1 must be a non-negative integer'),
    (dict(eval_every=-5),
     'eval_every=-5 must be a non-negative integer'),
    (dict(checkpoint_every=-1),
     'checkpoint_every=-1 must be a non-negative integer'),
    (dict(eval_batches=0),
     'eval_batches=0 must be a positive integer'),
    (dict(keep_checkpoints=0),
     'keep_checkpoints=0 must be a positive integer'),
    (dict(on_nonfinite='ignore'),
     "on_nonfinite='ignore' is not one of 'stop', 'skip'"),
    (dict(min_lr_ratio=-0.1),
     'min_lr_ratio=-0.1 must be in [0, 1]'),
    (dict(seed=True),
     'seed=True must be an integer in [0, 2**63 - 1]'),
    (dict(learning_rate='1e-3'),
     "learning_rate='1e-3' must be a number"),
    (dict(progress='False'),
     "progress='False' must be True or False"),
]

DECODE_INVALID = [
    (dict(max_new_tokens=0),
     'max_new_tokens=0 must be a positive integer'),
    (dict(cache='ring2'),
     "cache='ring2' is not one of 'contiguous', 'ring', 'paged'"),
    (dict(temperature=-0.5),
     'temperature=-0.5 must be 0 (greedy) or >= 1e-06'),
    (dict(temperature=1e-40),  # logits / 1e-40 overflow float32: every draw was token 0
     'temperature=1e-40 must be 0 (greedy) or >= 1e-06'),
    (dict(temperature='0.7'),
     "temperature='0.7' must be a number"),
    (dict(top_p='0.9'),
     "top_p='0.9' must be a number or None"),
    (dict(temperature=float("nan")),
     'temperature=nan must be a finite number'),
    (dict(top_k=0),
     'top_k=0 must be a positive integer'),
    (dict(top_k=2.5),
     'top_k=2.5 must be a positive integer'),
    (dict(top_p=0.0),
     'top_p=0.0 must be in (0, 1]'),
    (dict(top_p=1.5),
     'top_p=1.5 must be in (0, 1]'),
    (dict(beam_size=0),
     'beam_size=0 must be a positive integer'),
    # Beam search does not sample: sampling settings with it were silently ignored.
    (dict(beam_size=2, temperature=0.8),
     'beam_size=2 decodes deterministically: temperature=0.8, top_k=None, top_p=None '
     '(sampling) are not used with it; leave them unset'),
    (dict(beam_size=4, top_k=5),
     'beam_size=4 decodes deterministically: temperature=0.0, top_k=5, top_p=None '
     '(sampling) are not used with it; leave them unset'),
    # Filters of sampling with greedy decoding did nothing (until 2026-12-04, unsaid).
    (dict(top_k=5), "top_k=5, top_p=None filter what is sampled, and temperature=0 is greedy "
                    "(no sampling): give a temperature > 0, or leave them unset"),
    (dict(top_p=0.9, temperature=0.0), "top_k=None, top_p=0.9 filter what is sampled, and "
     "temperature=0 is greedy (no sampling): give a temperature > 0, or leave them unset"),
    (dict(beam_size=2, top_p=0.9),
     'beam_size=2 decodes deterministically: temperature=0.0, top_k=None, top_p=0.9 '
     '(sampling) are not used with it; leave them unset'),
    (dict(length_penalty=-0.1),
     'length_penalty=-0.1 must be >= 0'),
    (dict(seed=-1),
     'seed=-1 must be an integer in [0, 2**63 - 1]'),
    (dict(seed=2**70),
     f'seed={2**70} must be an integer in [0, 2**63 - 1]'),
    (dict(page_size=0),
     'page_size=0 must be a positive integer'),
    (dict(num_pages=0),
     'num_pages=0 must be a positive integer'),
]

SWEEP_INVALID = [
    (dict(base='a.gin'),
     "base='a.gin' must be a list"),
    (dict(seeds=1),
     'seeds=1 must be a list'),
    (dict(uptrain_num_kv_heads=2),
     'uptrain_num_kv_heads=2 must be a list'),
    (dict(uptrain_methods='mean'),
     "uptrain_methods='mean' must be a list"),
    (dict(num_kv_heads=2),
     'num_kv_heads=2 must be a list (or None)'),
    (dict(num_kv_heads='2'),
     "num_kv_heads='2' must be a list (or None)"),
    (dict(num_kv_heads=()),
     'num_kv_heads=() is an empty arm list: give at least one K (or None for N, N/2, ..., 1)'),
    (dict(num_kv_heads=(2, 0)),
     'num_kv_heads=0 must be a positive integer'),
    (dict(num_kv_heads=(2, 2)),
     'num_kv_heads=(2, 2) repeats a value'),
    (dict(seeds=()),
     'seeds=() is empty: give at least one seed'),
    (dict(seeds=(0, -1)),
     'seeds=(0, -1) must be integers in [0, 2**63 - 1]'),
    (dict(seeds=(True,)),
     'seeds=(True,) must be integers in [0, 2**63 - 1]'),
    (dict(seeds=(0, 2**63)),
     f'seeds=(0, {2**63}) must be integers in [0, 2**63 - 1]'),
    (dict(seeds=(1, 1)),
     'seeds=(1, 1) repeats a seed'),
    (dict(match_params=1),
     'match_params=1 must be True or False'),
    (dict(uptrain_num_kv_heads=(0,)),
     'uptrain_num_kv_heads=0 must be a positive integer'),
    (dict(uptrain_num_kv_heads=(1, 1)),
     'uptrain_num_kv_heads=(1, 1) repeats a value'),
    (dict(uptrain_num_kv_heads=(1,), uptrain_methods=()),
     'uptrain_methods=() is empty while uptrain_num_kv_heads is set'),
    (dict(uptrain_methods=('mean', 'max')),
     "uptrain_methods=('mean', 'max'): 'max' is not one of 'mean', 'first', 'random'"),
    (dict(uptrain_methods=('mean', 'first', 'mean')),  # one arm read twice into its row
     "uptrain_methods=('mean', 'first', 'mean') repeats a value"),
    (dict(uptrain_fraction=0.0),
     'uptrain_fraction=0.0 must be in (0, 1]'),
    (dict(uptrain_fraction=1.5),
     'uptrain_fraction=1.5 must be in (0, 1]'),
    (dict(uptrain_fraction='0.1'),
     "uptrain_fraction='0.1' must be a number"),
    (dict(uptrain_learning_rate='1e-4'),
     "uptrain_learning_rate='1e-4' must be a number or None"),
    (dict(uptrain_learning_rate=0.0),
     "uptrain_learning_rate=0.0 must be a positive number (or None: the base run's "
     "learning_rate)"),
    (dict(uptrain_learning_rate=-1e-4),
     "uptrain_learning_rate=-0.0001 must be a positive number (or None: the base run's "
     "learning_rate)"),
    # named as TrainConfig.learning_rate, the run config's field, until 2026-12-06
    (dict(uptrain_learning_rate=1e39),
     _outside_float32('uptrain_learning_rate=1e+39', UPTRAIN)),
    (dict(curve_points=0),
     'curve_points=0 must be a positive integer'),
    (dict(decode_prompt_len=0),
     'decode_prompt_len=0 must be a positive integer'),
    (dict(decode_new_tokens=0),
     'decode_new_tokens=0 must be a positive integer'),
    (dict(decode_repeats=0),
     'decode_repeats=0 must be a positive integer'),
]

CASES = ([(ModelConfig, kw, m) for kw, m in INVALID]
         + [(DataConfig, kw, m) for kw, m in DATA_INVALID]
         + [(TrainConfig, kw, m) for kw, m in TRAIN_INVALID]
         + [(DecodeConfig, kw, m) for kw, m in DECODE_INVALID]
         + [(Sweep, kw, m) for kw, m in SWEEP_INVALID])


@pytest.mark.parametrize("cls,kwargs,message", CASES,
                         ids=[f"{c.__name__}-{m}" for c, _, m in CASES])
def test_an_invalid_value_raises_a_value_error_naming_it(cls, kwargs, message):
  with pytest.raises(ValueError) as e:
    cls(**kwargs)
  assert str(e.value) == message


VALID_EDGES = [
    (DataConfig, dict(task="add", max_len=2)),  # 1-digit operands; min_len does not apply
    (ModelConfig, dict(rope_theta=2.71e-38)),  # the highest frequency x 2048 stays finite
    (DataConfig, dict(task="add", max_len=37)),  # 18-digit operands, the most int64 holds
    (TrainConfig, dict(optimizer="sgd", eps=0.0)),  # sgd has no eps
    (TrainConfig, dict(optimizer="adamw", weight_decay=0.1)),
    (ModelConfig, dict(pos="sinusoidal", d_model=32, num_heads=4)),
    (ModelConfig, dict(pos="rope", d_model=33, num_heads=1, head_dim=8)),  # head_dim given
    (ModelConfig, dict(rope_theta=0.5)),
    (ModelConfig, dict(norm_eps=1e-12)),
    # float32's smallest normal and largest numbers; layernorm over two features; sgd, no eps
    (ModelConfig, dict(norm_eps=float(np.finfo(np.float32).tiny))),
    (ModelConfig, dict(norm_eps=float(np.finfo(np.float32).max))),
    (ModelConfig, dict(norm="layernorm", d_model=2, num_heads=1, num_kv_heads=1, head_dim=2)),
    (TrainConfig, dict(eps=float(np.finfo(np.float32).tiny))),
    (TrainConfig, dict(optimizer="adam", eps=float(np.finfo(np.float32).max))),
    (TrainConfig, dict(optimizer="sgd", eps=1e-40)),
    (TrainConfig, dict(learning_rate=float(np.finfo(np.float32).tiny))),
    (TrainConfig, dict(learning_rate=float(np.finfo(np.float32).max))),
    (ModelConfig, dict(use_bias=True, qkv_bias=None, o_bias=False, mlp_bias=True)),
    (ModelConfig, dict(dropout_rate=0.0, attention_dropout_rate=0.0, attention_impl="chunked")),
    (ModelConfig, dict(attention_dropout_rate=0.5, attention_impl="reference")),
    (ModelConfig, dict(attention_dropout_rate=0.5, attention_impl="auto")),
    (ModelConfig, dict(pad_id=258)),
    (ModelConfig, dict(arch="encoder_decoder", num_encoder_layers=2)),
    (DataConfig, dict(validation_percent=0)),
    (DataConfig, dict(validation_percent=99)),
    (DataConfig, dict(task="copy", min_len=4, max_len=4)),
    (DataConfig, dict(task="reverse", vocab_chars=26, max_files=0, seed=0)),
    (DataConfig, dict(max_files=7, paths=["*.py"], validation_percent=1)),
    (DataConfig, dict(task="tsv", paths=["a.tsv", "b.tsv"], validation_percent=10)),
    (DataConfig, dict(task="add", max_len=37, min_len=3, vocab_chars=10)),
    (DataConfig, dict(tokenizer="hf_json", tokenizer_model="t.json", bos_id=0, eos_id=2)),
    (DataConfig, dict(tokenizer="hf_json", tokenizer_model="t.json", bos_id=None, eos_id=7)),
    (DataConfig, dict(tokenizer="sentencepiece", tokenizer_model="m.model")),
    (TrainConfig, dict(schedule="cosine", warmup_steps=0)),
    (TrainConfig, dict(schedule="constant", warmup_steps=0, min_lr_ratio=0.0)),
    (TrainConfig, dict(min_lr_ratio=1.0, b1=0.0, b2=0.0, eps=1e-30, weight_decay=0.0,
                       grad_clip=0.0, label_smoothing=0.0)),
    (TrainConfig, dict(b1=0.9999999, b2=0.9999999)),  # below 1 in float32
    (TrainConfig, dict(optimizer="sgd", weight_decay=0.0, b2=0.99999999)),  # SGD reads no b2
    (TrainConfig, dict(mesh_shape=(2, 2, -1), log_every=0, eval_every=0, checkpoint_every=0)),
    (DecodeConfig, dict(temperature=0.0, length_penalty=0.0, seed=0, num_pages=1)),
    (TrainConfig, dict(seed=2**63 - 1)), (DataConfig, dict(seed=2**63 - 1)),  # MAX_SEED
    (DecodeConfig, dict(temperature=1e-6, top_k=1, top_p=1.0)),
    (DecodeConfig, dict(beam_size=4, temperature=0.0, length_penalty=1.0)),  # beam: greedy
    (Sweep, dict(num_kv_heads=[4, 1], seeds=[0], uptrain_num_kv_heads=[1],
                 uptrain_methods=["first"], uptrain_fraction=1.0)),
    (Sweep, dict(seeds=[0, 2**63 - 1], uptrain_learning_rate=1e-30)),  # MAX_SEED
]


@pytest.mark.parametrize("cls,kwargs", VALID_EDGES,
                         ids=[f"{c.__name__}-{sorted(kw)}" for c, kw in VALID_EDGES])
def test_the_edges_of_what_is_allowed_are_accepted(cls, kwargs):
  cfg = cls(**kwargs)
  for name, value in kwargs.items():
    want = tuple(value) if isinstance(value, list) else value
    assert getattr(cfg, name) == want, name


def test_defaults_and_derived_sizes():
  cfg = ModelConfig(d_model=256, num_heads=8, num_kv_heads=2)
  assert cfg.head_dim == 32 and cfg.num_kv_heads == 2
  assert ModelConfig(num_heads=8).num_kv_heads == 8
  # 2 (K and V) * 4 layers * 2 KV heads * 32 dims * 4 bytes.
  assert cfg.kv_cache_bytes_per_token() == 2 * 4 * 2 * 32 * 4
  assert type(cfg.head_dim) is int
  assert ModelConfig(arch="encoder_decoder", num_layers=3).num_encoder_layers == 3
  assert ModelConfig(arch="decoder_only", num_layers=3).num_encoder_layers is None


def test_replace_rederives_only_the_defaults_that_were_not_given():
  cfg = ModelConfig(d_model=64, num_heads=4, num_layers=2, arch="encoder_decoder")
  wider = cfg.replace(num_heads=8, num_layers=3)
  assert (wider.num_kv_heads, wider.head_dim, wider.num_encoder_layers) == (8, 8, 3)
  fixed = ModelConfig(d_model=64, num_heads=4, num_kv_heads=2, head_dim=32)
  again = fixed.replace(num_heads=8)
  assert (again.num_kv_heads, again.head_dim) == (2, 32)  # given: kept
  assert fixed.replace(num_kv_heads=None, num_heads=8).num_kv_heads == 8
  with pytest.raises(ValueError, match="^num_heads=6 must be a multiple of num_kv_heads=4$"):
    ModelConfig(num_heads=4, num_kv_heads=4, d_model=48).replace(num_heads=6)
  tcfg = TrainConfig().replace(steps=7)
  assert tcfg.steps == 7 and tcfg.seed == TrainConfig().seed
  with pytest.raises(ValueError, match="^steps=0 must be a positive integer$"):
    TrainConfig().replace(steps=0)


@pytest.mark.parametrize("kw,want", [
    (dict(), (False, False, False)),
    (dict(use_bias=True), (True, True, True)),
    (dict(use_bias=True, o_bias=False), (True, False, True)),
    (dict(qkv_bias=True), (True, False, False)),
    (dict(mlp_bias=True), (False, False, True)),
])
def test_has_bias_follows_use_bias_unless_a_projection_says_otherwise(kw, want):
  cfg = ModelConfig(**kw)
  assert (cfg.has_bias("qkv"), cfg.has_bias("o"), cfg.has_bias("mlp")) == want


def test_kv_cache_bytes_counts_k_and_v_and_the_int8_scales():
  kw = dict(layers=2, seq=3, kv_heads=4, head_dim=8, batch=5)
  assert kv_cache_bytes(dtype="float32", **kw) == 2 * 5 * 2 * 3 * 4 * 8 * 4
  assert kv_cache_bytes(dtype="bfloat16", **kw) == 2 * 5 * 2 * 3 * 4 * 8 * 2
  assert kv_cache_bytes(dtype="int8", **kw) == 2 * 5 * 2 * 3 * 4 * (8 + 4)  # + float32 scale
  with pytest.raises(ValueError, match=re.escape(
      "dtype='int4' is not one of 'float32', 'bfloat16', 'float16', 'int8' (a name, a NumPy "
      "dtype or a scalar type such as jnp.bfloat16)")):
    kv_cache_bytes(dtype="int4", **kw)


def test_kv_cache_bytes_takes_the_dtypes_a_cache_takes_and_positive_integer_sizes():
  """Until 2026-12-07 np.dtype("float16") was a bare KeyError, jnp.bfloat16 was refused
  (init_cache and generate take both), "" and 0 were the model's dtype, and only the dtype
  was checked: layers=-2 gave a negative size, seq=2.5 a float, seq="10" a repeated string,
  batch=True a size."""
  import jax.numpy as jnp

  cfg = ModelConfig(d_model=32, num_heads=4, num_kv_heads=2, num_layers=3)  # float32, H = 8
  per_token = {"float32": 2 * 3 * 2 * 8 * 4, "bfloat16": 2 * 3 * 2 * 8 * 2,
               "float16": 2 * 3 * 2 * 8 * 2, "int8": 2 * 3 * 2 * (8 + 4)}
  assert cfg.kv_cache_bytes_per_token() == per_token["float32"]
  for dtype, name in [(np.dtype("float16"), "float16"), (np.float16, "float16"),
                      (jnp.bfloat16, "bfloat16"), (jnp.dtype("bfloat16"), "bfloat16"),
                      (jnp.int8, "int8"), ("f4", "float32"), (np.dtype("int8"), "int8")]:
    assert cfg.kv_cache_bytes_per_token(dtype) == per_token[name], dtype
  allowed = ("is not one of 'float32', 'bfloat16', 'float16', 'int8' (a name, a NumPy dtype "
             "or a scalar type such as jnp.bfloat16)")
  for dtype in ("", 0, "int4", np.float64, False):
    with pytest.raises(ValueError) as e:
      cfg.kv_cache_bytes_per_token(dtype)
    assert str(e.value) == f"dtype={dtype!r} {allowed}"
  kw = dict(layers=2, seq=3, kv_heads=4, head_dim=8, batch=5, dtype="float32")
  with pytest.raises(ValueError, match=re.escape(f"dtype=None {allowed}")):
    kv_cache_bytes(**{**kw, "dtype": None})  # no model here to default to
  jitted = jax.jit(lambda: 0)  # an object of JAX's (jaxlib's) with no shape: no size
  for name, bad in [("layers", -2), ("layers", 0), ("seq", 2.5), ("seq", "10"),
                    ("batch", True), ("kv_heads", None), ("head_dim", np.float32(8)),
                    ("seq", jitted), ("seq", jax.random.key(0))]:
    with pytest.raises(ValueError) as e:
      kv_cache_bytes(**{**kw, name: bad})
    assert str(e.value) == f"{name}={bad!r} must be a positive integer"
  # NumPy integers are sizes, counted as Python ints (int32 would wrap past 2**31 bytes)
  big = kv_cache_bytes(**{**kw, "seq": np.int32(2**20), "layers": np.int64(64)})
  assert type(big) is int and big == 2 * 5 * 64 * 2**20 * 4 * 8 * 4


def test_config_is_frozen():
  cfg = ModelConfig()
  with pytest.raises(AttributeError):
    cfg.d_model = 3


def test_data_and_train_defaults_are_valid_and_frozen():
  dcfg, tcfg = DataConfig(), TrainConfig()
  assert tcfg.mesh_shape == (-1, 1, 1)
  assert TrainConfig(mesh_shape=[2, -1, 1]).mesh_shape == (2, -1, 1)
  assert TrainConfig(mesh_shape=np.array([2, -1, 1])).mesh_shape == (2, -1, 1)
  assert DataConfig(task="tsv", paths=["a.tsv"]).paths == ("a.tsv",)
  with pytest.raises(AttributeError):
    dcfg.batch_size = 3
  with pytest.raises(AttributeError):
    tcfg.steps = 3


# NumPy scalars (a value read from an array, a sweep grid) are the numbers they hold.
NUMPY_AS_PYTHON = [
    (ModelConfig, dict(num_kv_heads=np.int64(2), window=np.int64(16), pad_id=np.int64(0),
                       head_dim=np.int32(32), rope_theta=np.float32(1e4),
                       norm_eps=np.float64(1e-6), dropout_rate=np.float32(0.5)),
     dict(num_kv_heads=2, window=16, pad_id=0, head_dim=32, rope_theta=1e4, norm_eps=1e-6,
          dropout_rate=0.5)),
    (DataConfig, dict(seq_len=np.int32(64), validation_percent=np.int64(5), seed=np.uint8(3)),
     dict(seq_len=64, validation_percent=5, seed=3)),
    (TrainConfig, dict(steps=np.int64(7), learning_rate=np.float32(0.5),
                       mesh_shape=(np.int64(1), -1, np.int32(1)), b1=np.float64(0.25)),
     dict(steps=7, learning_rate=0.5, mesh_shape=(1, -1, 1), b1=0.25)),
    (DecodeConfig, dict(temperature=np.float32(0.5), top_k=np.int64(40), top_p=np.float32(0.5),
                        length_penalty=np.int64(1), num_pages=np.int16(4)),
     dict(temperature=0.5, top_k=40, top_p=0.5, length_penalty=1, num_pages=4)),
    (Sweep, dict(num_kv_heads=[np.int64(4), 1], seeds=[np.int64(0), 1],
                 uptrain_num_kv_heads=[np.int64(2), 1], uptrain_learning_rate=np.float32(0.5)),
     dict(num_kv_heads=[4, 1], seeds=[0, 1], uptrain_num_kv_heads=[2, 1],
          uptrain_learning_rate=0.5)),
]


@pytest.mark.parametrize("cls,numpy_kw,python_kw", NUMPY_AS_PYTHON,
                         ids=[c.__name__ for c, _, _ in NUMPY_AS_PYTHON])
def test_numpy_scalars_are_accepted_and_stored_as_the_python_numbers_they_hold(
    cls, numpy_kw, python_kw):
  got, want = cls(**numpy_kw), cls(**python_kw)
  assert got == want and hash(got) == hash(want)
  for name in python_kw:
    stored = getattr(got, name)
    items = stored if isinstance(stored, tuple) else (stored,)
    assert all(type(x) in (int, float) for x in items), (name, stored)
  # The gin text a run writes (config.gin) is the text of the Python numbers.
  assert operative_config(got) == operative_config(want)


def test_numpy_bools_are_taken_in_bool_fields_as_the_bools_they_hold():
  """As the README says of NumPy scalars, and as ``attention(causal=np.True_)`` takes one
  (refused as not True or False until 2026-12-06)."""
  got = ModelConfig(scale_embeddings=np.True_, tie_embeddings=np.False_, use_bias=np.True_)
  want = ModelConfig(scale_embeddings=True, tie_embeddings=False, use_bias=True)
  assert got == want and hash(got) == hash(want)
  assert type(got.scale_embeddings) is bool and type(got.tie_embeddings) is bool
  assert operative_config(got) == operative_config(want)
  assert type(DataConfig(task="copy", loss_on_prompt=np.True_).loss_on_prompt) is bool
  with pytest.raises(ValueError, match=r"^scale_embeddings=np.int64\(1\) must be True or False$"):
    ModelConfig(scale_embeddings=np.int64(1))


def test_a_sweeps_arm_list_may_be_a_numpy_array_or_any_iterable_of_ints():
  for given in (np.array([4, 1]), (k for k in (4, 1)), range(4, 0, -3)):
    sweep = Sweep(num_kv_heads=given)
    assert sweep.num_kv_heads == (4, 1) and all(type(k) is int for k in sweep.num_kv_heads)


@pytest.mark.parametrize("cls,kwargs,message", [
    (ModelConfig, dict(window=np.True_), "window=np.True_ must be a positive integer"),
    (ModelConfig, dict(num_heads=np.float64(8.0)), "num_heads=8.0 must be a positive integer"),
    (ModelConfig, dict(pad_id=np.False_), "pad_id=np.False_ must be in [0, vocab_size=259)"),
    (ModelConfig, dict(rope_theta=np.True_), "rope_theta=np.True_ must be a number"),
    (DataConfig, dict(seed=np.float32(1.0)), "seed=1.0 must be an integer in [0, 2**63 - 1]"),
    (TrainConfig, dict(mesh_shape=(np.True_, -1, 1)),
     "mesh_shape=(np.True_, -1, 1) must be 3 positive ints (data, fsdp, tensor), at most one -1"),
    (DecodeConfig, dict(top_p=np.float32("nan")), "top_p=nan must be a finite number"),
    (Sweep, dict(seeds=[np.True_]), "seeds=(np.True_,) must be integers in [0, 2**63 - 1]"),
    (Sweep, dict(num_kv_heads=np.int64(2)), "num_kv_heads=np.int64(2) must be a list (or None)"),
], ids=str)
def test_numpy_bools_and_integral_floats_stay_refused_where_integers_are_wanted(
    cls, kwargs, message):
  with pytest.raises(ValueError) as e:
    cls(**kwargs)
  assert str(e.value) == message


def test_seed_key_keeps_every_bit_of_a_seed_as_x64_jax_does():
  """``seed_key`` is ``jax.random.key`` with the seed's 64 bits (JAX without x64 keeps the
  low 32: key(2**32 + 5) was key(5), key(-1) was key(2**32 - 1)): x64 JAX's own key,
  and ``key(seed)`` itself below 2**32."""
  import jax

  from attnlab.config import seed_key

  seeds = (0, 5, 2**31, 2**32 - 1, 2**32, 2**32 + 5, 2**63 - 1, -1, -5, -2**63)
  data = {s: np.asarray(jax.random.key_data(seed_key(s))) for s in seeds}
  assert len({d.tobytes() for d in data.values()}) == len(seeds)
  for s in seeds:
    assert data[s].tolist() == [(s >> 32) & 0xFFFFFFFF, s & 0xFFFFFFFF]  # [high, low]
    if 0 <= s < 2**32:
      np.testing.assert_array_equal(data[s], jax.random.key_data(jax.random.key(s)))
  if hasattr(jax, "enable_x64"):  # an independent reference: JAX's own int64 seeding
    with jax.enable_x64(True):
      for s in seeds:
        np.testing.assert_array_equal(data[s], jax.random.key_data(jax.random.key(s)))
  for bad in (2**63, -2**63 - 1):
    with pytest.raises(ValueError, match=r"must be in \[-2\*\*63, 2\*\*63\)"):
      seed_key(bad)
  # Another default key implementation (rbg: 4 words of key data) folds the high bits in.
  before = jax.config.jax_default_prng_impl
  jax.config.update("jax_default_prng_impl", "rbg")
  try:
    rbg = lambda k: np.asarray(jax.random.key_data(k))
    np.testing.assert_array_equal(rbg(seed_key(5)), rbg(jax.random.key(5)))
    np.testing.assert_array_equal(rbg(seed_key(2**32 + 5)),
                                  rbg(jax.random.fold_in(jax.random.key(5), 1)))
    assert rbg(seed_key(5)).shape == (4,)
  finally:
    jax.config.update("jax_default_prng_impl", before)
