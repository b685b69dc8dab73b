"""Copies stay in step by test, not by hope. Each script is read and copied alone, so the functions several scripts
need are written into each of them (CleanRL's rule). This test holds every top-level function and class that two or
more scripts define to one text: a fix made in one copy and not in the others fails here. The copies that differ on
purpose are listed with the reason, and where some of their copies still agree, which ones. A variant file (a base
plus one setting's machinery) shares every function with its base word for word but those listed, and its diff from
the base stays within a budget."""

import ast
import difflib
import functools
from pathlib import Path

import pytest

from conftest import ROOT

SCRIPTS = [
    "grpo_gsm8k.py",
    "grpo_gsm8k_lora_one_gpu.py",
    "reinforce_math_fsdp2.py",
    "pipeline_actor.py",
    "pipeline_learner.py",
    "eval.py",
]

GSM8K = ("grpo_gsm8k.py", "grpo_gsm8k_lora_one_gpu.py", "pipeline_actor.py")  # those that grade GSM8K the same way
TRAINERS = ("grpo_gsm8k.py", "grpo_gsm8k_lora_one_gpu.py", "reinforce_math_fsdp2.py", "pipeline_learner.py")
GRPO = ("grpo_gsm8k.py", "grpo_gsm8k_lora_one_gpu.py")  # a base and its variant: see VARIANTS
ON_POLICY = (*GRPO, "reinforce_math_fsdp2.py")  # the trainers that sample their own batches
DIFFER = {  # name: (why the copies differ, the groups of scripts whose copies must still be identical)
    "Args": ("each script's own flags", []),
    "check_args": ("each script's own flags", [GRPO]),
    "Sample": ("what each script keeps of a completion", []),
    "generate": ("each script asks the server for what it trains or evaluates on", []),
    "grade": ("GSM8K's answer, MATH's with a strict format, or either (eval.py's task)", [GSM8K]),
    "grade_batch": ("eval.py's grade takes the task and the strict format too", [(*GSM8K, "reinforce_math_fsdp2.py")]),
    "warm_up_grader": (
        "it grades its own task's example; the FSDP2 trainer's workers leave torchrun's process group",
        [GSM8K],
    ),
    "load_split": ("each task's dataset fields", [GSM8K]),
    "group_advantages": ("the actor grades one group at a time", [ON_POLICY]),
    "init_weight_sync": ("the pipeline learner joins several servers", [ON_POLICY]),
    "sampler_logprobs": ("the pipeline reads records, not samples", [ON_POLICY]),
    "push_weights": ("one model (LoRA: its merged base), a gathered FSDP2 model, or several servers", []),
    "policy_loss": ("GRPO's clipped loss, or the pipeline's off-policy corrections", []),
    "verify_weights": ("one server (LoRA: the merged base's names), or several", []),
    "evaluate": ("one process, or each rank its share with the counts summed over ranks", []),
    "write_rollouts": ("each task's fields, and the rank that sampled them", []),
    "save_checkpoint": ("one model (and its LoRA adapter), or the ranks' shards of an FSDP2 model", []),
    "Batch": ("the pipeline's records carry their group's verdict, and no per-sample token count", [ON_POLICY]),
    "make_batch": (
        "samples of whole groups, or the pipeline's records; GRPO's KL term (--beta) feeds zero advantages, REINFORCE "
        "has none",
        [GRPO],
    ),
    "log_metrics": ("the pipeline's text metrics (lag_hist) are printed, not sent to W&B", [ON_POLICY]),
    "update_policy": ("GRPO's loss, REINFORCE's over FSDP2's ranks, or the pipeline's off-policy one", [GRPO]),
    "step_metrics": ("one process's, or summed over the ranks", [GRPO]),
    "start_vllm_server": ("a server on its own GPU, one beside the trainer (sleep, LoRA), or eval's", []),
    "check_lengths": (
        "the completion budget's flag: --max-completion-tokens, eval.py's --max-tokens",
        [(*ON_POLICY, "pipeline_actor.py")],
    ),
    "to_problem": ("each task's rows and gold: GSM8K's, or MATH's", [GSM8K]),
    "load_problems": ("the evaluation set: --dataset's test split, or --eval-dataset's", [GRPO]),
    "load_trainer_state": (
        "one model's optimizer, each rank's shards of an FSDP2 model, or the pipeline learner's record counts "
        "(save_checkpoint's pair)",
        [GRPO],
    ),
    "main": (
        "each script's set-up and loop: one process, one GPU shared with vLLM, FSDP2's ranks, or the pipeline's actor "
        "and learner",
        [],
    ),
    "parse_args": (
        "with --resume a trainer takes its run's saved arguments; eval.py only the training run's system prompt; the "
        "scripts with --server-args read the command line through command_line",
        [GRPO, ("reinforce_math_fsdp2.py", "pipeline_learner.py")],
    ),
}


@functools.cache  # the scripts do not change during a test run: read them once
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


