"""tools/demo.sh end to end (few steps: ATTNLAB_DEMO_STEPS)."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path):
  """ATTNLAB_DEMO_WORKDIR relative to where the demo is called from (it resolved it from
  the repo before 2026-12-04), marked as the demo's."""
  venv = os.path.dirname(os.path.dirname(sys.executable))
  env = dict(os.environ, ATTNLAB_DEMO_STEPS="6", ATTNLAB_DEMO_WORKDIR="demo")
  res = subprocess.run(["bash", os.path.join(REPO, "tools", "demo.sh"), venv], env=env,
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
  assert res.returncode == 0, res.stderr[-3000:]
  # set -e: rc 0 means the decode step (attnlab decode, or the fallback) ran.
  sample = res.stdout.split("== greedy sample")[1].split("== TensorBoard")[0]
  lines = sample.split("\n")  # the header's tail, then the sample (maybe just spaces)
  assert len(lines) >= 3 and len(lines[1]) > 0
  assert f"{tmp_path / 'demo'}/tensorboard" in res.stdout
  assert os.listdir(tmp_path / "demo" / "tensorboard")
  assert os.path.isdir(tmp_path / "demo" / "checkpoints" / "6")
  assert os.path.isfile(tmp_path / "demo" / ".attnlab_demo")


def test_demo_deletes_only_a_workdir_of_an_earlier_demo(tmp_path):
  """The demo starts afresh, deleting its workdir: an existing directory that no demo made
  (no .attnlab_demo in it) stops it before anything is deleted or trained (exit 2); one
  that a demo made is deleted (here the run then fails at once: no venv)."""
  mine = tmp_path / "mine"
  mine.mkdir()
  (mine / "notes.txt").write_text("keep me")
  env = dict(os.environ, ATTNLAB_DEMO_WORKDIR="mine")
  script = os.path.join(REPO, "tools", "demo.sh")
  res = subprocess.run(["bash", script, str(tmp_path / "no_venv")], env=env,
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
  assert res.returncode == 2 and res.stdout == ""
  assert res.stderr.strip() == (
      f"tools/demo.sh: {mine} exists and is not a workdir of an earlier demo (no "
      ".attnlab_demo in it): not deleting it; set ATTNLAB_DEMO_WORKDIR to a new path")
  assert (mine / "notes.txt").read_text() == "keep me"
  (mine / ".attnlab_demo").write_text("")
  env["ATTNLAB_DEMO_WORKDIR"] = "./mine/"  # another spelling of the same directory
  res = subprocess.run(["bash", script, str(tmp_path / "no_venv")], env=env,
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
  assert res.returncode != 0 and "no_venv/bin/attnlab" in res.stderr
  assert sorted(os.listdir(mine)) == [".attnlab_demo"]  # deleted and marked afresh
