"""``attnlab convert``: transformers checkpoints in and out.

    attnlab convert --from-hf DIR --workdir OUT [--dtype float32|bfloat16|float16]
    attnlab convert --to-hf --workdir RUN --out DIR [--step N] [--max_shard_mb M]

``--from-hf`` reads a local transformers directory (config.json,
*.safetensors, sharded or not, and tokenizer.json when present) and writes a
workdir that ``attnlab decode / eval / train`` and ``attnlab.load_checkpoint``
use as they are: a weights-only checkpoint at step 0, a config.gin, and a
copy of tokenizer.json. ``--to-hf`` writes the transformers layout of a
workdir's checkpoint (``AutoModelForCausalLM.from_pretrained(DIR)`` loads it).

Everything is checked (config fields, tensor names and shapes, from the
file headers) before anything is written; the output is assembled in a
temporary folder beside it and renamed at the end, so a failed conversion
leaves no half-written OUT. Nothing is fetched from the network.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile

import jax
from flax import nnx

from attnlab import config_gin as gin_config
from attnlab.commands import CommandError
from attnlab.commands._common import (
    CommandParser,
    check_can_make,
    check_path_given,
    check_workdir_given,
    log_attnlab_info,
)
from attnlab.config import DTYPES, DataConfig, TrainConfig
from attnlab.convert import hf
from attnlab.data.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TOKENIZER_FILES,
    HFJsonTokenizer,
    SentencePieceTokenizer,
    check_companion_files,
)
from attnlab.nn.layers import as_dtype
from attnlab.nn.transformer import build_model
from attnlab.training.checkpoint import (
  Checkpointer,
  CheckpointMismatchError,
  UnreadableCheckpointError,
  workdir_config,
)

STEP = 0


MAX_SHARD_MB = 2048  # --max_shard_mb's default


def _parser():
  p = CommandParser(prog="attnlab convert",
              description="Convert a transformers checkpoint to an attnlab workdir, or back.")
  way = p.add_mutually_exclusive_group(required=True)
  way.add_argument("--from-hf", dest="from_hf", metavar="DIR",
                   help="a local transformers checkpoint directory to import")
  way.add_argument("--to-hf", dest="to_hf", action="store_true",
                   help="export --workdir to the transformers layout in --out")
  p.add_argument("--workdir", required=True,
                 help="--from-hf: the workdir to create; --to-hf: the workdir to export")
  p.add_argument("--out", default=None, help="--to-hf: the directory to create")
  p.add_argument("--dtype", default=None, choices=DTYPES,
                 help="--from-hf: parameter and compute dtype (default: the checkpoint's)")
  p.add_argument("--step", type=int, default=None, help="--to-hf: checkpoint step (latest)")
  p.add_argument("--max_shard_mb", type=int, default=None,
                 help=f"--to-hf: largest safetensors shard (MiB; default {MAX_SHARD_MB})")
  return p


def main(argv: list[str]) -> int:
  args = _parser().parse_args(argv)
  log_attnlab_info()

  try:
    if args.from_hf is not None:
      check_path_given("--from-hf", args.from_hf)
      for flag in ("out", "step", "max_shard_mb"):  # the last ignored until 2026-12-06
        if getattr(args, flag) is not None:
          raise CommandError(f"--{flag} is only for --to-hf")
      summary = from_hf(args.from_hf, args.workdir, dtype=args.dtype)
    else:
      check_workdir_given(args.workdir)
      if args.out is None:
        raise CommandError("--to-hf needs --out DIR")
      if args.dtype is not None:
        raise CommandError("--dtype is only for --from-hf (--to-hf keeps the checkpoint's)")
      if args.max_shard_mb is None:
        args.max_shard_mb = MAX_SHARD_MB
      if args.max_shard_mb < 1:
        raise CommandError(f"--max_shard_mb={args.max_shard_mb} must be a positive integer")
      summary = to_hf(args.workdir, args.out, step=args.step,
                      max_shard_bytes=args.max_shard_mb << 20)
  except (hf.ConversionError, FileNotFoundError) as e:
    raise CommandError(str(e)) from None
  # config.gin no longer describes the checkpoint, or its bytes changed since the save
  except (CheckpointMismatchError, UnreadableCheckpointError) as e:
    raise CommandError(str(e)) from None
  except ImportError as e:
    raise CommandError(f"{e} (attnlab convert needs safetensors, in the hf extra, and for a "
                       "tokenizer.json tokenizers, in the tokenizers extra)") from None
  print(json.dumps(summary))
  return 0


def _check_new(path: str, flag: str) -> str:
  """``path`` made absolute: a directory that does not exist yet and can be made (missing
  parents are made, as train and convert-heads make theirs; until 2026-12-04 a missing
  parent was refused). An empty or blank path is refused before it is made absolute (until
  2026-12-06 "" was the working directory and "  " a folder of that name)."""
  check_path_given(flag, path)
  path = os.path.abspath(path)
  if os.path.exists(path):
    raise CommandError(f"{flag} {path} already exists; give a new directory")
  check_can_make(flag, path)
  return path


@contextlib.contextmanager
def _staging(final: str):
  """A temporary folder beside ``final``, renamed to it on success, removed on error with
  the parent folders made for it. It has the mode of a plain mkdir under the umask."""
  made, at = [], os.path.dirname(final)
  while not os.path.isdir(at):
    made.append(at)
    at = os.path.dirname(at)
  os.makedirs(os.path.dirname(final), exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.tmp-", dir=os.path.dirname(final))
  try:
    # mkdtemp's folder is 0700: ``final`` gets a plain mkdir's mode under the umask (it
    # stayed 0700 until 2026-12-07, unread by colleagues on a shared filesystem)
    hf.set_plain_mode(tmp)
    yield tmp
    os.rename(tmp, final)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    for d in made:  # deepest first
      with contextlib.suppress(OSError):
        os.rmdir(d)
    raise


def _check_companion_files(folder: str, what: str) -> None:
  """CommandError naming a tokenizer.json's companion file that is no regular file
  (``check_companion_files``): the conversion copies them, and the export reads its pad
  from them. Until 2026-12-07 such a file was passed over without a word (the copy lacked
  it, the export's config.json named no pad), while convert-heads refused it."""
  try:
    check_companion_files(folder, f"{what} copies it with the tokenizer.json beside it")
  except ValueError as e:
    raise CommandError(str(e)) from None


def finetune_train_config():
  """The TrainConfig a converted workdir starts with: gentle fine-tuning."""
  return TrainConfig(steps=100, learning_rate=2e-5, schedule="constant", warmup_steps=10,
                     weight_decay=0.0, checkpoint_every=100)


def from_hf(src_dir: str, workdir: str, *, dtype: str | None = None) -> dict:
  """Import ``src_dir`` (transformers layout) as the new workdir ``workdir``."""
  out = _check_new(workdir, "--workdir")
  hf_cfg = hf.read_hf_config(src_dir)
  family, mcfg = hf.from_hf_config(hf_cfg, dtype=dtype)
  files = hf.tensor_files(src_dir)
  rules = hf.check_tensors(family, mcfg, files)
  ids = hf.special_ids(hf_cfg)
  tok_path = os.path.join(src_dir, "tokenizer.json")
  # Anything there is read: a folder, a FIFO or a dangling link is named (until 2026-12-07
  # it was passed over and the workdir got the byte tokenizer, another vocabulary).
  if os.path.lexists(tok_path):
    try:
      tok = HFJsonTokenizer(tok_path)
    except ValueError as e:
      raise CommandError(str(e)) from None
    _check_companion_files(src_dir, "the import")
    if tok.vocab_size > mcfg.vocab_size:
      raise CommandError(f"{tok_path} has {tok.vocab_size} tokens, more than config.json "
                         f"vocab_size={mcfg.vocab_size}")
    # A config.json without bos_token_id: the bos its tokenizer.json's post-processor adds
    # (transformers' prompts start with it; the pipeline and decode put DataConfig.bos_id
    # in front, without the post-processor).
    bos = ids["bos"] if ids["bos"] is not None else tok.post_processor_bos()
    dcfg = DataConfig(tokenizer="hf_json", tokenizer_model=os.path.join(out, "tokenizer.json"),
                      bos_id=bos, eos_id=ids["eos"])
  else:
    dcfg = DataConfig()
  # rows no longer than the model's positions (128 > max_position_embeddings=64 made the
  # README's fine-tune command fail until 2026-12-06)
  dcfg = dataclasses.replace(dcfg, seq_len=min(dcfg.seq_len, mcfg.max_len))
  tcfg = finetune_train_config()


  with _staging(out) as tmp:
    params = hf.read_params(rules, files, as_dtype(mcfg.param_dtype))
    n = _save_weights(tmp, mcfg, params, meta={"converted_from": os.path.abspath(src_dir),
                                               "family": family})
    del params
    _write_config(tmp, mcfg, dcfg, tcfg, src_dir, out)
    if dcfg.tokenizer == "hf_json":
      for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src_dir, name)):
          shutil.copyfile(os.path.join(src_dir, name), os.path.join(tmp, name))
    if not gin_config.copy_generation_config(src_dir, tmp):
      _write_stop_ids(tmp, hf.eos_ids(hf_cfg))
  return {"workdir": out, "family": family, "params": n, "step": STEP,
          "tokenizer": dcfg.tokenizer}