# A variant (CleanRL's ppo.py -> ppo_atari.py) is its base plus the machinery of one setting. Every function and class
# the two define is identical but those listed here, each with what the variant adds to it; and the variant's whole
# difference from its base stays within a stated number of changed lines, so that it cannot drift into a fork.
VARIANTS = {  # variant: (base, {name: what the variant adds}, the most lines `diff base variant` may show)
    "grpo_gsm8k_lora_one_gpu.py": (
        "grpo_gsm8k.py",
        {
            "Args": "the flags of LoRA, of the shared transport and of sleep mode",
            "push_weights": "the shared transport's push; LoRA: the merged base under its own names",
            "verify_weights": "LoRA: the merged base under its own names",
            "generate": "the adapter to sample with (--lora-sync adapter)",
            "evaluate": "the adapter to sample with (--lora-sync adapter)",
            "save_checkpoint": "LoRA: the adapter, and the merged policy for eval.py",
            "start_vllm_server": "one GPU: vLLM's share of it and sleep mode; LoRA: vLLM's LoRA for adapters",
            "main": "one GPU: vLLM asleep while the trainer updates; LoRA's model and push; the adapter to sample with",
        },
        # the shared transport, sleep mode and LoRA, with the flags and branches they add (573 lines), and room; 11
        # more for lora_merged's exact restore of the base (peft's unmerge does not give a bf16 base back); 4 for the
        # new version of sleep mode's re-push after a skipped step; 26 for the checkpoint transport, which the base
        # leaves to this file (a setting of its own: a server that cannot reach the trainer's ports); 4 for the server
        # check after the refusal of sleep mode on CPU (it needs torch); 1 for `import contextlib`, which the base no
        # longer needs since the server's own `launch` starts and stops it
        647,
    ),
    "grpo_gsm8k_python_tool.py": (
        "grpo_gsm8k.py",
        {
            "Args": "the tool's flags (--max-tool-calls, its limits, --tool-workers, --tool-unsafe)",
            "Batch": "which completion tokens are the model's (actions) and which the tool's",
            "make_batch": "the actions; only the model's tokens count as trained (the loss's divisor)",
            "update_policy": "the tool's tokens out of the loss, the logprob mismatch and the entropy",
            "generate": "each completion in turns (rollout), the tool's replies among its tokens",
            "evaluate": "with the tool; the share of answers that called it",
            "write_rollouts": "the transcript and every turn",
            "main": "the sandbox checked at start; the tool handed to generate and evaluate; its metrics logged",
        },
        # the turns, the tool and its sandbox, with the flags, metrics and docstrings they add (496 lines), and room
        600,
    ),
    "distill_gsm8k.py": (
        "grpo_gsm8k.py",
        {
            "Args": "the teacher's flags and --reward-weight; no dynamic sampling (every group is scored)",
            "Sample": "the teacher's logprob of each completion token",
            "make_batch": "every sample is fed: each token has the teacher's score",
            "update_policy": "each token's advantage from the teacher's logprobs and pi_old's; the reverse KL",
            "start_vllm_server": "the model, URL, GPU and flags of either server: the student's and the teacher's",
            "command_line": "--teacher-server-args glued like --server-args",
            "check_args": "--reward-weight needs groups; the teacher's URL is not the student's",
            "main": "the teacher: its tokenizer checked, its server started, its scores; one round of sampling a step",
        },
        # the teacher's route, flags, advantage and metrics, and the docstring that teaches them (301 lines), and room
        400,
    ),
}


def definitions(script: str) -> dict[str, str]:
    """{name: source} of every top-level function and class of `script`."""
    src = Path(ROOT, script).read_text()
    return {
        node.name: ast.get_source_segment(src, node)
        for node in ast.parse(src).body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_variant_shares_its_bases_functions_word_for_word(variant):
    base, differ, _ = VARIANTS[variant]
    ours, theirs = definitions(variant), definitions(base)
    shared = ours.keys() & theirs.keys()
    assert {"policy_loss", "update_policy", "grade", "init_weight_sync"} <= shared  # the scan works
    assert set(differ) <= shared, f"listed as differing but not shared: {set(differ) - shared}"
    for name in sorted(shared - set(differ)):
        assert ours[name] == theirs[name], (
            f"{name} differs between {base} and {variant}: make them identical, or list it"
        )
    for name in differ:
        assert ours[name] != theirs[name], f"{name} is listed as differing but is identical: drop it from the list"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_variants_diff_from_its_base_stays_within_its_budget(variant):
    base, _, budget = VARIANTS[variant]
    a = Path(ROOT, base).read_text().splitlines()
    b = Path(ROOT, variant).read_text().splitlines()
    changed = [line for line in difflib.unified_diff(a, b, lineterm="", n=0) if line[:1] in "+-"]
    changed = [line for line in changed if not line.startswith(("+++", "---"))]
    print(f"diff {base} {variant}: {len(changed)} lines changed (budget {budget})")
    assert changed, "a variant identical to its base"
    assert len(changed) <= budget, f"{variant} differs from {base} by {len(changed)} lines, over its budget {budget}"
