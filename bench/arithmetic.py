"""Benchmark: does a real model get better at math with each training script? Held-out accuracy before and after.

The task: one-digit sums and products ("What is 5 times 3? Put the answer inside \\boxed{}, like \\boxed{0}."),
96 training and 32 held-out problems (tests/fixtures/make_arithmetic.py; `--tier harder` for the harder set). The
model: SmolLM2-135M-Instruct in float32 (tests/real_model.py). Every run is the unchanged script on the CPU with its
own vllm_sync_server.py, in a folder of its own under --out; eval.py scores the base model and each run's last
checkpoint on the held-out problems, greedy: `accuracy` (the boxed answer, as training rewards it) and
`last_number_accuracy` (the last number of the completion, box or not: the arithmetic without the format).

What runs (one or more, each with every --seeds):
  grpo          grpo_gsm8k.py, full fine-tuning, GSM8K schema
  lora_merged   grpo_gsm8k_lora_one_gpu.py --lora-rank 16, the base with the adapters merged in pushed each step
  lora_adapter  the same with --lora-sync adapter: the server runs vLLM's LoRA, loading each version's adapter
  reinforce     torchrun --nproc_per_node 2 reinforce_math_fsdp2.py, MATH schema (problem / solution with a box)
  pipeline      pipeline_actor.py + pipeline_learner.py through a real redis-server, one version of lag allowed
  obj:LOSS      grpo_gsm8k.py --loss-type LOSS --num-iterations 2 (grpo, dapo, dr_grpo, gspo, cispo), each with
                the clip range of its paper (OBJECTIVE_FLAGS)
Every finished run is a line of --out/results.jsonl, and a run already there is not run again: an interrupted
benchmark continues where it stopped. --table prints the results as the docs show them; --png draws the mean
training reward per step of each run name (matplotlib: a dependency of this benchmark alone).

Run: python bench/arithmetic.py --runs grpo reinforce --seeds 1 2 3 [--steps 8] [--out /tmp/arith] [--table]
"""

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
SERVER_ARGS = "--dtype float32 --enforce-eager --kv-cache-memory-bytes 268435456 --max-model-len 1024"
# The recipe of every run (the scripts' defaults are for GPUs and larger models): 8 prompts x 8 samples a step at
# temperature 0.6 (at 1.0 this model rambles), 48 tokens, no system prompt, lr 1e-5 (LoRA: 1e-4, LoRA's usual 10x),
# at most 4096 tokens a micro-batch (the logits of a 49,152-token vocabulary are large).
LR = "1e-5"
LORA_LR = "1e-4"
SAMPLES = {"prompts": 8, "group": 8, "temperature": "0.6", "tokens": "48"}
OBJECTIVE_FLAGS = {
    "grpo": [],
    "dapo": ["--clip-eps-high", "0.28"],  # clip-higher (DAPO's paper)
    "dr_grpo": [],
    "gspo": ["--clip-eps-low", "3e-4", "--clip-eps-high", "4e-4"],  # a sequence-level ratio (GSPO's paper)
    "cispo": ["--clip-eps-low", "1.0"],  # no lower bound (MiniMax-M1); the upper bound is grpo's 0.2
}
STEP = re.compile(r"^step (\d+): (.*)$")
EVAL = re.compile(r"^step (\d+): .*\beval/accuracy=(\S+)")  # step 0: alone; later: after the step's metrics


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def metrics_of(log: str) -> list[dict]:
    """The `step N: key=value ...` lines of a training log, one dict per step (evaluation lines left out)."""
    steps = []
    for m in filter(None, map(STEP.match, log.splitlines())):
        values = dict(kv.split("=", 1) for kv in m.group(2).split() if "=" in kv)
        if "reward" in values:
            steps.append({k: float(v) for k, v in values.items() if re.fullmatch(r"-?[\d.]+(e-?\d+)?|nan", v)})
    return steps


def start(cmd: list, log_path: str, cwd: str, env: dict | None = None) -> subprocess.Popen:
    """A process in its own session (stop() ends it with everything it started), its output in `log_path`."""
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
        os.killpg(proc.pid, signal.SIGKILL)


def start_server(model: str, port: int, workdir: str, *extra: str) -> subprocess.Popen:
    """vllm_sync_server.py on the CPU, waited for: its /health answers."""
    import requests

    cmd = [PY, os.path.join(ROOT, "vllm_sync_server.py"), "--model", model, "--port", str(port), *SERVER_ARGS.split()]
    proc = start(cmd + list(extra), os.path.join(workdir, "vllm_server.log"), workdir)
    for _ in range(600):
        if proc.poll() is not None:
            sys.exit(f"the server exited with {proc.returncode}: see {workdir}/vllm_server.log")
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).ok:
                return proc
        time.sleep(1)
    sys.exit(f"the server did not start in 10 minutes: see {workdir}/vllm_server.log")


