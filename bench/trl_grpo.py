"""Benchmark: grpo_gsm8k.py side by side with TRL's GRPOTrainer on the same work, on the CPU, in one run, paired seeds.

The same model (SmolLM2-135M-Instruct: tests/real_model.py), precision (fp32 master weights, the forward and the
sampling in --dtype), task (bench/arithmetic.py's: one-digit sums and products,
tests/fixtures/arithmetic_one_digit_gsm8k, 96 training problems and 32 held out, the chat template with its own system
message), reward (grpo_gsm8k.grade), batch (--rollouts prompts x --group completions a step, one optimizer step per
batch), completion tokens, temperature, learning rate (constant, AdamW without weight decay, gradient norm clipped at
1), loss (GRPO: per-sequence means, clip 0.2, no KL, rewards scaled by the group's std), no activation checkpointing,
and the held-out evaluation (greedy, all 32 problems, graded alike) before training and after every step. What
differs is the machinery: grpo_gsm8k.py samples with vllm_sync_server.py (vLLM on the CPU, started here first and
counted in its time) and pushes the weights after each step; TRL 1.16 samples in-process with transformers' generate,
and its held-out answers come from transformers' generate too (a callback of this file's; in bf16 after step 0, under
the autocast that accelerate wraps the model's forward in as training starts, as TRL samples).

Paired seeds: for each --seeds value both sides run, and TRL gets the data order grpo_gsm8k.py draws with that --seed
(the same permutation of the training problems, consumed in order: shuffle_dataset=False), so a seed compares the
trainers, not two data orders. Each side's sampling follows the seed too (ours through rollout_seed, TRL through
torch's generator). Ours runs the recipe docs/grpo_gsm8k.md recommends for a weak model (--ours-flags, default
--dynamic-sampling); with dynamic sampling it may draw more prompts a step than TRL, in the same order, and pays for
them in its seconds.

TRL is not a dependency of this project: the benchmark installs trl==1.16.0 and accelerate==1.15.0 without their
dependencies (the project's venv has them) into ~/.cache/cleanrlvr/trl-1.16.0 and runs TRL's side in a child process
with that folder on PYTHONPATH; the project's venv is left as it was.
Printed: the training reward and the held-out accuracy per step for both, the median seconds a step (steps 2..), the
time to the first held-out accuracy of --threshold or more (the start before the first step, then the steps up to that
evaluation; the evaluations themselves are not counted), and the ratios.
--json FILE writes {"runs": [{"side": "ours" | "trl", "seed", "held_out": [before training, after step 1, ...],
"rewards": [...], "step_s": median seconds a step, "time_to_threshold_s": seconds or null}, ...], "settings": {...}}.
Run: python bench/trl_grpo.py [--seeds 1 2 3] [--steps 10] [--rollouts 8] [--group 8] [--tokens 48]
     [--temperature 0.6] [--lr 1e-5] [--threshold 0.6] [--dtype bfloat16] [--dataset DIR] [--json FILE]
     [--sides ours trl] [--ours-flags="--dynamic-sampling"]
"""

import argparse
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
DATASET = os.path.join(ROOT, "tests", "fixtures", "arithmetic_one_digit_gsm8k")  # train.jsonl, test.jsonl (held out)
RECIPE = "--dynamic-sampling"  # docs/grpo_gsm8k.md's recipe for a weak model: ours runs it unless --ours-flags says
TRL_DIR = os.path.expanduser("~/.cache/cleanrlvr/trl-1.16.0")
TRL_PINS = ("trl==1.16.0", "accelerate==1.15.0")
SERVER_FLAGS = (
    "--enforce-eager",
    "--kv-cache-memory-bytes",
    str(256 << 20),
    "--max-model-len",
    "1024",
)
STEP = re.compile(r"^step (\d+): (.*)$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed_lines(cmd: list, env=None, cwd=None):
    """Run `cmd`, yielding (seconds since launch, line) for each line of its stdout as it arrives; its stderr goes to
    a file in `cwd`, shown if it fails."""
    t0 = time.time()
    with open(os.path.join(cwd, "stderr.log"), "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=cwd)
        for line in proc.stdout:
            yield time.time() - t0, line
        if proc.wait() != 0:
            tail = Path(cwd, "stderr.log").read_text()[-3000:]
            sys.exit(f"{' '.join(cmd[:3])} ... exited with {proc.returncode}:\n{tail}")


# ---------------------------------------------------------------------------------------------------
# ours: the server, then the unchanged script


def start_server(model: str, port: int, log_path: str, all_cores: bool, dtype: str) -> subprocess.Popen:
    """vllm_sync_server.py of `model`, in its own process group, once /health answers (at most 10 minutes). all_cores:
    its OpenMP threads on every core, none kept for its scheduler, as grpo_gsm8k.py --start-server starts it on a CPU;
    else vLLM's default (one core kept)."""
    import requests

    cmd = [PY, os.path.join(ROOT, "vllm_sync_server.py"), "--model", model, "--port", str(port), *SERVER_FLAGS]
    cmd += ["--dtype", dtype]  # grpo_gsm8k.py's update computes in the server's dtype (bf16 autocast beside bf16)
    env = dict(os.environ)
    if all_cores:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(os.sched_getaffinity(0))))
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited with {proc.returncode}: see {log_path}")
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).ok:
                return proc
        except requests.RequestException:
            pass
        time.sleep(1)
    os.killpg(proc.pid, signal.SIGKILL)
    sys.exit(f"the server did not answer /health within 10 minutes: see {log_path}")


