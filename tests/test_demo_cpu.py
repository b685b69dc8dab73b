"""SCRIPT, the newcomer's first command, run as a newcomer runs it: set-up (a no-op here: the venv exists), the toy
model, the GRPO script with --start-server on CPU for 30 steps, the chart and the verdict. A copy of the demo is
tested by changing SCRIPT."""

import os
import re
import subprocess
import sys

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


def test_demo_fails_on_a_flat_line(tmp_path):
    """A policy that does not learn (learning rate 0) is never shown as a success."""
    r = run_demo(tmp_path / "demo", "--train-steps", "8", "--learning-rate", "0", timeout=600)
    assert r.returncode == 1 and "NOT LEARNED" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
