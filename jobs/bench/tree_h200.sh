#!/usr/bin/env bash
# Tree verification on the batch-invariant row step (issue 13) on a lent H200, after `engine_h200.sh part 1` and
# `part 2` (see there):
#
#   bash jobs/bench/engine_h200.sh run bash jobs/bench/tree_h200.sh [DTYPE...]   # default: bf16 fp32
#
# `bench spec --tree` (depth 5, top-4, 8 nodes verified, batch 8, 64 tokens, --ignore-eos) with the shipped champion on
# MT-bench 80 and HumanEval 164 per dtype: lossless (every tree output equals the plain output) and tok/s beside plain;
# JSON per run under $OUT, tables in $OUT/tree.log.
set -uo pipefail
dtypes=("$@")
[ ${#dtypes[@]} -gt 0 ] || dtypes=(bf16 fp32)
for dtype in "${dtypes[@]}"; do
  for set in mtbench:80 humaneval:164; do
    name=${set%%:*}
    echo "== tree $name ${set##*:} $dtype" | tee -a "$OUT/tree.log"
    python3 -m eagleray.jobs.bench spec --target smollm2 --draft shipped:smollm2-135m-instruct-eagle3-sharegpt \
      --prompts "$STAGE/$name.jsonl" --limit "${set##*:}" --max-tokens 64 --tree --dtype "$dtype" --device cuda \
      --batch 8 --no-hf --ignore-eos --json "$OUT/tree-$name-$dtype.json" 2>&1 | tail -n 30 | tee -a "$OUT/tree.log"
  done
done
