#!/usr/bin/env bash
# The batch-invariant step's paired epilogues (FusedDecodeStep.PAIRED_EPILOGUES: rotary + K/V write and SiLU * up in
# the qkv and gate_up products) and one-tile attention splits (DecodeMetadata.ONE_TILE_SPLITS) on a lent H200
# (BENCHMARKS.md, issue 13): both on (the landed code) against both off (the step before them), through
# step_variants_h200.sh; `kernels` runs the GPU tests first and then the paired epilogues alone at SmolLM2 batch 1.
#
#   bash jobs/bench/engine_h200.sh part 1 bash jobs/bench/fusions_h200.sh kernels   # GPU tests + step-kernels
#   bash jobs/bench/engine_h200.sh part 2 bash jobs/bench/fusions_h200.sh 8b        # random 8B weights
#   bash jobs/bench/engine_h200.sh run bash jobs/bench/fusions_h200.sh smollm2      # SmolLM2 + the champion
set -u
pairs=eagleray.platform.models.graphs:FusedDecodeStep.PAIRED_EPILOGUES
tiles=eagleray.platform.models.decode_metadata:DecodeMetadata.ONE_TILE_SPLITS
here=$(dirname "$0")
case "${1:-}" in
kernels)
  SETTING=$pairs,$tiles VALUES="True False" TAG=both GPU_TESTS=1 bash "$here/step_variants_h200.sh" kernels
  SETTING=$tiles VALUES=False TAG=tiles-off SPECS=smollm2:1 bash "$here/step_variants_h200.sh" kernels
  ;;
8b | smollm2)
  SETTING=$pairs,$tiles VALUES="True False" TAG=both exec bash "$here/step_variants_h200.sh" "$1"
  ;;
*)
  echo "usage: $0 kernels | 8b | smollm2" >&2
  exit 2
  ;;
esac
