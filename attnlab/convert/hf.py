"""transformers checkpoints: config mapping and a weight name table.

Four layouts are supported, read from and written to a local directory in
the transformers format (``config.json`` + ``*.safetensors``, sharded or
not):

  llama    GQA, RoPE (rotate-half pairing, the layout transformers stores),
           RMSNorm, SwiGLU, tied or untied embeddings; optional biases.
  mistral  llama + ``sliding_window``.
  qwen2    llama + biases on the q/k/v projections only.
  gpt2     learned positions, LayerNorm, GELU (tanh approximation), one fused
           ``c_attn`` Conv1D ([in, out] weights) for q/k/v, biases everywhere.

A config field that would change the math and that attnlab does not
implement raises ``ConversionError`` naming the field: a wrong import is
worse than none. Weights move one tensor at a time (``safe_open`` reads
lazily), so a conversion holds one full copy of the weights plus one tensor
(reading) or one shard (writing).

The weight table is a list of ``Rule``: HF tensor name(s), attnlab parameter
path(s) and two pure reshape functions, one per direction. transformers,
safetensors and tokenizers are optional: they are imported inside the
functions that need them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
from collections.abc import Callable

import numpy as np

from attnlab.config import ModelConfig, is_integer
from attnlab.data.tokenizer import not_a_regular_file

FAMILIES = ("llama", "mistral", "qwen2", "gpt2")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "gpt2": "GPT2LMHeadModel"}
# What transformers' config classes (5.x) take for a key a config.json leaves out, where the
# families differ: a hand-written config.json must mean to attnlab what it means to them.
FAMILY_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048, "num_key_value_heads": None},
    "mistral": {"max_position_embeddings": 131072, "num_key_value_heads": 8,
                "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32,
              "sliding_window": 4096, "max_window_layers": 28},
}  # num_key_value_heads None: num_attention_heads
# The eos id of a config.json without the key: transformers' config classes' default, which
# its generate stops at. (A missing bos stays None: the prompts' bos is then what the
# tokenizer.json's post-processor puts in front, as transformers' tokenizer does.)
EOS_DEFAULTS = {"llama": 2, "mistral": 2, "gpt2": 50256}
# transformers' tanh-approximated GELUs (attnlab's "gelu" is that approximation).
GPT2_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
               "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# Tensors some checkpoints carry that hold no weights (buffers of old versions): a rotary
# table, GPT-2's causal mask ("h.N.attn.bias"). Matched from the dot before the module, so
# a weight such as "self_attn.bias" is not taken for one (until 2026-12-04 it was skipped).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


class ConversionError(ValueError):
  """Input that cannot be converted; the message names the field or tensor."""


# --------------------------------------------------------------------------- configs


def read_hf_config(src_dir: str) -> dict:
  """``src_dir/config.json`` as a dict."""
  path = os.path.join(src_dir, "config.json")
  if not os.path.isdir(src_dir):
    raise ConversionError(f"--from-hf {src_dir} is not a directory")
  kind = not_a_regular_file(path)  # a FIFO is not opened (it would wait for a writer)
  if kind is not None:  # "does not exist" until 2026-12-07
    raise ConversionError(f"{path} is {kind}, not a regular file: put the checkpoint's "
                          "config.json there")
  if not os.path.isfile(path):
    raise ConversionError(f"{path} does not exist: not a transformers checkpoint directory")
  try:
    with open(path, encoding="utf-8") as f:
      hf = json.load(f)
  except (OSError, ValueError) as e:
    raise ConversionError(f"{path} is not readable JSON: {e}") from None
  if not isinstance(hf, dict):
    raise ConversionError(f"{path} holds {type(hf).__name__}, not a JSON object")
  return hf


def _get(hf: dict, key: str, default=None, *, required: bool = False):
  if key not in hf or hf[key] is None:
    if required:
      raise ConversionError(f"config.json has no {key}")
    return default
  return hf[key]


def _expect(hf: dict, key: str, allowed: tuple, default):
  value = _get(hf, key, default)
  if value not in allowed:
    raise ConversionError(f"config.json {key}={value!r} is not supported "
                          f"(supported: {', '.join(map(repr, allowed))})")
  return value


def _rope_theta(hf: dict) -> float:
  """The RoPE base; any rope scaling other than "default" is refused."""
  params = hf.get("rope_parameters")
  scaling = hf.get("rope_scaling")
  for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
    if value is None:
      continue
    if not isinstance(value, dict):
      raise ConversionError(f"config.json {key}={value!r} is not a JSON object")
    kind = value.get("rope_type", value.get("type", "default"))
    if kind != "default":
      raise ConversionError(f"config.json {key}.rope_type={kind!r} is not supported "
                            "(only 'default' RoPE, no scaling)")
    factor = value.get("partial_rotary_factor", 1.0)
    if factor != 1.0:
      raise ConversionError(f"config.json {key}.partial_rotary_factor={factor!r} is not "
                            "supported (only 1.0)")
  if hf.get("partial_rotary_factor", 1.0) != 1.0:
    raise ConversionError(f"config.json partial_rotary_factor={hf['partial_rotary_factor']!r} "
                          "is not supported (only 1.0)")
  theta = (params or {}).get("rope_theta", hf.get("rope_theta", 10000.0))
  return float(theta)


def _dtype(hf: dict) -> str:
  name = hf.get("dtype", hf.get("torch_dtype")) or "float32"
  if name not in DTYPE_NAMES:
    raise ConversionError(f"config.json dtype={name!r} is not supported "
                          f"(supported: {', '.join(sorted(set(DTYPE_NAMES.values())))})")
  return DTYPE_NAMES[name]


def _in_vocab(value, vocab_size: int) -> bool:
  """Whether a config.json value is a token id of the vocabulary (an int, not a bool)."""
  return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def _vocab_size(hf: dict) -> int:
  """config.json's vocab_size, 0 (no id fits) where it is not an int."""
  vocab = _get(hf, "vocab_size", 0)
  return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else 0


