"""The sampler's policy check (--max-logprob-mismatch) of every training script: its copies are identical, its limits
follow the dtypes, it stops what it must and lets the rest pass, and a negative limit is refused before any heavy
import. The end-to-end stops (a server whose weights change behind the trainer's back) are in each script's tests."""

import ast
import math
import os
import subprocess
from pathlib import Path

import pytest

from conftest import PY, ROOT, import_script, stopped_by_the_check

SCRIPTS = ["grpo_gsm8k.py", "grpo_gsm8k_lora_one_gpu.py", "reinforce_math_fsdp2.py", "pipeline_learner.py"]
COPIED = ("MISMATCH_LIMITS", "logprob_mismatch_limit", "check_logprob_mismatch")


def copies(script: str) -> dict[str, str]:
    """The source of the check's definitions in `script`, and of its flag (the Args field and its docstring)."""
    src = Path(ROOT, script).read_text()
    tree = ast.parse(src)
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in COPIED:
            out[node.name] = ast.get_source_segment(src, node)
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) in COPIED for t in node.targets):
            out[node.targets[0].id] = ast.get_source_segment(src, node)
        if isinstance(node, ast.ClassDef) and node.name == "Args":
            body = node.body
            for field, doc in zip(body, body[1:], strict=False):
                if isinstance(field, ast.AnnAssign) and field.target.id == "max_logprob_mismatch":
                    out["flag"] = ast.get_source_segment(src, field) + ast.get_source_segment(src, doc)
    return out


def test_the_copies_are_identical():
    found = [copies(script) for script in SCRIPTS]
    assert sorted(found[0]) == sorted([*COPIED, "flag"]), found[0].keys()
    assert all(f == found[0] for f in found[1:])


@pytest.mark.parametrize("script", SCRIPTS)
def test_limits_and_verdicts(script):
    m = import_script(script)
    assert m.logprob_mismatch_limit(None, ["float32", "float32"]) == 1e-3
    assert m.logprob_mismatch_limit(None, ["float32", "bfloat16"]) == 0.1  # one bf16 end: a bf16 run
    assert m.logprob_mismatch_limit(None, ["bfloat16", "float32"]) == 0.1
    assert m.logprob_mismatch_limit(None, ["float16", "float32"]) == 0.1
    assert m.logprob_mismatch_limit(0.0, ["float32"]) == 0.0 and m.logprob_mismatch_limit(0.5, ["bfloat16"]) == 0.5
    for passes in [(5e-4, 1e-3), (1e-3, 1e-3), (math.nan, 1e-3), (7.0, 0.0)]:  # below, at, no token, check off
        m.check_logprob_mismatch(*passes, step=3, version=2, transport="collective")
    with pytest.raises(RuntimeError) as e:
        m.check_logprob_mismatch(0.3205, 1e-3, step=3, version=2, transport="shared")
    assert stopped_by_the_check(f"RuntimeError: {e.value}") == (3, 2, "shared", 0.3205, 1e-3)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_negative_limit_is_refused(script, tmp_path):
    r = subprocess.run(
        [PY, os.path.join(ROOT, script), "--max-logprob-mismatch", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert r.returncode != 0 and "--max-logprob-mismatch must be >= 0 (0: no check), got -1.0" in r.stderr, r.stderr
