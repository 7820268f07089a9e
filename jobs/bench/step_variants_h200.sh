#!/usr/bin/env bash
# One class attribute of the decode step set to each of several values, the step measured with each, on a lent H200, in
# the three back-to-back calls of jobs/bench/engine_h200.sh (BENCHMARKS.md, issue 13):
#
#   SETTING=module:Class.ATTR VALUES="a b" TAG=x bash jobs/bench/step_variants_h200.sh kernels   # step-kernels (no GGUF)
#   (SETTING=mod:A.X,mod2:B.Y sets both to each value; SETTING=env:NAME sets the environment variable NAME to each
#   value, "-" leaving it unset, e.g. env:EAGLERAY_INVARIANT_PLANS with plan files; SPECS="smollm2:1 8b:1" picks
#   step-kernels' model:batch runs)
#   ... bash jobs/bench/step_variants_h200.sh 8b        # engine, random 8B weights, batch 1
#   ... bash jobs/bench/step_variants_h200.sh smollm2   # engine, SmolLM2 + the shipped champion, batch 1 and 64
#
# Each measurement sets the value (a Python literal) in its own process, then runs `python -m eagleray.jobs.bench`;
# JSON goes to $OUT as <what>-<TAG><value>.json. GPU_TESTS=1 runs the GPU tests first. The wrappers
# attention_split_h200.sh, attention_tile_h200.sh and norm_fold_h200.sh name their settings.
set -u
: "${SETTING:?set SETTING=module:Class.ATTR}" "${VALUES:?set VALUES to the values to try}"
TAG=${TAG:-v}
with_value() {  # VALUE SUITE ARGS...: one bench suite with SETTING = VALUE
  python3 -m eagleray.jobs.bench.with_setting "$SETTING" "$@"
}
suite() {  # VALUE TIMEOUT SUITE ARGS...
  local v=$1 limit=$2
  shift 2
  if [[ $SETTING == env:* ]]; then
    if [ "$v" = - ]; then
      timeout "$limit" env -u "${SETTING#env:}" python3 -m eagleray.jobs.bench "$@"
    else
      timeout "$limit" env "${SETTING#env:}=$v" python3 -m eagleray.jobs.bench "$@"
    fi
    return
  fi
  timeout "$limit" bash -c "SETTING='$SETTING'; $(declare -f with_value); with_value \"\$@\"" _ "$v" "$@"
}
label() {  # a value as a file-name part: a path's base name, "-" as "unset"
  local b=${1##*/}
  [ "$1" = - ] && b=unset
  echo "${b%.json}"
}
if [ "${GPU_TESTS:-0}" = 1 ]; then
  timeout 170 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tail -4
fi
case "${1:-}" in
kernels)
  for v in $VALUES; do
    for spec in ${SPECS:-smollm2:1 smollm2:64 8b:1}; do
      set -- ${spec/:/ }
      echo "=== $SETTING = $v: step-kernels --model $1 --batch $2"
      suite "$v" 100 step-kernels --model "$1" --batch "$2" --json "$OUT/sk-$1-b$2-$TAG$(label "$v").json" 2>&1 | tail -14
    done
  done
  ;;
8b)
  for v in $VALUES; do
    echo "=== $SETTING = $v: engine --models 8b --batches 1"
    suite "$v" 170 engine --models 8b --prompts "$STAGE/mtbench.jsonl" --prompt-ids "$STAGE/mtbench-ids.json" --batches 1 \
      --adaptive-batches '' --json "$OUT/engine-8b-$TAG$(label "$v").json" 2>&1 | tail -8
  done
  ;;
smollm2)
  for v in $VALUES; do
    echo "=== $SETTING = $v: engine --models smollm2 (champion) --batches 1,64"
    suite "$v" 130 engine --models smollm2 --draft shipped:smollm2-135m-instruct-eagle3-sharegpt \
      --prompts "$STAGE/mtbench.jsonl" --batches 1,64 --adaptive-batches '' --json "$OUT/engine-smollm2-$TAG$(label "$v").json" 2>&1 | tail -10
  done
  ;;
*)
  echo "usage: SETTING=module:Class.ATTR VALUES='a b' $0 kernels | 8b | smollm2" >&2
  exit 2
  ;;
esac
