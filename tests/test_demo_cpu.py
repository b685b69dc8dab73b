"""SCRIPT, the newcomer's first command, run as a newcomer runs it: set-up (a no-op here: the venv exists), the toy
model, the GRPO script with --start-server on CPU for 30 steps, the chart and the verdict. A copy of the demo is
tested by changing SCRIPT."""

import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, free_port, read_jsonl

SCRIPT = "demo_cpu.sh"


def run_demo(demo_dir, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """The demo with its files in `demo_dir`; its set-up finds the venv running the tests ready."""
    venv = os.path.dirname(os.path.dirname(sys.executable))
    env = {**os.environ, "VENV": venv, "DEMO_DIR": str(demo_dir)}
    return subprocess.run(
        ["bash", os.path.join(ROOT, SCRIPT), "--vllm-port", str(free_port()), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_demo_learns_and_says_where_its_files_are(tmp_path):
    r = run_demo(tmp_path / "demo", timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    chart = re.findall(r"^\s*(\d+)\s+(\d\.\d\d) \|#*$", r.stdout, re.M)
    assert [int(step) for step, _ in chart] == list(range(1, 31)), r.stdout
    assert "it learned" in r.stdout and "NOT LEARNED" not in r.stdout
    rewards = [float(x) for _, x in chart]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:3]) / 3 + 0.3  # what the verdict says is what the chart shows
    rollouts = read_jsonl(tmp_path / "demo" / "rollouts.jsonl")
    assert len(rollouts) == 30 * 64 and f"{tmp_path}/demo/rollouts.jsonl" in r.stdout
    assert os.path.exists(tmp_path / "demo" / "checkpoints" / "step_30" / "model.safetensors")
    assert "demo/checkpoints/step_30" in r.stdout


def verdict(tmp_path, rewards: list[float], held_out: dict | None = None) -> subprocess.CompletedProcess:
    """The demo's own chart-and-verdict code (its `<<'PY'` block, read from SCRIPT) on a train.log of these rewards,
    and of these held-out accuracies ({step: accuracy}, logged as grpo_gsm8k.py logs its evaluations)."""
    text = Path(ROOT, SCRIPT).read_text()
    code = text.split("<<'PY'\n", 1)[1].split("\nPY\n", 1)[0]
    log = tmp_path / "train.log"
    evals = {step: f"eval/accuracy={acc:.4f} eval/parse_err_rate=0" for step, acc in (held_out or {}).items()}
    # as grpo_gsm8k.py logs them: the evaluation before training on a line of its own, a later one after its step's
    steps = [f"step {i}: loss=0.0 reward={r:.4f} step_s=1.0 {evals.get(i, '')}\n" for i, r in enumerate(rewards, 1)]
    log.write_text((f"step 0: {evals[0]}\n" if 0 in evals else "") + "".join(steps))
    return subprocess.run([sys.executable, "-c", code, str(log)], capture_output=True, text=True, timeout=60)


def test_demo_fails_on_a_flat_line(tmp_path):
    """A policy that does not learn is never shown as a success: a flat line, a rise too small, a rise that ends
    below 0.5, and a run too short to judge all exit 1; the rise the demo draws exits 0. (The verdict is the demo's
    own code; the learning run above shows it reads the script's real log lines.)"""
    flat = verdict(tmp_path, [0.13] * 30)
    assert flat.returncode == 1 and "NOT LEARNED" in flat.stdout, flat.stdout + flat.stderr
    assert "first 3 steps 0.13, last 5 steps 0.13" in flat.stdout
    for rewards in ([0.1] * 25 + [0.35] * 5, [0.0] * 25 + [0.45] * 5, [0.1, 0.1, 0.1, 1.0, 1.0, 1.0, 1.0]):
        r = verdict(tmp_path, rewards)
        assert r.returncode == 1 and "NOT LEARNED" in r.stdout, (rewards, r.stdout + r.stderr)
    rise = verdict(tmp_path, [0.1] * 3 + [0.5] * 22 + [0.9] * 5)
    assert rise.returncode == 0 and "it learned" in rise.stdout, rise.stdout + rise.stderr


def test_real_demo_verdict_is_the_held_out_rise(tmp_path):
    """--real judges the held-out accuracy, not the reward: a rise of 25 points from the evaluation before training
    passes; 24 points, a fall, or no evaluation before the first step fail, whatever the rewards did."""
    rising_rewards = [0.0, 0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.9, 0.9, 0.9]
    cases = [
        ({0: 0.21875, 5: 0.5, 10: 0.5}, 0),  # +28 points
        ({0: 0.25, 5: 0.3, 10: 0.5}, 0),  # +25 points: the bar
        ({0: 0.25, 5: 0.3, 10: 0.49}, 1),  # +24 points
        ({0: 0.5, 5: 0.9, 10: 0.2}, 1),  # a fall at the end
        ({5: 0.1, 10: 0.9}, 1),  # no accuracy before training to compare with
    ]
    for held_out, code in cases:
        r = verdict(tmp_path, rising_rewards, held_out)
        assert r.returncode == code and ("NOT LEARNED" in r.stdout) == bool(code), (held_out, r.stdout + r.stderr)
        assert "held-out accuracy: " + ", ".join(f"{100 * a:.1f}% at step {s}" for s, a in held_out.items()) in r.stdout


def test_set_up_twice_leaves_the_venv_alone(tmp_path):
    """tests/setup_cpu.sh on a venv it already set up from this requirements-cpu.txt runs no pip: a second pip install
    would put back the torchvision the set-up removes, and a test or run importing transformers meanwhile (the demo's
    set-up runs beside the other tests) would fail on it. A changed requirements file installs again."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    calls = tmp_path / "pip_calls"
    (venv / "bin" / "pip").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (venv / "bin" / "pip").chmod(0o755)
    env = {**os.environ, "VENV": str(venv)}
    setup = ["bash", os.path.join(ROOT, "tests", "setup_cpu.sh"), "--demo"]
    subprocess.run(setup, env=env, check=True, capture_output=True, timeout=60)
    assert calls.read_text().splitlines() == [
        "install -q -r requirements-cpu.txt",
        "uninstall -q -y torchvision torchaudio torchcodec",
    ]
    calls.unlink()
    subprocess.run(setup, env=env, check=True, capture_output=True, timeout=60)
    assert not calls.exists()  # set up already: no pip
    (venv / "cleanrlvr-requirements-cpu.sha256").write_text("another requirements file\n")
    subprocess.run(setup, env=env, check=True, capture_output=True, timeout=60)
    assert calls.read_text().splitlines()[0] == "install -q -r requirements-cpu.txt"