def _write_stop_ids(dst: str, ids: list[int]) -> None:
  """A generation_config.json naming config.json's eos ids, where it lists several and the
  source ships no generation_config.json: the workdir keeps one eos id
  (``DataConfig.eos_id``), decode reads the others from this file, and the export gives
  it back (transformers stops at all of them, as it did on the source)."""
  if len(ids) > 1:
    with open(os.path.join(dst, gin_config.GENERATION_CONFIG), "w", encoding="utf-8") as f:
      json.dump({"eos_token_id": ids}, f, indent=2)


def _save_weights(tmp: str, mcfg, params: dict, meta: dict) -> int:
  """Fill the abstract model's parameters with ``params`` (consumed) and save them."""
  state, n = filled_params(mcfg, params)
  ckpt = Checkpointer(tmp)
  try:
    ckpt.save_params(STEP, state, meta)
  finally:
    ckpt.close()
  return n


def filled_params(mcfg, params: dict):
  """(the model's ``nnx.Param`` state holding ``params``, parameter count).

  ``params`` ({parameter path: array}, consumed) must fill every parameter with its
  shape and dtype, and hold nothing else; no model is initialized.
  """
  abstract = nnx.eval_shape(lambda: build_model(mcfg, rngs=nnx.Rngs(0)))
  state = nnx.state(abstract, nnx.Param)
  n = 0
  for path, var in nnx.to_flat_state(state):
    value = params.pop(tuple(path), None)
    if value is None:
      raise AssertionError(f"no rule fills the parameter {'/'.join(map(str, path))}")
    if value.shape != var.shape or value.dtype != var.dtype:
      raise AssertionError(f"parameter {'/'.join(map(str, path))}: {value.shape} "
                           f"{value.dtype}, the model has {var.shape} {var.dtype}")
    var.set_value(value)
    n += value.size
  if params:
    raise AssertionError(f"rules fill parameters the model lacks: {sorted(params)[:3]}")
  return state, n


