"""Hand-made transformers checkpoints and a NumPy (float64) forward of their layouts,
for the torch-free tests of tests/convert/ (test_hf_layouts.py, test_convert_command.py).

The tensor names and shapes come from transformers' model definitions (Llama, Mistral,
Qwen2: ``nn.Linear`` weights [out, in]; GPT-2: ``Conv1D`` weights [in, out] and one
fused ``c_attn``), written out here, not taken from ``attnlab.convert.hf``; the
forward passes follow the same definitions (rotate-half RoPE, ``repeat_kv``, RMSNorm
/ LayerNorm, SwiGLU / gelu_new, Mistral's window).
"""

from __future__ import annotations

import json
import os

import numpy as np
from flax import nnx

import attnlab
from attnlab.config import ModelConfig
from attnlab.convert import hf
from tests.ops.naive import naive_attention

V, D, F, L, N = 50, 48, 40, 2, 4
T = 11  # tokens of the logits check: longer than Mistral's window below

# config.json dicts as transformers writes them (the fields the mapping reads).
LLAMA = dict(model_type="llama", vocab_size=V, hidden_size=D, intermediate_size=F,
             num_hidden_layers=L, num_attention_heads=N, num_key_value_heads=2,
             hidden_act="silu", max_position_embeddings=64, rms_norm_eps=1e-5,
             rope_theta=700.0, tie_word_embeddings=False, attention_bias=False,
             mlp_bias=False, bos_token_id=1, eos_token_id=2, pad_token_id=None,
             torch_dtype="float32")
FAMILY_CONFIGS = {
    # biases everywhere; 4 heads of 16 = 64 != d_model 48 (an explicit head_dim)
    "llama_bias_head_dim": dict(LLAMA, attention_bias=True, mlp_bias=True, head_dim=16),
    "llama_mqa_tied": dict(LLAMA, num_key_value_heads=1, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 300.0}),
    "mistral": dict(LLAMA, model_type="mistral", sliding_window=4, rope_theta=10000.0),
    "qwen2": dict(LLAMA, model_type="qwen2", tie_word_embeddings=True,
                  use_sliding_window=False, layer_types=["full_attention"] * L),
    "gpt2": dict(model_type="gpt2", vocab_size=V, n_embd=D, n_layer=L, n_head=N, n_inner=F,
                 n_positions=64, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                 bos_token_id=1, eos_token_id=2),
    "gpt2_untied": dict(model_type="gpt2", vocab_size=V, n_embd=D, n_layer=L, n_head=N,
                        n_positions=32, tie_word_embeddings=False),
}


# --------------------------------------------------------------------------- checkpoints


def llama_shapes(c: dict, prefix: str = "model.") -> dict[str, tuple]:
  """transformers' Llama / Mistral / Qwen2 tensor names and shapes (nn.Linear: [out, in])."""
  H = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
  n, k = c["num_attention_heads"] * H, c.get("num_key_value_heads", c["num_attention_heads"]) * H
  d, f = c["hidden_size"], c["intermediate_size"]
  qkv_bias = c["model_type"] == "qwen2" or c.get("attention_bias", False)
  o_bias = c["model_type"] == "llama" and c.get("attention_bias", False)
  mlp_bias = c["model_type"] == "llama" and c.get("mlp_bias", False)
  out = {f"{prefix}embed_tokens.weight": (c["vocab_size"], d), f"{prefix}norm.weight": (d,)}
  if not c.get("tie_word_embeddings", False):
    out["lm_head.weight"] = (c["vocab_size"], d)
  for i in range(c["num_hidden_layers"]):
    p = f"{prefix}layers.{i}."
    out |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (n, d), p + "self_attn.k_proj.weight": (k, d),
            p + "self_attn.v_proj.weight": (k, d), p + "self_attn.o_proj.weight": (d, n),
            p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f)}
    if qkv_bias:
      out |= {p + "self_attn.q_proj.bias": (n,), p + "self_attn.k_proj.bias": (k,),
              p + "self_attn.v_proj.bias": (k,)}
    if o_bias:
      out[p + "self_attn.o_proj.bias"] = (d,)
    if mlp_bias:
      out |= {p + "mlp.gate_proj.bias": (f,), p + "mlp.up_proj.bias": (f,),
              p + "mlp.down_proj.bias": (d,)}
  return out