def load_grpo():
    """grpo_gsm8k.py as a module: its TASK (to_problem, grade) and its data order (problem_index), both sides use."""
    spec = importlib.util.spec_from_file_location("grpo_gsm8k", os.path.join(ROOT, "grpo_gsm8k.py"))
    grpo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grpo)
    return grpo


def training_order(dataset: str, seed: int, prompts: int) -> list[tuple[str, str]]:
    """The first `prompts` (prompt, gold) problems grpo_gsm8k.py --seed `seed` draws from `dataset`: its training
    problems less the test split's (load_problems), in the order of its problem_index, epoch after epoch."""
    grpo = load_grpo()
    train, _ = grpo.drop_eval_overlap(grpo.load_split(dataset, "train"), grpo.load_split(dataset, "test"))
    return [train[grpo.problem_index(seed, k, len(train))] for k in range(prompts)]


def run_ours(model: str, args, workdir: str, all_cores: bool = True) -> dict:
    t0 = time.time()
    port = free_port()
    log = os.path.join(tempfile.gettempdir(), "bench_trl_grpo_server.log")
    server = start_server(model, port, log, all_cores, args.dtype)
    server_s = time.time() - t0
    cmd = [PY, os.path.join(ROOT, "grpo_gsm8k.py"), "--model", model, "--dataset", args.dataset]
    cmd += ["--vllm-port", str(port), *shlex.split(args.ours_flags)]
    cmd += ["--train-steps", str(args.steps), "--rollouts-per-update", str(args.rollouts), "--group-size"]
    cmd += [str(args.group), "--max-completion-tokens", str(args.tokens), "--learning-rate", str(args.lr)]
    cmd += ["--train-temperature", str(args.temperature), "--seed", str(args.seed), "--system-prompt", ""]
    cmd += ["--eval-before-start", "--eval-every", "1", "--eval-limit", "None", "--save-every", "100000"]
    cmd += ["--checkpoint-dir", "ckpt", "--no-activation-checkpointing", "--micro-token-budget", "4096"]
    steps = []
    held_out = {}
    first = None
    try:
        for since, line in timed_lines(cmd, cwd=workdir):
            if not (m := STEP.match(line)):
                continue
            fields = dict(kv.split("=", 1) for kv in m.group(2).split())
            held_out[int(m.group(1))] = float(fields["eval/accuracy"])
            if "reward" in fields:
                steps.append({k: float(fields[k]) for k in ("reward", "step_s", "generate_s", "update_s")})
            elif first is None:  # step 0: the evaluation before training, the trainer's start behind it
                first = server_s + since
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    return {"steps": steps, "held_out": held_out, "start_s": first}


# ---------------------------------------------------------------------------------------------------
# TRL: GRPOTrainer in a child process (--trl-child), TRL on its PYTHONPATH


def install_trl() -> None:
    if os.path.isdir(os.path.join(TRL_DIR, "trl")):
        return
    print(f"installing {' '.join(TRL_PINS)} (no dependencies) into {TRL_DIR}", flush=True)
    cmd = [PY, "-m", "pip", "install", "-q", "--no-deps", "--target", TRL_DIR, *TRL_PINS]
    subprocess.run(cmd, check=True)


