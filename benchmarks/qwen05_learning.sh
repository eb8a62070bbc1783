#!/usr/bin/env bash
# The Qwen2.5-Coder-0.5B-Instruct learning runs of BENCHMARKS.md: hotpotqa_search (held out: all of HotpotQA dev)
# and gsm8k_math (held out: the last 500 rows of the shared GSM8K train file, which its recipe never trains on),
# each through benchmarks/learning.sh: greedy eval before, time-bounded GRPO, greedy eval after, compare.
# usage: MODEL=path/to/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf DATA=../shared/data OUT=runs/qwen05 \
#        HOTPOT_SECONDS=240 GSM8K_SECONDS=120 [SEARCH_BONUS=0.5] [TRAIN_ARGS="--key=value ..."] bash benchmarks/qwen05_learning.sh
# The recipes take any Qwen2.5 GGUF as MODEL: the 1.5B model too (TRAIN_ARGS="--trainer.rows_per_micro_batch=1").
# HOTPOT_TOTAL_SECONDS / GSM8K_TOTAL_SECONDS bound a whole eval-train-eval instead (learning.sh's TOTAL_SECONDS).
# SEARCH_BONUS, HOP_BONUS, FOUND_BONUS and GENERATED override hotpotqa_search's `search_bonus`, `hop_bonus`,
# `found_bonus` and `generated_questions`; unset, each is the recipe's (env.args of its yaml). The bonuses apply in
# training and in both evals alike; the generated questions in training only (the evals read dev and the training file).
# STOP_AFTER_CALL=1 ends each hotpotqa turn at its `</tool_call>` (rollout.stop_after_tool_call, matched as text as
# well as ids) in training and in both evals: at temperature 1.0 the 0.5B model writes the tool's response itself.
set -euo pipefail
: "${MODEL:?the model: a .gguf path (benchmarks/ship_model.py carries it to a GPU host)}"
DATA=${DATA:-../shared/data}
OUT=${OUT:-runs/qwen05}
# The eval's turn budgets and tool-tag spelling are the recipe's, so before and after are measured as the policy trains.
STOP=""
[ "${STOP_AFTER_CALL:-0}" = 1 ] && STOP="--rollout.stop_after_tool_call=true"
RECIPE=examples/train_hotpotqa_search_qwen05.yaml
recipe_arg() {  # $1: a hotpotqa_search env arg, as the recipe sets it (0 where it does not)
  python3 -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['env']['args'].get(sys.argv[2], 0))" "$RECIPE" "$1"
}
SEARCH=${SEARCH_BONUS:-$(recipe_arg search_bonus)}
HOP=${HOP_BONUS:-$(recipe_arg hop_bonus)}
FOUND=${FOUND_BONUS:-$(recipe_arg found_bonus)}
GEN=${GENERATED:-$(recipe_arg generated_questions)}
HOTPOT_EVAL="--env-arg few_shot=1 --env-arg search_bonus=$SEARCH --env-arg hop_bonus=$HOP --env-arg found_bonus=$FOUND --max-turns 4 --max-new-tokens 256 --rollouts-in-flight 128 --model.tool_tags=text $STOP"
# Held out: all of dev. Seen: the 320 training questions, the same way (learning.sh's SEEN_EVAL), to tell questions
# learned from a skill learned.
CONFIG=$RECIPE MODEL=$MODEL OUT=$OUT/hotpotqa TRAIN_SECONDS=${HOTPOT_SECONDS:-240} TOTAL_SECONDS=${HOTPOT_TOTAL_SECONDS:-} \
  EVAL="--data $DATA/hotpotqa/dev.jsonl --limit 738 $HOTPOT_EVAL" SEEN_EVAL="--data $DATA/hotpotqa/train.jsonl --limit 320 $HOTPOT_EVAL" \
  bash benchmarks/learning.sh --env.data="$DATA/hotpotqa/train.jsonl" --env.args.search_bonus="$SEARCH" --env.args.hop_bonus="$HOP" --env.args.found_bonus="$FOUND" --env.args.generated_questions="$GEN" $STOP ${TRAIN_ARGS:-}
[ "${GSM8K_SECONDS:-120}" = 0 ] && exit 0
CONFIG=examples/train_gsm8k_math_qwen05.yaml MODEL=$MODEL OUT=$OUT/gsm8k TRAIN_SECONDS=${GSM8K_SECONDS:-120} TOTAL_SECONDS=${GSM8K_TOTAL_SECONDS:-} \
  EVAL="--data $DATA/gsm8k/train.jsonl --split train --env.data_rows=-500: --limit 500 --max-turns 1 --max-new-tokens 512 --rollouts-in-flight 128" \
  bash benchmarks/learning.sh --env.data="$DATA/gsm8k/train.jsonl"