def _write_config(tmp: str, mcfg, dcfg, tcfg, src_dir: str, workdir: str) -> None:
  # The tokenizer.json copied into the workdir is named relative to it (movable).
  text = gin_config.operative_config(mcfg, dcfg, tcfg, workdir=workdir)
  header = (f"# Converted by `attnlab convert --from-hf {os.path.abspath(src_dir)}`.\n"
            "# Fine-tune: attnlab train --gin_file THIS_FILE --workdir THIS_WORKDIR "
            "--gin.DataConfig.paths=\"('my/*.txt',)\" --gin.TrainConfig.steps=N\n")
  with open(os.path.join(tmp, "config.gin"), "w", encoding="utf-8") as f:
    f.write(header + text)


def export_special_ids(dcfg: DataConfig) -> tuple[int, int, int | None]:
  """(bos, eos, pad) of a workdir's tokenizer, as config.json names them. The pad is the one
  the tokenizer names, or None (transformers masks a pad id's tokens, and an embedding's
  padding row is not trained): a tokenizer.json's from its companion files, a sentencepiece
  model's own (none in sentencepiece's default layout, whose id 0 is <unk>), the byte
  tokenizer's 0."""
  if dcfg.tokenizer == "byte":  # pad 0, bos 1, eos 2
    return BOS_ID, EOS_ID, PAD_ID
  try:
    if dcfg.tokenizer == "hf_json":
      pad = HFJsonTokenizer(dcfg.tokenizer_model).named_pad_id(dcfg.tokenizer_model)
      return dcfg.bos_id, dcfg.eos_id, pad
    return BOS_ID, EOS_ID, SentencePieceTokenizer(dcfg.tokenizer_model).model_pad_id
  except ValueError as e:
    raise CommandError(str(e)) from None


