#!/usr/bin/env bash
# Mutation testing of one module with mutmut (3.x), from a throwaway copy of the tree.
#
#   bash tools/mutation.sh NAME MODULE TEST [TEST ...]
#   bash tools/mutation.sh masks attnlab/ops/masks.py tests/ops/test_masks.py \
#       tests/ops/test_attention.py::test_mask_predicates_and_key_range_agree
#
# Copies the tracked files to ${MUT_DIR:-/tmp/attnlab-mutation}/NAME, appends a
# [tool.mutmut] section (only MODULE mutated, only the TESTs run), runs `mutmut run`
# under `timeout ${MUT_TIMEOUT:-1800}` and writes `mutmut results` to NAME/results.txt
# (survivors listed; `mutmut show NAME` in that folder prints one). Needs mutmut: the
# `mutmut` on PATH, or $MUTMUT (e.g. /work/venv/bin/mutmut); exits 127 without it. MUT_NAMES (space-separated fnmatch
# patterns of mutant names, e.g. "attnlab.nn.kv_cache.x_quantize__mutmut_*") runs only
# those mutants: the functions a module's fast tests reach. MUT_RECHECK=DIR (a previous
# round's folder) runs only the mutants that survived there and those it selected but did
# not run (its time box), with the TESTs given now (the round's tests plus those since);
# mutants that no test reached there are not included: name them with MUT_NAMES.
#
# JAX is not fork-safe once its backend has started, and mutmut forks a worker per
# mutant: the workers come from a fork server that has only imported the third-party
# packages (process_isolation = "forkserver", forkserver_warmup = "import"). One
# persistent compilation cache serves every mutant, so programs a mutant leaves alone
# compile once.
set -euo pipefail
set -f  # mutant-name patterns (MUT_NAMES) are never file globs
[ $# -ge 3 ] || { sed -n '2,/^set -e/p' "$0" | sed '$d'; exit 2; }
name=$1; module=$2; shift 2
repo=$(cd "$(dirname "$0")/.." && pwd)
dir=${MUT_DIR:-/tmp/attnlab-mutation}/$name
if [ -n "${MUT_RECHECK:-}" ]; then
  [ -f "$MUT_RECHECK/results.txt" ] || { echo "MUT_RECHECK: no $MUT_RECHECK/results.txt" >&2; exit 2; }
  # Survivors, and the mutants that round selected (its names.txt) but did not run.
  MUT_NAMES="${MUT_NAMES:-} $(python3 - "$MUT_RECHECK" <<'EOP'
import fnmatch, os, re, sys
folder = sys.argv[1]
names = os.path.join(folder, "names.txt")
selected = open(names).read().split() if os.path.exists(names) else []
for line in open(os.path.join(folder, "results.txt")):
  m = re.match(r"\s*(\S+): (survived|not checked)$", line)
  if m and (m[2] == "survived" or not selected
            or any(fnmatch.fnmatch(m[1], p) for p in selected)):
    print(m[1])
EOP
)"
  MUT_NAMES=$(echo $MUT_NAMES)  # one line (set -f: no globbing)
  [ -n "$MUT_NAMES" ] || { echo "MUT_RECHECK: nothing left to run in $MUT_RECHECK" >&2; exit 0; }
fi
rm -rf "$dir"; mkdir -p "$dir"
(cd "$repo" && git ls-files | grep -v '^configs$' | tar -cf - -T -) | (cd "$dir" && tar -xf -)
cd "$dir"
echo "${MUT_NAMES:-}" > names.txt  # what this round selects (empty: every mutant)
rm -rf configs && cp -r attnlab/configs configs
# mutmut's workers are forked from its fork server and inherit its signal handlers (SIGTERM:
# kill the workers and exit 0; SIGINT ignored; SIGCHLD: wake the server). A test that sends
# or checks a signal must see what a plain run has, or a mutant counts as killed (or survives)
# for the handler, not the code: each worker puts back Python's defaults. (mutmut stops a
# worker past its time with SIGXCPU / SIGKILL, which this leaves alone.)
cat >> tests/conftest.py <<'EOT'


def pytest_sessionstart(session):  # appended by tools/mutation.sh to its copy of the tree
  import signal
  signal.signal(signal.SIGTERM, signal.SIG_DFL)
  signal.signal(signal.SIGINT, signal.default_int_handler)
  signal.signal(signal.SIGCHLD, signal.SIG_DFL)
EOT
tests=$(printf '"%s", ' "$@"); tests="[${tests%, }]"
printf '%s\n' jax jax.numpy numpy flax flax.nnx optax orbax.checkpoint einops chex pytest \
  hypothesis > preload.txt
cat >> pyproject.toml <<EOT

[tool.mutmut]
source_paths = ["attnlab/"]
only_mutate = ["$module"]
also_copy = ["configs"]  # the gin files that tests name by the repo-root path
pytest_add_cli_args_test_selection = $tests
pytest_add_cli_args = ["-x", "-p", "no:cacheprovider", "-p", "no:randomly"]
process_isolation = "forkserver"
forkserver_warmup = "import"
preload_modules_file = "$dir/preload.txt"
EOT
export JAX_COMPILATION_CACHE_DIR=$dir/xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
MUTMUT=${MUTMUT:-mutmut}
status=0
# shellcheck disable=SC2086  # MUT_NAMES: patterns, one word each
timeout "${MUT_TIMEOUT:-1800}" "$MUTMUT" run --max-children "${MUT_CHILDREN:-1}" ${MUT_NAMES:-} \
  > run.log 2>&1 || status=$?
if [ "$status" -eq 127 ]; then
  echo "mutmut not found ('$MUTMUT'): pip install mutmut into the venv, or set MUTMUT" >&2
  exit 127
fi
"$MUTMUT" results > results.txt 2>&1 || true
echo "mutmut run exit $status; $(grep -c ': survived' results.txt || true) survived; see $dir"
