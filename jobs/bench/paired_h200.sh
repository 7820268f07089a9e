#!/usr/bin/env bash
# Rotary + K/V write and SiLU * up in the qkv and gate_up products' epilogues (FusedDecodeStep.PAIRED_EPILOGUES) on
# and off on a lent H200 (BENCHMARKS.md, issue 13), through step_variants_h200.sh; `kernels` runs the GPU tests first:
#
#   bash jobs/bench/engine_h200.sh part 1 bash jobs/bench/paired_h200.sh kernels   # GPU tests + step-kernels
#   bash jobs/bench/engine_h200.sh part 2 bash jobs/bench/paired_h200.sh 8b        # random 8B weights
#   bash jobs/bench/engine_h200.sh run bash jobs/bench/paired_h200.sh smollm2      # SmolLM2 + the champion
tests=0
[ "${1:-}" = kernels ] && tests=1
SETTING=eagleray.platform.models.graphs:FusedDecodeStep.PAIRED_EPILOGUES VALUES=${PAIRS:-"True False"} TAG=p \
  GPU_TESTS=${GPU_TESTS:-$tests} exec bash "$(dirname "$0")/step_variants_h200.sh" "$@"
