"""The built-in configs ship in the package: a non-editable install resolves
``include 'models/...'`` from a user's gin file anywhere, and a built-in config by name."""

import glob
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_wheel_ships_configs_and_an_installed_copy_resolves_includes(tmp_path):
  src = tmp_path / "src"  # a copy: the build writes build/ and *.egg-info next to the sources
  src.mkdir()
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(os.path.join(REPO, name), src / name)
  shutil.copytree(os.path.join(REPO, "attnlab"), src / "attnlab",
                  ignore=shutil.ignore_patterns("__pycache__"))
  wheels = tmp_path / "wheels"
  res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(wheels), str(src)], capture_output=True, text=True,
                       timeout=600)
  assert res.returncode == 0, res.stderr[-2000:]
  (wheel,) = glob.glob(str(wheels / "*.whl"))
  shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".gin")}
  in_repo = {os.path.relpath(p, REPO) for p in
             glob.glob(os.path.join(REPO, "attnlab", "configs", "**", "*.gin"), recursive=True)}
  assert shipped == in_repo and "attnlab/configs/models/llama_tiny.gin" in shipped

  # "Install" the wheel (a wheel is a zip of the site-packages tree) and import
  # attnlab from there only, in a directory far from any checkout.
  site = tmp_path / "site"
  zipfile.ZipFile(wheel).extractall(site)
  user = tmp_path / "user"
  user.mkdir()
  (user / "mine.gin").write_text("include 'models/llama_tiny.gin'\nModelConfig.d_model = 64\n")
  # ... and runs a built-in config by its name, or spelt configs/... as in a checkout.
  code = ("import attnlab.config_gin as g; m, _, _ = g.parse(['mine.gin'], []); "
          "print(g.__file__); print(m.num_kv_heads, m.d_model, m.head_dim); "
          "print(g.parse(['seq2seq_sort.gin'], [])[1].task, "
          "g.parse(['configs/seq2seq_add.gin'], [])[1].task)")
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env["PYTHONPATH"] = str(site)
  res = subprocess.run([sys.executable, "-c", code], cwd=user, env=env, capture_output=True,
                       text=True, timeout=300)
  assert res.returncode == 0, res.stderr[-2000:]
  where, values = res.stdout.split()[:1], res.stdout.split()[1:]
  assert where[0].startswith(str(site))
  # llama_tiny's GQA and head dim, the user's d_model; the built-in configs' tasks
  assert values == ["2", "64", "32", "sort", "add"]
