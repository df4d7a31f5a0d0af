"""tools/demo.sh end to end (few steps: ATTNLAB_DEMO_STEPS)."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path):
  venv = os.path.dirname(os.path.dirname(sys.executable))
  env = dict(os.environ, ATTNLAB_DEMO_STEPS="6", ATTNLAB_DEMO_WORKDIR=str(tmp_path / "demo"))
  res = subprocess.run(["bash", os.path.join(REPO, "tools", "demo.sh"), venv], env=env,
                       capture_output=True, text=True, timeout=600)
  assert res.returncode == 0, res.stderr[-3000:]
  # set -e: rc 0 means the decode step (attnlab decode, or the fallback) ran.
  sample = res.stdout.split("== greedy sample")[1].split("== TensorBoard")[0]
  lines = sample.split("\n")  # the header's tail, then the sample (maybe just spaces)
  assert len(lines) >= 3 and len(lines[1]) > 0
  assert f"{tmp_path / 'demo'}/tensorboard" in res.stdout
  assert os.listdir(tmp_path / "demo" / "tensorboard")
  assert os.path.isdir(tmp_path / "demo" / "checkpoints" / "6")