def evaluate(model: str, dataset: str, task: str, out: str) -> dict:
    """eval.py on the held-out problems (all of them, greedy, the training's 48 tokens): its summary line."""
    cmd = [PY, os.path.join(ROOT, "eval.py"), "--model", model, "--dataset", dataset, "--task", task, "--limit", "None"]
    cmd += ["--max-tokens", SAMPLES["tokens"], "--system-prompt", "", "--out", out, "--start-server"]
    cmd += ["--vllm-port", str(free_port()), f"--server-args={SERVER_ARGS}"]
    r = subprocess.run(cmd, cwd=os.path.dirname(out), capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        sys.exit(f"eval.py failed on {model}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return read_jsonl(out)[-1]["summary"]


def grpo_cmd(script: str, model: str, dataset: str, steps: int, seed: int, lr: str, *extra: str) -> list:
    """grpo_gsm8k.py (or its variant) with the benchmark's recipe, starting its own server."""
    cmd = [PY, os.path.join(ROOT, script), "--model", model, "--dataset", dataset, "--seed", str(seed)]
    cmd += ["--train-steps", str(steps), "--rollouts-per-update", str(SAMPLES["prompts"])]
    cmd += ["--group-size", str(SAMPLES["group"]), "--train-temperature", SAMPLES["temperature"]]
    cmd += ["--max-completion-tokens", SAMPLES["tokens"], "--learning-rate", lr, "--system-prompt", ""]
    cmd += ["--eval-before-start", "--eval-every", str(steps // 2), "--eval-limit", "None"]  # start, middle, end
    cmd += ["--save-every", str(steps), "--checkpoint-dir", "ckpt"]
    cmd += ["--no-activation-checkpointing", "--micro-token-budget", "4096"]
    cmd += ["--start-server", "--vllm-port", str(free_port()), f"--server-args={SERVER_ARGS}"]
    return cmd + list(extra)


def reinforce_cmd(model: str, dataset: str, steps: int, seed: int, port: int, workdir: str) -> list:
    """reinforce_math_fsdp2.py on 2 ranks (gloo) against the server at `port`: a copy in `workdir` whose TASK rewards
    the last box anywhere (STRICT_FORMAT = False), as the other trainers do; SmolLM2 writes no think block."""
    with open(os.path.join(ROOT, "reinforce_math_fsdp2.py")) as f:
        text = f.read()
    script = os.path.join(workdir, "reinforce_math_fsdp2.py")
    with open(script, "w") as f:
        f.write(text.replace("\nSTRICT_FORMAT = True ", "\nSTRICT_FORMAT = False ", 1))
    cmd = [os.path.join(os.path.dirname(PY), "torchrun"), "--nproc_per_node=2", script]
    cmd += ["--model", model, "--dataset", dataset, "--eval-dataset", dataset, "--seed", str(seed)]
    cmd += ["--train-steps", str(steps), "--rollouts-per-update", str(SAMPLES["prompts"])]
    cmd += ["--group-size", str(SAMPLES["group"]), "--train-temperature", SAMPLES["temperature"]]
    cmd += ["--max-completion-tokens", SAMPLES["tokens"], "--learning-rate", LR, "--system-prompt", ""]
    cmd += ["--param-dtype", "float32", "--no-activation-checkpointing", "--eval-every", "0"]
    cmd += ["--micro-token-budget", "4096"]
    return cmd + ["--save-every", str(steps), "--checkpoint-dir", "ckpt", "--vllm-port", str(port)]


def pipeline(model: str, dataset: str, steps: int, seed: int, workdir: str) -> str:
    """redis-server, a server, an actor and the learner (one version of lag, 64 records a step): the learner's log."""
    redis_port = free_port()
    port = free_port()
    redis_cmd = ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    procs = [start(redis_cmd, os.path.join(workdir, "redis.log"), workdir)]
    try:
        procs.append(start_server(model, port, workdir))
        queue = ["--redis-url", f"redis://127.0.0.1:{redis_port}/0", "--vllm-urls", f"http://127.0.0.1:{port}"]
        actor = [PY, os.path.join(ROOT, "pipeline_actor.py"), *queue, "--dataset", dataset, "--seed", str(seed)]
        actor += ["--system-prompt", "", "--temperature", SAMPLES["temperature"], "--group-size", str(SAMPLES["group"])]
        actor += ["--max-completion-tokens", SAMPLES["tokens"], "--records-per-version", "64", "--max-lag", "1"]
        procs.append(start(actor, os.path.join(workdir, "actor.log"), workdir))
        learner = [PY, os.path.join(ROOT, "pipeline_learner.py"), "--model", model, *queue]
        learner += ["--train-steps", str(steps), "--batch-size", "64", "--max-lag", "1", "--learning-rate", LR]
        learner += ["--temperature", SAMPLES["temperature"], "--save-every", str(steps), "--checkpoint-dir", "ckpt"]
        learner += ["--no-activation-checkpointing", "--micro-token-budget", "4096", "--rollout-log", "rollouts.jsonl"]
        r = subprocess.run(learner, cwd=workdir, capture_output=True, text=True, timeout=7200)
        if r.returncode != 0:
            sys.exit(f"pipeline_learner.py failed in {workdir}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
        return r.stdout
    finally:
        for proc in reversed(procs):
            stop(proc)


def train(name: str, model: str, tier: str, steps: int, seed: int, workdir: str) -> tuple[str, str]:
    """One training run of `name` in `workdir`: its log and the checkpoint to evaluate."""
    gsm8k = os.path.join(FIXTURES, f"arithmetic_{tier}_gsm8k")
    if name == "pipeline":
        return pipeline(model, gsm8k, steps, seed, workdir), os.path.join(workdir, "ckpt", f"step_{steps}")
    if name == "reinforce":
        port = free_port()
        server = start_server(model, port, workdir)
        try:
            cmd = reinforce_cmd(model, os.path.join(FIXTURES, f"arithmetic_{tier}_math"), steps, seed, port, workdir)
            r = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=7200)
        finally:
            stop(server)
    else:
        if name.startswith("obj:"):
            loss = name.split(":", 1)[1]
            flags = ["--loss-type", loss, "--num-iterations", "2", *OBJECTIVE_FLAGS[loss]]
            cmd = grpo_cmd("grpo_gsm8k.py", model, gsm8k, steps, seed, LR, *flags)
        elif name.startswith("lora_"):
            flags = ["--lora-rank", "16", "--lora-alpha", "32", "--lora-sync", name.split("_", 1)[1]]
            cmd = grpo_cmd("grpo_gsm8k_lora_one_gpu.py", model, gsm8k, steps, seed, LORA_LR, *flags)
        else:
            cmd = grpo_cmd("grpo_gsm8k.py", model, gsm8k, steps, seed, LR)
        r = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=7200)
    if r.returncode != 0:
        sys.exit(f"{name} failed in {workdir}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return r.stdout, os.path.join(workdir, "ckpt", f"step_{steps}")


def run_one(name: str, seed: int, args, model: str, before: dict) -> dict:
    """Train, evaluate the last checkpoint, and return the record of the run."""
    tier = "" if args.tier == "one_digit" else f"_{args.tier}"  # the first tier's folders keep their names
    workdir = os.path.join(args.out, f"{name.replace(':', '_')}_seed{seed}{tier}")
    os.makedirs(workdir, exist_ok=True)
    t0 = time.time()
    log, checkpoint = train(name, model, args.tier, args.steps, seed, workdir)
    wall = time.time() - t0
    with open(os.path.join(workdir, "train.log"), "w") as f:
        f.write(log)
    task, dataset = ("math500", "math") if name == "reinforce" else ("gsm8k", "gsm8k")
    held_out = os.path.join(FIXTURES, f"arithmetic_{args.tier}_{dataset}")
    after = evaluate(checkpoint, held_out, task, os.path.join(workdir, "eval_after.jsonl"))
    steps = metrics_of(log)
    mean = lambda key: statistics.fmean(s[key] for s in steps) if steps and key in steps[0] else None  # noqa: E731
    return {
        "name": name,
        "seed": seed,
        "tier": args.tier,
        "steps": args.steps,
        "wall_s": round(wall),
        "before": {k: before[task][k] for k in ("accuracy", "last_number_accuracy")},
        "after": {k: after[k] for k in ("accuracy", "last_number_accuracy")},
        "rewards": [s["reward"] for s in steps],
        "held_out": {m.group(1): float(m.group(2)) for m in map(EVAL.match, log.splitlines()) if m},
        "clip_frac": mean("clip_frac"),
        "mis_masked_frac": mean("mis_masked_frac"),
    }


def table(records: list[dict]) -> str:
    """One row per run name: held-out accuracy before and after (the mean over seeds, then the range), last-number
    accuracy likewise, the steps, the mean wall time of a run (training alone) and the mean clip fraction a step."""
    rows = [
        "| run | seeds | accuracy before | after: mean [min, max] | last number: before | after | steps | wall | clip |"
    ]
    rows.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in dict.fromkeys(r["name"] for r in records):
        runs = [r for r in records if r["name"] == name]
        acc = [100 * r["after"]["accuracy"] for r in runs]
        last = [100 * r["after"]["last_number_accuracy"] for r in runs]
        before = runs[0]["before"]
        cells = [name, ", ".join(str(r["seed"]) for r in runs), f"{100 * before['accuracy']:.1f}%"]
        cells += [f"{statistics.fmean(acc):.1f}% [{min(acc):.1f}, {max(acc):.1f}]"]
        cells += [f"{100 * before['last_number_accuracy']:.1f}%", f"{statistics.fmean(last):.1f}%"]
        cells += [str(runs[0]["steps"]), f"{statistics.fmean(r['wall_s'] for r in runs) / 60:.1f} min"]
        clip = [r["clip_frac"] for r in runs if r.get("clip_frac") is not None]
        cells += [f"{statistics.fmean(clip):.4f}" if clip else "-"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(records: list[dict], png: str, title: str) -> None:
    """Left: the training reward per step; right: the held-out accuracy at the start, middle and end (where logged).
    One run name: a line per seed; several: a line per name, the mean over its seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["name"] for r in records))
    if len(names) == 1:
        lines = {f"seed {r['seed']}": [r] for r in records}
    else:
        runs_of = {name: [r for r in records if r["name"] == name] for name in names}
        lines = {f"{name} ({len(runs)} seed{'s' * (len(runs) > 1)})": runs for name, runs in runs_of.items()}
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 3.8), dpi=120)
    for label, runs in lines.items():
        curves = [r["rewards"] for r in runs]
        reward = [statistics.fmean(c[i] for c in curves) for i in range(min(map(len, curves)))]
        left.plot(range(1, len(reward) + 1), reward, marker="o", label=label)
        steps = sorted(set.intersection(*(set(r.get("held_out") or {}) for r in runs)), key=int)
        accuracy = [100 * statistics.fmean(r["held_out"][s] for r in runs) for s in steps]
        right.plot([int(s) for s in steps], accuracy, marker="s", label=label)
    left.set_xlabel(f"step ({SAMPLES['prompts']} prompts x {SAMPLES['group']} completions)")
    left.set_ylabel("mean training reward (T = 0.6)")
    left.set_ylim(-0.02, 1.02)
    right.set_xlabel("step")
    right.set_ylabel("held-out accuracy, greedy (%)")
    right.set_ylim(-2, 102)
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(png)
    print(f"wrote {png}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="*", default=[], help="run names (see above); none: --table and --png only")
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--steps", type=int, default=10, help="training steps of every run")
    p.add_argument("--tier", choices=["one_digit", "harder"], default="one_digit")
    p.add_argument("--out", default="/tmp/cleanrlvr_arithmetic", help="run folders and results.jsonl")
    p.add_argument("--table", action="store_true", help="print the table of every result in --out")
    p.add_argument("--png", default=None, help="draw the mean training reward per step of each run name here")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = os.path.join(args.out, "results.jsonl")
    records = read_jsonl(results)
    model = subprocess.run([PY, os.path.join(ROOT, "tests", "real_model.py")], capture_output=True, text=True)
    model = model.stdout.strip().splitlines()[-1]
    before = {}
    for task, dataset in (("gsm8k", "gsm8k"), ("math500", "math")):  # the base model, once per schema
        out = os.path.join(args.out, f"base_{args.tier}_{dataset}.jsonl")
        held_out = os.path.join(FIXTURES, f"arithmetic_{args.tier}_{dataset}")
        before[task] = read_jsonl(out)[-1]["summary"] if os.path.exists(out) else None
        if before[task] is None and any((n == "reinforce") == (task == "math500") for n in args.runs):
            before[task] = evaluate(model, held_out, task, out)
    for name in args.runs:
        for seed in args.seeds:
            done = [
                r
                for r in records
                if (r["name"], r["seed"], r["tier"], r["steps"]) == (name, seed, args.tier, args.steps)
            ]
            if done:
                continue
            record = run_one(name, seed, args, model, before)
            records.append(record)
            with open(results, "a") as f:
                f.write(json.dumps(record) + "\n")
            print(json.dumps({k: v for k, v in record.items() if k != "rewards"}), flush=True)
    mine = [r for r in records if r["tier"] == args.tier and r["steps"] == args.steps]
    if args.table:
        print(table(mine))
    if args.png:
        title = f"SmolLM2-135M-Instruct on CPU, {args.tier.replace('_', '-')} arithmetic"
        names = args.runs or {r["name"] for r in mine}  # no --runs: every run in --out
        plot([r for r in mine if r["name"] in names], args.png, title)


if __name__ == "__main__":
    main()
