"""Run by test_sharding.py in a subprocess with 8 forced host devices:
compiles the train step of each ``CONFIG:TASK`` on each mesh shape given and
prints, as JSON, the SPMD partitioner's involuntary-rematerialization warnings
that each compilation wrote to stderr (compile only: no step runs).

    python remat_check.py configs/models/llama_tiny.gin:lm 2,2,2 1,1,8 1,8,1
    python remat_check.py 'configs/models/llama_tiny.gin:lm:ModelConfig.pos="learned"' 2,2,2

A model is CONFIG:TASK, optionally :BINDING (one more gin binding).
"""

import json
import os
import sys
import tempfile

# Appended: the test session's flags (tests/conftest.py) are kept.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402

# The warnings are printed while XLA compiles: a program loaded from the test
# session's compilation cache would print none.
jax.config.update("jax_enable_compilation_cache", False)

from attnlab import config_gin  # noqa: E402
from attnlab.data import pipeline  # noqa: E402
from attnlab.training import sharding, steps  # noqa: E402

WARNING = "Involuntary full rematerialization"


def compile_stderr(fn) -> str:
  """What ``fn()`` writes to file descriptor 2 (XLA logs from C++, not via sys.stderr)."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile(mode="w+b") as f:
    os.dup2(f.fileno(), 2)
    try:
      fn()
    finally:
      os.dup2(saved, 2)
      os.close(saved)
    f.seek(0)
    return f.read().decode(errors="replace")


def main(argv):
  models = [a for a in argv if ":" in a]
  meshes = [tuple(int(x) for x in a.split(",")) for a in argv if ":" not in a]
  out = {"devices": jax.device_count()}
  for model in models:
    path, task, *extra = model.split(":", 2)
    bindings = [f'DataConfig.task = "{task}"',
                *(["DataConfig.max_files = 2"] if task == "lm" else []),  # the LM corpus's
                "DataConfig.seq_len = 32", "DataConfig.batch_size = 8",
                "ModelConfig.num_layers = 1", *extra]
    mcfg, dcfg, tcfg = config_gin.parse([path], bindings)
    sources, _ = pipeline.build_sources(dcfg, mcfg)
    host_batch = next(pipeline.train_iterator(sources, dcfg))
    for shape in meshes:
      mesh = sharding.make_mesh(shape)
      setup, state = steps.init_train(mcfg, tcfg, mesh)
      step_fn = steps.make_train_step(setup, tcfg)
      batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=setup.batch_sharding)
               for k, v in host_batch.items()}
      lowered = step_fn.lower(setup.abstract_state(state), batch)
      log = compile_stderr(lowered.compile)
      out[f"{model} {shape}"] = [line[:300] for line in log.splitlines() if WARNING in line]
  print(json.dumps(out))


if __name__ == "__main__":
  main(sys.argv[1:])
