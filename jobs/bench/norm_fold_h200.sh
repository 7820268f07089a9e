#!/usr/bin/env bash
# RMSNorm folded into the batch-invariant step's products (FusedDecodeStep.FOLD_NORMS) measured on and off on a lent
# H200, in the three back-to-back calls of jobs/bench/engine_h200.sh (BENCHMARKS.md, issue 13):
#
#   bash jobs/bench/engine_h200.sh part 1 bash jobs/bench/norm_fold_h200.sh kernels   # GPU tests + step-kernels
#   bash jobs/bench/engine_h200.sh part 2 bash jobs/bench/norm_fold_h200.sh 8b        # random 8B weights
#   bash jobs/bench/engine_h200.sh run bash jobs/bench/norm_fold_h200.sh smollm2      # SmolLM2 + the champion
#
# Each measurement sets the switch in its own process (and lifts graphs.FOLD_MAX_BYTES, so that 8B folds too), then
# runs `python -m eagleray.jobs.bench`; JSON goes to $OUT.
set -u
FOLDS=${FOLDS:-"1 0"}
with_fold() {  # FOLD SUITE ARGS...: one bench suite with FusedDecodeStep.FOLD_NORMS = bool(FOLD), any model size
  local f=$1
  shift
  python3 -c "import runpy, sys
from eagleray.platform.models import graphs
graphs.FusedDecodeStep.FOLD_NORMS = bool(int(sys.argv[1]))
graphs.FOLD_MAX_BYTES = 1 << 40
sys.argv = ['eagleray.jobs.bench'] + sys.argv[2:]
runpy.run_module('eagleray.jobs.bench', run_name='__main__')" "$f" "$@"
}
case "${1:-}" in
kernels)
  timeout 170 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tail -4
  for f in $FOLDS; do
    for spec in "smollm2 1" "smollm2 64" "8b 1"; do
      set -- $spec
      echo "=== fold $f: step-kernels --model $1 --batch $2"
      timeout 100 bash -c "$(declare -f with_fold); with_fold $f step-kernels --model $1 --batch $2 --json $OUT/sk-$1-b$2-f$f.json" 2>&1 | tail -12
    done
  done
  ;;
8b)
  for f in $FOLDS; do
    echo "=== fold $f: engine --models 8b --batches 1"
    timeout 170 bash -c "$(declare -f with_fold); with_fold $f engine --models 8b --prompts $STAGE/mtbench.jsonl --prompt-ids $STAGE/mtbench-ids.json --batches 1 --adaptive-batches '' --json $OUT/engine-8b-f$f.json" 2>&1 | tail -8
  done
  ;;
smollm2)
  for f in $FOLDS; do
    echo "=== fold $f: engine --models smollm2 (champion) --batches 1,64"
    timeout 130 bash -c "$(declare -f with_fold); with_fold $f engine --models smollm2 --draft shipped:smollm2-135m-instruct-eagle3-sharegpt --prompts $STAGE/mtbench.jsonl --batches 1,64 --adaptive-batches '' --json $OUT/engine-smollm2-f$f.json" 2>&1 | tail -10
  done
  ;;
*)
  echo "usage: $0 kernels | 8b | smollm2" >&2
  exit 2
  ;;
esac
