#!/usr/bin/env bash
# Does a recipe learn? Held-out eval before → GRPO with the recipe (time-bounded) → eval after → the difference
# with 95% bootstrap intervals (`agentrl eval --compare`), curves and a summary.md for BENCHMARKS.md.
#
# usage: CONFIG=examples/train_hotpotqa_search_qwen05.yaml EVAL="--data ../shared/data/hotpotqa/dev.jsonl" \
#        MODEL=path/to/model.gguf TRAIN_SECONDS=240 OUT=out/hotpotqa bash benchmarks/learning.sh [--key=value ...]
# EVAL holds the eval's data and environment flags: the held-out questions (never the training rows) and the same
# env.args the recipe trains with. Extra arguments go to `agentrl train` (config overrides).
# SKIP_BEFORE=1 reuses $OUT/before.jsonl (greedy: an earlier run measured exactly the same).
# A run longer than one device call (10 minutes) goes over several, back to back on a machine kept warm, with one $OUT:
# SKIP_AFTER=1 ends a call after training (no after-eval or report), and RESUME=1 continues the run from its last
# checkpoint (the time limit saves one) instead of starting it over. With TOTAL_SECONDS, a call that skips the
# before-eval reserves AFTER_EVAL_SECONDS for its after-eval.
# TOTAL_SECONDS (optional) bounds the whole script instead: training gets what is left once the after-eval (timed as
# long as the before-eval, which also converted the model) and 75 s for loading, saving and the report are set aside,
# so a device call with a hard limit always ends with both evals.
set -euo pipefail
: "${CONFIG:?the recipe, e.g. examples/train_hotpotqa_search_qwen05.yaml}" "${EVAL:?the held-out eval flags}"
OUT=${OUT:-runs/learning}
RUN=${RUN:-$OUT/run}
TRAIN_SECONDS=${TRAIN_SECONDS:-240}
ENV_NAME=$(python3 -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['env']['name'])" "$CONFIG")
MODEL=${MODEL:-$(python3 -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['model']['name'])" "$CONFIG")}
mkdir -p "$OUT"
# SEEN_EVAL (optional): eval flags for questions the run trains on, evaluated before and after as EVAL is (seen_before,
# seen_after): a rise there far above the held-out one says the run learned its questions rather than the skill.
# shellcheck disable=SC2086  # EVAL and SEEN_EVAL are lists of flags
evaluate() {  # $1 model, $2 name: the per-question JSONL and the summary line, for EVAL and SEEN_EVAL alike
  python3 -m agentrl.cli eval "$ENV_NAME" --model "$1" $EVAL --out "$OUT/$2.jsonl" | tee "$OUT/$2.json"
  [ -z "${SEEN_EVAL:-}" ] || python3 -m agentrl.cli eval "$ENV_NAME" --model "$1" $SEEN_EVAL --out "$OUT/seen_$2.jsonl" \
    | tee "$OUT/seen_$2.json"
}
started=$(date +%s)
[ "${SKIP_BEFORE:-0}" = 1 ] || evaluate "$MODEL" before
if [ -n "${TOTAL_SECONDS:-}" ]; then
  spent=$(( $(date +%s) - started ))
  after=${AFTER_EVAL_SECONDS:-$spent}  # as long as the before-eval, unless this call skipped it
  [ "${SKIP_AFTER:-0}" = 1 ] && after=0
  TRAIN_SECONDS=$(( TOTAL_SECONDS - spent - after - 75 ))
  [ "$TRAIN_SECONDS" -ge 30 ] || { echo "TOTAL_SECONDS=$TOTAL_SECONDS leaves no time to train (before-eval: ${spent}s)" >&2; exit 1; }
  echo "before-eval took ${spent}s: training for ${TRAIN_SECONDS}s" >&2
fi
# A run that stops making steps is ended 180 s after its time limit; what it saved is evaluated all the same.
START=--overwrite
[ "${RESUME:-0}" = 1 ] && START=--resume || { : > "$OUT/train.log"; : > "$OUT/train_calls"; }  # a resumed run's go on
echo "$TRAIN_SECONDS" >> "$OUT/train_calls"  # each call's training budget, for the report of a run over several
timeout $(( TRAIN_SECONDS + 180 )) python3 -m agentrl.cli train "$ENV_NAME" --config "$CONFIG" --model "$MODEL" \
  --time_limit_s="$TRAIN_SECONDS" --run-dir "$RUN" "$START" "$@" 2>> "$OUT/train.log" | tail -1 || {
  echo "training ended with an error or stalled; see $OUT/train.log" >&2
  tail -5 "$OUT/train.log" >&2
}
[ "${SKIP_AFTER:-0}" = 1 ] && exit 0
evaluate "$RUN/final" after
python3 -m agentrl.cli eval --compare "$OUT/before.jsonl" "$OUT/after.jsonl" | tee "$OUT/compare.txt"
[ -f "$OUT/seen_before.jsonl" ] && [ -f "$OUT/seen_after.jsonl" ] && python3 -m agentrl.cli eval --compare \
  "$OUT/seen_before.jsonl" "$OUT/seen_after.jsonl" | tee "$OUT/seen_compare.txt"
python3 -m agentrl.cli plot "$RUN" --out "$OUT/curves.png" || true
{
  printf '# %s on %s\n\n' "$(basename "$MODEL")" "$ENV_NAME"
  printf 'Command: `CONFIG=%s EVAL="%s" MODEL=%s TRAIN_SECONDS=%s bash benchmarks/learning.sh%s`\n' \
    "$CONFIG" "$EVAL" "$MODEL" "$TRAIN_SECONDS" "${*:+ $*}"
  calls=$(paste -sd+ "$OUT/train_calls")
  [ "$(wc -l < "$OUT/train_calls")" -gt 1 ] && printf 'Training over %s calls (RESUME=1, SKIP_AFTER=1 before this one): %s = %s s\n' \
    "$(wc -l < "$OUT/train_calls")" "$calls" "$(( calls ))"
  printf 'at commit %s · %s · device: %s · curves: curves.png\n\n' "$(git rev-parse --short HEAD 2>/dev/null || echo ?)" \
    "$(date -u '+%F %H:%M UTC')" \
    "$(python3 -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU")')"
  printf '## Held-out, before → after (95%% paired bootstrap intervals)\n\n```\n%s\n```\n\n' "$(cat "$OUT/compare.txt")"
  [ -f "$OUT/seen_compare.txt" ] && printf '## Questions it trains on (SEEN_EVAL), before → after\n\n```\n%s\n```\n\n' \
    "$(cat "$OUT/seen_compare.txt")"
  python3 benchmarks/summarize_run.py "$RUN" --eval "$OUT/before.json" --eval "$OUT/after.json"
  if [ "$ENV_NAME" = hotpotqa_search ]; then
    printf '\n## Where the held-out F1 is (benchmarks/eval_breakdown.py)\n\n'
    data=$(printf '%s\n' "$EVAL" | sed -n 's/.*--data \([^ ]*\).*/\1/p')  # the evaluated file: its question types
    python3 benchmarks/eval_breakdown.py "$OUT/before.jsonl" "$OUT/after.jsonl" ${data:+--data "$data"}
  fi
} > "$OUT/summary.md"
cp "$RUN/metrics.jsonl" "$OUT/metrics.jsonl" 2>/dev/null || true
cat "$OUT/summary.md"