def _special_id(hf: dict, key: str, vocab_size: int, default: int | None = None) -> int | None:
  value = hf.get(key, default)  # a null is None; a missing key the family's default
  if isinstance(value, list):  # several eos ids (Llama 3): the first in the vocabulary
    return next((v for v in value if _in_vocab(v, vocab_size)), None)
  return value if _in_vocab(value, vocab_size) else None


def special_ids(hf: dict) -> dict:
  """bos / eos / pad ids of config.json, a missing eos key taken as transformers' config
  class has it (``EOS_DEFAULTS``: Llama's 2, GPT-2's 50256); ids outside the vocabulary
  are None."""
  vocab = _vocab_size(hf)
  defaults = {"eos": EOS_DEFAULTS.get(hf.get("model_type"))}
  return {name: _special_id(hf, f"{name}_token_id", vocab, defaults.get(name))
          for name in ("bos", "eos", "pad")}


def eos_ids(hf: dict) -> list[int]:
  """Every eos id of config.json inside the vocabulary, in its order: ``eos_token_id`` may be
  one id or a list (Llama 3.1 lists ``<|end_of_text|>``, ``<|eom_id|>``, ``<|eot_id|>``),
  and transformers stops at any of them when no generation_config.json says otherwise."""
  vocab, value = _vocab_size(hf), hf.get("eos_token_id")
  values = value if isinstance(value, list) else [value]
  return list(dict.fromkeys(i for i in values if _in_vocab(i, vocab)))


# attnlab's ModelConfig field -> the config.json key it is read from, per layout: an invalid
# value is named by its key (until 2026-12-06 by the attnlab field alone: "num_heads=0").
HF_KEYS = {"num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
           "num_layers": "num_hidden_layers", "d_model": "hidden_size",
           "d_ff": "intermediate_size", "norm_eps": "rms_norm_eps",
           "max_len": "max_position_embeddings", "window": "sliding_window",
           "head_dim": "head_dim", "vocab_size": "vocab_size", "rope_theta": "rope_theta",
           "pad_id": "pad_token_id"}
GPT2_KEYS = {**HF_KEYS, "num_heads": "n_head", "num_layers": "n_layer", "d_model": "n_embd",
             "d_ff": "n_inner", "norm_eps": "layer_norm_epsilon", "max_len": "n_positions"}


def _invalid(e: Exception, keys: dict, hf: dict) -> ConversionError:
  """The ModelConfig error of a config.json value, named by its config.json key(s): those
  the file holds; a value the family's default gave for a key the file lacks is said to be
  that default (until 2026-12-06 a Mistral config without num_key_value_heads was blamed on
  its num_attention_heads alone); one under rope_parameters is left to the message itself."""
  named = [f for f in dict.fromkeys(re.findall(r"\b(\w+)=", str(e))) if f in keys]
  fields = [f for f in named if keys[f] in hf]
  where = "config.json"
  if fields:
    where += (f" {', '.join(keys[f] for f in fields)} (attnlab's "
              f"{', '.join('ModelConfig.' + f for f in fields)})")
  family = hf.get("model_type")
  defaults = FAMILY_DEFAULTS.get(family, {})
  notes = "".join(f" (config.json has no {keys[f]}: {family}'s default is {defaults[keys[f]]})"
                  for f in named if keys[f] not in hf and defaults.get(keys[f]) is not None)
  return ConversionError(f"{where} gives an invalid attnlab config: {e}{notes}")