def gpt2_shapes(c: dict, prefix: str = "transformer.") -> dict[str, tuple]:
  """transformers' GPT-2 tensor names and shapes (Conv1D: [in, out])."""
  d, f = c["n_embd"], c.get("n_inner") or 4 * c["n_embd"]
  out = {f"{prefix}wte.weight": (c["vocab_size"], d), f"{prefix}wpe.weight": (c["n_positions"], d),
         f"{prefix}ln_f.weight": (d,), f"{prefix}ln_f.bias": (d,)}
  if not c.get("tie_word_embeddings", True):
    out["lm_head.weight"] = (c["vocab_size"], d)
  for i in range(c["n_layer"]):
    p = f"{prefix}h.{i}."
    out |= {p + "ln_1.weight": (d,), p + "ln_1.bias": (d,), p + "ln_2.weight": (d,),
            p + "ln_2.bias": (d,), p + "attn.c_attn.weight": (d, 3 * d),
            p + "attn.c_attn.bias": (3 * d,), p + "attn.c_proj.weight": (d, d),
            p + "attn.c_proj.bias": (d,), p + "mlp.c_fc.weight": (d, f),
            p + "mlp.c_fc.bias": (f,), p + "mlp.c_proj.weight": (f, d),
            p + "mlp.c_proj.bias": (d,)}
  return out


def shapes_of(c: dict, prefix: str | None = None) -> dict[str, tuple]:
  if c["model_type"] == "gpt2":
    return gpt2_shapes(c) if prefix is None else gpt2_shapes(c, prefix)
  return llama_shapes(c) if prefix is None else llama_shapes(c, prefix)


def random_tensors(shapes: dict[str, tuple], seed: int = 0) -> dict[str, np.ndarray]:
  """Random float32 tensors; norm weights near 1 so that the activations stay O(1)."""
  rng = np.random.default_rng(seed)
  out = {}
  for name, shape in shapes.items():
    x = 0.3 * rng.standard_normal(shape)
    if "norm" in name or "ln_" in name:
      x = (1.0 + x) if name.endswith("weight") else x
    out[name] = x.astype(np.float32)
  return out


def write_checkpoint(path, config: dict, tensors: dict[str, np.ndarray]) -> str:
  """``path`` as transformers' save_pretrained leaves it: config.json, model.safetensors."""
  from safetensors.numpy import save_file

  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  return str(path)


def import_checkpoint(src: str):
  """(family, ModelConfig, model) through the library calls `convert --from-hf` makes."""
  family, cfg = hf.from_hf_config(hf.read_hf_config(src))
  files = hf.tensor_files(src)
  params = hf.read_params(hf.check_tensors(family, cfg, files), files, np.float32)
  return family, cfg, model_from_params(cfg, params)


