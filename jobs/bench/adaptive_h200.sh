#!/usr/bin/env bash
# Issue 13's adaptive sweep on a lent H200, one device call after `engine_h200.sh part 1` and `part 2` (the GPU
# engine tests, lossless in bf16, run in part 2: they need no GGUF):
#
#   bash jobs/bench/engine_h200.sh part 2 bash jobs/bench/adaptive_h200.sh tests
#   bash jobs/bench/engine_h200.sh run bash jobs/bench/adaptive_h200.sh sweep
#
# sweep: per draft (random, then the shipped champion) `bench engine` over all 164 HumanEval prompts at adaptive
# batches 1-128 (128 tokens, EOS ignored, k_max 4, one round), each under `timeout $SWEEP_S` (a cut run keeps the
# batches it finished: the JSON is rewritten after each). JSON and logs under $OUT. JOIN_WAITS=0,8: each speculative
# run once per engine.join_wait_steps value, side by side (e.g. BATCHES=32,128 JOIN_WAITS=0,8,16 for the held joins).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
case "${1:-}" in
tests)
  timeout "${TESTS_S:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_engine_graphs_gpu.py 2>&1 |
    tee "$OUT/gpu-tests.log"
  ;;
sweep)
  for d in random shipped:smollm2-135m-instruct-eagle3-sharegpt; do
    name=$([ "$d" = random ] && echo random || echo champion)
    timeout "${SWEEP_S:-275}" python3 -m eagleray.jobs.bench engine --models smollm2 --draft "$d" \
      --prompts "$STAGE/humaneval.jsonl" --limit 164 --batches "" --adaptive-batches "${BATCHES:-1,8,32,64,128}" \
      --repeats 1 ${JOIN_WAITS:+--join-wait-steps $JOIN_WAITS} --json "$OUT/adaptive-$name.json" 2>&1 | grep -v "^Loading\|it/s\]" | tee "$OUT/adaptive-$name.log"
  done
  ;;
*)
  echo "usage: $0 tests|sweep" >&2
  exit 2
  ;;
esac