def from_hf_config(hf: dict, *, dtype: str | None = None) -> tuple[str, ModelConfig]:
  """(family, ModelConfig) of a transformers config.json dict.

  Args:
    hf: the parsed config.json.
    dtype: parameter and compute dtype; None = the checkpoint's own.

  Raises:
    ConversionError: an unknown model_type or a field attnlab does not
      implement (the message names it).
  """
  family = hf.get("model_type")
  if family not in FAMILIES:
    raise ConversionError(f"config.json model_type={family!r} is not supported "
                          f"(supported: {', '.join(map(repr, FAMILIES))})")
  dtype = dtype or _dtype(hf)
  pad = special_ids(hf)["pad"]
  common = dict(arch="decoder_only", vocab_size=_get(hf, "vocab_size", required=True),
                dtype=dtype, param_dtype=dtype, pad_id=0 if pad is None else pad,
                norm_position="pre", scale_embeddings=False)
  if family == "gpt2":
    return family, _gpt2_config(hf, common)
  _expect(hf, "hidden_act", ("silu",), "silu")
  d_model = _get(hf, "hidden_size", required=True)
  num_heads = _get(hf, "num_attention_heads", required=True)
  head_dim = _get(hf, "head_dim", None)
  defaults = FAMILY_DEFAULTS[family]
  window = None
  bias = dict(qkv_bias=False, o_bias=False, mlp_bias=False)
  if family == "llama":
    attention_bias = _expect(hf, "attention_bias", (False, True), False)
    bias = dict(qkv_bias=attention_bias, o_bias=attention_bias,
                mlp_bias=_expect(hf, "mlp_bias", (False, True), False))
  elif family == "mistral":  # a null window is none; a missing one the class default
    window = hf.get("sliding_window", defaults["sliding_window"])
  else:  # qwen2: biases on q/k/v, hard-wired in transformers
    bias["qkv_bias"] = True
    use_window = _expect(hf, "use_sliding_window", (False, True), False)
    layer_types = hf.get("layer_types") or []
    if not layer_types and use_window:
      # As transformers derives them: a window (if any) from layer max_window_layers on. A
      # window that no layer reaches is full attention (refused until 2026-12-06).
      layers = _get(hf, "num_hidden_layers", required=True)
      first = hf.get("max_window_layers", defaults["max_window_layers"])
      if hf.get("sliding_window", defaults["sliding_window"]) is not None and not (
          is_integer(layers) and is_integer(first) and first >= layers):
        raise ConversionError(
            f"config.json use_sliding_window=True with max_window_layers={first!r} and "
            f"num_hidden_layers={layers!r} gives layers a sliding window, which is not "
            "supported (only full attention: max_window_layers >= num_hidden_layers)")
    if any(t != "full_attention" for t in layer_types):
      raise ConversionError(f"config.json layer_types={layer_types!r} is not supported "
                            "(only 'full_attention' layers)")
  # As transformers reads it: a missing field is the family's class default, a null one
  # (as a null default) num_attention_heads.
  num_kv_heads = hf.get("num_key_value_heads", defaults["num_key_value_heads"])
  try:
    cfg = ModelConfig(
        **common, d_model=d_model, num_layers=_get(hf, "num_hidden_layers", required=True),
        num_heads=num_heads, num_kv_heads=num_heads if num_kv_heads is None else num_kv_heads,
        # An explicit head_dim is kept unless it is the one d_model / num_heads gives.
        head_dim=None if head_dim is None or head_dim * num_heads == d_model else head_dim,
        d_ff=_get(hf, "intermediate_size", required=True), pos="rope",
        rope_theta=_rope_theta(hf), rope_pairing="half", window=window, norm="rmsnorm",
        norm_eps=float(_get(hf, "rms_norm_eps", 1e-6)), mlp="swiglu", use_bias=False, **bias,
        tie_embeddings=_expect(hf, "tie_word_embeddings", (False, True), False),
        max_len=_get(hf, "max_position_embeddings", defaults["max_position_embeddings"]))
  except ConversionError:  # a field of config.json named by its own message
    raise
  except (ValueError, TypeError, ZeroDivisionError) as e:  # a size of 0, a number as text
    raise _invalid(e, HF_KEYS, hf) from None
  return family, cfg


