"""Benchmark: does on-policy distillation (distill_gsm8k.py) bring a small model up to its teacher, and how much sooner
than GRPO from the same start?

The task and the model are bench/arithmetic.py's: one-digit sums and products (96 training, 32 held-out problems),
SmolLM2-135M-Instruct in float32, everything on the CPU. The teacher is that model trained by grpo_gsm8k.py
(--teacher-steps steps, seed --teacher-seed, --dynamic-sampling): its last checkpoint. Then, for each of --seeds, from
the base model:
  distill   distill_gsm8k.py, the teacher on a second vllm_sync_server.py, --steps steps
  grpo      grpo_gsm8k.py as its docs recommend (--dynamic-sampling), --grpo-steps steps
Each step: 8 prompts x 8 samples at temperature 0.6, 48 tokens, lr 1e-5, no system prompt; the held-out problems
evaluated greedy before the first step and after each (the scripts' own evaluation, on the student's server). A run's
`time_to_teacher_s` is the training time (evaluations aside) until its held out first comes within 5 points of the
teacher's (null: never). Every finished run is a line of --out/results.jsonl, and one already there is not run again.
--table prints the docs' table, --png draws the held out per step (matplotlib: a dependency of this benchmark alone).

Run: python bench/distill.py --seeds 1 2 3 --distill-lr 5e-5 --out /tmp/cleanrlvr_distill --table \
     [--png docs/images/distill_gsm8k.png]   (the results on docs/distill_gsm8k.md)
"""

import argparse
import contextlib
import json
import os
import re
import socket
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
DATASET = os.path.join(ROOT, "tests", "fixtures", "arithmetic_one_digit_gsm8k")
SERVER_ARGS = "--dtype float32 --enforce-eager --kv-cache-memory-bytes 268435456 --max-model-len 1024"
RECIPE = [  # bench/arithmetic.py's: the scripts' defaults are for GPUs and larger models
    *("--rollouts-per-update", "8", "--group-size", "8", "--train-temperature", "0.6"),
    *("--max-completion-tokens", "48", "--system-prompt", ""),
    *("--no-activation-checkpointing", "--micro-token-budget", "4096", "--eval-limit", "None"),
]
STEP = re.compile(r"^step (\d+): (.*)$")
WITHIN = 0.05  # "caught up": within 5 points of the teacher's held out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def steps_of(log: str) -> tuple[list[dict], list[float]]:
    """A training log's step metrics (one dict per step, numbers only) and its held out per step (step 0 first)."""
    steps, held_out = [], {}
    for m in filter(None, map(STEP.match, log.splitlines())):
        values = dict(kv.split("=", 1) for kv in m.group(2).split() if "=" in kv)
        with contextlib.suppress(KeyError):
            held_out[int(m.group(1))] = float(values["eval/accuracy"])
        if "reward" in values:
            steps.append({k: float(v) for k, v in values.items() if re.fullmatch(r"-?[\d.]+(e-?\d+)?|nan", v)})
    return steps, [held_out[s] for s in sorted(held_out)]


def run(cmd: list, workdir: str) -> tuple[list[dict], list[float]]:
    """`cmd` in `workdir` (it starts its own servers), its output in workdir/train.log as it runs; its steps and held
    out."""
    os.makedirs(workdir, exist_ok=True)
    log_path = os.path.join(workdir, "train.log")
    with open(log_path, "w") as log:
        code = subprocess.run(cmd, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, timeout=4 * 3600).returncode
    with open(log_path) as log:
        output = log.read()
    if code != 0:
        sys.exit(f"{cmd[1]} failed in {workdir} (exit {code}):\n{output[-4000:]}")
    return steps_of(output)


def grpo_cmd(steps: int, seed: int) -> list:
    cmd = [PY, os.path.join(ROOT, "grpo_gsm8k.py"), "--model", base_model(), "--dataset", DATASET, "--seed", str(seed)]
    cmd += ["--train-steps", str(steps), *RECIPE, "--learning-rate", "1e-5", "--dynamic-sampling"]
    cmd += ["--eval-before-start", "--eval-every", "1", "--save-every", str(steps), "--checkpoint-dir", "ckpt"]
    return cmd + ["--start-server", "--vllm-port", str(free_port()), f"--server-args={SERVER_ARGS}"]


def distill_cmd(steps: int, seed: int, teacher: str, lr: str) -> list:
    cmd = [PY, os.path.join(ROOT, "distill_gsm8k.py"), "--model", base_model(), "--dataset", DATASET]
    cmd += ["--seed", str(seed), "--teacher-model", teacher, "--train-steps", str(steps), *RECIPE]
    cmd += ["--learning-rate", lr, "--eval-before-start", "--eval-every", "1"]
    cmd += ["--save-every", str(steps), "--checkpoint-dir", "ckpt"]
    cmd += ["--start-server", "--vllm-port", str(free_port()), f"--server-args={SERVER_ARGS}"]
    return cmd + ["--teacher-url", f"http://127.0.0.1:{free_port()}", f"--teacher-server-args={SERVER_ARGS}"]


def base_model() -> str:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from real_model import real_model_dir  # SmolLM2-135M-Instruct, float32 (tests/real_model.py)

    return real_model_dir()


