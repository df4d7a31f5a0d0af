"""Per-projection biases (qkv_bias / o_bias / mlp_bias) and the hf_json tokenizer fields."""

from __future__ import annotations

import pytest
from flax import nnx

import attnlab
from attnlab.config import DataConfig

BASE = dict(vocab_size=50, d_model=16, num_layers=1, num_heads=2, d_ff=32)


def _bias_params(**fields) -> set[str]:
  """Names of the bias parameters a config builds ("self_attn.q_proj", "mlp.up_proj", ...)."""
  cfg = attnlab.ModelConfig(**BASE, **fields)
  model = nnx.eval_shape(lambda: attnlab.build_model(cfg, rngs=nnx.Rngs(0)))
  return {".".join(map(str, path[3:-1])) for path, _ in
          nnx.to_flat_state(nnx.state(model, nnx.Param)) if path[-1] == "b"}


ATTN = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}
MLP = {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}


@pytest.mark.parametrize("fields,want", [
    ({}, set()),                                               # the default: unchanged
    ({"use_bias": True}, ATTN | {"self_attn.o_proj"} | MLP),   # unchanged meaning
    ({"qkv_bias": True}, ATTN),                                # Qwen2
    ({"use_bias": True, "mlp_bias": False}, ATTN | {"self_attn.o_proj"}),
    ({"o_bias": True, "mlp_bias": True}, {"self_attn.o_proj"} | MLP),
])
def test_bias_fields_choose_the_projections(fields, want):
  assert _bias_params(**fields) == want


@pytest.mark.parametrize("field,value", [("qkv_bias", 1), ("o_bias", "yes"), ("use_bias", None)])
def test_bias_fields_are_validated(field, value):
  with pytest.raises(ValueError, match=f"{field}={value!r} must be"):
    attnlab.ModelConfig(**BASE, **{field: value})


def test_hf_json_tokenizer_fields_are_validated():
  with pytest.raises(ValueError, match="tokenizer='hf_json' needs tokenizer_model"):
    DataConfig(tokenizer="hf_json")
  with pytest.raises(ValueError, match="bos_id=1 is only allowed with tokenizer='hf_json'"):
    DataConfig(bos_id=1)
  with pytest.raises(ValueError, match="eos_id=-1 must be a non-negative integer"):
    DataConfig(tokenizer="hf_json", tokenizer_model="t.json", eos_id=-1)
  cfg = DataConfig(tokenizer="hf_json", tokenizer_model="t.json", bos_id=None, eos_id=7)
  assert (cfg.bos_id, cfg.eos_id) == (None, 7)
