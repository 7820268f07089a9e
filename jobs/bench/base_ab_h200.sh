#!/usr/bin/env bash
# The engine with the Python files of a base commit and with the tree as it is, side by side in one lease (an A/B of
# a change that has no setting to turn it off), in the back-to-back calls of jobs/bench/engine_h200.sh:
#
#   bash jobs/bench/base_ab_h200.sh stage BASE      # here: BASE's version of every .py file changed since -> .stage3/base.tar
#   bash jobs/bench/engine_h200.sh run bash jobs/bench/base_ab_h200.sh smollm2 [VARIANT...]
#   bash jobs/bench/engine_h200.sh run bash jobs/bench/base_ab_h200.sh 8b [VARIANT...]
#
# `smollm2`: `bench engine` on SmolLM2 + the shipped champion, MT-bench, batch 1 and 64; `8b`: random 8B weights,
# batch 1. Runs in turn: base, then the tree once per VARIANT (default one run as is). A VARIANT `mod:Class.ATTR=VALUE`
# sets that class attribute (a Python literal) for its run, as step_variants_h200.sh does. JSON: $OUT/<what>-base.json,
# $OUT/<what>-<i>.json (the variant in the record's file name order; BENCHMARKS.md names them).
set -u
ROOT=/root/engine-run
what=${1:?usage: $0 stage BASE | smollm2|8b [VARIANT...]}
shift
if [ "$what" = stage ]; then
  base=${1:?name the base commit}
  mkdir -p .stage3
  files=$(git diff --name-only "$base" -- '*.py')
  tmp=$(mktemp -d)
  for f in $files; do
    if git cat-file -e "$base:$f" 2>/dev/null; then
      mkdir -p "$tmp/$(dirname "$f")"
      git show "$base:$f" >"$tmp/$f"
    fi
  done
  tar -C "$tmp" -cf .stage3/base.tar .
  rm -rf "$tmp"
  echo "staged $base's version of: $files"
  exit 0
fi
# the base tree: this tree with the base's files over it (a file new since the base stays; nothing imports it there)
rm -rf $ROOT/base && mkdir -p $ROOT/base/src
cp -a "$PWD" $ROOT/base/src/eagleray
tar -C $ROOT/base/src/eagleray -xf "$STAGE/base.tar"
bench() {  # NAME PYTHONPATH-SRC SETTING: one engine run
  local name=$1 src=$2 setting=$3 args
  if [ "$what" = 8b ]; then
    args=(--models 8b --prompts "$STAGE/mtbench.jsonl" --prompt-ids "$STAGE/mtbench-ids.json" --batches 1)
  else
    args=(--models smollm2 --draft shipped:smollm2-135m-instruct-eagle3-sharegpt --prompts "$STAGE/mtbench.jsonl"
      --batches 1,64)
  fi
  echo "=== $what $name ${setting:-(as is)}"
  PYTHONPATH=$ROOT/site:$src timeout "${LIMIT:-170}" python3 -m eagleray.jobs.bench.with_setting "${setting%%=*}" \
    "${setting#*=}" engine "${args[@]}" --adaptive-batches '' \
    --json "$OUT/$what-$name.json" 2>&1 | tail -10
}
bench base $ROOT/base/src ""
i=0
for v in "${@:-}"; do
  bench "$i" $ROOT/src "$v"
  i=$((i + 1))
done
