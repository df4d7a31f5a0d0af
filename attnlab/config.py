"""Frozen, validated configuration dataclasses, and the one home of every choice.

Every field is checked once in ``__post_init__``; a bad value raises a
``ValueError`` that names the field, the value and what is allowed. Modules
receive these typed values, never gin.

The tuples of allowed values (implementations, cache kinds, dtypes, ...),
the dtype table and the derived sizes (``kv_cache_bytes``) are spelled here
only; the rest of the package imports them.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import os
from dataclasses import dataclass

import numpy as np

ARCHS = ("decoder_only", "encoder_decoder")
POSITIONS = ("rope", "sinusoidal", "learned", "none")
ROPE_PAIRINGS = ("half", "adjacent")
NORMS = ("rmsnorm", "layernorm")
NORM_POSITIONS = ("pre", "post")
MLPS = ("relu", "gelu", "swiglu")
# Bytes per element of every dtype name attnlab accepts. DTYPES are the
# compute / parameter dtypes; the 1-byte ones are storage only (KV caches).
INT8_SCALE_BYTES = 4  # the float32 scale of an int8 KV cache, per token and KV head
# Bytes per element of the caches attnlab builds (CACHE_DTYPES).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
DTYPES = ("float32", "bfloat16", "float16")
CACHE_DTYPES = (*DTYPES, "int8")  # KV-cache element types (int8: symmetric, per-token scales)
# What ``attnlab.attention(implementation=...)`` runs; a model may also ask for "auto".
IMPLEMENTATIONS = ("reference", "blocked", "chunked", "xla", "cudnn", "pallas")
ATTENTION_IMPLS = ("auto", *IMPLEMENTATIONS)
# The self-attention KV caches of decoding (attnlab.nn.kv_cache).
CACHE_KINDS = ("contiguous", "ring", "paged")

# The smallest sampling temperature above 0 (greedy): logits / temperature must stay finite
# in float32 (a logit of 1e3 over 1e-36 is inf, and a draw from inf logits is token 0).
MIN_TEMPERATURE = 1e-6


def absolute_path(path: str) -> str:
  """``path`` (a file or a glob pattern) as an absolute, normalized path: ``~`` expanded,
  a relative one taken from the working directory. The one spelling of a data path that
  config.gin, the data state's stream and a sweep's comparison of configs use."""
  return os.path.normpath(os.path.abspath(os.path.expanduser(path)))


def is_integer(value) -> bool:
  """A Python or NumPy integer, not a bool (``True`` is an int to Python, never a count here)."""
  return isinstance(value, int | np.integer) and not isinstance(value, bool)


def seed_key(seed: int):
  """``jax.random.key`` for an integer seed in [-2**63, 2**63), every bit of it counted.

  Without ``jax_enable_x64`` JAX keeps a seed's low 32 bits only (``key(5)``
  and ``key(2**32 + 5)`` are one key, as are ``key(-1)`` and ``key(2**32 - 1)``).
  With JAX's default threefry keys this is the key x64 JAX makes: key data
  [high 32 bits, low 32 bits] of the seed in two's complement, so a seed in
  [0, 2**32) gives ``key(seed)`` itself. (Another key implementation gets
  ``key(low)`` with the high bits folded in.)
  """
  import jax  # here, not at the top: the configs are read without JAX

  seed = int(seed)
  if not -2**63 <= seed < 2**63:
    raise ValueError(f"seed={seed} must be in [-2**63, 2**63)")
  low, high = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
  key = jax.random.key(low)
  if not high:
    return key
  if jax.random.key_data(key).shape == (2,):  # threefry2x32: [0, low] -> [high, low]
    return jax.random.wrap_key_data(np.array([high, low], np.uint32))
  return jax.random.fold_in(key, high)


# float32's smallest normal and largest numbers: an epsilon below the first is 0 once in float32
# (XLA:CPU flushes subnormals), above the second inf.
FLOAT32_TINY = float(np.finfo(np.float32).tiny)
FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_float32_range(name: str, value, why: str) -> None:
  """``value`` a positive number that float32 holds as a normal number (``why``: what 0 or
  inf would do)."""
  if not FLOAT32_TINY <= value <= FLOAT32_MAX:
    raise ValueError(f"{name}={value!r} must be within float32's normal range [{FLOAT32_TINY!r}, "
                     f"{FLOAT32_MAX!r}]: {why}")


def is_number(value) -> bool:
  """A Python or NumPy integer or float, not a bool (nor ``np.bool_``)."""
  return is_integer(value) or isinstance(value, float | np.floating)


def check_temperature(temperature) -> None:
  if not (temperature == 0.0 or temperature >= MIN_TEMPERATURE):
    raise ValueError(f"temperature={temperature!r} must be 0 (greedy) or >= {MIN_TEMPERATURE}")


# Methods of multi-head -> grouped / multi-query conversion (attnlab.convert.heads).
CONVERT_METHODS = ("mean", "first", "random")


def check_mesh_shape(shape) -> tuple[int, int, int]:
  """``shape`` as a (data, fsdp, tensor) tuple of positive ints, at most one -1 (the
  devices the others leave); ValueError naming it otherwise."""
  # A sequence, in order: a set was taken in its iteration order and a dict as its keys
  # until 2026-12-06 ({4, 1, 2} became (1, 2, 4)).
  if not isinstance(shape, list | tuple | np.ndarray):
    raise ValueError(f"mesh_shape={shape!r} must be 3 positive ints (data, fsdp, tensor), at "
                     "most one -1, e.g. (1, -1, 1)")
  given = shape
  shape = tuple(shape)
  if len(shape) != 3 or any(
      not is_integer(s) or (s < 1 and s != -1) for s in shape
  ) or shape.count(-1) > 1:
    raise ValueError(
        f"mesh_shape={given!r} must be 3 positive ints (data, fsdp, tensor), at most one -1"
    )
  return tuple(int(s) for s in shape)


_WANTED = {"bool": "True or False", "float": "a number", "str": "a string"}


def _check_types(config) -> None:
  """Every scalar field against its annotation, before any check compares it: a gin binding
  of the wrong type (``'false'``, ``'1e-3'``) is an error naming the field, never a truthy
  string or a TypeError from inside a comparison; a float must be finite. An int where a
  float is expected is a number; a float where an int is expected is left to the field's
  own check (which names the range too). ``paths``-like ``tuple[str, ...]`` fields must
  be lists of strings (a lone string would be iterated character by character). A NumPy
  number in an int or float field (an ``np.bool_`` in a bool field) is stored as the Python
  value it holds, so the config compares, hashes and is written to gin as if that value had
  been given."""
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    kinds = {k.strip() for k in str(field.type).split("|")}
    if value is None and "None" in kinds:
      continue
    if kinds - {"None"} == {"tuple[str, ...]"}:
      if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(
          isinstance(v, str) for v in value):
        raise ValueError(f"{field.name}={value!r} must be a list of strings, e.g. "
                         f"('{value if isinstance(value, str) else 'a'}',)")
      continue
    [kind] = kinds - {"None"} if len(kinds - {"None"}) == 1 else [None]
    if (kind in ("int", "float") and isinstance(value, np.integer | np.floating)) or (
        kind == "bool" and isinstance(value, np.bool_)):  # np.bool_ refused until 2026-12-06
      value = value.item()
      object.__setattr__(config, field.name, value)
    if kind not in _WANTED:  # int fields: each has its own check, naming the range it allows
      continue
    number = is_number(value)
    if kind == "float" and number and not math.isfinite(value):
      # nan passes no comparison and would pass "not x < 0"; inf is written to config.gin
      # as a value gin cannot read back
      raise ValueError(f"{field.name}={value!r} must be a finite number")
    ok = {"bool": isinstance(value, bool), "float": number, "str": isinstance(value, str)}[kind]
    if not ok:
      wanted = _WANTED[kind] + (" or None" if "None" in kinds else "")
      raise ValueError(f"{field.name}={value!r} must be {wanted}")


def _choice(name: str, value, allowed: tuple) -> None:
  if value not in allowed:
    raise ValueError(f"{name}={value!r} is not one of {', '.join(map(repr, allowed))}")


def check_positive(name: str, value) -> None:
  if not is_integer(value) or value < 1:
    raise ValueError(f"{name}={value!r} must be a positive integer")


def positive_count(name: str, value) -> int:
  """``value`` as a Python int: a positive Python or NumPy integer, or a concrete 0-d integer
  array (``np.array(8)``, ``jnp.int32(8)``, as ``generate`` takes its counts); else
  ``check_positive``'s ValueError. (A size of a cache or an allocator: a NumPy int8 would
  overflow the arithmetic on it.)"""
  if _is_0d_int_array(value):
    with contextlib.suppress(TypeError):  # a tracer (ConcretizationTypeError): refused below
      value = int(value)
  check_positive(name, value)
  return int(value)


def _is_0d_int_array(value) -> bool:
  """A NumPy or JAX array (JAX not imported here: by its type's module) of shape () and an
  integer dtype (a PRNG key's dtype is none NumPy reads: not one)."""
  if not (isinstance(value, np.ndarray) or type(value).__module__.startswith("jax")):
    return False
  try:
    return getattr(value, "shape", None) == () and np.issubdtype(np.dtype(value.dtype),
                                                                  np.integer)
  except TypeError:
    return False


def _fraction(name: str, value) -> None:
  if not 0.0 <= value < 1.0:
    raise ValueError(f"{name}={value!r} must be in [0, 1)")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Architecture of a transformer: everything needed to build it.

  Attributes:
    arch: "decoder_only" (GPT / Llama-like) or "encoder_decoder" (the 2017
      Transformer).
    vocab_size: V, shared by source and target.
    d_model: D, the residual width.
    num_layers: L, decoder layers (and encoder layers unless
      ``num_encoder_layers`` is set).
    num_encoder_layers: encoder depth of an encoder-decoder; None = num_layers
      (resolved at construction). Must be None for a decoder-only model.
    num_heads: N query heads.
    num_kv_heads: K key/value heads; None = num_heads (MHA), 1 = MQA, else GQA.
      Must divide num_heads. Resolved at construction: never None afterwards.
    head_dim: H; None = d_model // num_heads (resolved at construction).
    d_ff: F, the hidden width of the feed-forward block.
    pos: "rope" | "sinusoidal" | "learned" | "none".
    rope_theta: RoPE base frequency.
    rope_pairing: "half" (rotate-half, the Llama layout) or "adjacent"
      (pairs (2i, 2i+1), the RoFormer paper's layout).
    window: sliding window of that many keys (the query's own included) for
      causal self-attention; an encoder's bidirectional self-attention sees the keys
      within window - 1 on either side (|q - k| < window, 2 window - 1 keys); None = full
      attention.
    norm: "rmsnorm" or "layernorm".
    norm_position: "pre" (x + f(norm(x))) or "post" (norm(x + f(x)), the
      2017 paper).
    norm_eps: epsilon of the norm layers (within float32's normal range).
    mlp: "relu" (the paper), "gelu" (the tanh approximation, GPT-2's
      "gelu_new") or "swiglu".
    use_bias: biases on the attention and MLP projections.
    qkv_bias, o_bias, mlp_bias: biases on the query/key/value projections, the
      attention output projection and the MLP projections one by one; None
      = ``use_bias`` (Qwen2: qkv_bias=True alone; GPT-2: use_bias=True).
    tie_embeddings: output logits use the transposed input embedding.
    scale_embeddings: multiply embeddings by sqrt(d_model) (the paper).
    dropout_rate: residual / embedding dropout (the paper: 0.1).
    attention_dropout_rate: dropout on the attention probabilities (with
      ``attention_impl`` "reference" or "auto", which then runs the reference math).
    max_len: longest sequence the positions support (the size of the learned
      table). The length of an input is checked against it; position values given
      explicitly (``positions_BT``) are not (traced values): a learned table reads a
      position past it as its last row.
    dtype: compute dtype of activations; parameters are ``param_dtype``.
    param_dtype: storage dtype of the parameters (drawn in float32 and rounded to
      it: one seed is one model in every dtype).
    attention_impl: "auto" | "reference" | "blocked" | "chunked" | "xla" | "cudnn" |
      "pallas". "auto" picks one for the backend and the length
      (``attnlab.ops.dispatch.auto_implementation``: on XLA:CPU "blocked" up to 2048 x 2048
      scores, "chunked" past them; "xla" on GPU and TPU).
    pad_id: the padding token; encoder inputs equal to it are masked.
    remat: rematerialize each block in the backward pass (less memory).
  """

  arch: str = "decoder_only"
  vocab_size: int = 259
  d_model: int = 256
  num_layers: int = 4
  num_encoder_layers: int | None = None
  num_heads: int = 8
  num_kv_heads: int | None = None
  head_dim: int | None = None
  d_ff: int = 1024
  pos: str = "rope"
  rope_theta: float = 10000.0
  rope_pairing: str = "half"
  window: int | None = None
  norm: str = "rmsnorm"
  norm_position: str = "pre"
  norm_eps: float = 1e-6
  mlp: str = "swiglu"
  use_bias: bool = False
  qkv_bias: bool | None = None
  o_bias: bool | None = None
  mlp_bias: bool | None = None
  tie_embeddings: bool = True
  scale_embeddings: bool = False
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  max_len: int = 2048
  dtype: str = "float32"
  param_dtype: str = "float32"
  attention_impl: str = "auto"
  pad_id: int = 0
  remat: bool = False

  def __post_init__(self):
    for name in ("use_bias", "qkv_bias", "o_bias", "mlp_bias"):
      value = getattr(self, name)
      if isinstance(value, np.bool_):  # as _check_types takes one
        value = value.item()
        object.__setattr__(self, name, value)
      if not (isinstance(value, bool) or (value is None and name != "use_bias")):
        allowed = "True or False" if name == "use_bias" else "True, False or None (= use_bias)"
        raise ValueError(f"{name}={value!r} must be {allowed}")
    _check_types(self)
    _choice("arch", self.arch, ARCHS)
    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "max_len"):
      check_positive(name, getattr(self, name))
    for name in ("num_encoder_layers", "num_kv_heads", "head_dim"):
      if getattr(self, name) is not None:
        check_positive(name, getattr(self, name))
    if self.arch == "decoder_only" and self.num_encoder_layers is not None:
      raise ValueError(
          f"num_encoder_layers={self.num_encoder_layers} is only allowed with "
          "arch='encoder_decoder'"
      )
    kv_heads = self.num_heads if self.num_kv_heads is None else self.num_kv_heads
    if self.num_heads % kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} must be a multiple of num_kv_heads={kv_heads}"
      )
    if self.head_dim is None and self.d_model % self.num_heads:
      raise ValueError(
          f"d_model={self.d_model} must be divisible by num_heads={self.num_heads} "
          "when head_dim is not given"
      )
    # The defaults, resolved once: every reader sees the number (one name per quantity).
    resolved = {"num_kv_heads": self.num_heads, "head_dim": self.d_model // self.num_heads}
    if self.arch == "encoder_decoder":
      resolved["num_encoder_layers"] = self.num_layers
    resolved = {k: v for k, v in resolved.items() if getattr(self, k) is None}
    for name, value in resolved.items():
      object.__setattr__(self, name, value)
    object.__setattr__(self, "_resolved", frozenset(resolved))
    _choice("pos", self.pos, POSITIONS)
    _choice("rope_pairing", self.rope_pairing, ROPE_PAIRINGS)
    if self.pos == "rope" and self.head_dim % 2:
      given = ("" if "head_dim" not in resolved else
               f" (d_model={self.d_model} / num_heads={self.num_heads}; head_dim not given)")
      raise ValueError(f"head_dim={self.head_dim}{given} must be even with pos='rope'")
    if self.pos == "sinusoidal" and self.d_model % 2:
      raise ValueError(f"d_model={self.d_model} must be even with pos='sinusoidal'")
    if self.rope_theta <= 0:
      raise ValueError(f"rope_theta={self.rope_theta!r} must be positive")
    if self.pos == "rope" and self.head_dim > 2 and (
        math.log(self.max_len)
        - (self.head_dim - 2) / self.head_dim * math.log(self.rope_theta) > math.log(3.4e38)):
      # until 2026-12-05 (1e-300: inf frequencies, a nan loss at the first step)
      raise ValueError(f"rope_theta={self.rope_theta!r} is too small: RoPE's highest "
                       f"frequency, rope_theta ** -({self.head_dim} - 2) / {self.head_dim}, "
                       f"times the last position (max_len={self.max_len}) overflows float32 "
                       "(RoPE's base is 10000 in the paper)")
    if self.window is not None:
      check_positive("window", self.window)
    _choice("norm", self.norm, NORMS)
    _choice("norm_position", self.norm_position, NORM_POSITIONS)
    if self.norm_eps <= 0:
      raise ValueError(f"norm_eps={self.norm_eps!r} must be positive")
    # until 2026-12-06 1e39 (inf in float32) made every norm's output 0: a model that learned
    # nothing, its loss log(vocab_size) without an error
    check_float32_range("norm_eps", self.norm_eps, "the norms compute in float32, where it "
                        "would be 0 or inf (every output 0)")
    if self.norm == "layernorm" and self.d_model == 1:
      raise ValueError("norm='layernorm' over d_model=1 feature is always 0 (x - mean(x)): the "
                       "model could not see its input; give d_model >= 2 or norm='rmsnorm'")
    _choice("mlp", self.mlp, MLPS)
    _fraction("dropout_rate", self.dropout_rate)
    _fraction("attention_dropout_rate", self.attention_dropout_rate)
    _choice("dtype", self.dtype, DTYPES)
    _choice("param_dtype", self.param_dtype, DTYPES)
    _choice("attention_impl", self.attention_impl, ATTENTION_IMPLS)
    if self.attention_dropout_rate > 0 and self.attention_impl not in ("reference", "auto"):
      raise ValueError(
          f"attention_dropout_rate={self.attention_dropout_rate} needs "
          f"attention_impl='reference', got attention_impl={self.attention_impl!r}"
      )
    if not is_integer(self.pad_id) or not 0 <= self.pad_id < self.vocab_size:
      raise ValueError(f"pad_id={self.pad_id!r} must be in [0, vocab_size={self.vocab_size})")

  def has_bias(self, projections: str) -> bool:
    """Whether the "qkv", "o" or "mlp" projections carry biases."""
    value = {"qkv": self.qkv_bias, "o": self.o_bias, "mlp": self.mlp_bias}[projections]
    return self.use_bias if value is None else value

  def kv_cache_bytes_per_token(self, dtype=None) -> int:
    """Bytes of K and V cached per token over all decoder layers (self-attention).

    Args:
      dtype: the cache dtype, as ``init_cache`` / ``generate`` take it (a ``CACHE_DTYPES``
        name, a NumPy dtype or a scalar type such as ``jnp.bfloat16``); None (only None:
        "" and 0 were the model's dtype until 2026-12-07) = the model's. "int8" counts its
        float32 scale per token and KV head: 2 * L * K * (H + 4).
    """
    return kv_cache_bytes(layers=self.num_layers, seq=1, kv_heads=self.num_kv_heads,
                          head_dim=self.head_dim, dtype=self.dtype if dtype is None else dtype)

  def replace(self, **changes) -> ModelConfig:
    """A copy with ``changes``. Resolved defaults follow their source: a copy
    with a new ``num_heads`` / ``d_model`` / ``num_layers`` gets the derived
    ``num_kv_heads`` / ``head_dim`` / ``num_encoder_layers`` it would get if
    built from scratch, unless those were set explicitly or are changed too."""
    unset = {name: None for name in self._resolved if name not in changes}
    return dataclasses.replace(self, **unset, **changes)


def effective_window(cfg: ModelConfig) -> int | None:
  """The window a model's self-attention applies: ``cfg.window`` capped at ``cfg.max_len``.
  No sequence a model takes is longer than max_len, so a wider window masks nothing more,
  and a ring cache (``init_cache``) holds this many slots: a window of 2**40 made a ring of
  2**40 slots until 2026-12-06 (an overflow or an out-of-memory error inside JAX)."""
  return None if cfg.window is None else min(cfg.window, cfg.max_len)


def cache_dtype_name(dtype) -> str | None:
  """The ``CACHE_DTYPES`` name of a cache dtype given as a name ("bfloat16", or one NumPy
  reads as such: "f2"), a NumPy dtype or a scalar type (``jnp.bfloat16``, ``np.float16``);
  None for anything else (None too). The one reading of a cache dtype:
  ``kv_cache.check_cache_dtype`` (``init_cache``, ``generate``) and ``kv_cache_bytes``."""
  if isinstance(dtype, str) and dtype in CACHE_DTYPES:
    return dtype  # without NumPy's name table, where "bfloat16" needs ml_dtypes loaded
  if dtype is None:
    return None
  try:
    name = np.dtype(dtype).name
  except (TypeError, ValueError):
    return None
  return name if name in CACHE_DTYPES else None


def kv_cache_bytes(*, layers: int, seq: int, kv_heads: int, head_dim: int, dtype,
                   batch: int = 1) -> int:
  """Bytes of a K/V cache: 2 (K and V) * B * L * S * K * H * bytes per element.

  The one formula: ``ModelConfig.kv_cache_bytes_per_token`` and
  ``attnlab kv-size`` both call it. An int8 cache also stores one float32
  scale per token and KV head (symmetric per-token quantization), so each
  head costs H + 4 bytes a token.

  The sizes are positive Python / NumPy integers (not bools; a 0-d integer array as its
  number), the dtype a cache dtype as ``cache_dtype_name`` reads it; anything else is a
  ValueError naming it (until 2026-12-07 only a dtype name was checked: ``layers=-2`` gave a
  negative size, ``seq=2.5`` a float, ``seq="10"`` a repeated string, and
  ``np.dtype("float16")`` a bare KeyError).
  """
  layers, seq, kv_heads, head_dim, batch = (
      positive_count(name, value) for name, value in dict(
          layers=layers, seq=seq, kv_heads=kv_heads, head_dim=head_dim, batch=batch).items())
  name = cache_dtype_name(dtype)
  if name is None:
    raise ValueError(f"dtype={dtype!r} is not one of {', '.join(map(repr, DTYPE_BYTES))} "
                     "(a name, a NumPy dtype or a scalar type such as jnp.bfloat16)")
  per_head = head_dim * DTYPE_BYTES[name] + (INT8_SCALE_BYTES if name == "int8" else 0)
  # Python ints (positive_count): NumPy int32 sizes would wrap past 2**31 bytes
  return 2 * batch * layers * seq * kv_heads * per_head


# --------------------------------------------------------------------------- training

TASKS = ("lm", "copy", "reverse", "sort", "add", "tsv")
OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULES = ("inverse_sqrt", "cosine", "constant")
NONFINITE = ("stop", "skip")
TOKENIZERS = ("byte", "sentencepiece", "hf_json")


def _nonnegative(name: str, value) -> None:
  if not is_integer(value) or value < 0:
    raise ValueError(f"{name}={value!r} must be a non-negative integer")


MAX_SEED = 2**63 - 1  # an int64, every bit of it in the key (``seed_key``)


def check_seed(name: str, value) -> None:
  if not is_integer(value) or not 0 <= value <= MAX_SEED:
    raise ValueError(f"{name}={value!r} must be an integer in [0, 2**63 - 1]")


# The DataConfig fields only some tasks read, and what each task reads of them (besides
# seq_len, batch_size, seed and the tokenizer's, which every task reads). A value other than
# the default in a field the task does not read would be silently ignored: refused (for
# task='add''s min_len / vocab_chars since 2026-12-03, the rest since 2026-12-06: a
# synthetic task with paths trained on its synthetic data without a word).
TASK_FIELDS = ("paths", "validation_percent", "max_files", "min_len", "max_len", "vocab_chars")
_TASK_READS = {
    "lm": (("paths", "validation_percent", "max_files"),
           "a language model reads the text files of paths"),
    "tsv": (("paths", "validation_percent"), "it reads the pairs of the files in paths"),
    "add": (("max_len",), "its operands are decimal numbers of 1 to max_len // 2 digits"),
}
_SYNTHETIC_READS = (("min_len", "max_len", "vocab_chars"),
                    "its examples are drawn from seed, min_len, max_len and vocab_chars")


# Set while a saved run's config.gin is read (``saved_data_config``): the fields its run did
# not read are reset to their defaults and listed here instead of refused. attnlab before
# 2026-12-06 took them (and ignored them) and wrote them into config.gin; the run they
# describe did not read them, and its workdir must still evaluate, decode and resume. A
# TrainConfig's b1 / b2 at 1 in float32 (taken before 2026-12-07) are read as they are.
_unread_fields: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "unread_fields", default=None)
# Set while ``TrainConfig.replace`` copies a config without b1, b2 or the optimizer among the
# changes: what its source holds was taken (checked, or read from a saved run as it is).
_betas_kept: contextvars.ContextVar[bool] = contextvars.ContextVar("betas_kept", default=False)


@contextlib.contextmanager
def saved_data_config():
  """Within it, a DataConfig resets the fields its task does not read (``TASK_FIELDS``;
  ``tokenizer_model`` of the byte tokenizer, ``loss_on_prompt`` of a language model) and a
  TrainConfig the ``weight_decay`` of an optimizer that has none to their defaults rather than
  refuse them; yields the list of ``(class name, field, value)`` reset, for the caller to
  warn about."""
  dropped: list = []
  token = _unread_fields.set(dropped)
  try:
    yield dropped
  finally:
    _unread_fields.reset(token)


def _unread(cfg, name: str, default, message: str) -> None:
  """A field of ``cfg`` (a DataConfig or TrainConfig) its run does not read: refused with
  ``message``, or reset to ``default`` while a saved config is read (``saved_data_config``)."""
  dropped = _unread_fields.get()
  if dropped is None:
    raise ValueError(message)
  dropped.append((type(cfg).__name__, name, getattr(cfg, name)))
  object.__setattr__(cfg, name, default)


def _check_task_fields(dcfg) -> None:
  """ValueError naming a field of ``TASK_FIELDS`` set (not at its default) for a task that
  does not read it. (A TSV task given a validation file does not read validation_percent
  either; it is let be: the file says what the validation set is.)"""
  reads, how = _TASK_READS.get(dcfg.task, _SYNTHETIC_READS)
  defaults = {f.name: f.default for f in dataclasses.fields(dcfg)}
  for name in TASK_FIELDS:
    value = getattr(dcfg, name)
    if name not in reads and value != defaults[name]:
      _unread(dcfg, name, defaults[name],
              f"{name}={value!r} does not apply to task={dcfg.task!r} ({how}); leave it at "
              f"{defaults[name]!r}")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
  """What a training run reads, and how it is cut into batches.

  Attributes:
    task: "lm" (packed text), "copy" | "reverse" | "sort" | "add" (synthetic
      seq2seq from ``seed``) or "tsv" (parallel text, one "source<TAB>target"
      pair a line).
    paths: text files or glob patterns for "lm" (empty = the Python standard
      library's own source on this interpreter); for "tsv" the training file
      first, then optionally the validation file.
    seq_len: T, tokens a row (targets are the next token, so a row reads T+1).
    batch_size: B, rows a step (all accumulation micro-batches together).
    validation_percent: files (lm) or lines (tsv) held out for validation, by
      a stable hash of their name / index.
    max_files: use at most this many files of each split (0 = all); keeps CPU demos
      quick. Of a split's n files sorted by path: every (n // max_files)-th, the first
      max_files of those (so with fewer than 2 * max_files files, the first max_files).
    min_len, max_len: length range of synthetic sources; for "add", operands
      of 1 to max_len // 2 digits ("9999+9999" at max_len 8), min_len unused.
    vocab_chars: size of the synthetic alphabet (unused by "add": digits).
    loss_on_prompt: decoder-only seq2seq: also train on the source tokens.
    tokenizer: "byte" (default), "sentencepiece" (needs the extra and
      ``tokenizer_model``) or "hf_json" (a transformers ``tokenizer.json``
      read with the ``tokenizers`` extra; ``attnlab convert --from-hf`` sets
      it).
    tokenizer_model: path of a sentencepiece model or of a tokenizer.json.
    bos_id, eos_id: the special ids of an "hf_json" tokenizer (the
      checkpoint's config.json names them); None = it has none. The byte and
      sentencepiece tokenizers fix bos=1, eos=2: leave these None.
    seed: the training data's order and synthetic training examples (the
      validation split is the same for every seed).
  """

  task: str = "lm"
  paths: tuple[str, ...] = ()
  seq_len: int = 128
  batch_size: int = 16
  validation_percent: int = 5
  max_files: int = 0
  min_len: int = 3
  max_len: int = 12
  vocab_chars: int = 10
  loss_on_prompt: bool = False
  tokenizer: str = "byte"
  tokenizer_model: str = ""
  bos_id: int | None = None
  eos_id: int | None = None
  seed: int = 0

  def __post_init__(self):
    _check_types(self)
    _choice("task", self.task, TASKS)
    object.__setattr__(self, "paths", tuple(self.paths))
    for name in ("seq_len", "batch_size", "min_len", "max_len", "vocab_chars"):
      check_positive(name, getattr(self, name))
    _nonnegative("max_files", self.max_files)
    check_seed("seed", self.seed)
    if not is_integer(self.validation_percent) or not 0 <= self.validation_percent < 100:
      raise ValueError(f"validation_percent={self.validation_percent!r} must be an integer in "
                       "[0, 100)")
    _check_task_fields(self)
    if self.task != "add" and self.min_len > self.max_len:
      raise ValueError(f"min_len={self.min_len} must be <= max_len={self.max_len}")
    if self.task == "add" and not 2 <= self.max_len <= 37:
      # operands of up to max_len // 2 digits, drawn as int64 (at most 18 digits); max_len 1
      # was taken as 1 digit until 2026-12-04
      raise ValueError(f"max_len={self.max_len} does not fit task='add': its operands have "
                       "1 to max_len // 2 digits, at most 18; use 2 <= max_len <= 37")
    if self.vocab_chars > 26:
      raise ValueError(f"vocab_chars={self.vocab_chars} must be at most 26")
    _choice("tokenizer", self.tokenizer, TOKENIZERS)
    if self.tokenizer == "byte" and self.tokenizer_model:  # ignored until 2026-12-06
      _unread(self, "tokenizer_model", "",
              f"tokenizer_model={self.tokenizer_model!r} is read by tokenizer='sentencepiece' "
              "or 'hf_json'; the 'byte' tokenizer has no model file: set DataConfig.tokenizer, "
              "or leave tokenizer_model unset")
    if self.tokenizer == "sentencepiece" and not self.tokenizer_model:
      raise ValueError("tokenizer='sentencepiece' needs tokenizer_model (a .model path)")
    if self.tokenizer == "hf_json" and not self.tokenizer_model:
      raise ValueError("tokenizer='hf_json' needs tokenizer_model (a tokenizer.json path)")
    for name in ("bos_id", "eos_id"):
      value = getattr(self, name)
      if value is None:
        continue
      _nonnegative(name, value)
      if self.tokenizer != "hf_json":
        raise ValueError(f"{name}={value} is only allowed with tokenizer='hf_json' (the "
                         f"{self.tokenizer!r} tokenizer fixes bos=1, eos=2)")
    if self.task == "tsv" and not self.paths:
      raise ValueError("task='tsv' needs paths=('train.tsv', ['valid.tsv'])")
    if self.task == "lm" and self.loss_on_prompt:  # ignored there until 2026-12-04
      _unread(self, "loss_on_prompt", False,
              "loss_on_prompt=True does not apply to task='lm' (a language model is trained on "
              "every token); it is for a decoder-only pair task")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
  """How a model is trained: steps, optimizer, schedule, mesh, checkpoints.

  Attributes:
    steps: optimizer steps of the whole run.
    seed: parameter init and dropout.
    optimizer: "adamw" (default), "adam" or "sgd".
    learning_rate: peak rate ("cosine", "constant"); with "inverse_sqrt" a
      multiplier of the paper's d_model^-0.5 * min(s^-0.5, s * w^-1.5).
    schedule: "inverse_sqrt" (the paper), "cosine" (warmup + cosine) or
      "constant" (warmup, then flat).
    warmup_steps: linear warmup (the paper: 4000).
    min_lr_ratio: the cosine schedule decays to this fraction of the peak.
    b1, b2, eps, weight_decay: Adam(W) hyperparameters (the paper: 0.9, 0.98,
      1e-9; no weight decay). eps must be positive for "adam" / "adamw" (a
      parameter whose gradient is always 0 would be 0 / 0); weight_decay is
      "adamw"'s (another optimizer refuses a nonzero one); "sgd" takes b1 as its
      momentum and ignores b2 and eps.
    grad_clip: clip the global gradient norm to this; 0 = no clipping.
    label_smoothing: the paper's 0.1; 0 = plain cross-entropy.
    grad_accum: micro-batches per step (must divide the batch size).
    mesh_shape: (data, fsdp, tensor); one entry may be -1 = the remaining
      devices. A shape using fewer devices than exist takes the first ones.
    log_every, eval_every, checkpoint_every: in steps (0 = never; the last
      step always logs and checkpoints).
    eval_batches: validation batches an evaluation reads.
    keep_checkpoints: checkpoints kept in the workdir.
    on_nonfinite: "stop" (keep the last good checkpoint and exit with an
      error) or "skip" (drop the update, count it, continue).
    progress: show a tqdm bar on stderr.
  """

  steps: int = 1000
  seed: int = 0
  optimizer: str = "adamw"
  learning_rate: float = 1e-3
  schedule: str = "cosine"
  warmup_steps: int = 100
  min_lr_ratio: float = 0.1
  b1: float = 0.9
  b2: float = 0.98
  eps: float = 1e-9
  weight_decay: float = 0.0
  grad_clip: float = 1.0
  label_smoothing: float = 0.0
  grad_accum: int = 1
  mesh_shape: tuple[int, int, int] = (-1, 1, 1)
  log_every: int = 10
  eval_every: int = 0
  eval_batches: int = 4
  checkpoint_every: int = 200
  keep_checkpoints: int = 3
  on_nonfinite: str = "stop"
  progress: bool = True

  def __post_init__(self):
    _check_types(self)
    check_positive("steps", self.steps)
    check_seed("seed", self.seed)
    for name in ("steps", "warmup_steps"):  # int32 in the train state and the schedule:
      if is_integer(getattr(self, name)) and getattr(self, name) >= 2**31:  # a traceback
        raise ValueError(f"{name}={getattr(self, name)} must be below 2**31")  # until 12-05
    _choice("optimizer", self.optimizer, OPTIMIZERS)
    _choice("schedule", self.schedule, SCHEDULES)
    if not self.learning_rate > 0:
      raise ValueError(f"learning_rate={self.learning_rate!r} must be positive")
    # 1e39 was inf in float32: the first update NaN (0 x inf in the warmup), reported as a
    # non-finite update at "learning rate nan" (until 2026-12-06); 1e-46 was 0
    check_float32_range("learning_rate", self.learning_rate, "the schedule computes in "
                        "float32, where it would be inf (a nan update) or 0 (no update)")
    _nonnegative("warmup_steps", self.warmup_steps)
    if self.schedule == "inverse_sqrt" and self.warmup_steps == 0:
      raise ValueError("warmup_steps=0 is not allowed with schedule='inverse_sqrt'")
    if not 0.0 <= self.min_lr_ratio <= 1.0:
      raise ValueError(f"min_lr_ratio={self.min_lr_ratio!r} must be in [0, 1]")
    for name in ("b1", "b2"):
      _fraction(name, getattr(self, name))
    self._check_betas_below_1_in_float32()
    for name in ("eps", "weight_decay", "grad_clip"):
      if not getattr(self, name) >= 0:
        raise ValueError(f"{name}={getattr(self, name)!r} must be non-negative")
    if self.optimizer in ("adam", "adamw") and not self.eps > 0:
      raise ValueError(f"eps={self.eps!r} must be positive with optimizer={self.optimizer!r}: "
                       "Adam divides by sqrt(v) + eps, and a parameter whose gradient is "
                       "always 0 (an unused embedding row) would become nan")
    if self.optimizer in ("adam", "adamw"):  # 1e-40 was 0 in float32: the nan above
      check_float32_range("eps", self.eps, "Adam divides by sqrt(v) + eps in float32, where it "
                          "would be 0 (a nan update) or inf (no update)")
    if self.weight_decay > 0 and self.optimizer != "adamw":  # ignored until 2026-12-03
      _unread(self, "weight_decay", 0.0,
              f"weight_decay={self.weight_decay!r} is applied by optimizer='adamw' only; got "
              f"optimizer={self.optimizer!r}")
    # 1e39 was inf in float32 (accepted until 2026-12-06: the first update non-finite, after
    # the run's folder was made and its config.gin rewritten); 1e-40 was 0 there
    if self.weight_decay > 0:
      check_float32_range("weight_decay", self.weight_decay, "AdamW multiplies the "
                          "parameters by it in float32, where it would be inf (a nan update) "
                          "or 0 (no decay; weight_decay=0 says that)")
    if self.grad_clip > 0:
      check_float32_range("grad_clip", self.grad_clip, "the gradient norm is compared with it "
                          "in float32, where it would be inf or 0; grad_clip=0 turns "
                          "clipping off")
    _fraction("label_smoothing", self.label_smoothing)
    check_positive("grad_accum", self.grad_accum)
    object.__setattr__(self, "mesh_shape", check_mesh_shape(self.mesh_shape))
    for name in ("log_every", "eval_every", "checkpoint_every"):
      _nonnegative(name, getattr(self, name))
    check_positive("eval_batches", self.eval_batches)
    check_positive("keep_checkpoints", self.keep_checkpoints)
    _choice("on_nonfinite", self.on_nonfinite, NONFINITE)

  def _check_betas_below_1_in_float32(self) -> None:
    """0.99999999 is 1.0 in float32, where optax computes: Adam's bias correction 1 - b**t
    is 0 (b2: an update 0, or nan where a parameter's gradients were all 0, an unused
    embedding row: a run that does not train; b1: nan at step 1, blamed on the learning
    rate), and SGD's momentum (b1; SGD reads no b2) never decays (taken until 2026-12-07). A
    saved run's config.gin (``saved_data_config``) is read as it is: the run trained so, and
    its workdir must still evaluate and decode (a resume warns: ``betas_at_1_in_float32``)."""
    if _unread_fields.get() is not None or _betas_kept.get():
      return
    why = self.betas_at_1_in_float32()
    if why is not None:
      raise ValueError(f"{why}: give at most 0.9999999")

  def betas_at_1_in_float32(self) -> str | None:
    """What is wrong with a b1 / b2 (those the optimizer reads) that is 1 in float32, or None
    (a resume of a saved run that holds one warns with it: ``trainer``)."""
    names = ("b1", "b2") if self.optimizer in ("adam", "adamw") else ("b1",)
    for name in names:
      if np.float32(getattr(self, name)) == 1.0:
        why = (f"Adam's bias correction 1 - {name}**t would be 0" if self.optimizer != "sgd"
               else "SGD's momentum would never decay")
        return (f"{name}={getattr(self, name)!r} is 1 in float32, where the optimizer "
                f"computes ({why})")
    return None

  def replace(self, **changes) -> TrainConfig:
    """A copy with ``changes``, checked as a new config, but for b1 / b2 at 1 in float32,
    refused only when they or the optimizer are among the changes: a saved run's config
    that holds one (read as it is) stays readable in its copies (until 2026-12-07 eval, a
    resume, ``ablate --report`` and convert-heads refused the copies they made of it)."""
    if {"b1", "b2", "optimizer"} & changes.keys():  # what the check reads (sgd reads no b2)
      return dataclasses.replace(self, **changes)
    token = _betas_kept.set(True)
    try:
      return dataclasses.replace(self, **changes)
    finally:
      _betas_kept.reset(token)


# --------------------------------------------------------------------------- decoding

@dataclass(frozen=True, kw_only=True)
class DecodeConfig:
  """How ``attnlab decode`` / ``attnlab.generate`` produce tokens.

  The one home of the decoding defaults: ``generate``'s keyword defaults are
  read from ``DecodeConfig()``. The end-of-sequence and start tokens are not
  here: they belong to the tokenizer (``attnlab.data.tokenizer``).

  Attributes:
    max_new_tokens: tokens generated per sequence at most.
    cache: "contiguous" | "ring" (sliding-window models) | "paged"
      (``CACHE_KINDS``).
    temperature: 0 = greedy; else logits are divided by it before sampling.
    top_k: sample only among the k most likely tokens; None = all.
    top_p: sample only from the smallest set whose probability reaches p.
    beam_size: beam search width (either architecture); 1 = no beam search.
    length_penalty: alpha of the GNMT length penalty ((5 + len) / 6)^alpha
      that divides the log probability of a finished beam; 0 = none.
    seed: the sampling seed.
    page_size: C, slots per page of the paged cache.
    num_pages: P, pages of the paged cache; None = enough for every sequence.
  """

  max_new_tokens: int = 64
  cache: str = "contiguous"
  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None
  beam_size: int = 1
  length_penalty: float = 0.6
  seed: int = 0
  page_size: int = 16
  num_pages: int | None = None

  def __post_init__(self):
    _check_types(self)
    check_positive("max_new_tokens", self.max_new_tokens)
    _choice("cache", self.cache, CACHE_KINDS)
    check_temperature(self.temperature)
    if self.top_k is not None:
      check_positive("top_k", self.top_k)
    if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
    check_positive("beam_size", self.beam_size)
    if self.beam_size > 1 and (self.temperature != 0.0 or self.top_k is not None
                               or self.top_p is not None):
      raise ValueError(f"beam_size={self.beam_size} decodes deterministically: temperature="
                       f"{self.temperature!r}, top_k={self.top_k!r}, top_p={self.top_p!r} "
                       "(sampling) are not used with it; leave them unset")
    if self.temperature == 0.0 and (self.top_k is not None or self.top_p is not None):
      raise ValueError(f"top_k={self.top_k!r}, top_p={self.top_p!r} filter what is sampled, "
                       "and temperature=0 is greedy (no sampling): give a temperature > 0, or "
                       "leave them unset")
    if not self.length_penalty >= 0.0:
      raise ValueError(f"length_penalty={self.length_penalty!r} must be >= 0")
    check_seed("seed", self.seed)
    check_positive("page_size", self.page_size)
    if self.num_pages is not None:
      check_positive("num_pages", self.num_pages)


# --------------------------------------------------------------------------- ablation

@dataclass(frozen=True, kw_only=True)
class Sweep:
  """A head-sharing ablation: arms x seeds on top of a base run.

  Attributes:
    base: gin files of the run every arm starts from (found as given, next
      to the sweep file, or in configs/); () = the sweep file binds it all.
    num_kv_heads: K of the from-scratch arms; None = N, N/2, ..., 1 of the
      base config (MHA, GQA..., MQA; halving while N stays divisible).
    seeds: one run per arm and seed (the seed sets the init and data order).
    match_params: widen every from-scratch arm's FFN (d_ff) so its parameter count
      equals the MHA arm's within 1% (the uptraining arms keep the MHA run's d_ff, and so
      have fewer parameters).
    uptrain_num_kv_heads: K of the uptraining arms: the MHA arm's final
      checkpoint converted to K heads (``attnlab.convert_heads``), then
      trained ``uptrain_fraction`` of the base steps. () = none.
    uptrain_methods: conversion methods of the uptraining arms.
    uptrain_fraction: uptraining steps as a fraction of the base steps (the
      paper's alpha = 0.05); the warmup is scaled by it too.
    uptrain_learning_rate: ``TrainConfig.learning_rate`` of the uptraining
      runs (same meaning: the peak, or the inverse_sqrt multiplier); None =
      the base run's. The optimizer state starts fresh either way.
    curve_points: validation evaluations per run for the loss curves, used
      when the base's ``TrainConfig.eval_every`` is 0.
    decode_prompt_len: tokens of each benchmark prompt (cut from the
      validation data; the same prompts for every arm).
    decode_new_tokens: greedy tokens generated per sequence (no early stop).
    decode_repeats: timed repetitions after a compile run; the best counts.
  """

  base: tuple[str, ...] = ()
  num_kv_heads: tuple[int, ...] | None = None
  seeds: tuple[int, ...] = (0, 1, 2)
  match_params: bool = False
  uptrain_num_kv_heads: tuple[int, ...] = ()
  uptrain_methods: tuple[str, ...] = CONVERT_METHODS
  uptrain_fraction: float = 0.05
  uptrain_learning_rate: float | None = None
  curve_points: int = 10
  decode_prompt_len: int = 32
  decode_new_tokens: int = 64
  decode_repeats: int = 3

  def __post_init__(self):
    for name in ("base", "seeds", "uptrain_num_kv_heads", "uptrain_methods"):
      value = getattr(self, name)
      if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"{name}={value!r} must be a list")
      object.__setattr__(self, name, tuple(value))
    _check_types(self)
    if self.num_kv_heads is not None:
      if isinstance(self.num_kv_heads, int | np.integer | str):
        raise ValueError(f"num_kv_heads={self.num_kv_heads!r} must be a list (or None)")
      object.__setattr__(self, "num_kv_heads", tuple(self.num_kv_heads))
      if not self.num_kv_heads:
        raise ValueError("num_kv_heads=() is an empty arm list: give at least one K "
                         "(or None for N, N/2, ..., 1)")
      for k in self.num_kv_heads:
        check_positive("num_kv_heads", k)
      if len(set(self.num_kv_heads)) != len(self.num_kv_heads):
        raise ValueError(f"num_kv_heads={self.num_kv_heads!r} repeats a value")
      object.__setattr__(self, "num_kv_heads", tuple(int(k) for k in self.num_kv_heads))
    if not self.seeds:
      raise ValueError("seeds=() is empty: give at least one seed")
    for s in self.seeds:
      if not is_integer(s) or not 0 <= s <= MAX_SEED:
        raise ValueError(f"seeds={self.seeds!r} must be integers in [0, 2**63 - 1]")
    if len(set(self.seeds)) != len(self.seeds):
      raise ValueError(f"seeds={self.seeds!r} repeats a seed")
    object.__setattr__(self, "seeds", tuple(int(s) for s in self.seeds))
    if not isinstance(self.match_params, bool):
      raise ValueError(f"match_params={self.match_params!r} must be True or False")
    for k in self.uptrain_num_kv_heads:
      check_positive("uptrain_num_kv_heads", k)
    if len(set(self.uptrain_num_kv_heads)) != len(self.uptrain_num_kv_heads):
      raise ValueError(f"uptrain_num_kv_heads={self.uptrain_num_kv_heads!r} repeats a value")
    object.__setattr__(self, "uptrain_num_kv_heads",
                       tuple(int(k) for k in self.uptrain_num_kv_heads))
    if self.uptrain_num_kv_heads and not self.uptrain_methods:
      raise ValueError("uptrain_methods=() is empty while uptrain_num_kv_heads is set")
    for m in self.uptrain_methods:
      if m not in CONVERT_METHODS:
        raise ValueError(f"uptrain_methods={self.uptrain_methods!r}: {m!r} is not one of "
                         f"{', '.join(map(repr, CONVERT_METHODS))}")
    if len(set(self.uptrain_methods)) != len(self.uptrain_methods):  # one arm, two rows
      raise ValueError(f"uptrain_methods={self.uptrain_methods!r} repeats a value")
    if not 0.0 < self.uptrain_fraction <= 1.0:
      raise ValueError(f"uptrain_fraction={self.uptrain_fraction!r} must be in (0, 1]")
    lr = self.uptrain_learning_rate
    if lr is not None and (not is_number(lr) or not 0.0 < lr < math.inf):
      raise ValueError(f"uptrain_learning_rate={lr!r} must be a positive number (or None: the "
                       "base run's learning_rate)")
    if lr is not None:  # as TrainConfig.learning_rate, named as this field
      check_float32_range("uptrain_learning_rate", lr, "the uptraining runs' learning_rate, "
                          "which computes in float32, where it would be inf or 0")
    for name in ("curve_points", "decode_prompt_len", "decode_new_tokens", "decode_repeats"):
      check_positive(name, getattr(self, name))
