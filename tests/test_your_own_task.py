"""docs/your_own_task.md: Countdown in place of GSM8K (and of MATH) by rewriting a script's TASK section alone. Its
diffs are applied to copies of the scripts; each copy must differ from its script inside the TASK section only, grade
known Countdown completions right, refuse a bad row by file and line, and train end to end on the tiny model."""

import difflib
import importlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import GRADE_WORKERS, PY, ROOT, metrics_of, read_jsonl, run_ok

DOCS = os.path.join(ROOT, "docs")
DIFFS = {  # script -> the diff of docs/ that swaps its task for Countdown
    "grpo_gsm8k.py": "your_own_task.diff",
    "pipeline_actor.py": "your_own_task.diff",  # the same TASK section as grpo_gsm8k.py's: the same diff applies
    "reinforce_math_fsdp2.py": "your_own_task_math.diff",
}
TORCHRUN = os.path.join(os.path.dirname(PY), "torchrun")


def patched(script: str, folder) -> str:
    """A copy of `script` in `folder` with its diff applied by `patch`, as the doc tells a reader to do."""
    os.makedirs(folder, exist_ok=True)
    copy = os.path.join(folder, script)
    shutil.copy(os.path.join(ROOT, script), copy)
    diff = os.path.join(DOCS, DIFFS[script])
    r = subprocess.run(["patch", "--no-backup-if-mismatch", copy, diff], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return copy


def task_section(lines: list[str]) -> range:
    """The lines of the TASK section: from its `# TASK` comment to the line before `def main(`."""
    start = next(i for i, line in enumerate(lines) if line.startswith("# TASK"))
    end = next(i for i, line in enumerate(lines) if line.startswith("def main("))
    assert start < end
    return range(start, end)


def load(path: str):
    """The module of the script copy at `path`, importable by name (the grading pool's spawned workers import it)."""
    folder, name = os.path.split(path)
    name = f"countdown_{os.path.basename(folder)}_{name.removesuffix('.py')}"
    shutil.copy(path, os.path.join(folder, name + ".py"))
    sys.path.insert(0, folder)
    return importlib.import_module(name)


def countdown_data(folder, train: int = 64, test: int = 8) -> str:
    """A Countdown data folder as the doc makes it: rows {nums, target}, three numbers each, target (a + b) * c."""
    rng = random.Random(0)
    os.makedirs(folder, exist_ok=True)
    for split, n in (("train", train), ("test", test)):
        with open(os.path.join(folder, f"{split}.jsonl"), "w") as f:
            for _ in range(n):
                a, b, c = (rng.randint(1, 12) for _ in range(3))
                f.write(json.dumps({"nums": [a, b, c], "target": (a + b) * c}) + "\n")
    return str(folder)


def test_the_doc_shows_the_whole_diff():
    doc = Path(DOCS, "your_own_task.md").read_text()
    shown = re.search(r"```diff\n(.*?)```", doc, re.S)[1]
    assert shown == Path(DOCS, "your_own_task.diff").read_text()


@pytest.mark.parametrize("script", sorted(DIFFS))
def test_the_diff_changes_the_task_section_alone(script, tmp_path):
    old = Path(ROOT, script).read_text().splitlines()
    new = Path(patched(script, tmp_path)).read_text().splitlines()
    section = task_section(old)
    changed = [
        (i1, i2)
        for tag, i1, i2, _, _ in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes()
        if tag != "equal"
    ]
    assert changed, "the diff changed nothing"
    outside = [old[i1:i2] or new for i1, i2 in changed if not (section.start <= i1 and i2 <= section.stop)]
    assert not outside, f"{script}: the diff changes lines outside the TASK section: {outside[:2]}"
    assert new[task_section(new).start].startswith("# TASK: Countdown")


@pytest.mark.parametrize("script", sorted(DIFFS))
def test_the_copy_grades_countdown(script, tmp_path):
    """Known completions against a hand-checked verdict: right equations (LaTeX operators, an `= 24` tail), a wrong
    value, a number used twice or left out, no box, and what is not an equation (a power, a call, a division by 0)."""
    m = load(patched(script, tmp_path))
    think = "<think>8 times 3.</think> " if script == "reinforce_math_fsdp2.py" else ""  # its grade's strict format
    prompt, gold = m.to_problem({"nums": [3, 5, 3], "target": 24})
    assert "3, 5, 3" in prompt and "24" in prompt and json.loads(gold) == {"nums": [3, 5, 3], "target": 24}
    cases = {
        "So \\boxed{(3 + 5) * 3}.": (1.0, True, False),
        "\\boxed{(5 + 3) \\times 3 = 24}": (1.0, True, False),
        "\\boxed{3 * (3 + 5)}": (1.0, True, False),
        "\\boxed{3 * 5 + 3}": (0.0, False, False),  # 18
        "\\boxed{(3 + 5) * 3 * 1}": (0.0, False, False),  # a number that is not given
        "\\boxed{(3 + 5) * 3 + 3 - 3}": (0.0, False, False),  # numbers used twice
        "\\boxed{8 * 3}": (0.0, False, False),  # 24, but not from the numbers
        "The answer is 24.": (0.0, False, True),
        "\\boxed{3 ** 5}": (0.0, False, True),
        "\\boxed{__import__('os').getcwd()}": (0.0, False, True),
        "\\boxed{3 / (5 - 5)}": (0.0, False, True),
    }
    cases = {think + completion: want for completion, want in cases.items()}
    if think:  # the answer outside the think block's format
        cases["\\boxed{(3 + 5) * 3}"] = (0.0, False, True)
    for completion, want in cases.items():
        assert tuple(m.grade(completion, gold)) == want, completion
    grades = m.grade_batch(list(cases), [gold] * len(cases), timeout_s=5.0, workers=1)  # the pool, its warm-up too
    m.stop_graders()
    assert [tuple(g) for g in grades] == list(cases.values())


def test_a_bad_countdown_row_is_named_by_file_and_line(tmp_path):
    """The copy's to_problem refuses a row (a target as a string): one line FILE:LINE: message, exit 2, before any
    work (no server is running at that port)."""
    data = countdown_data(tmp_path / "data")
    with open(os.path.join(data, "train.jsonl"), "a") as f:
        f.write(json.dumps({"nums": [1, 2], "target": "3"}) + "\n")
    copy = patched("grpo_gsm8k.py", tmp_path / "copy")
    r = subprocess.run([PY, copy, "--dataset", data, "--vllm-port", "9"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == f"{data}/train.jsonl:65: 'target' is not an integer: '3'"


COMMON = ("--max-completion-tokens", "16", "--rollouts-per-update", "4", "--group-size", "4", "--learning-rate", "3e-3")
COMMON += ("--system-prompt", "", "--eval-every", "2", "--eval-limit", "4", *GRADE_WORKERS)


def assert_trained_on_countdown(metrics: list[dict], rollouts: list[dict], samples: int) -> None:
    """Two steps logged, every rollout a Countdown problem with its JSON gold, graded by the copy's grade."""
    assert len([m for m in metrics if "reward" in m]) == 2, metrics
    assert len(rollouts) == samples and all(r["prompt"].startswith("Using the numbers") for r in rollouts)
    assert all(set(json.loads(r["gold"])) == {"nums", "target"} for r in rollouts)
    assert all(r["parse_error"] for r in rollouts if "\\boxed{" not in r["completion"])


def test_the_grpo_copy_trains_on_countdown(toy, tmp_path):
    copy = patched("grpo_gsm8k.py", tmp_path / "copy")
    data = countdown_data(tmp_path / "data")
    cmd = [PY, copy, "--model", toy.model, "--dataset", data, "--vllm-port", toy.url.rsplit(":", 1)[1], *COMMON]
    cmd += ["--train-steps", "2", "--checkpoint-dir", "ckpt", "--rollout-log", "rollouts.jsonl"]
    out = run_ok(cmd, cwd=tmp_path, timeout=600).stdout
    assert_trained_on_countdown(metrics_of(out), read_jsonl(tmp_path / "rollouts.jsonl"), 2 * 16)
    assert "eval/accuracy" in out and (tmp_path / "ckpt" / "step_2" / "trainer_state.pt").is_file()


def test_the_reinforce_copy_trains_on_countdown(toy, tmp_path):
    """The FSDP2 copy under torchrun, 2 ranks (gloo), 2 steps on Countdown, its TASK in the strict format."""
    copy = patched("reinforce_math_fsdp2.py", tmp_path / "copy")
    data = countdown_data(tmp_path / "data")
    cmd = [TORCHRUN, "--nproc_per_node=2", copy, "--model", toy.model, "--dataset", data, "--eval-dataset", data]
    cmd += ["--vllm-port", toy.url.rsplit(":", 1)[1], *COMMON, "--param-dtype", "float32"]
    cmd += ["--train-steps", "2", "--rollouts-per-update", "2", "--rank0-only-output", "--save-every", "2"]
    out = run_ok(cmd, cwd=tmp_path, timeout=900).stdout
    rollouts = [r for rank in (0, 1) for r in read_jsonl(tmp_path / f"fsdp2_math_rollouts.rank{rank}.jsonl")]
    assert_trained_on_countdown(metrics_of(out), rollouts, 2 * 2 * 2 * 4)
