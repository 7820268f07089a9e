#!/usr/bin/env bash
# The batch-invariant step's attention splits read as one tile of the whole split (DecodeMetadata.ONE_TILE_SPLITS) on
# and off on a lent H200 (BENCHMARKS.md, issue 13), through step_variants_h200.sh; `kernels` runs the GPU tests first:
#
#   bash jobs/bench/engine_h200.sh part 1 bash jobs/bench/attention_tile_h200.sh kernels   # GPU tests + step-kernels
#   bash jobs/bench/engine_h200.sh part 2 bash jobs/bench/attention_tile_h200.sh 8b        # random 8B weights
#   bash jobs/bench/engine_h200.sh run bash jobs/bench/attention_tile_h200.sh smollm2      # SmolLM2 + the champion
tests=0
[ "${1:-}" = kernels ] && tests=1
SETTING=eagleray.platform.models.decode_metadata:DecodeMetadata.ONE_TILE_SPLITS VALUES=${TILES:-"True False"} TAG=t \
  GPU_TESTS=${GPU_TESTS:-$tests} exec bash "$(dirname "$0")/step_variants_h200.sh" "$@"