def _gpt2_config(hf: dict, common: dict) -> ModelConfig:
  _expect(hf, "activation_function", GPT2_GELUS, "gelu_new")
  _expect(hf, "scale_attn_weights", (True,), True)
  _expect(hf, "scale_attn_by_inverse_layer_idx", (False,), False)
  _expect(hf, "add_cross_attention", (False,), False)
  d_model = _get(hf, "n_embd", required=True)
  try:
    return ModelConfig(
        **common, d_model=d_model, num_layers=_get(hf, "n_layer", required=True),
        num_heads=_get(hf, "n_head", required=True),
        d_ff=_get(hf, "n_inner", 4 * d_model), pos="learned", norm="layernorm",
        norm_eps=float(_get(hf, "layer_norm_epsilon", 1e-5)), mlp="gelu", use_bias=True,
        tie_embeddings=_expect(hf, "tie_word_embeddings", (False, True), True),
        max_len=_get(hf, "n_positions", 1024))
  except ConversionError:  # a field of config.json named by its own message
    raise
  except (ValueError, TypeError, ZeroDivisionError) as e:
    raise _invalid(e, GPT2_KEYS, hf) from None


def _dims(cfg: ModelConfig) -> tuple[int, int, int, int, int, int]:
  """(D, N, K, H, F, V), K and H resolved (the one use of the derived sizes)."""
  return (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.d_ff,
          cfg.vocab_size)


def hf_family(cfg: ModelConfig) -> str:
  """The transformers layout that computes exactly what ``cfg`` does.

  Raises:
    ConversionError: ``cfg`` has a feature none of the layouts has (the
      message names the field).
  """
  def refuse(field, allowed):
    raise ConversionError(f"ModelConfig.{field}={getattr(cfg, field)!r} has no transformers "
                          f"layout here ({allowed})")

  if cfg.arch != "decoder_only":
    refuse("arch", "only 'decoder_only' exports")
  if cfg.norm_position != "pre":
    refuse("norm_position", "all four layouts are 'pre'")
  if cfg.scale_embeddings:
    refuse("scale_embeddings", "no layout scales embeddings")
  if cfg.pos == "learned":
    D, N, K, H, _, _ = _dims(cfg)
    for field, want in (("norm", "layernorm"), ("mlp", "gelu"), ("window", None)):
      if getattr(cfg, field) != want:
        refuse(field, f"gpt2 needs {want!r}")
    if K != N:
      refuse("num_kv_heads", "gpt2 is multi-head: num_kv_heads = num_heads")
    if H * N != D:
      refuse("head_dim", "gpt2 needs head_dim = d_model / num_heads")
    for part in ("qkv", "o", "mlp"):
      if not cfg.has_bias(part):
        refuse(f"{part}_bias" if getattr(cfg, f"{part}_bias") is not None else "use_bias",
               "gpt2 has biases on every projection")
    return "gpt2"
  if cfg.pos != "rope":
    refuse("pos", "llama / mistral / qwen2 need 'rope', gpt2 'learned'")
  for field, want in (("rope_pairing", "half"), ("norm", "rmsnorm"), ("mlp", "swiglu")):
    if getattr(cfg, field) != want:
      refuse(field, f"llama / mistral / qwen2 need {want!r}")
  qkv, o, mlp = cfg.has_bias("qkv"), cfg.has_bias("o"), cfg.has_bias("mlp")
  if cfg.window is not None:
    if qkv or o or mlp:
      refuse("window", "mistral, the sliding-window layout, has no biases")
    return "mistral"
  if qkv and not o and not mlp:
    return "qwen2"
  if qkv != o:
    refuse("o_bias", "llama's attention_bias covers q, k, v and o together; qwen2 is q/k/v only")
  if cfg.d_model % cfg.num_heads:
    # transformers' LlamaConfig refuses a hidden_size that is no multiple of the heads, even
    # with head_dim given; MistralConfig takes it, and Mistral without a window computes
    # what Llama does.
    if qkv or mlp:
      refuse("d_model", "transformers' llama needs a multiple of num_heads, and mistral, "
             "which does not, has no biases")
    return "mistral"
  return "llama"


