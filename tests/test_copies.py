"""Copies stay in step by test, not by hope. Each script is read and copied alone, so the functions several scripts
need are written into each of them (CleanRL's rule). This test holds every top-level function and class that two or
more scripts define to one text: a fix made in one copy and not in the others fails here. The copies that differ on
purpose are listed with the reason, and where some of their copies still agree, which ones."""

import ast
from pathlib import Path

import pytest

from conftest import ROOT

SCRIPTS = ["grpo_gsm8k.py", "reinforce_math_fsdp2.py", "pipeline_actor.py", "pipeline_learner.py", "eval.py"]

GSM8K = ("grpo_gsm8k.py", "pipeline_actor.py")  # the two that grade GSM8K the same way
TRAINERS = ("grpo_gsm8k.py", "reinforce_math_fsdp2.py", "pipeline_learner.py")
ON_POLICY = ("grpo_gsm8k.py", "reinforce_math_fsdp2.py")  # the trainers that sample their own batches
DIFFER = {  # name: (why the copies differ, the groups of scripts whose copies must still be identical)
    "Args": ("each script's own flags", []),
    "Sample": ("what each script keeps of a completion", []),
    "generate": ("each script asks the server for what it trains or evaluates on", []),
    "grade": ("GSM8K's answer, MATH's with a strict format, or either (eval.py's task)", [GSM8K]),
    "grade_batch": ("it calls its own script's grade", [GSM8K]),
    "warm_up_grader": ("it grades its own task's example", [GSM8K]),
    "load_split": ("each task's dataset fields", [GSM8K]),
    "group_advantages": ("the actor grades one group at a time", [("grpo_gsm8k.py", "reinforce_math_fsdp2.py")]),
    "init_weight_sync": ("the pipeline learner joins several servers", [("grpo_gsm8k.py", "reinforce_math_fsdp2.py")]),
    "sampler_logprobs": ("the pipeline reads records, not samples", [("grpo_gsm8k.py", "reinforce_math_fsdp2.py")]),
    "push_weights": ("one model, a gathered FSDP2 model, or several servers", []),
    "policy_loss": ("GRPO's clipped loss, or the pipeline's off-policy corrections", []),
    "verify_weights": ("one server, or several", []),
    "evaluate": ("one process, or each rank its share with the counts summed over ranks", []),
    "write_rollouts": ("each task's fields, and the rank that sampled them", []),
    "save_checkpoint": ("one model (and its LoRA adapter), or the ranks' shards of an FSDP2 model", []),
    "start_vllm_server": ("a trainer's server sleeps and syncs; eval's only generates", []),
    "Batch": ("the pipeline's records carry their group's verdict, and no per-sample token count", [ON_POLICY]),
    "make_batch": ("samples of whole groups, or the pipeline's records", [ON_POLICY]),
    "log_metrics": ("the pipeline's text metrics (lag_hist) are printed, not sent to W&B", [ON_POLICY]),
    "update_policy": ("GRPO's loss, REINFORCE's over FSDP2's ranks, or the pipeline's off-policy one", []),
    "step_metrics": ("one process's, or summed over the ranks", []),
    "parse_args": (
        "with --resume a trainer takes its run's saved arguments; eval.py only the training run's system prompt",
        [TRAINERS],
    ),
}


def copies() -> dict[str, dict[str, str]]:
    """{name: {script: source}} of every top-level function and class defined in two scripts or more."""
    found = {}
    for script in SCRIPTS:
        src = Path(ROOT, script).read_text()
        for node in ast.parse(src).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.setdefault(node.name, {})[script] = ast.get_source_segment(src, node)
    return {name: by_script for name, by_script in found.items() if len(by_script) > 1}


def test_shared_functions_are_identical_in_every_script():
    found = copies()
    assert {"grade", "post", "token_logprobs", "normalize_answer", "last_boxed"} <= found.keys()  # the scan works
    for name, by_script in sorted(found.items()):
        if name in DIFFER:
            continue
        texts = {text: script for script, text in by_script.items()}
        assert len(texts) == 1, f"{name} differs between {sorted(by_script)}: make the copies identical, or list it"


@pytest.mark.parametrize("name", sorted(DIFFER))
def test_copies_that_differ_on_purpose(name):
    found = copies()
    assert name in found, f"{name} is listed as differing but no longer shared: drop it from DIFFER"
    _why, groups = DIFFER[name]
    for group in groups:
        texts = {found[name][script] for script in group}
        assert len(texts) == 1, f"{name} must be identical in {group}"
