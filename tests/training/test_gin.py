"""gin configs: every file parses and builds its model; bad input exits 2
naming the problem and writes nothing; --gin. overrides beat files; the
written config.gin reproduces the run's configs."""

import glob
import os

import pytest
from flax import nnx

import attnlab
from attnlab import cli
from attnlab import config_gin as gin_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GIN_FILES = sorted(glob.glob(os.path.join(REPO, "configs", "**", "*.gin"), recursive=True))


def test_there_are_configs():
  names = {os.path.relpath(p, os.path.join(REPO, "configs")) for p in GIN_FILES}
  for want in ("lm_stdlib_tiny.gin", "lm_stdlib.gin", "seq2seq_reverse.gin", "seq2seq_sort.gin",
               "seq2seq_add.gin", "translation_tsv.gin", "models/transformer_base.gin"):
    assert want in names


@pytest.mark.parametrize("path", GIN_FILES, ids=lambda p: os.path.relpath(p, REPO))
def test_every_gin_file_parses_and_builds(path):
  mcfg, dcfg, tcfg = gin_config.parse([path], [])
  # Shapes only: the 7B config must not allocate.
  model = nnx.eval_shape(lambda: attnlab.build_model(mcfg, rngs=nnx.Rngs(0)))
  assert attnlab.count_params(model) > 0


def test_paper_base_config_is_the_paper():
  mcfg, _, tcfg = gin_config.parse([os.path.join(REPO, "configs", "translation_tsv.gin")], [])
  assert (mcfg.d_model, mcfg.num_heads, mcfg.d_ff, mcfg.num_layers, mcfg.num_encoder_layers) == (
      512, 8, 2048, 6, 6)
  assert (mcfg.norm_position, mcfg.norm, mcfg.pos, mcfg.mlp) == (
      "post", "layernorm", "sinusoidal", "relu")
  assert mcfg.tie_embeddings and mcfg.scale_embeddings and mcfg.dropout_rate == 0.1
  assert tcfg.label_smoothing == 0.1 and tcfg.schedule == "inverse_sqrt"
  assert tcfg.warmup_steps == 4000 and (tcfg.b2, tcfg.eps) == (0.98, 1e-9)


def _train(argv, capsys):
  rc = cli.main(["train", *argv])
  return rc, capsys.readouterr().err


@pytest.mark.parametrize("binding,needle", [
    ("--gin.ModelConfig.d_modle=64", "d_modle"),
    ("--gin.ModelConfg.d_model=64", "ModelConfg"),
    ("--gin.ModelConfig.d_model='big'", "d_model"),
    ("--gin.TrainConfig.mesh_shape=(1,1)", "mesh_shape"),
])
def test_bad_binding_exits_2_naming_it(tmp_path, capsys, binding, needle):
  workdir = tmp_path / "run"
  rc, err = _train(["--gin_file", os.path.join(REPO, "configs", "seq2seq_reverse.gin"),
                    binding, "--workdir", str(workdir)], capsys)
  assert rc == 2
  assert needle in err and len(err.strip().splitlines()) == 1
  assert not workdir.exists()


def test_missing_file_and_include_exit_2(tmp_path, capsys):
  rc, err = _train(["--gin_file", str(tmp_path / "nope.gin"), "--workdir",
                    str(tmp_path / "w")], capsys)
  assert rc == 2 and "nope.gin" in err
  bad = tmp_path / "bad.gin"
  bad.write_text("include 'models/no_such_model.gin'\n")
  rc, err = _train(["--gin_file", str(bad), "--workdir", str(tmp_path / "w")], capsys)
  assert rc == 2 and "no_such_model.gin" in err
  assert not (tmp_path / "w").exists()


def test_overrides_beat_files_and_config_gin_reproduces(tmp_path):
  base = os.path.join(REPO, "configs", "seq2seq_reverse.gin")
  extra = tmp_path / "extra.gin"
  extra.write_text("ModelConfig.d_model = 48\nTrainConfig.steps = 7\n")
  configs = gin_config.parse([base, str(extra)], ["ModelConfig.d_model = 32"])
  assert configs[0].d_model == 32 and configs[2].steps == 7  # later file, then --gin.
  written = tmp_path / "config.gin"
  written.write_text(gin_config.operative_config(*configs))
  assert gin_config.read_workdir_config(str(written)) == configs


def test_relative_inside_resolves_links_and_is_not_fooled_by_a_shared_prefix(tmp_path):
  run = tmp_path / "run"
  (run / "tok").mkdir(parents=True)
  (tmp_path / "run2").mkdir()
  (tmp_path / "link").symlink_to(run)
  assert gin_config.relative_inside(str(run / "tok" / "t.json"), str(run)) == "tok/t.json"
  assert gin_config.relative_inside(str(tmp_path / "link" / "t.json"), str(run)) == "t.json"
  assert gin_config.relative_inside(str(tmp_path / "run2" / "t.json"), str(run)) is None
  assert gin_config.relative_inside(str(tmp_path / "t.json"), str(run)) is None