def to_hf_config(cfg: ModelConfig, *, bos_id: int | None = None, eos_id: int | None = None,
                 pad_id: int | None = None) -> dict:
  """config.json of the transformers model computing what ``cfg`` does.

  ``bos_id`` / ``eos_id`` / ``pad_id``: the tokenizer's special ids, None for none. The pad is
  not ``cfg.pad_id`` (what attnlab fills a batch with, 0 for a model imported without one):
  transformers masks every prompt token equal to ``pad_token_id`` and freezes that
  embedding row.
  """
  family = hf_family(cfg)
  _, _, K, H, _, _ = _dims(cfg)
  out = {"architectures": [ARCHITECTURES[family]], "model_type": family,
         "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings,
         "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id,
         "dtype": cfg.param_dtype, "use_cache": True}
  if family == "gpt2":
    out.update(n_embd=cfg.d_model, n_layer=cfg.num_layers, n_head=cfg.num_heads,
               n_inner=cfg.d_ff, n_positions=cfg.max_len, activation_function="gelu_new",
               layer_norm_epsilon=cfg.norm_eps, resid_pdrop=cfg.dropout_rate,
               embd_pdrop=cfg.dropout_rate, attn_pdrop=cfg.attention_dropout_rate,
               scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
               reorder_and_upcast_attn=False)
    return out
  out.update(hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
             num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
             num_key_value_heads=K, head_dim=H, hidden_act="silu",
             max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps,
             rope_theta=cfg.rope_theta,
             rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
             attention_dropout=cfg.attention_dropout_rate)
  if family == "llama":
    out.update(attention_bias=cfg.has_bias("qkv"), mlp_bias=cfg.has_bias("mlp"))
  elif family == "mistral":
    out.update(sliding_window=cfg.window)
  else:
    out.update(use_sliding_window=False, sliding_window=None,
               layer_types=["full_attention"] * cfg.num_layers)
  return out


# --------------------------------------------------------------------------- weights


@dataclasses.dataclass(frozen=True)
class Rule:
  """HF tensors <-> attnlab parameters, with one pure function per direction.

  ``to_attnlab(*hf_arrays) -> tuple of attnlab arrays`` and
  ``to_hf(*attnlab_arrays) -> tuple of hf arrays``; ``hf_shapes`` are the
  shapes the HF tensors must have.
  """

  hf_names: tuple[str, ...]
  hf_shapes: tuple[tuple[int, ...], ...]
  paths: tuple[tuple, ...]
  to_attnlab: Callable
  to_hf: Callable


def _linear(hf_name, path, in_shape, out_shape):
  """torch ``Linear`` weight [out, in] <-> attnlab [*in, *out]."""
  n_in, n_out = math.prod(in_shape), math.prod(out_shape)
  return Rule((hf_name,), ((n_out, n_in),), (path,),
              lambda w: (w.T.reshape(*in_shape, *out_shape),),
              lambda w: (w.reshape(n_in, n_out).T,))


def _conv1d(hf_name, path, in_shape, out_shape):
  """GPT-2 ``Conv1D`` weight [in, out] <-> attnlab [*in, *out]."""
  n_in, n_out = math.prod(in_shape), math.prod(out_shape)
  return Rule((hf_name,), ((n_in, n_out),), (path,),
              lambda w: (w.reshape(*in_shape, *out_shape),),
              lambda w: (w.reshape(n_in, n_out),))


def _vector(hf_name, path, shape):
  """A bias or norm vector [prod(shape)] <-> attnlab ``shape``."""
  n = math.prod(shape)
  return Rule((hf_name,), ((n,),), (path,), lambda b: (b.reshape(shape),),
              lambda b: (b.reshape(n),))


def _same(hf_name, path, shape):
  return Rule((hf_name,), (tuple(shape),), (path,), lambda x: (x,), lambda x: (x,))


def _fused_qkv(hf_name, paths, d_model, num_heads, head_dim, *, bias: bool):
  """GPT-2's ``c_attn``: q, k, v concatenated on the output axis."""
  n = num_heads * head_dim
  if bias:
    return Rule((hf_name,), ((3 * n,),), paths,
                lambda b: tuple(p.reshape(num_heads, head_dim) for p in np.split(b, 3)),
                lambda q, k, v: (np.concatenate([x.reshape(n) for x in (q, k, v)]),))
  return Rule((hf_name,), ((d_model, 3 * n),), paths,
              lambda w: tuple(p.reshape(d_model, num_heads, head_dim)
                              for p in np.split(w, 3, axis=1)),
              lambda q, k, v: (np.concatenate([x.reshape(d_model, n) for x in (q, k, v)],
                                              axis=1),))


