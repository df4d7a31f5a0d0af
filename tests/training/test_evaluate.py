"""Seq2seq evaluation through the real path: train a tiny model to memorize a
4-line TSV (validation = the same lines), then ``attnlab eval`` must decode
every line exactly (exact match 1, BLEU 100), and at an early checkpoint the
reported exact match / BLEU must equal what sacrebleu computes from the
predictions file the eval writes."""

import json

import numpy as np
import pytest
import sacrebleu

from attnlab import config_gin as gin_config
from attnlab.training import trainer

# Four or more words per line: corpus BLEU needs 4-grams (with only 3-word
# sentences it is 0 even for perfect output).
LINES = [("the cat sat down", "le chat est assis"),
         ("a red door here", "une porte rouge ici"),
         ("I see you now", "je te vois maintenant"),
         ("good night my friend", "bonne nuit mon ami")]
STEPS = 150


def _train(tmp_path, arch):
  tsv = tmp_path / "pairs.tsv"
  tsv.write_text("".join(f"{s}\t{t}\n" for s, t in LINES))
  model = "encdec_tiny.gin" if arch == "encoder_decoder" else "decoder_tiny.gin"
  gin = tmp_path / "task.gin"
  gin.write_text(f"include 'models/{model}'\n")
  bindings = [
      "ModelConfig.d_model = 32", "ModelConfig.d_ff = 64", "ModelConfig.num_layers = 1",
      "ModelConfig.num_heads = 2",
      "DataConfig.task = 'tsv'", f"DataConfig.paths = ('{tsv}', '{tsv}')",
      "DataConfig.seq_len = 48", "DataConfig.batch_size = 4",
      f"TrainConfig.steps = {STEPS}", "TrainConfig.learning_rate = 3e-3",
      "TrainConfig.schedule = 'constant'", "TrainConfig.warmup_steps = 10",
      "TrainConfig.weight_decay = 0.0", "TrainConfig.eval_every = 0",
      "TrainConfig.checkpoint_every = 30", "TrainConfig.keep_checkpoints = 10",
      "TrainConfig.log_every = 50", "TrainConfig.progress = False"]
  if arch == "encoder_decoder":
    bindings.append("ModelConfig.num_encoder_layers = 1")
  configs = gin_config.parse([str(gin)], bindings)
  mcfg, dcfg, tcfg = configs
  workdir = tmp_path / "run"
  trainer.train(mcfg, tcfg, dcfg, str(workdir), config_text=gin_config.operative_config(*configs))
  return str(workdir)


def _predictions(workdir, step):
  with open(trainer.predictions_path(workdir, step), encoding="utf-8") as f:
    return [json.loads(line) for line in f]


@pytest.mark.parametrize("arch", ["encoder_decoder", "decoder_only"])
def test_eval_decodes_memorized_tsv_and_bleu_matches_sacrebleu(tmp_path, arch):
  workdir = _train(tmp_path, arch)
  final = trainer.evaluate_workdir(workdir)
  assert final["step"] == STEPS
  rows = _predictions(workdir, STEPS)
  assert [(r["source"], r["reference"]) for r in rows] == LINES
  assert [r["prediction"] for r in rows] == [t for _, t in LINES]
  assert final["exact_match"] == 1.0
  assert final["bleu"] == pytest.approx(100.0)

  # Early on the outputs are partly wrong: the reported numbers must still
  # be those of the written predictions.
  early = trainer.evaluate_workdir(workdir, step=30)
  rows = _predictions(workdir, 30)
  preds, refs = [r["prediction"] for r in rows], [r["reference"] for r in rows]
  assert early["exact_match"] == np.mean([p == r for p, r in zip(preds, refs)])
  assert early["exact_match"] < 1.0
  assert early["bleu"] == pytest.approx(sacrebleu.corpus_bleu(preds, [refs]).score, abs=1e-9)
  assert early["bleu"] < 100.0