def model_from_params(cfg: ModelConfig, params: dict):
  """The model whose parameters are exactly ``params`` ({path: array}), filled as
  ``attnlab convert --from-hf`` fills them (``convert.filled_params``)."""
  from attnlab.commands.convert import filled_params

  graphdef, _, rest = nnx.split(
      nnx.eval_shape(lambda: attnlab.build_model(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)
  state, _ = filled_params(cfg, dict(params))
  return nnx.merge(graphdef, state, rest)


def flat_params(model) -> dict[tuple, np.ndarray]:
  return {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(
      nnx.state(model, nnx.Param))}


# --------------------------------------------------------------------------- NumPy forward


def _rmsnorm(x, w, eps):
  return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _layernorm(x, w, b, eps):
  mu = x.mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w + b


def _attend(q, k, v, window=None):
  """Causal softmax attention of one sequence, q [T, N, H], k / v [T, K, H]: query head n
  reads KV head n // (N / K), as transformers' repeat_kv does; a window W keeps keys j
  with i - j < W (Mistral's sliding window). The textbook loop of tests/ops/naive.py."""
  return naive_attention(q[None], k[None], v[None], causal=True, window=window)[0]


def llama_forward(c: dict, w: dict, tokens) -> np.ndarray:
  """transformers' LlamaForCausalLM (and Mistral, Qwen2) for one unpadded sequence."""
  w = {k: v.astype(np.float64) for k, v in w.items()}
  n_heads, n_kv = c["num_attention_heads"], c.get("num_key_value_heads")
  H = c.get("head_dim") or c["hidden_size"] // n_heads
  params = c.get("rope_parameters") or {}
  theta = params.get("rope_theta", c.get("rope_theta", 10000.0))
  eps = c["rms_norm_eps"]
  window = c.get("sliding_window") if c["model_type"] == "mistral" else None
  lin = lambda x, name: x @ w[name + ".weight"].T + w.get(name + ".bias", 0.0)
  # rotate_half RoPE: frequencies theta^(-2i/H) for i < H/2, repeated for both halves.
  inv_freq = theta ** (-np.arange(0, H, 2) / H)
  angles = np.arange(len(tokens))[:, None] * np.concatenate([inv_freq, inv_freq])[None]
  cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
  rotate_half = lambda x: np.concatenate([-x[..., H // 2:], x[..., :H // 2]], -1)
  rope = lambda x: x * cos + rotate_half(x) * sin
  x = w["model.embed_tokens.weight"][tokens]
  for i in range(c["num_hidden_layers"]):
    p = f"model.layers.{i}."
    h = _rmsnorm(x, w[p + "input_layernorm.weight"], eps)
    q = rope(lin(h, p + "self_attn.q_proj").reshape(len(tokens), n_heads, H))
    k = rope(lin(h, p + "self_attn.k_proj").reshape(len(tokens), n_kv, H))
    v = lin(h, p + "self_attn.v_proj").reshape(len(tokens), n_kv, H)
    x = x + lin(_attend(q, k, v, window).reshape(len(tokens), -1), p + "self_attn.o_proj")
    h = _rmsnorm(x, w[p + "post_attention_layernorm.weight"], eps)
    gate = lin(h, p + "mlp.gate_proj")
    x = x + lin(gate / (1 + np.exp(-gate)) * lin(h, p + "mlp.up_proj"), p + "mlp.down_proj")
  x = _rmsnorm(x, w["model.norm.weight"], eps)
  return x @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T


def gpt2_forward(c: dict, w: dict, tokens) -> np.ndarray:
  """transformers' GPT2LMHeadModel for one sequence (Conv1D: x @ W + b)."""
  w = {k: v.astype(np.float64) for k, v in w.items()}
  d, n_heads, eps = c["n_embd"], c["n_head"], c.get("layer_norm_epsilon", 1e-5)
  conv = lambda x, name: x @ w[name + ".weight"] + w[name + ".bias"]
  gelu_new = lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
  x = w["transformer.wte.weight"][tokens] + w["transformer.wpe.weight"][:len(tokens)]
  for i in range(c["n_layer"]):
    p = f"transformer.h.{i}."
    h = _layernorm(x, w[p + "ln_1.weight"], w[p + "ln_1.bias"], eps)
    q, k, v = (a.reshape(len(tokens), n_heads, d // n_heads)
               for a in np.split(conv(h, p + "attn.c_attn"), 3, axis=-1))
    x = x + conv(_attend(q, k, v).reshape(len(tokens), d), p + "attn.c_proj")
    h = _layernorm(x, w[p + "ln_2.weight"], w[p + "ln_2.bias"], eps)
    x = x + conv(gelu_new(conv(h, p + "mlp.c_fc")), p + "mlp.c_proj")
  x = _layernorm(x, w["transformer.ln_f.weight"], w["transformer.ln_f.bias"], eps)
  return x @ w.get("lm_head.weight", w["transformer.wte.weight"]).T