def run_trl(model: str, args, workdir: str) -> dict:
    install_trl()
    env = {**os.environ, "PYTHONPATH": TRL_DIR, "TOKENIZERS_PARALLELISM": "false"}
    cmd = [PY, os.path.abspath(__file__), "--trl-child", "--model", model, "--steps", str(args.steps)]
    cmd += ["--rollouts", str(args.rollouts), "--group", str(args.group), "--tokens", str(args.tokens)]
    cmd += ["--temperature", str(args.temperature), "--lr", str(args.lr), "--seed", str(args.seed)]
    cmd += ["--dtype", args.dtype, "--dataset", args.dataset]
    steps = []
    held_out = {}
    first = None
    for since, line in timed_lines(cmd, env=env, cwd=workdir):
        if line.startswith("step {"):
            record = json.loads(line[len("step ") :])
            held_out[record["step"]] = record["held_out"]
            if record["step"] > 0:
                steps.append(record)
            else:
                first = since
    return {"steps": steps, "held_out": held_out, "start_s": first}


def trl_child(args) -> None:
    """TRL's side: GRPOTrainer with the settings of grpo_gsm8k.py's run; a line per step on stdout: "step {json}"."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    grpo = load_grpo()  # its to_problem and grade(), the problems and the reward both runs use

    def chat(prompt: str) -> list[dict]:
        return [{"role": "user", "content": prompt}]

    # ours' data order for this seed, one prompt after the other (shuffle_dataset=False below)
    order = training_order(args.dataset, args.seed, args.steps * args.rollouts)
    data = Dataset.from_list([{"prompt": chat(prompt), "gold": gold} for prompt, gold in order])
    test = grpo.load_split(args.dataset, "test")

    def reward(completions, gold, **_):
        return [grpo.grade(c[0]["content"], g).reward for c, g in zip(completions, gold, strict=True)]

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(args.model)

    @torch.no_grad()
    def held_out_accuracy() -> float:
        """Greedy answers to every held-out problem in one left-padded batch, graded as in training."""
        texts = [tokenizer.apply_chat_template(chat(p), tokenize=False, add_generation_prompt=True) for p, _ in test]
        tokenizer.padding_side = "left"
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        was_training = model.training
        model.eval()
        out = model.generate(**batch, max_new_tokens=args.tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        model.train(was_training)
        answers = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        return sum(grpo.grade(a, gold).correct for a, (_, gold) in zip(answers, test, strict=True)) / len(test)

    class StepLines(TrainerCallback):
        """A line per step: its reward and seconds (generation, loss, update; the evaluation after it not counted)."""

        def on_step_begin(self, _args, state, control, **kw):
            self.t = time.time()

        def on_log(self, _args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                record = {"step": state.global_step, "reward": logs["reward"], "step_s": time.time() - self.t}
                record["held_out"] = held_out_accuracy()
                print("step " + json.dumps(record), flush=True)  # (the Trainer prints its own dicts too)

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-"),
        max_steps=args.steps,
        per_device_train_batch_size=args.rollouts * args.group,  # one batch of completions = one optimizer step
        shuffle_dataset=False,  # the prompts in the order given: ours' for this seed
        num_generations=args.group,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        max_completion_length=args.tokens,
        temperature=args.temperature,
        top_p=1.0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        loss_type="grpo",
        beta=0.0,
        epsilon=0.2,
        scale_rewards="group",
        gradient_checkpointing=False,
        use_cpu=True,
        bf16=args.dtype == "bfloat16",  # accelerate's autocast over the fp32 model, as grpo_gsm8k.py's
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[StepLines()],
    )
    print("step " + json.dumps({"step": 0, "held_out": held_out_accuracy()}), flush=True)  # before training
    trainer.train()


# ---------------------------------------------------------------------------------------------------


def summary(side: str, seed: int, run: dict, threshold: float) -> dict:
    """A run as --json records it: the held-out accuracy before training and after each step, the training rewards,
    the median seconds a step (the first step, with its warm-up, left out) and the time to the first held-out accuracy
    at or above `threshold`: the start (launch to the evaluation before training, included) plus the steps up to that
    evaluation (None: not reached)."""
    later = [s["step_s"] for s in run["steps"][1:]] or [s["step_s"] for s in run["steps"]]
    step = next((k for k in sorted(run["held_out"]) if run["held_out"][k] >= threshold), None)
    reached = None if step is None else run["start_s"] + sum(s["step_s"] for s in run["steps"][:step])
    return {
        "side": side,
        "seed": seed,
        "held_out": [run["held_out"][k] for k in sorted(run["held_out"])],
        "rewards": [s["reward"] for s in run["steps"]],
        "step_s": statistics.median(later),
        "time_to_threshold_s": reached,
    }


def report(runs: list[dict], args) -> None:
    """Per seed, both sides; then per side the final held out's mean, min and max, the median seconds a step and the
    median time to the threshold; then the ratios of ours to TRL's."""
    target = f"to {100 * args.threshold:.0f}%"
    print(
        f"\n{args.rollouts} x {args.group} completions of up to {args.tokens} tokens at T {args.temperature}, ", end=""
    )
    print(f"lr {args.lr}, {args.steps} steps, {args.dtype}, ours with {args.ours_flags or 'no flags'!r}")
    print(f"{'seed':>4} {'side':<5}{'s/step':>7}{target:>9}  held out per step (%)")
    for r in runs:
        reached = "-" if r["time_to_threshold_s"] is None else f"{r['time_to_threshold_s']:.0f} s"
        held = " ".join(f"{100 * a:.0f}" for a in r["held_out"])
        print(f"{r['seed']:>4} {r['side']:<5}{r['step_s']:>7.1f}{reached:>9}  {held}")
    medians = {}
    for side in args.sides:
        mine = [r for r in runs if r["side"] == side]
        final = [100 * r["held_out"][-1] for r in mine]
        times = [r["time_to_threshold_s"] for r in mine]
        reached = sorted(t if t is not None else math.inf for t in times)
        medians[side] = (statistics.median(r["step_s"] for r in mine), statistics.median(reached))
        print(
            f"{side}: final held out mean {statistics.mean(final):.1f}%, min {min(final):.1f}%, max {max(final):.1f}% "
            f"over {len(mine)} seeds; {sum(t is not None for t in times)} of {len(mine)} {target}; median s/step "
            f"{medians[side][0]:.1f}, median time {target} {medians[side][1]:.0f} s"
        )
    if set(args.sides) == {"ours", "trl"}:
        ratio = medians["ours"][1] / medians["trl"][1] if math.isfinite(medians["trl"][1]) else math.nan
        print(f"ours / TRL: s/step {medians['ours'][0] / medians['trl'][0]:.2f}x, median time {target} {ratio:.2f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="training steps of each run")
    parser.add_argument("--rollouts", type=int, default=8, help="prompts a step")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--tokens", type=int, default=48, help="completion tokens at most")
    parser.add_argument("--temperature", type=float, default=0.6, help="sampling temperature of training")
    parser.add_argument("--lr", type=float, default=1e-5, help="learning rate")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1], help="the paired seeds: both sides run each")
    parser.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)  # the TRL child's
    parser.add_argument("--sides", nargs="+", choices=["ours", "trl"], default=["ours", "trl"], help="which to run")
    parser.add_argument("--threshold", type=float, default=0.6, help="the held-out accuracy whose first step is timed")
    parser.add_argument("--model", default=None, help="(the real model of tests/real_model.py)")
    parser.add_argument("--dataset", default=DATASET, help="a folder with train.jsonl and test.jsonl (GSM8K's schema)")
    parser.add_argument("--json", default=None, help="write every run's figures to this file")
    parser.add_argument(
        "--ours-flags",
        default=RECIPE,
        help=f"grpo_gsm8k.py's flags beyond the shared settings (default: the docs' recipe, {RECIPE!r}); write "
        '--ours-flags="..." or --ours-flags "" for none',
    )
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="what both compute in: the server's dtype and grpo_gsm8k.py's autocast, TRL's bf16; the weights stay fp32",
    )
    parser.add_argument(
        "--server-cores",
        choices=["all", "default"],
        default="all",
        help="all: grpo_gsm8k.py's server on every core (as its --start-server on a CPU); default: vLLM's (a core kept "
        "for its scheduler)",
    )
    parser.add_argument("--trl-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_child:
        return trl_child(args)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from real_model import real_model_dir

    model = args.model or real_model_dir()
    runners = {"ours": lambda *a: run_ours(*a, all_cores=args.server_cores == "all"), "trl": run_trl}
    runs = []
    for seed in args.seeds:
        for side in args.sides:
            workdir = tempfile.mkdtemp(prefix="cleanrlvr-trl-bench-")
            try:
                run = runners[side](model, argparse.Namespace(**{**vars(args), "seed": seed}), workdir)
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
            runs.append(summary(side, seed, run, args.threshold))
            print(f"seed {seed} {side}: {json.dumps(runs[-1])}", flush=True)
            if args.json:  # after every run: a long benchmark cut short keeps what it measured
                settings = {k: v for k, v in vars(args).items() if k not in ("trl_child", "seed", "json")}
                Path(args.json).write_text(json.dumps({"settings": settings, "runs": runs}, indent=1) + "\n")
    report(runs, args)


if __name__ == "__main__":
    main()