def to_hf(workdir: str, out_dir: str, *, step: int | None = None,
          max_shard_bytes: int = 2 << 30) -> dict:
  """Export ``workdir``'s checkpoint to the transformers layout in ``out_dir``."""
  out = _check_new(out_dir, "--out")
  config_path = workdir_config(workdir)
  try:
    mcfg, dcfg, _ = gin_config.read_workdir_config(config_path)
  except gin_config.GinConfigError as e:
    raise CommandError(str(e)) from None
  family = hf.hf_family(mcfg)
  bos, eos, pad = export_special_ids(dcfg)  # tokenizer.json read first: its errors first
  if dcfg.tokenizer == "hf_json":
    _check_companion_files(os.path.dirname(dcfg.tokenizer_model), "the export")
  hf_cfg = hf.to_hf_config(mcfg, bos_id=bos, eos_id=eos, pad_id=pad)
  rules = hf.weight_rules(family, mcfg)
  params, step = _restore_weights(workdir, mcfg, step)
  with _staging(out) as tmp:
    files = hf.write_params(rules, params, tmp, max_shard_bytes=max_shard_bytes)
    del params
    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
      json.dump(hf_cfg, f, indent=2)
    if dcfg.tokenizer == "hf_json":
      src = os.path.dirname(dcfg.tokenizer_model)
      shutil.copyfile(dcfg.tokenizer_model, os.path.join(tmp, "tokenizer.json"))
      for name in TOKENIZER_FILES[1:]:
        if os.path.isfile(os.path.join(src, name)):
          shutil.copyfile(os.path.join(src, name), os.path.join(tmp, name))
    gin_config.copy_generation_config(workdir, tmp)
  return {"out": out, "family": family, "step": step,
          "files": [os.path.join(out, os.path.basename(f)) for f in files]}


def _restore_weights(workdir: str, mcfg, step: int | None):
  """({parameter path: array}, step): one host copy, no model initialized. ``step`` None:
  the newest checkpoint that reads (a damaged newer one is skipped with a warning)."""
  ckpt = Checkpointer(workdir, read_only=True)
  try:
    try:
      ckpt.resolve_step(step)  # nothing saved, or a step that was not: the errors named
    except ValueError as e:
      raise CommandError(f"--{e}") from None
    abstract = nnx.state(nnx.eval_shape(lambda: build_model(mcfg, rngs=nnx.Rngs(0))), nnx.Param)
    device = jax.sharding.make_single_device_sharding(jax.devices("cpu")[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                            abstract)
    step, state = ckpt.read_step(step, lambda s: ckpt.restore_params(s, abstract))
  finally:
    ckpt.close()
  return {tuple(path): var.get_value() for path, var in nnx.to_flat_state(state)}, step
