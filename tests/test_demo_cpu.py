"""demo_cpu.sh, the newcomer's first command, run as a newcomer runs it: set-up (a no-op here: the venv exists),
the toy model, grpo_gsm8k.py --start-server on CPU for 30 steps, the chart and the verdict."""

import json
import os
import re
import subprocess
import sys

from conftest import ROOT, free_port

SCRIPT = "demo_cpu.sh"


def test_demo_learns_and_says_where_its_files_are(tmp_path):
    venv = os.path.dirname(os.path.dirname(sys.executable))  # the venv running the tests: set-up finds it ready
    env = {**os.environ, "VENV": venv, "DEMO_DIR": str(tmp_path / "demo")}
    r = subprocess.run(
        ["bash", os.path.join(ROOT, SCRIPT), "--vllm-port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    chart = re.findall(r"^\s*(\d+)\s+(\d\.\d\d) \|#*$", r.stdout, re.M)
    assert [int(step) for step, _ in chart] == list(range(1, 31)), r.stdout
    assert "it learned" in r.stdout and "NOT LEARNED" not in r.stdout
    rewards = [float(x) for _, x in chart]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:3]) / 3 + 0.3  # what the verdict says is what the chart shows
    rollouts = [json.loads(x) for x in open(tmp_path / "demo" / "rollouts.jsonl")]
    assert len(rollouts) == 30 * 64 and f"{tmp_path}/demo/rollouts.jsonl" in r.stdout
    assert os.path.exists(tmp_path / "demo" / "checkpoints" / "step_30" / "model.safetensors")
    assert "demo/checkpoints/step_30" in r.stdout


def test_demo_fails_on_a_flat_line(tmp_path):
    """A policy that does not learn (learning rate 0) is never shown as a success."""
    venv = os.path.dirname(os.path.dirname(sys.executable))
    env = {**os.environ, "VENV": venv, "DEMO_DIR": str(tmp_path / "demo")}
    r = subprocess.run(
        [
            "bash",
            os.path.join(ROOT, SCRIPT),
            "--vllm-port",
            str(free_port()),
            "--train-steps",
            "8",
            "--learning-rate",
            "0",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 1 and "NOT LEARNED" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