def weight_rules(family: str, cfg: ModelConfig, prefix: str | None = None) -> list[Rule]:
  """The name table of ``family`` for the shapes of ``cfg``.

  Args:
    prefix: the HF name prefix of the base model ("model." for the Llama
      family, "transformer." for GPT-2); None = that default. Checkpoints
      saved from a base model have "".
  """
  D, N, K, H, F, V = _dims(cfg)
  if family == "gpt2":
    return _gpt2_rules(cfg, "transformer." if prefix is None else prefix)
  p = "model." if prefix is None else prefix
  rules = [_same(f"{p}embed_tokens.weight", ("embedder", "embed_tokens"), (V, D)),
           _vector(f"{p}norm.weight", ("decoder", "norm", "scale"), (D,))]
  if not cfg.tie_embeddings:
    rules.append(_linear("lm_head.weight", ("embedder", "lm_head"), (D,), (V,)))
  for i in range(cfg.num_layers):
    hf, at = f"{p}layers.{i}.", ("decoder", "layers", i)
    rules += [
        _vector(f"{hf}input_layernorm.weight", (*at, "input_layernorm", "scale"), (D,)),
        _vector(f"{hf}post_attention_layernorm.weight",
                (*at, "post_attention_layernorm", "scale"), (D,)),
        _linear(f"{hf}self_attn.q_proj.weight", (*at, "self_attn", "q_proj", "w"), (D,), (N, H)),
        _linear(f"{hf}self_attn.k_proj.weight", (*at, "self_attn", "k_proj", "w"), (D,), (K, H)),
        _linear(f"{hf}self_attn.v_proj.weight", (*at, "self_attn", "v_proj", "w"), (D,), (K, H)),
        _linear(f"{hf}self_attn.o_proj.weight", (*at, "self_attn", "o_proj", "w"), (N, H), (D,)),
        _linear(f"{hf}mlp.gate_proj.weight", (*at, "mlp", "gate_proj", "w"), (D,), (F,)),
        _linear(f"{hf}mlp.up_proj.weight", (*at, "mlp", "up_proj", "w"), (D,), (F,)),
        _linear(f"{hf}mlp.down_proj.weight", (*at, "mlp", "down_proj", "w"), (F,), (D,)),
    ]
    if cfg.has_bias("qkv"):
      for name, heads in (("q_proj", N), ("k_proj", K), ("v_proj", K)):
        rules.append(_vector(f"{hf}self_attn.{name}.bias", (*at, "self_attn", name, "b"),
                             (heads, H)))
    if cfg.has_bias("o"):
      rules.append(_vector(f"{hf}self_attn.o_proj.bias", (*at, "self_attn", "o_proj", "b"), (D,)))
    if cfg.has_bias("mlp"):
      for name, n in (("gate_proj", F), ("up_proj", F), ("down_proj", D)):
        rules.append(_vector(f"{hf}mlp.{name}.bias", (*at, "mlp", name, "b"), (n,)))
  return rules


def _gpt2_rules(cfg: ModelConfig, p: str) -> list[Rule]:
  D, N, _, H, F, V = _dims(cfg)
  rules = [_same(f"{p}wte.weight", ("embedder", "embed_tokens"), (V, D)),
           _same(f"{p}wpe.weight", ("decoder", "learned_positions", "embed_positions"),
                 (cfg.max_len, D)),
           _vector(f"{p}ln_f.weight", ("decoder", "norm", "scale"), (D,)),
           _vector(f"{p}ln_f.bias", ("decoder", "norm", "bias"), (D,))]
  if not cfg.tie_embeddings:
    rules.append(_linear("lm_head.weight", ("embedder", "lm_head"), (D,), (V,)))
  for i in range(cfg.num_layers):
    hf, at = f"{p}h.{i}.", ("decoder", "layers", i)
    attn = (*at, "self_attn")
    rules += [
        _vector(f"{hf}ln_1.weight", (*at, "input_layernorm", "scale"), (D,)),
        _vector(f"{hf}ln_1.bias", (*at, "input_layernorm", "bias"), (D,)),
        _vector(f"{hf}ln_2.weight", (*at, "post_attention_layernorm", "scale"), (D,)),
        _vector(f"{hf}ln_2.bias", (*at, "post_attention_layernorm", "bias"), (D,)),
        _fused_qkv(f"{hf}attn.c_attn.weight", tuple((*attn, n, "w") for n in
                                                    ("q_proj", "k_proj", "v_proj")),
                   D, N, H, bias=False),
        _fused_qkv(f"{hf}attn.c_attn.bias", tuple((*attn, n, "b") for n in
                                                  ("q_proj", "k_proj", "v_proj")),
                   D, N, H, bias=True),
        _conv1d(f"{hf}attn.c_proj.weight", (*attn, "o_proj", "w"), (N, H), (D,)),
        _vector(f"{hf}attn.c_proj.bias", (*attn, "o_proj", "b"), (D,)),
        _conv1d(f"{hf}mlp.c_fc.weight", (*at, "mlp", "up_proj", "w"), (D,), (F,)),
        _vector(f"{hf}mlp.c_fc.bias", (*at, "mlp", "up_proj", "b"), (F,)),
        _conv1d(f"{hf}mlp.c_proj.weight", (*at, "mlp", "down_proj", "w"), (F,), (D,)),
        _vector(f"{hf}mlp.c_proj.bias", (*at, "mlp", "down_proj", "b"), (D,)),
    ]
  return rules


