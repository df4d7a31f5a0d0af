"""The loss of a decoder-only LM's first tokens with and without the bos it was trained with.

attnlab's training data lays every document out as ``[bos] document [eos]``, so the
model only ever sees a bos at position 0. For ``--files`` validation files of the
workdir's corpus (its config.gin's DataConfig), this prints the mean loss of predicting
tokens 1..N of each file (N = ``--tokens``) from the file's first tokens, once after a
bos (as in training, and as ``attnlab decode`` lays out a prompt) and once without (the
text alone at position 0, what ``attnlab decode`` read before 2026-12-03).

    PYTHONPATH=$PWD python tools/prompt_bos_loss.py --workdir runs/demo [--files 40] [--tokens 64]
"""

from __future__ import annotations

import argparse
import os
import sys

import _bench  # noqa: E402 - tools/ is on sys.path (run as a script)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--workdir", required=True)
  p.add_argument("--files", type=_bench.positive_int, default=40)
  p.add_argument("--tokens", type=_bench.positive_int, default=64)
  args = p.parse_args()

  import jax
  import jax.numpy as jnp
  import numpy as np

  import attnlab
  from attnlab import config_gin
  from attnlab.commands.decode import _tokenizer
  from attnlab.data import text

  try:  # one line, not a traceback (until 2026-12-04)
    model, cfg = attnlab.load_checkpoint(args.workdir)
  except (FileNotFoundError, ValueError) as e:
    p.error(str(e))
  if cfg.arch != "decoder_only":
    p.error(f"{args.workdir} holds an encoder-decoder; this measures a decoder-only LM")
  _, dcfg, _ = config_gin.read_workdir_config(os.path.join(args.workdir, "config.gin"))
  if dcfg.task != "lm":  # its validation files would be the stdlib's, not the run's data
    p.error(f"{args.workdir} trained task={dcfg.task!r}; this measures a language model "
            "(task='lm') on its validation files")
  if args.tokens + 1 > cfg.max_len:
    p.error(f"--tokens={args.tokens} needs {args.tokens + 1} positions, more than the "
            f"model's max_len={cfg.max_len}")
  tok = _tokenizer(args.workdir)
  files = text.lm_files(dcfg.paths, validation_percent=dcfg.validation_percent)["validation"]

  @jax.jit
  def losses(tokens):  # the loss of predicting tokens[1:] from what precedes each
    logp = jax.nn.log_softmax(model(tokens[None, :-1])[0].astype(jnp.float32))
    return -jnp.take_along_axis(logp, tokens[1:, None], axis=1)[:, 0]

  n = args.tokens
  with_bos, without = [], []
  for path in files:
    ids = tok.encode(text.read_text(path), add_special_tokens=False)[:n + 1]
    if len(ids) < n + 1:
      continue
    with_bos.append(np.mean(np.asarray(losses(jnp.asarray([tok.bos_id, *ids], jnp.int32)))[1:]))
    without.append(np.mean(np.asarray(losses(jnp.asarray(ids, jnp.int32)))))
    if len(with_bos) == args.files:
      break
  if not with_bos:  # nan and a NumPy warning until 2026-12-04
    sys.exit(f"no validation file of {args.workdir} holds {n + 1} tokens: give a smaller "
             "--tokens")
  print(f"{len(with_bos)} validation files of {args.workdir}: mean loss of predicting tokens "
        f"1..{n}: {np.mean(with_bos):.4f} after bos, {np.mean(without):.4f} without "
        f"({np.mean(without) / np.mean(with_bos):.3f}x)")


if __name__ == "__main__":
  main()