def record(side: str, seed: int, steps: list[dict], held_out: list[float], teacher_held_out: float) -> dict:
    """One run's line of results.jsonl."""
    step_s = [s["step_s"] for s in steps]
    caught = [i for i, acc in enumerate(held_out) if acc >= teacher_held_out - WITHIN]
    return {
        "side": side,
        "seed": seed,
        "held_out": held_out,
        "rewards": [s["reward"] for s in steps],
        "reverse_kl": [s["reverse_kl"] for s in steps if "reverse_kl" in s],
        "step_s": statistics.median(step_s),
        "time_to_teacher_s": round(sum(step_s[: caught[0]])) if caught else None,
    }


def table(records: list[dict]) -> str:
    """Per seed: the teacher's held out, the student's per step under distillation and under GRPO, and the training
    seconds each took to come within 5 points of the teacher."""
    teacher = next(r for r in records if r["side"] == "teacher")
    rows = [f"teacher: {100 * teacher['held_out'][-1]:.1f}% held out after {len(teacher['rewards'])} GRPO steps\n"]
    rows += ["| seed | side | held out per step (0 = base) | within 5 points after | median step |"]
    rows += ["| ---: | --- | --- | ---: | ---: |"]
    for r in sorted((r for r in records if r["side"] != "teacher"), key=lambda r: (r["seed"], r["side"])):
        held = " ".join(f"{100 * acc:.1f}" for acc in r["held_out"])
        caught = "never" if r["time_to_teacher_s"] is None else f"{r['time_to_teacher_s'] / 60:.1f} min"
        rows.append(f"| {r['seed']} | {r['side']} | {held} | {caught} | {r['step_s']:.0f} s |")
    return "\n".join(rows)


def plot(records: list[dict], png: str) -> None:
    """The student's held out per step, a line per seed and side, and the teacher's as a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    teacher = next(r for r in records if r["side"] == "teacher")
    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=120)
    sides = sorted({r["side"] for r in records} - {"teacher"})
    for r in sorted((r for r in records if r["side"] != "teacher"), key=lambda r: (r["side"], r["seed"])):
        color = f"C{sides.index(r['side'])}"
        marker = "os^Dv"[(r["seed"] - 1) % 5]
        label = f"{r['side']}, seed {r['seed']}"
        ax.plot([100 * a for a in r["held_out"]], color=color, marker=marker, alpha=0.75, label=label)
    ax.axhline(100 * teacher["held_out"][-1], color="k", linestyle="--", label="teacher")
    ax.set_xlabel("step (8 prompts x 8 samples)")
    ax.set_ylabel("held-out accuracy, greedy (%)")
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(png)
    print(f"wrote {png}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", nargs="*", type=int, default=[1, 2, 3])
    p.add_argument("--steps", type=int, default=4, help="distillation steps a seed")
    p.add_argument("--grpo-steps", type=int, default=8, help="GRPO steps a seed, from the same start (0: none)")
    p.add_argument("--teacher-steps", type=int, default=8)
    p.add_argument("--teacher-seed", type=int, default=1)
    p.add_argument("--distill-lr", default="1e-5", help="distillation's learning rate (GRPO's: 1e-5)")
    p.add_argument("--out", default="/tmp/cleanrlvr_distill", help="run folders and results.jsonl")
    p.add_argument("--table", action="store_true")
    p.add_argument("--png", default=None)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = os.path.join(args.out, "results.jsonl")
    records = []
    if os.path.exists(results):
        with open(results) as f:
            records = [json.loads(line) for line in f if line.strip()]
    done = {(r["side"], r["seed"]) for r in records}
    teacher_ckpt = os.path.join(args.out, "teacher", "ckpt", f"step_{args.teacher_steps}")
    distill = "distill" if args.distill_lr == "1e-5" else f"distill_lr{args.distill_lr}"
    todo = [("teacher", args.teacher_seed)] + [(side, seed) for seed in args.seeds for side in (distill, "grpo")]
    for side, seed in todo:
        if (side, seed) in done or (side == "grpo" and not args.grpo_steps):
            continue
        if side == "grpo" and (seed, args.grpo_steps) == (args.teacher_seed, args.teacher_steps):  # the same run
            records.append({**next(r for r in records if r["side"] == "teacher"), "side": "grpo"})
            with open(results, "a") as f:
                f.write(json.dumps(records[-1]) + "\n")
            continue
        if side == "teacher":
            cmd = grpo_cmd(args.teacher_steps, seed)
        elif side.startswith("distill"):
            cmd = distill_cmd(args.steps, seed, teacher_ckpt, args.distill_lr)
        else:
            cmd = grpo_cmd(args.grpo_steps, seed)
        steps, held_out = run(cmd, os.path.join(args.out, side if side == "teacher" else f"{side}_seed{seed}"))
        teacher = [r["held_out"][-1] for r in records if r["side"] == "teacher"]
        teacher_held_out = held_out[-1] if side == "teacher" else teacher[0]
        records.append(record(side, seed, steps, held_out, teacher_held_out))
        with open(results, "a") as f:
            f.write(json.dumps(records[-1]) + "\n")
        print(f"{side} seed {seed}: {json.dumps(records[-1])}", flush=True)
    if args.table:
        print(table(records))
    if args.png:
        plot(records, args.png)


if __name__ == "__main__":
    main()