# --------------------------------------------------------------------------- reading


def tensor_files(src_dir: str) -> dict[str, str]:
  """{tensor name: safetensors file} of a checkpoint directory.

  Uses model.safetensors.index.json when present (sharded checkpoints),
  else reads the header of every *.safetensors file (no data).
  """
  index = os.path.join(src_dir, "model.safetensors.index.json")
  if os.path.isfile(index):
    try:
      with open(index, encoding="utf-8") as f:
        weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise ConversionError(f"{index} has no readable weight_map: {e}") from None
    if not (isinstance(weight_map, dict)
            and all(isinstance(f, str) for f in weight_map.values())):
      raise ConversionError(f"{index}'s weight_map is not an object of tensor name: file name")
    out = {}
    for name, file in weight_map.items():
      path = os.path.join(src_dir, file)
      if not os.path.isfile(path):
        raise ConversionError(f"{index} names {file} for tensor {name}, which does not exist")
      out[name] = path
    return out
  files = sorted(f for f in os.listdir(src_dir)
                 if f.endswith(".safetensors") and os.path.isfile(os.path.join(src_dir, f)))
  if not files:
    raise ConversionError(f"{src_dir} holds no *.safetensors file (a pytorch_model.bin is not "
                          "read: re-save it with save_pretrained, which writes safetensors)")
  out = {}
  for file in files:
    with _safetensors(os.path.join(src_dir, file)) as f:
      for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
        if name in out:  # two saves in one folder: which is the model is not ours to guess
          raise ConversionError(
              f"tensor {name} is in both {os.path.basename(out[name])} and {file} of "
              f"{src_dir} (and no model.safetensors.index.json says which to read): remove "
              "the stale file")
        out[name] = os.path.join(src_dir, file)
  return out


@contextlib.contextmanager
def _safetensors(path: str):
  """``safe_open(path)``; a damaged or mislabelled file (a truncated header, a tensor an
  index places in the wrong shard) is a ConversionError naming the file."""
  from safetensors import SafetensorError, safe_open

  try:
    with safe_open(path, framework="flax") as f:
      yield f
  except (SafetensorError, OSError) as e:
    raise ConversionError(f"{path} is not a readable safetensors file: {e}") from None


def _name_prefix(family: str, names) -> str | None:
  """"" for checkpoints saved from the base model (no "model." prefix)."""
  probe = "wte.weight" if family == "gpt2" else "embed_tokens.weight"
  default = "transformer." if family == "gpt2" else "model."
  return "" if default + probe not in names and probe in names else None


def check_tensors(family: str, cfg: ModelConfig, files: dict[str, str]) -> list[Rule]:
  """The rules for this checkpoint, after checking every tensor's presence and
  shape from the headers alone (nothing is loaded).

  Raises:
    ConversionError: a missing tensor, one of the wrong shape, or a tensor
      that no rule reads (a feature attnlab would silently drop); the
      message names the tensor.
  """
  rules = weight_rules(family, cfg, _name_prefix(family, files))
  expected = {name: shape for r in rules for name, shape in zip(r.hf_names, r.hf_shapes)}
  for name in expected:
    if name not in files:
      raise ConversionError(f"tensor {name} is missing from the checkpoint")
  for name in files:
    tied_head = name == "lm_head.weight" and cfg.tie_embeddings
    if name not in expected and not tied_head and not name.endswith(IGNORED_SUFFIXES):
      raise ConversionError(f"tensor {name} has no place in a {family} model with this "
                            "config.json (an unsupported feature?)")
  by_file: dict[str, list[str]] = {}
  for name in expected:
    by_file.setdefault(files[name], []).append(name)
  for path, names in by_file.items():
    with _safetensors(path) as f:
      for name in names:
        shape = tuple(f.get_slice(name).get_shape())
        if shape != expected[name]:
          raise ConversionError(f"tensor {name} has shape {list(shape)}, expected "
                                f"{list(expected[name])} from config.json")
  if cfg.tie_embeddings and "lm_head.weight" in files:
    _check_tied_head(files, next(n for n in expected if n.endswith(("embed_tokens.weight",
                                                                      "wte.weight"))))
  return rules


