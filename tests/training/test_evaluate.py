"""Seq2seq evaluation through the real path: train a tiny model to memorize a
4-line TSV (validation = the same lines), then ``attnlab eval`` must decode
every line exactly (exact match 1, BLEU 100), and at an early checkpoint the
reported exact match / BLEU must equal what sacrebleu computes from the
predictions file the eval writes. The BLEU of hand-made partial matches is
checked against a value worked out from n-gram counts by hand."""

import json
import math

import numpy as np
import pytest
import sacrebleu

from attnlab import config_gin as gin_config
from attnlab.data.tokenizer import ByteTokenizer
from attnlab.training import evaluate as eval_lib
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


def test_bleu_of_hand_made_partial_matches_is_the_hand_computed_value(tmp_path):
  tok = ByteTokenizer()
  pairs = [  # (prediction, reference)
      ("the cat sat on the mat", "the cat sat on a mat"),
      ("good night", "good night my friend"),
      ("a red door here", "a red door here"),
  ]
  examples = [{"source": tok.encode("x"), "prediction": list(tok.encode(p)),
               "reference": list(tok.encode(r))} for p, r in pairs]
  # Clipped n-gram matches / n-grams of the predictions, summed over the corpus:
  #   1-grams: 5/6 (one "the" too many) + 2/2 + 4/4 = 11/12
  #   2-grams: 3/5 ("the cat", "cat sat", "sat on") + 1/1 + 3/3 = 7/9
  #   3-grams: 2/4 + 0/0 + 2/2 = 4/6
  #   4-grams: 1/3 ("the cat sat on") + 0/0 + 1/1 = 2/4
  # Prediction length c = 6 + 2 + 4 = 12 < reference length r = 6 + 4 + 4 = 14:
  # brevity penalty exp(1 - r / c).
  precisions = [11 / 12, 7 / 9, 4 / 6, 2 / 4]
  want = 100 * math.exp(1 - 14 / 12) * math.exp(sum(math.log(p) for p in precisions) / 4)
  out = eval_lib.seq2seq_metrics(examples, tok, bleu=True,
                                 predictions_path=str(tmp_path / "p.jsonl"))
  assert out["bleu"] == pytest.approx(want, rel=1e-9)  # 59.10...
  assert out["exact_match"] == pytest.approx(1 / 3)
  rows = [json.loads(line) for line in
          (tmp_path / "p.jsonl").read_text(encoding="utf-8").splitlines()]
  assert [(r["prediction"], r["reference"]) for r in rows] == pairs
