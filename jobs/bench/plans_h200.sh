#!/usr/bin/env bash
# The batch-invariant linear's plans tuned again on a lent H200 (invariant_check --tune, into a file of their own), then
# the step measured with the shipped plans and with the new ones side by side (BENCHMARKS.md, issue 13), in the
# back-to-back calls of jobs/bench/engine_h200.sh:
#
#   bash jobs/bench/engine_h200.sh part 1 bash jobs/bench/plans_h200.sh tune 8b            # the 8B shapes -> $NEW
#   bash jobs/bench/engine_h200.sh part 2 bash jobs/bench/plans_h200.sh tune smollm2 kernels
#   bash jobs/bench/engine_h200.sh run bash jobs/bench/plans_h200.sh smollm2 tests        # SmolLM2 + the champion
#   bash jobs/bench/engine_h200.sh run bash jobs/bench/plans_h200.sh 8b                   # random 8B weights
#
# `kernels`, `smollm2` and `8b` are step_variants_h200.sh's runs with SETTING=env:EAGLERAY_INVARIANT_PLANS and the
# values $PLANS: by default $OLD (the best plans among the earlier tuning's candidates, which the tuning writes beside
# $NEW: an A/B on a GPU with no shipped plans too) and $NEW ("-" is the shipped file); `tests` runs the GPU tests on
# $NEW. Both files are copied to $OUT after a tuning: copy $NEW's device entry into kernels/invariant_linear_plans.json
# to ship it.
set -u
NEW=${NEW:-/root/engine-run/plans-new.json}
OLD=${NEW%.json}.old-tiles.json
while [ $# -gt 0 ]; do
  what=$1
  shift
  case "$what" in
  tune)
    models=$1
    shift
    echo "=== tune $models -> $NEW"
    EAGLERAY_INVARIANT_PLANS=$NEW timeout "${TUNE_LIMIT:-420}" python3 -m eagleray.jobs.bench.invariant_check \
      "$OUT/tune-$models.json" --tune --models "$models" 2>&1 | grep -v '^  skip' | tail -40
    cp "$NEW" "$OLD" "$OUT/"
    ;;
  8b | smollm2 | kernels)
    SETTING=env:EAGLERAY_INVARIANT_PLANS VALUES="${PLANS:-$OLD $NEW}" TAG=plans- bash "$(dirname "$0")/step_variants_h200.sh" "$what"
    ;;
  tests)
    echo "=== GPU tests on $NEW"
    EAGLERAY_INVARIANT_PLANS=$NEW timeout 170 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tail -4
    ;;
  *)
    echo "usage: $0 [tune 8b|smollm2] [kernels] [smollm2] [8b] [tests]" >&2
    exit 2
    ;;
  esac
done
