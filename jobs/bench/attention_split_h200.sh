#!/usr/bin/env bash
# The batch-invariant decode step's attention split length (DecodeGraphRunner.SPLIT_TOKENS) measured at 64, 128 and 256
# tokens on a lent H200, in the three back-to-back calls of jobs/bench/engine_h200.sh (BENCHMARKS.md, issue 13):
#
#   bash jobs/bench/engine_h200.sh part 1 bash jobs/bench/attention_split_h200.sh kernels   # no GGUF needed
#   bash jobs/bench/engine_h200.sh part 2 bash jobs/bench/attention_split_h200.sh 8b        # random 8B weights
#   bash jobs/bench/engine_h200.sh run bash jobs/bench/attention_split_h200.sh smollm2      # GPU tests + SmolLM2
#
# Each measurement sets the split in its own process, then runs `python -m eagleray.jobs.bench`; JSON goes to $OUT.
set -u
SPLITS=${SPLITS:-"64 128 256"}
with_split() {  # SPLIT SUITE ARGS...: one bench suite with DecodeGraphRunner.SPLIT_TOKENS = SPLIT
  local s=$1
  shift
  python3 -c "import runpy, sys
from eagleray.platform.models.graphs import DecodeGraphRunner
DecodeGraphRunner.SPLIT_TOKENS = int(sys.argv[1])
sys.argv = ['eagleray.jobs.bench'] + sys.argv[2:]
runpy.run_module('eagleray.jobs.bench', run_name='__main__')" "$s" "$@"
}
case "${1:-}" in
kernels)
  for s in $SPLITS; do
    for spec in "smollm2 1" "smollm2 64" "8b 1"; do
      set -- $spec
      echo "=== split $s: step-kernels --model $1 --batch $2"
      timeout 100 bash -c "$(declare -f with_split); with_split $s step-kernels --model $1 --batch $2 --json $OUT/sk-$1-b$2-s$s.json" 2>&1 | tail -14
    done
  done
  ;;
8b)
  for s in $SPLITS; do
    echo "=== split $s: engine --models 8b --batches 1"
    timeout 170 bash -c "$(declare -f with_split); with_split $s engine --models 8b --prompts $STAGE/mtbench.jsonl --prompt-ids $STAGE/mtbench-ids.json --batches 1 --adaptive-batches '' --json $OUT/engine-8b-s$s.json" 2>&1 | tail -8
  done
  ;;
smollm2)
  timeout 180 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tail -3
  for s in $SPLITS; do
    echo "=== split $s: engine --models smollm2 (champion) --batches 1,64"
    timeout 130 bash -c "$(declare -f with_split); with_split $s engine --models smollm2 --draft shipped:smollm2-135m-instruct-eagle3-sharegpt --prompts $STAGE/mtbench.jsonl --batches 1,64 --adaptive-batches '' --json $OUT/engine-smollm2-s$s.json" 2>&1 | tail -10
  done
  ;;
*)
  echo "usage: $0 kernels | 8b | smollm2" >&2
  exit 2
  ;;
esac
