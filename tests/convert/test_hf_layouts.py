"""``attnlab.convert.hf`` without torch: the four transformers layouts against a NumPy
(float64) forward written from transformers' definitions, and the config mapping.

The checkpoints here are made by hand: random tensors under transformers' names and
shapes (listed below from the transformers model definitions, not from
``hf.weight_rules``) saved with ``safetensors.numpy``, next to a config.json. Checked:

  * the logits of the imported model against the NumPy forward (Llama with biases and a
    head_dim that is not d_model / num_heads, GQA / MQA, Mistral's window, Qwen2's q/k/v
    biases, GPT-2's fused c_attn Conv1D; tied and untied heads);
  * the export (``write_params`` of ``weight_rules``) gives back every tensor bitwise,
    in one file or in shards with an index, float32 and bfloat16, and ``to_hf_config``
    maps back to the same ModelConfig;
  * every refusal names its field or tensor.

tests/convert/test_hf.py runs the same layouts through ``attnlab convert`` against
transformers itself (torch); this file is the fast one, and the one
``tools/mutation.sh`` runs on ``attnlab/convert/hf.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re

import jax
import numpy as np
import pytest

from attnlab.config import ModelConfig
from attnlab.convert import hf

pytest.importorskip("safetensors")
from safetensors.numpy import save_file  # noqa: E402

from tests.convert.hf_checkpoints import (  # noqa: E402
  FAMILY_CONFIGS,
  LLAMA,
  D,
  F,
  L,
  N,
  T,
  V,
  flat_params,
  gpt2_forward,
  import_checkpoint,
  llama_forward,
  random_tensors,
  shapes_of,
  write_checkpoint,
)

# --------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_imported_logits_match_the_numpy_forward_of_the_transformers_layout(name, tmp_path):
  c = FAMILY_CONFIGS[name]
  tensors = random_tensors(shapes_of(c), seed=1)
  family, cfg, model = import_checkpoint(write_checkpoint(tmp_path / "hf", c, tensors))
  assert family == c["model_type"]
  tokens = np.random.default_rng(2).integers(0, V, T)
  forward = gpt2_forward if family == "gpt2" else llama_forward
  want = forward(c, tensors, tokens)
  got = np.asarray(jax.jit(lambda t: model(t))(tokens[None]))[0]
  assert np.abs(want).max() > 1.0  # weights large enough for the check to mean something
  np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_export_gives_back_every_tensor_and_the_config(name, tmp_path):
  c = FAMILY_CONFIGS[name]
  tensors = random_tensors(shapes_of(c), seed=3)
  family, cfg, model = import_checkpoint(write_checkpoint(tmp_path / "hf", c, tensors))
  assert hf.hf_family(cfg) == family
  out = tmp_path / "back"
  out.mkdir()
  files = hf.write_params(hf.weight_rules(family, cfg), flat_params(model), str(out))
  assert files == [str(out / "model.safetensors")]
  from safetensors import safe_open
  from safetensors.numpy import load_file

  with safe_open(files[0], framework="numpy") as f:
    assert f.metadata() == {"format": "pt"}  # transformers refuses a file without it
  back = load_file(files[0])
  assert sorted(back) == sorted(tensors)
  for key, value in tensors.items():
    assert back[key].dtype == value.dtype, key
    np.testing.assert_array_equal(back[key], value, err_msg=key)
  again = hf.to_hf_config(cfg, bos_id=1, eos_id=2)
  assert hf.from_hf_config(again) == (family, cfg)
  assert again["architectures"] == [hf.ARCHITECTURES[family]]
  assert (again["bos_token_id"], again["eos_token_id"]) == (1, 2)


def test_a_base_model_checkpoint_without_the_model_prefix_is_read(tmp_path):
  c = FAMILY_CONFIGS["llama_mqa_tied"]
  tensors = random_tensors(shapes_of(c), seed=4)
  bare = {k.removeprefix("model."): v for k, v in tensors.items()}
  assert len(bare) == len(tensors) and "embed_tokens.weight" in bare
  _, _, model = import_checkpoint(write_checkpoint(tmp_path / "bare", c, bare))
  _, _, want = import_checkpoint(write_checkpoint(tmp_path / "full", c, tensors))
  got, expected = flat_params(model), flat_params(want)
  for path in expected:
    np.testing.assert_array_equal(got[path], expected[path], err_msg=str(path))
  g = FAMILY_CONFIGS["gpt2"]
  tensors = random_tensors(shapes_of(g), seed=4)
  bare = {k.removeprefix("transformer."): v for k, v in tensors.items()}
  _, _, model = import_checkpoint(write_checkpoint(tmp_path / "gpt2_bare", g, bare))
  _, _, want = import_checkpoint(write_checkpoint(tmp_path / "gpt2_full", g, tensors))
  got, expected = flat_params(model), flat_params(want)
  for path in expected:
    np.testing.assert_array_equal(got[path], expected[path], err_msg=str(path))
  assert hf._name_prefix("gpt2", dict.fromkeys(bare, "f")) == ""
  assert hf._name_prefix("gpt2", dict.fromkeys(tensors, "f")) is None
  assert hf._name_prefix("llama", dict.fromkeys(bare, "f")) is None  # no embed_tokens at all
  # Both spellings present: the standard (prefixed) layout is the one read.
  for family, full, short in (("gpt2", "transformer.wte.weight", "wte.weight"),
                              ("llama", "model.embed_tokens.weight", "embed_tokens.weight")):
    assert hf._name_prefix(family, {full: "f", short: "f"}) is None, family
    assert hf._name_prefix(family, {short: "f"}) == "", family


def test_sharded_export_writes_an_index_that_the_import_reads(tmp_path):
  c = FAMILY_CONFIGS["llama_bias_head_dim"]
  tensors = random_tensors(shapes_of(c), seed=5)
  family, cfg, model = import_checkpoint(write_checkpoint(tmp_path / "hf", c, tensors))
  out = tmp_path / "shards"
  out.mkdir()
  biggest = max(v.nbytes for v in tensors.values())
  files = hf.write_params(hf.weight_rules(family, cfg), flat_params(model), str(out),
                          max_shard_bytes=biggest + 1)
  assert len(files) > 2
  assert [os.path.basename(f) for f in files] == [f"model-{i:05d}.safetensors"
                                                  for i in range(1, len(files) + 1)]
  from safetensors.numpy import load_file

  sizes = [sum(v.nbytes for v in load_file(f).values()) for f in files]
  assert max(sizes) <= biggest + 1  # no shard past the limit
  index = json.loads((out / "model.safetensors.index.json").read_text())
  assert index["metadata"]["total_size"] == sum(v.nbytes for v in tensors.values())
  assert sorted(index["weight_map"]) == sorted(tensors)
  (out / "config.json").write_text(json.dumps(c))
  found = hf.tensor_files(str(out))
  assert {n: os.path.basename(p) for n, p in found.items()} == index["weight_map"]
  _, _, again = import_checkpoint(str(out))
  got, want = flat_params(again), flat_params(model)
  for path in want:
    np.testing.assert_array_equal(got[path], want[path], err_msg=str(path))


def test_a_shard_is_filled_up_to_its_limit_exactly(tmp_path):
  family, cfg = hf.from_hf_config(FAMILY_CONFIGS["llama_mqa_tied"])
  # The five norm vectors (final, two per layer): 4 * D bytes each.
  rules = [r for r in hf.weight_rules(family, cfg) if r.hf_shapes == ((D,),)]
  assert len(rules) == 5
  params = {r.paths[0]: np.ones(D, np.float32) for r in rules}
  files = hf.write_params(rules, params, str(tmp_path), max_shard_bytes=2 * 4 * D)
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  names = [os.path.basename(f) for f in files]
  assert list(index["weight_map"].values()) == [names[0]] * 2 + [names[1]] * 2 + [names[2]]


def test_read_params_casts_to_the_parameter_dtype(tmp_path):
  import jax.numpy as jnp

  c = FAMILY_CONFIGS["gpt2"]
  src = write_checkpoint(tmp_path / "hf", c, random_tensors(shapes_of(c)))
  family, cfg = hf.from_hf_config(c)
  files = hf.tensor_files(src)
  params = hf.read_params(hf.check_tensors(family, cfg, files), files, jnp.bfloat16)
  assert {v.dtype for v in params.values()} == {jnp.dtype(jnp.bfloat16)}


def test_a_tensor_larger_than_a_shard_gets_a_shard_of_its_own(tmp_path):
  c = FAMILY_CONFIGS["gpt2"]
  family, cfg = hf.from_hf_config(c)
  rules = hf.weight_rules(family, cfg)
  params = {path: np.ones(shape, np.float32) for r in rules
            for path, shape in zip(r.paths, [np.shape(a) for a in r.to_attnlab(
                *[np.zeros(s, np.float32) for s in r.hf_shapes])], strict=True)}
  files = hf.write_params(rules, params, str(tmp_path), max_shard_bytes=1)
  assert len(files) == len(shapes_of(c))  # one tensor per shard, none dropped


def test_bfloat16_parameters_export_as_bfloat16(tmp_path):
  import jax.numpy as jnp
  from safetensors import safe_open

  c = FAMILY_CONFIGS["qwen2"]
  tensors = random_tensors(shapes_of(c), seed=6)
  family, cfg, model = import_checkpoint(write_checkpoint(tmp_path / "hf", c, tensors))
  params = {p: jnp.asarray(v, jnp.bfloat16) for p, v in flat_params(model).items()}
  (path,) = hf.write_params(hf.weight_rules(family, cfg), params, str(tmp_path))
  with safe_open(path, framework="flax") as f:
    assert f.metadata() == {"format": "pt"}
    for name, value in tensors.items():
      got = f.get_tensor(name)
      assert got.dtype == jnp.bfloat16, name
      np.testing.assert_array_equal(np.asarray(got, np.float32),
                                    np.asarray(jnp.asarray(value, jnp.bfloat16), np.float32))
  bf16 = dict(c, torch_dtype="bfloat16")
  family, cfg16 = hf.from_hf_config(bf16)
  assert (cfg16.dtype, cfg16.param_dtype) == ("bfloat16", "bfloat16")
  assert hf.from_hf_config(bf16, dtype="float32")[1].param_dtype == "float32"
  assert hf.to_hf_config(cfg16)["dtype"] == "bfloat16"


# --------------------------------------------------------------------------- config mapping


def test_config_fields_map_one_to_one():
  family, cfg = hf.from_hf_config(FAMILY_CONFIGS["llama_bias_head_dim"])
  assert family == "llama"
  assert (cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
          cfg.d_ff, cfg.vocab_size, cfg.max_len) == (D, L, N, 2, 16, F, V, 64)
  assert (cfg.rope_theta, cfg.norm_eps, cfg.rope_pairing, cfg.pos) == (700.0, 1e-5, "half",
                                                                       "rope")
  assert cfg.has_bias("qkv") and cfg.has_bias("o") and cfg.has_bias("mlp")
  assert not cfg.tie_embeddings and cfg.window is None and cfg.pad_id == 0
  # head_dim = d_model / num_heads is the default, stored as None
  _, cfg = hf.from_hf_config(dict(LLAMA, head_dim=D // N))
  assert cfg.head_dim == D // N and hf.from_hf_config(LLAMA)[1] == cfg
  # ... but floor(d_model / num_heads) with a remainder is an explicit head_dim
  _, cfg = hf.from_hf_config(dict(LLAMA, hidden_size=D + 2, head_dim=(D + 2) // N))
  assert (cfg.d_model, cfg.head_dim) == (D + 2, D // N)
  # defaults of fields transformers may leave out
  minimal = {k: LLAMA[k] for k in ("model_type", "vocab_size", "hidden_size",
                                   "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads")}
  _, cfg = hf.from_hf_config(minimal)
  assert (cfg.num_kv_heads, cfg.rope_theta, cfg.norm_eps, cfg.max_len, cfg.tie_embeddings,
          cfg.dtype) == (N, 10000.0, 1e-6, 2048, False, "float32")
  assert not (cfg.has_bias("qkv") or cfg.has_bias("o") or cfg.has_bias("mlp"))
  _, cfg = hf.from_hf_config(FAMILY_CONFIGS["llama_mqa_tied"])
  assert cfg.rope_theta == 300.0 and cfg.num_kv_heads == 1 and cfg.tie_embeddings
  _, cfg = hf.from_hf_config(dict(LLAMA, rope_scaling={"type": "default"}, pad_token_id=7))
  assert cfg.rope_theta == 700.0 and cfg.pad_id == 7
  family, cfg = hf.from_hf_config(FAMILY_CONFIGS["mistral"])
  assert family == "mistral" and cfg.window == 4 and not cfg.has_bias("qkv")
  # No bias is pinned off, not left to use_bias: a later use_bias=True binding adds none.
  for name in ("llama_mqa_tied", "mistral", "qwen2"):
    cfg = hf.from_hf_config(FAMILY_CONFIGS[name])[1].replace(use_bias=True)
    assert (cfg.has_bias("o"), cfg.has_bias("mlp")) == (False, False), name
    assert cfg.has_bias("qkv") == (name == "qwen2"), name
  family, cfg = hf.from_hf_config(FAMILY_CONFIGS["qwen2"])
  assert family == "qwen2" and cfg.has_bias("qkv") and not cfg.has_bias("o")
  assert not cfg.has_bias("mlp") and cfg.tie_embeddings
  family, cfg = hf.from_hf_config(FAMILY_CONFIGS["gpt2"])
  assert family == "gpt2" and (cfg.pos, cfg.norm, cfg.mlp) == ("learned", "layernorm", "gelu")
  assert (cfg.d_ff, cfg.max_len, cfg.norm_eps, cfg.num_kv_heads) == (F, 64, 1e-5, N)
  assert cfg.has_bias("qkv") and cfg.has_bias("o") and cfg.has_bias("mlp")
  assert cfg.tie_embeddings and cfg.arch == "decoder_only" and not cfg.scale_embeddings
  _, cfg = hf.from_hf_config(FAMILY_CONFIGS["gpt2_untied"])
  assert (cfg.d_ff, cfg.max_len, cfg.norm_eps, cfg.tie_embeddings) == (4 * D, 32, 1e-5, False)
  gpt2 = {k: v for k, v in FAMILY_CONFIGS["gpt2"].items() if k != "n_positions"}
  _, cfg = hf.from_hf_config(dict(gpt2, layer_norm_epsilon=3e-4))
  assert (cfg.max_len, cfg.norm_eps) == (1024, 3e-4)
  # transformers >= 4.56 writes "dtype", older versions "torch_dtype"; "dtype" wins.
  assert hf.from_hf_config(dict(LLAMA, dtype="bfloat16"))[1].param_dtype == "bfloat16"
  assert hf.from_hf_config(dict(LLAMA, dtype="float16", torch_dtype="bfloat16"))[1].dtype == (
      "float16")


def test_keys_a_config_json_leaves_out_take_the_familys_defaults():
  """transformers' config classes' defaults, which differ by family (test_hf.py holds them to
  AutoConfig.for_model; this runs without torch): Llama is MHA with 2048 positions, Mistral
  has 8 KV heads, 131072 positions and a 4096 window, Qwen2 32 KV heads and 32768 positions.
  A null num_key_value_heads is MHA and a null sliding_window none."""
  base = dict(vocab_size=V, hidden_size=128, intermediate_size=F, num_hidden_layers=1,
              num_attention_heads=64)
  want = {"llama": (64, 2048, None), "mistral": (8, 131072, 4096), "qwen2": (32, 32768, None)}
  for family, (kv_heads, max_len, window) in want.items():
    cfg = hf.from_hf_config(dict(base, model_type=family))[1]
    assert (cfg.num_kv_heads, cfg.max_len, cfg.window) == (kv_heads, max_len, window), family
    cfg = hf.from_hf_config(dict(base, model_type=family, num_key_value_heads=None,
                                 sliding_window=None))[1]
    assert (cfg.num_kv_heads, cfg.max_len, cfg.window) == (64, max_len, None), family


def test_to_hf_config_writes_each_family_own_fields():
  llama = hf.to_hf_config(hf.from_hf_config(FAMILY_CONFIGS["llama_bias_head_dim"])[1])
  assert (llama["attention_bias"], llama["mlp_bias"], llama["head_dim"]) == (True, True, 16)
  assert llama["rope_parameters"] == {"rope_type": "default", "rope_theta": 700.0}
  assert llama["rope_theta"] == 700.0 and llama["num_key_value_heads"] == 2
  assert (llama["hidden_act"], llama["model_type"], llama["use_cache"]) == ("silu", "llama", True)
  assert (llama["bos_token_id"], llama["eos_token_id"], llama["pad_token_id"]) == (None, None, None)
  mistral = hf.to_hf_config(hf.from_hf_config(FAMILY_CONFIGS["mistral"])[1])
  assert mistral["sliding_window"] == 4 and "attention_bias" not in mistral
  qwen = hf.to_hf_config(hf.from_hf_config(FAMILY_CONFIGS["qwen2"])[1])
  assert qwen["use_sliding_window"] is False and qwen["sliding_window"] is None
  assert qwen["layer_types"] == ["full_attention"] * L
  gpt2 = hf.to_hf_config(hf.from_hf_config(FAMILY_CONFIGS["gpt2"])[1])
  assert (gpt2["n_embd"], gpt2["n_layer"], gpt2["n_head"], gpt2["n_inner"],
          gpt2["n_positions"]) == (D, L, N, F, 64)
  assert gpt2["activation_function"] == "gelu_new" and gpt2["scale_attn_weights"] is True
  assert gpt2["scale_attn_by_inverse_layer_idx"] is False and gpt2["tie_word_embeddings"]
  assert gpt2["reorder_and_upcast_attn"] is False and gpt2["layer_norm_epsilon"] == 1e-5
  assert "hidden_size" not in gpt2
  cfg = ModelConfig(vocab_size=V, d_model=D, num_layers=L, num_heads=N, d_ff=F, pos="learned",
                    norm="layernorm", mlp="gelu", use_bias=True, dropout_rate=0.1,
                    attention_dropout_rate=0.2)
  gpt2 = hf.to_hf_config(cfg.replace(norm_eps=3e-4))
  assert (gpt2["resid_pdrop"], gpt2["embd_pdrop"], gpt2["attn_pdrop"]) == (0.1, 0.1, 0.2)
  assert gpt2["layer_norm_epsilon"] == 3e-4
  llama = hf.to_hf_config(cfg.replace(pos="rope", norm="rmsnorm", mlp="swiglu", use_bias=False))
  assert llama["attention_dropout"] == 0.2 and llama["model_type"] == "llama"


def test_special_ids():
  assert hf.special_ids(dict(vocab_size=10, bos_token_id=1, eos_token_id=[2, 3],
                             pad_token_id=0)) == {"bos": 1, "eos": 2, "pad": 0}
  # out of the vocabulary, an empty list, a string, or absent: None
  assert hf.special_ids(dict(vocab_size=10, bos_token_id=10, eos_token_id=[],
                             pad_token_id="0")) == {"bos": None, "eos": None, "pad": None}
  assert hf.special_ids(dict(vocab_size=10, bos_token_id=-1, eos_token_id=9)) == {
      "bos": None, "eos": 9, "pad": None}
  assert hf.special_ids({"bos_token_id": 0}) == {"bos": None, "eos": None, "pad": None}
  # A missing eos key is the family's transformers default, which its generate stops at
  # (None until 2026-12-04, so a tokenizer.json import never stopped at eos); a null is None;
  # the range still applies. A missing bos stays None (the post-processor's, on import).
  assert hf.special_ids(dict(model_type="llama", vocab_size=10)) == {
      "bos": None, "eos": 2, "pad": None}
  assert hf.special_ids(dict(model_type="mistral", vocab_size=10, eos_token_id=None)) == {
      "bos": None, "eos": None, "pad": None}
  assert hf.special_ids(dict(model_type="gpt2", vocab_size=50257)) == {
      "bos": None, "eos": 50256, "pad": None}
  assert hf.special_ids(dict(model_type="gpt2", vocab_size=100)) == {
      "bos": None, "eos": None, "pad": None}
  assert hf.special_ids(dict(model_type="qwen2", vocab_size=10)) == {
      "bos": None, "eos": None, "pad": None}
  # A vocab_size that is no int (text, a bool: true is no size of 1) holds no id, and a bool
  # is no id: None, not a TypeError or id 0.
  for vocab in ("10", True, 10.0):
    assert hf.special_ids(dict(vocab_size=vocab, bos_token_id=0, eos_token_id=1,
                               pad_token_id=0)) == {"bos": None, "eos": None, "pad": None}
    assert hf.eos_ids(dict(vocab_size=vocab, eos_token_id=[0, 1])) == []
  assert hf.special_ids(dict(vocab_size=10, bos_token_id=True, eos_token_id=[False],
                             pad_token_id=False)) == {"bos": None, "eos": None, "pad": None}
  # Of several eos ids, the first in the vocabulary, i.e. eos_ids' first (until 2026-12-06
  # the first listed or none: [10, 5] gave no eos, and as eos_ids then held only 5, the
  # import wrote no generation_config.json either, so decode never stopped).
  for ids, eos in (([10, 5, 3], 5), ([False, 3], 3), ([-1, "2", 10], None)):
    config = dict(vocab_size=10, eos_token_id=ids)
    assert hf.special_ids(config)["eos"] == eos == (hf.eos_ids(config) or [None])[0], ids


def test_eos_ids():
  """Every eos id of config.json in the vocabulary, in its order, once; one id or a list."""
  assert hf.eos_ids(dict(vocab_size=10, eos_token_id=[4, 2, 4, 10, -1, True, "3", 9])) == [
      4, 2, 9]
  assert hf.eos_ids(dict(vocab_size=10, eos_token_id=7)) == [7]
  assert hf.eos_ids(dict(vocab_size=10, eos_token_id=10)) == []
  # No key or a null: none (not the family default, which special_ids' eos gives; the import
  # writes a generation_config.json only for several ids).
  assert hf.eos_ids(dict(model_type="llama", vocab_size=10)) == []
  assert hf.eos_ids(dict(vocab_size=10, eos_token_id=None)) == []
  assert hf.eos_ids(dict(eos_token_id=[0])) == []  # no vocab_size: no id fits


# The refusals: (config.json changes, the message). Each would change the math if ignored.
BAD_CONFIGS = {
    "model_type": ({"model_type": "gpt_neox"}, "model_type='gpt_neox' is not supported "
                   "(supported: 'llama', 'mistral', 'qwen2', 'gpt2')"),
    "no_model_type": ({"model_type": None}, "model_type=None is not supported"),
    "hidden_act": ({"hidden_act": "gelu"}, "config.json hidden_act='gelu' is not supported "
                   "(supported: 'silu')"),
    "attention_bias": ({"attention_bias": "yes"}, "attention_bias='yes' is not supported"),
    "mlp_bias": ({"mlp_bias": 1.5}, "mlp_bias=1.5 is not supported"),
    "rope_scaling": ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                     "config.json rope_scaling.rope_type='linear' is not supported "
                     "(only 'default' RoPE, no scaling)"),
    "rope_scaling_type": ({"rope_scaling": {"type": "dynamic"}},
                          "rope_scaling.rope_type='dynamic' is not supported"),
    "rope_parameters": ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5.0}},
                        "rope_parameters.rope_type='llama3' is not supported"),
    "rope_not_a_dict": ({"rope_parameters": 3}, "rope_parameters=3 is not a JSON object"),
    "partial_in_parameters": ({"rope_parameters": {"partial_rotary_factor": 0.5}},
                              "rope_parameters.partial_rotary_factor=0.5 is not supported "
                              "(only 1.0)"),
    "partial": ({"partial_rotary_factor": 0.25}, "config.json partial_rotary_factor=0.25 is "
                "not supported (only 1.0)"),
    "dtype": ({"torch_dtype": "int8"}, "config.json dtype='int8' is not supported "
              "(supported: bfloat16, float16, float32)"),
    **{f"required_{key}": ({key: None}, f"config.json has no {key}") for key in (
        "hidden_size", "vocab_size", "num_attention_heads", "num_hidden_layers",
        "intermediate_size")},
    # named by their config.json keys (by attnlab's fields alone until 2026-12-06)
    "heads": ({"num_key_value_heads": 3}, "config.json num_attention_heads, num_key_value_heads "
              "(attnlab's ModelConfig.num_heads, ModelConfig.num_kv_heads) gives an invalid "
              "attnlab config: num_heads=4 must be a multiple of num_kv_heads=3"),
    # Values of the wrong type or size: one error, not a traceback (until 2026-12-04 a
    # ZeroDivisionError, TypeErrors and a ValueError from int()), nor a string read as a bool.
    "zero_heads": ({"num_attention_heads": 0}, "config.json num_attention_heads (attnlab's "
                   "ModelConfig.num_heads) gives an invalid attnlab config: num_heads=0 must be "
                   "a positive integer"),
    "size_as_text": ({"hidden_size": "64"}, "config.json hidden_size (attnlab's "
                     "ModelConfig.d_model) gives an invalid attnlab config: d_model='64' must "
                     "be a positive integer"),
    "vocab_as_text": ({"vocab_size": "abc"}, "config.json vocab_size (attnlab's "
                      "ModelConfig.vocab_size) gives an invalid attnlab config: "),
    "window": ({"model_type": "mistral", "sliding_window": 0}, "config.json sliding_window "
               "(attnlab's ModelConfig.window) gives an invalid attnlab config: window=0"),
    "eps": ({"rms_norm_eps": 0.0}, "config.json rms_norm_eps (attnlab's ModelConfig.norm_eps) "
            "gives an invalid attnlab config: norm_eps=0.0"),

    "theta_list": ({"rope_theta": [1.0]}, "config.json gives an invalid attnlab config: "),
    "tie_as_text": ({"tie_word_embeddings": "false"}, "config.json tie_word_embeddings='false' "
                    "is not supported (supported: False, True)"),
    "qwen2_window": ({"model_type": "qwen2", "use_sliding_window": True, "layer_types": None,
                      "max_window_layers": 1},
                     "config.json use_sliding_window=True with max_window_layers=1 and "
                     "num_hidden_layers=2 gives layers a sliding window, which is not "
                     "supported (only full attention: max_window_layers >= num_hidden_layers)"),
    "qwen2_window_default": ({"model_type": "qwen2", "use_sliding_window": True,
                              "layer_types": None, "num_hidden_layers": 30},
                             "with max_window_layers=28 and num_hidden_layers=30"),
    "qwen2_window_layers": ({"model_type": "qwen2", "use_sliding_window": True,
                             "layer_types": ["full_attention", "sliding_attention"]},
                            "layer_types=['full_attention', 'sliding_attention'] is not"),
    "qwen2_layers": ({"model_type": "qwen2", "layer_types": ["full_attention",
                                                             "sliding_attention"]},
                     "layer_types=['full_attention', 'sliding_attention'] is not supported "
                     "(only 'full_attention' layers)"),
}
GPT2_BAD = {
    "activation": ({"activation_function": "relu"}, "activation_function='relu' is not "
                   "supported (supported: 'gelu_new', 'gelu_pytorch_tanh', 'gelu_fast')"),
    "scale": ({"scale_attn_weights": False}, "scale_attn_weights=False is not supported"),
    "layer_idx": ({"scale_attn_by_inverse_layer_idx": True},
                  "scale_attn_by_inverse_layer_idx=True is not supported"),
    "cross": ({"add_cross_attention": True}, "add_cross_attention=True is not supported"),
    **{f"required_{key}": ({key: None}, f"config.json has no {key}") for key in (
        "n_layer", "n_embd", "n_head", "vocab_size")},
    "heads": ({"n_head": 5}, "config.json n_embd, n_head (attnlab's ModelConfig.d_model, "
              "ModelConfig.num_heads) gives an invalid attnlab config: "),
    "positions": ({"n_positions": 0}, "config.json n_positions (attnlab's ModelConfig.max_len) "
                  "gives an invalid attnlab config: max_len=0"),
}


def test_an_invalid_value_names_only_the_keys_the_file_holds():
  """A value the file does not hold (Mistral's default of 8 KV heads, a head_dim derived from
  hidden_size) is not named as a config.json key; a family default is said to be one (until
  2026-12-06 the 8 came from nowhere the message said)."""
  mistral = {k: v for k, v in LLAMA.items() if k != "num_key_value_heads"}
  mistral.update(model_type="mistral", num_attention_heads=12, hidden_size=48)
  with pytest.raises(hf.ConversionError) as e:
    hf.from_hf_config(mistral)
  assert str(e.value) == (
      "config.json num_attention_heads (attnlab's ModelConfig.num_heads) gives an invalid "
      "attnlab config: num_heads=12 must be a multiple of num_kv_heads=8 (config.json has no "
      "num_key_value_heads: mistral's default is 8)")


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_llama_family_config_refusals_name_the_field(case):
  change, message = BAD_CONFIGS[case]
  with pytest.raises(hf.ConversionError) as e:
    hf.from_hf_config(dict(LLAMA, **change))
  assert message in str(e.value)
  if "invalid attnlab config" not in message:  # its own message, not wrapped
    assert "gives an invalid attnlab config" not in str(e.value), str(e.value)


@pytest.mark.parametrize("case", list(GPT2_BAD))
def test_gpt2_config_refusals_name_the_field(case):
  change, message = GPT2_BAD[case]
  with pytest.raises(hf.ConversionError) as e:
    hf.from_hf_config(dict(FAMILY_CONFIGS["gpt2"], **change))
  assert message in str(e.value)


def test_accepted_variants_of_refused_fields():
  for act in hf.GPT2_GELUS:
    assert hf.from_hf_config(dict(FAMILY_CONFIGS["gpt2"], activation_function=act))[1].mlp == "gelu"
  for name, want in (("fp16", "float16"), ("bf16", "bfloat16"), ("float32", "float32")):
    assert hf.from_hf_config(dict(LLAMA, torch_dtype=name))[1].param_dtype == want
  assert hf.from_hf_config(dict(LLAMA, torch_dtype=None, dtype="fp32"))[1].dtype == "float32"
  assert hf.from_hf_config(dict(LLAMA, rope_parameters={"partial_rotary_factor": 1.0}))[1]
  assert hf.from_hf_config(dict(LLAMA, model_type="qwen2", layer_types=None))[0] == "qwen2"
  # use_sliding_window with no layer reaching the window (max_window_layers >= the layers,
  # or a null window; or layer_types saying so) is full attention, as transformers computes
  # it: taken (refused until 2026-12-06).
  qwen = dict(FAMILY_CONFIGS["qwen2"], use_sliding_window=True)
  full = hf.from_hf_config(FAMILY_CONFIGS["qwen2"])[1]
  for changes in ({}, {"layer_types": None, "max_window_layers": 2},
                  {"layer_types": None, "max_window_layers": 1, "sliding_window": None}):
    family, cfg = hf.from_hf_config(dict(qwen, **changes))
    assert (family, cfg) == ("qwen2", full), changes


EXPORT_REFUSALS = {
    "arch": (dict(arch="encoder_decoder"), "ModelConfig.arch='encoder_decoder' has no "
             "transformers layout here (only 'decoder_only' exports)"),
    "post_norm": (dict(norm_position="post"), "ModelConfig.norm_position='post' has no "
                  "transformers layout here (all four layouts are 'pre')"),
    "scaled": (dict(scale_embeddings=True), "ModelConfig.scale_embeddings=True has no "
               "transformers layout here (no layout scales embeddings)"),
    "sinusoidal": (dict(pos="sinusoidal"), "ModelConfig.pos='sinusoidal' has no transformers "
                   "layout here (llama / mistral / qwen2 need 'rope', gpt2 'learned')"),
    "pairing": (dict(rope_pairing="adjacent"), "ModelConfig.rope_pairing='adjacent'"),
    "norm": (dict(norm="layernorm"), "ModelConfig.norm='layernorm' has no transformers layout "
             "here (llama / mistral / qwen2 need 'rmsnorm')"),
    "mlp": (dict(mlp="gelu"), "ModelConfig.mlp='gelu'"),
    "window_bias": (dict(window=4, qkv_bias=True), "ModelConfig.window=4 has no transformers "
                    "layout here (mistral, the sliding-window layout, has no biases)"),
    "window_mlp_bias": (dict(window=4, mlp_bias=True), "ModelConfig.window=4"),
    "window_o_bias": (dict(window=4, o_bias=True), "ModelConfig.window=4"),
    "d_model_bias": (dict(d_model=D + 2, head_dim=8, use_bias=True), "ModelConfig.d_model="
                     f"{D + 2} has no transformers layout here (transformers' llama needs a "
                     "multiple of num_heads, and mistral, which does not, has no biases)"),
    "d_model_mlp_bias": (dict(d_model=D + 2, head_dim=8, mlp_bias=True), "ModelConfig.d_model="),
    "o_only": (dict(o_bias=True), "ModelConfig.o_bias=True has no transformers layout here "
               "(llama's attention_bias covers q, k, v and o together"),
    "qkv_mlp": (dict(qkv_bias=True, mlp_bias=True), "ModelConfig.o_bias="),
    "gpt2_norm": (dict(pos="learned", mlp="gelu", use_bias=True),
                  "ModelConfig.norm='rmsnorm' has no transformers layout here (gpt2 needs "
                  "'layernorm')"),
    "gpt2_mlp": (dict(pos="learned", norm="layernorm", use_bias=True), "ModelConfig.mlp="),
    "gpt2_window": (dict(pos="learned", norm="layernorm", mlp="gelu", use_bias=True, window=3),
                    "ModelConfig.window=3"),
    "gpt2_gqa": (dict(pos="learned", norm="layernorm", mlp="gelu", use_bias=True,
                      num_kv_heads=2), "ModelConfig.num_kv_heads=2 has no transformers layout "
                 "here (gpt2 is multi-head: num_kv_heads = num_heads)"),
    "gpt2_head_dim": (dict(pos="learned", norm="layernorm", mlp="gelu", use_bias=True,
                           head_dim=8), "ModelConfig.head_dim=8 has no transformers layout "
                      "here (gpt2 needs head_dim = d_model / num_heads)"),
    "gpt2_no_bias": (dict(pos="learned", norm="layernorm", mlp="gelu"),
                     "ModelConfig.use_bias=False has no transformers layout here (gpt2 has "
                     "biases on every projection)"),
    "gpt2_mlp_bias": (dict(pos="learned", norm="layernorm", mlp="gelu", use_bias=True,
                           mlp_bias=False), "ModelConfig.mlp_bias=False"),
    "gpt2_o_bias": (dict(pos="learned", norm="layernorm", mlp="gelu", use_bias=True,
                         o_bias=False), "ModelConfig.o_bias=False"),
}


@pytest.mark.parametrize("case", list(EXPORT_REFUSALS))
def test_export_refusals_name_the_field(case):
  change, message = EXPORT_REFUSALS[case]
  base = dict(vocab_size=V, d_model=D, num_layers=L, num_heads=N, d_ff=F)
  with pytest.raises(hf.ConversionError) as e:
    hf.hf_family(ModelConfig(**{**base, **change}))
  assert message in str(e.value)


def test_export_families():
  base = dict(vocab_size=V, d_model=D, num_layers=L, num_heads=N, d_ff=F)
  assert hf.hf_family(ModelConfig(**base)) == "llama"
  assert hf.hf_family(ModelConfig(**base, use_bias=True)) == "llama"
  assert hf.hf_family(ModelConfig(**base, qkv_bias=True, o_bias=True)) == "llama"
  assert hf.hf_family(ModelConfig(**base, qkv_bias=True)) == "qwen2"
  assert hf.hf_family(ModelConfig(**base, window=5)) == "mistral"
  # transformers' LlamaConfig refuses a hidden_size no multiple of the heads; Mistral's
  # without a window is the same model
  assert hf.hf_family(ModelConfig(**dict(base, d_model=D + 2), head_dim=8)) == "mistral"
  assert hf.hf_family(ModelConfig(**dict(base, d_model=D + 2), head_dim=8,
                                  qkv_bias=True)) == "qwen2"
  assert hf.hf_family(ModelConfig(**base, pos="learned", norm="layernorm", mlp="gelu",
                                  use_bias=True)) == "gpt2"


# --------------------------------------------------------------------------- files


def test_unreadable_config_json(tmp_path):
  with pytest.raises(hf.ConversionError, match="is not a directory"):
    hf.read_hf_config(str(tmp_path / "nowhere"))
  with pytest.raises(hf.ConversionError, match="config.json does not exist: not a "
                     "transformers checkpoint directory"):
    hf.read_hf_config(str(tmp_path))
  # A folder or a FIFO there is named as one (both read "does not exist" until 2026-12-07).
  for make, kind in ((os.mkdir, "a folder"), (os.mkfifo, "a FIFO")):
    make(tmp_path / "config.json")
    with pytest.raises(hf.ConversionError) as e:
      hf.read_hf_config(str(tmp_path))
    assert str(e.value) == (f"{tmp_path / 'config.json'} is {kind}, not a regular file: put "
                            "the checkpoint's config.json there")
    (os.rmdir if kind == "a folder" else os.remove)(tmp_path / "config.json")
  (tmp_path / "config.json").write_text("{not json")
  with pytest.raises(hf.ConversionError, match="config.json is not readable JSON"):
    hf.read_hf_config(str(tmp_path))
  (tmp_path / "config.json").write_text("[1, 2]")
  with pytest.raises(hf.ConversionError, match="config.json holds list, not a JSON object"):
    hf.read_hf_config(str(tmp_path))
  (tmp_path / "config.json").write_text('{"model_type": "llama"}')
  assert hf.read_hf_config(str(tmp_path)) == {"model_type": "llama"}


def test_tensor_files_errors(tmp_path, monkeypatch):
  with pytest.raises(hf.ConversionError) as e:
    hf.tensor_files(str(tmp_path))
  assert str(e.value) == (f"{tmp_path} holds no *.safetensors file (a pytorch_model.bin is not "
                          "read: re-save it with save_pretrained, which writes safetensors)")
  index = tmp_path / "model.safetensors.index.json"
  index.write_text('{"metadata": {}}')
  with pytest.raises(hf.ConversionError, match="has no readable weight_map"):
    hf.tensor_files(str(tmp_path))
  index.write_text('{"weight_map": {"a.weight": "model-00001.safetensors"}}')
  with pytest.raises(hf.ConversionError, match="names model-00001.safetensors for tensor "
                     "a.weight, which does not exist"):
    hf.tensor_files(str(tmp_path))
  # A weight_map that is a list, or names no file: one error (tracebacks until 2026-12-04).
  for bad in ('{"weight_map": ["a.weight"]}', '{"weight_map": {"a.weight": null}}'):
    index.write_text(bad)
    with pytest.raises(hf.ConversionError, match="weight_map is not an object of tensor name: "
                       "file name"):
      hf.tensor_files(str(tmp_path))
  # without an index, every *.safetensors file's header is read (other files are not)
  index.unlink()
  save_file({"a": np.zeros(2, np.float32)}, str(tmp_path / "one.safetensors"))
  save_file({"b": np.zeros(3, np.float32), "c": np.ones(1, np.float32)},
            str(tmp_path / "two.safetensors"))
  (tmp_path / "notes.txt").write_text("x")
  (tmp_path / "folder.safetensors").mkdir()  # not a file: not read (an OSError until 2026-12-04)
  assert hf.tensor_files(str(tmp_path)) == {"a": str(tmp_path / "one.safetensors"),
                                            "b": str(tmp_path / "two.safetensors"),
                                            "c": str(tmp_path / "two.safetensors")}
  # A tensor in two files (two saves in one folder, no index) is refused, naming both (until
  # 2026-12-06 the later file in sorted order was read, silently).
  save_file({"c": np.zeros(1, np.float32)}, str(tmp_path / "three.safetensors"))
  with pytest.raises(hf.ConversionError) as e:
    hf.tensor_files(str(tmp_path))
  assert str(e.value) == (f"tensor c is in both three.safetensors and two.safetensors of "
                          f"{tmp_path} (and no model.safetensors.index.json says which to "
                          "read): remove the stale file")
  (tmp_path / "three.safetensors").unlink()
  # A damaged file (cut short: its header no longer covers it) is named, not a traceback.
  whole = (tmp_path / "two.safetensors").read_bytes()
  (tmp_path / "two.safetensors").write_bytes(whole[:len(whole) // 2])
  with pytest.raises(hf.ConversionError, match=re.escape(
      f"{tmp_path / 'two.safetensors'} is not a readable safetensors file: ")):
    hf.tensor_files(str(tmp_path))
  # So is a file the system cannot read (an I/O error; root reads past permissions, so the
  # error is made by hand).
  import safetensors

  def unreadable(path, framework):
    raise OSError(5, "Input/output error")

  monkeypatch.setattr(safetensors, "safe_open", unreadable)
  with pytest.raises(hf.ConversionError, match=re.escape(
      f"{tmp_path / 'one.safetensors'} is not a readable safetensors file: [Errno 5] "
      "Input/output error")):
    hf.tensor_files(str(tmp_path))


def _bad_tensors(change):
  tensors = random_tensors(shapes_of(LLAMA), seed=7)
  change(tensors)
  return tensors


BAD_TENSORS = {
    "missing": (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
                "tensor model.layers.1.mlp.up_proj.weight is missing from the checkpoint"),
    "wrong_shape": (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight":
                                        np.zeros((D, D), np.float32)}),
                    f"tensor model.layers.0.self_attn.k_proj.weight has shape [{D}, {D}], "
                    f"expected [24, {D}] from config.json"),
    "wrong_vector": (lambda t: t.update({"model.norm.weight": np.zeros(D + 1, np.float32)}),
                     f"tensor model.norm.weight has shape [{D + 1}], expected [{D}]"),
    "extra": (lambda t: t.update({"model.layers.0.self_attn.q_norm.weight":
                                  np.ones(12, np.float32)}),
              "tensor model.layers.0.self_attn.q_norm.weight has no place in a llama model "
              "with this config.json (an unsupported feature?)"),
    "bias_not_in_config": (lambda t: t.update({"model.layers.1.self_attn.q_proj.bias":
                                               np.ones(4 * 12, np.float32)}),
                           "tensor model.layers.1.self_attn.q_proj.bias has no place"),
    # GPT-2's mask buffers end in ".attn.bias"; this is no buffer (skipped until 2026-12-04)
    "self_attn_bias": (lambda t: t.update({"model.layers.0.self_attn.bias":
                                           np.ones(D, np.float32)}),
                       "tensor model.layers.0.self_attn.bias has no place"),
}


def test_a_tied_model_refuses_unknown_tensors_too(tmp_path):
  c = FAMILY_CONFIGS["llama_mqa_tied"]
  tensors = random_tensors(shapes_of(c), seed=7)
  tensors["model.layers.0.self_attn.k_norm.weight"] = np.ones(12, np.float32)
  src = write_checkpoint(tmp_path / "hf", c, tensors)
  with pytest.raises(hf.ConversionError, match="tensor model.layers.0.self_attn.k_norm.weight "
                     "has no place in a llama model"):
    hf.check_tensors(*hf.from_hf_config(c), hf.tensor_files(src))


@pytest.mark.parametrize("case", list(BAD_TENSORS))
def test_tensor_refusals_name_the_tensor(case, tmp_path):
  change, message = BAD_TENSORS[case]
  src = write_checkpoint(tmp_path / "hf", LLAMA, _bad_tensors(change))
  family, cfg = hf.from_hf_config(LLAMA)
  with pytest.raises(hf.ConversionError) as e:
    hf.check_tensors(family, cfg, hf.tensor_files(src))
  assert message in str(e.value)


def test_an_index_that_places_a_tensor_in_the_wrong_file_is_named(tmp_path):
  src = write_checkpoint(tmp_path / "hf", LLAMA, random_tensors(shapes_of(LLAMA), seed=7))
  files = hf.tensor_files(src)
  other = tmp_path / "other.safetensors"
  save_file({"x": np.zeros(2, np.float32)}, str(other))
  files["model.norm.weight"] = str(other)  # what a wrong weight_map entry gives
  with pytest.raises(hf.ConversionError, match=re.escape(
      f"{other} is not a readable safetensors file: ")):
    hf.check_tensors(*hf.from_hf_config(LLAMA), files)


def test_buffers_and_a_tied_head_are_not_refused(tmp_path):
  """Old checkpoints carry rotary inv_freq / attention-mask buffers, and some tied ones
  store lm_head.weight anyway (a copy of the embedding): none of it is a weight. A tied
  config whose lm_head.weight differs from the embedding is refused: transformers would use
  that head untied (until 2026-12-04 attnlab dropped it and gave other logits; a review
  found it)."""
  c = FAMILY_CONFIGS["llama_mqa_tied"]
  tensors = random_tensors(shapes_of(c), seed=8)
  extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(6, np.float32),
           "lm_head.weight": tensors["model.embed_tokens.weight"].copy()}
  src = write_checkpoint(tmp_path / "llama", c, tensors | extra)
  _, _, model = import_checkpoint(src)
  np.testing.assert_array_equal(
      flat_params(model)[("embedder", "embed_tokens")], tensors["model.embed_tokens.weight"])
  extra["lm_head.weight"] = np.full((V, D), 9.0, np.float32)
  src = write_checkpoint(tmp_path / "llama_other_head", c, tensors | extra)
  with pytest.raises(hf.ConversionError, match=re.escape(
      "config.json ties the embeddings (tie_word_embeddings true), but the checkpoint's "
      "lm_head.weight differs from model.embed_tokens.weight: transformers would use that "
      "head untied; set tie_word_embeddings to false in config.json to import it")):
    hf.check_tensors(*hf.from_hf_config(c), hf.tensor_files(src))
  # Compared a block of rows at a time (no whole second copy of the tensor): a difference
  # in the last, partial block is found too.
  head = tensors["model.embed_tokens.weight"].copy()
  head[-1, -1] += 1.0
  src = write_checkpoint(tmp_path / "llama_last_row", c, tensors | {"lm_head.weight": head})
  with pytest.raises(hf.ConversionError, match="lm_head.weight differs"):
    hf._check_tied_head(hf.tensor_files(src), "model.embed_tokens.weight", rows=8)
  hf._check_tied_head(hf.tensor_files(tmp_path / "llama"), "model.embed_tokens.weight", rows=8)
  # A head of another shape differs too (its rows are not read past the embedding's end).
  longer = np.concatenate([tensors["model.embed_tokens.weight"], np.zeros((1, D), np.float32)])
  src = write_checkpoint(tmp_path / "llama_longer", c, tensors | {"lm_head.weight": longer})
  with pytest.raises(hf.ConversionError) as e:
    hf.check_tensors(*hf.from_hf_config(c), hf.tensor_files(src))
  assert str(e.value) == (
      "config.json ties the embeddings (tie_word_embeddings true), but the checkpoint's "
      "lm_head.weight differs from model.embed_tokens.weight: transformers would use that "
      "head untied; set tie_word_embeddings to false in config.json to import it")
  g = FAMILY_CONFIGS["gpt2"]
  tensors = random_tensors(shapes_of(g), seed=8)
  extra = {"transformer.h.0.attn.bias": np.ones((1, 1, 4, 4), np.float32),
           "transformer.h.1.attn.masked_bias": np.ones(1, np.float32)}
  family, cfg = hf.from_hf_config(g)
  src = write_checkpoint(tmp_path / "gpt2", g, tensors | extra)
  rules = hf.check_tensors(family, cfg, hf.tensor_files(src))
  assert {n for r in rules for n in r.hf_names} == set(tensors)
  # GPT-2 (tied by default) with a stored lm_head.weight: compared with wte.weight.
  head = {"lm_head.weight": tensors["transformer.wte.weight"].copy()}
  src = write_checkpoint(tmp_path / "gpt2_head", g, tensors | head)
  assert hf.check_tensors(family, cfg, hf.tensor_files(src))
  head["lm_head.weight"][0, 0] += 1.0
  src = write_checkpoint(tmp_path / "gpt2_other_head", g, tensors | head)
  with pytest.raises(hf.ConversionError, match=re.escape(
      "lm_head.weight differs from transformer.wte.weight: transformers would use that head "
      "untied")):
    hf.check_tensors(family, cfg, hf.tensor_files(src))
  # untied, lm_head.weight is a weight like any other: required
  untied = dict(c, tie_word_embeddings=False)
  with pytest.raises(hf.ConversionError, match="tensor lm_head.weight is missing"):
    hf.check_tensors(*hf.from_hf_config(untied), hf.tensor_files(
        write_checkpoint(tmp_path / "untied", untied, random_tensors(shapes_of(c)))))


def test_the_tied_head_is_compared_a_block_of_rows_at_a_time(monkeypatch):
  """``_check_tied_head`` reads the head and the embedding ``rows`` rows at a time (4096 by
  default), each row once, first to last: neither tensor is held whole, and a difference in
  any row, the first and the last included, is found. (The files are stand-ins that record
  the slices read.)"""
  emb = np.arange(10000 * 2, dtype=np.float32).reshape(10000, 2)
  tensors = {"lm_head.weight": emb.copy(), "model.embed_tokens.weight": emb}
  read = []

  class Slice:
    def __init__(self, name):
      self.name = name

    def get_shape(self):
      return list(tensors[self.name].shape)

    def __getitem__(self, key):
      read.append((self.name, key.start, key.stop, key.step))
      return tensors[self.name][key]

  class File:
    def get_slice(self, name):
      return Slice(name)

  @contextlib.contextmanager
  def stand_in(path):
    yield File()

  monkeypatch.setattr(hf, "_safetensors", stand_in)
  files = {"lm_head.weight": "head.safetensors", "model.embed_tokens.weight": "emb.safetensors"}
  hf._check_tied_head(files, "model.embed_tokens.weight")
  assert read == [(name, start, stop, None)
                  for start, stop in ((0, 4096), (4096, 8192), (8192, 10000))
                  for name in ("lm_head.weight", "model.embed_tokens.weight")]
  for row in (0, 7, 8, 9999):
    tensors["lm_head.weight"] = emb.copy()
    tensors["lm_head.weight"][row, 1] = -1.0
    del read[:]
    with pytest.raises(hf.ConversionError, match="lm_head.weight differs from "
                       "model.embed_tokens.weight"):
      hf._check_tied_head(files, "model.embed_tokens.weight", rows=8)
    assert read[-2:] == [(name, row // 8 * 8, row // 8 * 8 + 8, None)
                         for name in ("lm_head.weight", "model.embed_tokens.weight")], row
