"""Benchmark: does a real model learn to use a Python tool, on CPU? Held-out accuracy with the tool, before and after.

The task: bench/arithmetic.py's harder tier ("What is 74 times 7? Put the answer inside \\boxed{}, like \\boxed{0}.",
tests/fixtures/arithmetic_harder_gsm8k: 96 training problems, 32 held out), on which plain GRPO (grpo_gsm8k.py, no
tool) went from 3.1% to 7.3% held out in 10 steps (docs/grpo_gsm8k.md, The harder tier). The model:
SmolLM2-135M-Instruct in float32 (tests/real_model.py). Each seed runs the unchanged grpo_gsm8k_python_tool.py on the
CPU with its own server (--start-server) in a folder of its own under --out: bench/arithmetic.py's recipe (8 prompts x
8 samples at T = 0.6, lr 1e-5, 10 steps), 96 tokens for the model's and the tool's (48 leave no room for the tool's
reply), and the script's own system prompt (the tool and one worked example). The held-out accuracy is the script's
own evaluation, with the tool, greedy, all 32 problems, before training, at step 5 and at the end; with it, the share
of answers that called the tool. Every finished run is a line of --out/results.jsonl (an interrupted benchmark goes on
where it stopped); --table prints them as the docs show them, --png draws them.

  python bench/python_tool.py --seeds 1 2 3 --out /tmp/cleanrlvr_tool --table --png docs/images/python_tool.png
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arithmetic import FIXTURES, PY, ROOT, SERVER_ARGS, free_port, read_jsonl  # noqa: E402 (bench/arithmetic.py)

PLAIN_GRPO_AFTER = 7.3  # grpo_gsm8k.py's held-out accuracy after 10 steps on this tier, the mean of seeds 1-3 (%)
STEP = re.compile(r"^step (\d+): (.*)$")


def recipe(model: str, seed: int, steps: int, lr: str) -> list[str]:
    """grpo_gsm8k_python_tool.py with the benchmark's recipe, starting its own server."""
    cmd = [PY, os.path.join(ROOT, "grpo_gsm8k_python_tool.py"), "--model", model, "--seed", str(seed)]
    cmd += ["--dataset", os.path.join(FIXTURES, "arithmetic_harder_gsm8k"), "--train-steps", str(steps)]
    cmd += ["--rollouts-per-update", "8", "--group-size", "8", "--train-temperature", "0.6"]
    cmd += ["--max-completion-tokens", "96", "--learning-rate", lr]
    cmd += ["--eval-before-start", "--eval-every", str(steps // 2), "--eval-limit", "None"]  # start, middle, end
    cmd += ["--save-every", str(steps), "--checkpoint-dir", "ckpt", "--rollout-log", "rollouts.jsonl"]
    cmd += ["--no-activation-checkpointing", "--micro-token-budget", "4096"]
    return cmd + ["--start-server", "--vllm-port", str(free_port()), f"--server-args={SERVER_ARGS}"]


def parse(log: str) -> tuple[list[dict], dict[int, dict]]:
    """The training steps' metrics, and each evaluation's (eval/accuracy, eval/tool_use_rate) by step."""
    steps, evals = [], {}
    for m in filter(None, map(STEP.match, log.splitlines())):
        values = dict(kv.split("=", 1) for kv in m.group(2).split() if "=" in kv)
        if "eval/accuracy" in values:
            evals[int(m.group(1))] = {k: float(values[k]) for k in ("eval/accuracy", "eval/tool_use_rate")}
        if "reward" in values:
            steps.append({k: float(values[k]) for k in ("reward", "tool_calls", "step_s", "logprob_mismatch")})
    return steps, evals


def run_one(model: str, seed: int, args) -> dict:
    workdir = os.path.join(args.out, f"tool_seed{seed}_lr{args.lr}")
    os.makedirs(workdir, exist_ok=True)
    t0 = time.time()
    r = subprocess.run(recipe(model, seed, args.steps, args.lr), cwd=workdir, capture_output=True, text=True)
    with open(os.path.join(workdir, "train.log"), "w") as f:
        f.write(r.stdout + r.stderr)
    if r.returncode != 0:
        sys.exit(f"seed {seed} failed in {workdir}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    steps, evals = parse(r.stdout)
    return {
        "seed": seed,
        "lr": args.lr,
        "steps": args.steps,
        "wall_s": round(time.time() - t0),
        "evals": {str(k): v for k, v in sorted(evals.items())},
        "rewards": [s["reward"] for s in steps],
        "tool_calls": [s["tool_calls"] for s in steps],
        "step_s": statistics.fmean(s["step_s"] for s in steps),
        "max_logprob_mismatch": max(s["logprob_mismatch"] for s in steps),
    }


def table(records: list[dict]) -> str:
    """One row per seed and one for the mean: held-out accuracy with the tool at the start, the middle and the end,
    the share of held-out answers that called the tool, plain GRPO's figure beside."""
    rows = ["| seed | accuracy before | middle | after | called the tool: before | after | rise | steps | wall |"]
    rows.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    cells = []
    for r in records:
        evals = [r["evals"][k] for k in sorted(r["evals"], key=int)]
        acc = [100 * e["eval/accuracy"] for e in evals]
        use = [100 * e["eval/tool_use_rate"] for e in evals]
        cells.append([acc[0], acc[len(acc) // 2], acc[-1], use[0], use[-1], acc[-1] - acc[0], r["wall_s"] / 60])
        row = [str(r["seed"]), *(f"{x:.1f}%" for x in cells[-1][:5]), f"{cells[-1][5]:+.1f}"]
        rows.append("| " + " | ".join(row + [str(r["steps"]), f"{cells[-1][6]:.1f} min"]) + " |")
    mean = [statistics.fmean(c[i] for c in cells) for i in range(7)]
    after = [c[2] for c in cells]
    row = ["mean", *(f"{x:.1f}%" for x in mean[:2]), f"**{mean[2]:.1f}%** [{min(after):.1f}, {max(after):.1f}]"]
    row += [f"{mean[3]:.1f}%", f"{mean[4]:.1f}%", f"{mean[5]:+.1f}", str(records[0]["steps"]), f"{mean[6]:.1f} min"]
    rows.append("| " + " | ".join(row) + " |")
    rows.append(f"\nplain grpo_gsm8k.py on this tier, no tool: 3.1% before, {PLAIN_GRPO_AFTER}% after 10 steps")
    return "\n".join(rows)


def plot(records: list[dict], png: str) -> None:
    """Left: training reward and tool calls per completion, each step; right: held-out accuracy with the tool."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 3.8), dpi=120)
    for r in records:
        steps = range(1, len(r["rewards"]) + 1)
        line = left.plot(steps, r["rewards"], marker="o", label=f"seed {r['seed']}: reward")[0]
        left.plot(steps, r["tool_calls"], ls="--", color=line.get_color(), label=f"seed {r['seed']}: tool calls")
        at = sorted(r["evals"], key=int)
        right.plot([int(s) for s in at], [100 * r["evals"][s]["eval/accuracy"] for s in at], marker="s")
    right.axhline(PLAIN_GRPO_AFTER, color="grey", ls=":", label="plain grpo_gsm8k.py after 10 steps")
    left.set_xlabel("step (8 prompts x 8 completions, T = 0.6)")
    left.set_ylabel("reward; tool calls per completion")
    right.set_xlabel("step")
    right.set_ylabel("held-out accuracy with the tool, greedy (%)")
    right.set_ylim(-2, 102)
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("SmolLM2-135M-Instruct with a Python tool, CPU, harder arithmetic", fontsize=9)
    fig.tight_layout()
    fig.savefig(png)
    print(f"wrote {png}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", nargs="*", type=int, default=[1, 2, 3], help="none: --table and --png only")
    p.add_argument("--steps", type=int, default=10, help="training steps of every run")
    p.add_argument("--lr", default="1e-5", help="learning rate (bench/arithmetic.py's)")
    p.add_argument("--out", default="/tmp/cleanrlvr_tool", help="run folders and results.jsonl")
    p.add_argument("--table", action="store_true", help="print the table of every result in --out")
    p.add_argument("--png", default=None, help="draw the results in --out here")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = os.path.join(args.out, "results.jsonl")
    records = read_jsonl(results)
    model = subprocess.run([PY, os.path.join(ROOT, "tests", "real_model.py")], capture_output=True, text=True)
    model = model.stdout.strip().splitlines()[-1]
    for seed in args.seeds:
        if any((r["seed"], r["steps"], r["lr"]) == (seed, args.steps, args.lr) for r in records):
            continue
        record = run_one(model, seed, args)
        records.append(record)
        with open(results, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)
    mine = [r for r in records if (r["steps"], r["lr"]) == (args.steps, args.lr)]
    if args.table and mine:
        print(table(mine))
    if args.png and mine:
        plot(mine, args.png)


if __name__ == "__main__":
    main()