def _check_tied_head(files: dict[str, str], embed_name: str, rows: int = 4096) -> None:
  """A tied config whose checkpoint also holds an lm_head.weight: it must be the embedding
  (transformers unties a head that differs and uses it; attnlab, tied, would not). Compared
  ``rows`` rows at a time, so the import still holds no whole tensor twice."""
  with _safetensors(files["lm_head.weight"]) as head, _safetensors(files[embed_name]) as emb:
    a, b = head.get_slice("lm_head.weight"), emb.get_slice(embed_name)
    same, n = a.get_shape() == b.get_shape(), a.get_shape()[0]
    for start in range(0, n if same else 0, rows):
      stop = min(start + rows, n)  # a slice past the end is an error, not clamped
      if not np.array_equal(np.asarray(a[start:stop]), np.asarray(b[start:stop])):
        same = False
        break
  if not same:
    raise ConversionError(
        "config.json ties the embeddings (tie_word_embeddings true), but the checkpoint's "
        f"lm_head.weight differs from {embed_name}: transformers would use that head "
        "untied; set tie_word_embeddings to false in config.json to import it")


def read_params(rules: list[Rule], files: dict[str, str], param_dtype) -> dict:
  """{attnlab path: jax array} read one tensor at a time (lazily, ``safe_open``).

  Each file is opened (memory-mapped) only while one tensor is read, so the
  mapped pages of what was already converted do not stay resident.
  """
  import jax.numpy as jnp
  out = {}
  for rule in rules:
    arrays = []
    for name in rule.hf_names:
      with _safetensors(files[name]) as f:
        arrays.append(np.asarray(f.get_tensor(name)))
    for path, value in zip(rule.paths, rule.to_attnlab(*arrays), strict=True):
      out[path] = jnp.asarray(value, dtype=param_dtype)
    del arrays
  return out


# --------------------------------------------------------------------------- writing


def write_params(rules: list[Rule], params: dict[tuple, object], out_dir: str, *,
                 max_shard_bytes: int = 2 << 30) -> list[str]:
  """Write the HF tensors of ``params`` as safetensors shards; returns the files.

  One shard (at most ``max_shard_bytes``, or one tensor when larger) is held
  in memory at a time. Several shards get a model.safetensors.index.json.
  """
  from safetensors.numpy import save_file as save_numpy

  current: dict[str, np.ndarray] = {}
  size = 0
  written: list[tuple[str, list[str]]] = []
  total = 0

  def flush():
    nonlocal current, size
    if current:
      index = len(written) + 1
      path = os.path.join(out_dir, f"model-{index:05d}.safetensors")
      _save(current, path, save_numpy)
      written.append((path, list(current)))
    current, size = {}, 0

  for rule in rules:
    arrays = [np.asarray(params[p]) for p in rule.paths]
    for name, value in zip(rule.hf_names, rule.to_hf(*arrays), strict=True):
      value = np.ascontiguousarray(value)
      if current and size + value.nbytes > max_shard_bytes:
        flush()
      current[name] = value
      size += value.nbytes
      total += value.nbytes
  flush()
  if len(written) == 1:
    final = os.path.join(out_dir, "model.safetensors")
    os.replace(written[0][0], final)
    return [final]
  weight_map = {name: os.path.basename(path) for path, names in written for name in names}
  with open(os.path.join(out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  return [path for path, _ in written]


def _save(tensors: dict[str, np.ndarray], path: str, save_numpy) -> None:
  """One safetensors shard, given the mode an ``open`` gives (``set_plain_mode``):
  safetensors writes 0600 whatever the umask (until 2026-12-07 the shards stayed so, unread
  by the colleagues on a shared filesystem)."""
  metadata = {"format": "pt"}  # transformers refuses safetensors files without it
  if any(v.dtype.name == "bfloat16" for v in tensors.values()):
    import jax.numpy as jnp
    from safetensors.flax import save_file as save_flax

    save_flax({k: jnp.asarray(v) for k, v in tensors.items()}, path, metadata=metadata)
  else:
    save_numpy(tensors, path, metadata=metadata)
  set_plain_mode(path)


def process_umask() -> int:
  """The process's umask: Linux's /proc/self/status names it; elsewhere it is set and put
  back (Python has no other way to read it)."""
  try:
    with open("/proc/self/status", encoding="ascii") as f:
      for line in f:
        if line.startswith("Umask:"):
          return int(line.split()[1], 8)
  except (OSError, ValueError):
    pass
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


def set_plain_mode(path: str) -> None:
  """Give ``path`` the mode a plain ``mkdir`` (a folder) or ``open`` (a file) gives it under
  the process umask: 0755 / 0644 under 022. For what a library makes private (mkdtemp's
  0700, safetensors' 0600)."""
  mode = 0o777 if os.path.isdir(path) else 0o666
  with contextlib.suppress(OSError):  # a mount that refuses chmod (some FUSE / SMB ones):
    os.chmod(path, mode & ~process_umask())  # left as made, the conversion goes on
