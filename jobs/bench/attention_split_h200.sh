#!/usr/bin/env bash
# The batch-invariant decode step's attention split length (DecodeGraphRunner.SPLIT_TOKENS) at 64, 128 and 256 tokens
# on a lent H200 (BENCHMARKS.md, issue 13), through step_variants_h200.sh:
#
#   bash jobs/bench/engine_h200.sh part 1 bash jobs/bench/attention_split_h200.sh kernels   # no GGUF needed
#   bash jobs/bench/engine_h200.sh part 2 bash jobs/bench/attention_split_h200.sh 8b        # random 8B weights
#   bash jobs/bench/engine_h200.sh run bash jobs/bench/attention_split_h200.sh smollm2      # GPU tests + SmolLM2
tests=0
[ "${1:-}" = smollm2 ] && tests=1
SETTING=eagleray.platform.models.graphs:DecodeGraphRunner.SPLIT_TOKENS VALUES=${SPLITS:-"64 128 256"} TAG=s \
  GPU_TESTS=${GPU_TESTS:-$tests} exec bash "$(dirname "$0")/step_variants_h200.sh" "$@"
