"""Kill it anywhere: a save cut short at any moment leaves a complete checkpoint or none (the real save_checkpoint of
each script, SIGKILLed at random moments while it saves), and a bad data row is refused before any work, named by
its file and line. Preemption (SIGTERM, then --resume) is tested end to end beside each script's resume test."""

import json
import multiprocessing as mp
import os
import random
import signal
import subprocess
import time

import pytest
import torch

from conftest import FIXTURES, PY, ROOT, free_port, import_script, read_jsonl

# ---------------------------------------------------------------------------------------------------
# a save killed at random moments


def save_forever(script: str, checkpoint_dir: str, model, tokenizer, optimizer) -> None:
    """A forked child: what a run does at every step's end, as fast as it can: save step N + 1 after the newest
    complete step N, then prune to the newest 2. It never returns: the test kills it."""
    torch.set_num_threads(1)  # (forked: no thread pool of the parent's is used)
    m = import_script(script)
    while True:
        steps = m.checkpoint_steps(checkpoint_dir)
        step = (steps[-1] if steps else 0) + 1
        path = os.path.join(checkpoint_dir, f"step_{step}")
        counters = {"step": step, "version": step, "skipped": 0, "data_pos": step, "wandb_id": None}
        if script == "grpo_gsm8k_lora_one_gpu.py":  # (the variant's save takes the LoRA model: None without LoRA)
            m.save_checkpoint(path, model, None, tokenizer, optimizer, counters, {"seed": 1})
        else:
            m.save_checkpoint(path, model, tokenizer, optimizer, counters, {"seed": 1})
        m.prune_checkpoints(checkpoint_dir, 2)


@pytest.mark.parametrize("script", ["grpo_gsm8k.py", "grpo_gsm8k_lora_one_gpu.py", "pipeline_learner.py"])
def test_a_save_killed_at_any_moment_leaves_a_complete_checkpoint(script, toy_model, tmp_path):
    """24 SIGKILLs at random moments of a loop of saves of the toy model (most land inside a save: they leave its
    .tmp folder). After each, the newest checkpoint checkpoint_steps offers loads (the model in transformers, the
    trainer state) and holds the weights saved; once a checkpoint exists one always does (pruning keeps the newest);
    and the next save of a step whose save was cut short succeeds."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    # no progress bars: tqdm's lock is a semaphore the forked children share, and one killed holding it would keep it
    transformers_logging.disable_progress_bar()
    m = import_script(script)
    model = AutoModelForCausalLM.from_pretrained(toy_model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(toy_model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()  # (an optimizer with state to save)
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    checkpoint_dir = str(tmp_path / "ckpt")
    os.makedirs(checkpoint_dir)
    rng = random.Random(0)
    mid_save = 0  # kills that left a save's .tmp behind
    complete = False  # a complete checkpoint was seen (how soon the first one is saved depends on the machine's load)
    for kill in range(24):
        child = mp.get_context("fork").Process(
            target=save_forever, args=(script, checkpoint_dir, model, tokenizer, optimizer)
        )
        child.start()
        time.sleep(rng.uniform(0.05, 0.6))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        mid_save += any(name.endswith(".tmp") for name in os.listdir(checkpoint_dir))
        steps = m.checkpoint_steps(checkpoint_dir)
        assert steps or not complete, f"no complete checkpoint left after kill {kill + 1}: {os.listdir(checkpoint_dir)}"
        complete = complete or bool(steps)
        if steps:
            newest = os.path.join(checkpoint_dir, f"step_{steps[-1]}")
            loaded = AutoModelForCausalLM.from_pretrained(newest, dtype=torch.float32).state_dict()
            assert all(torch.equal(loaded[k], expected[k]) for k in loaded), newest
            state = torch.load(os.path.join(newest, m.TRAINER_STATE), weights_only=False)
            assert state["step"] == steps[-1]
    assert mid_save >= 8, f"only {mid_save} of 24 kills landed inside a save"
    assert len(m.checkpoint_steps(checkpoint_dir)) >= 1


# ---------------------------------------------------------------------------------------------------
# bad data, refused at load

GSM8K_ROW = {"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"}
BAD_ROWS = [  # line 3 of the training file, and what the refusal says of it
    ('{"question": "What is 1 + 1?", "answer": ', "not JSON (Expecting value, column 42)"),
    ("[1, 2]", "not a JSON object but list"),
    ('{"question": "What is 1 + 1?"}', "no 'answer' field"),
    ('{"question": "What is 1 + 1?", "answer": 2}', "'answer' is not a string but int"),
    ('{"question": " \\n ", "answer": "#### 2"}', "'question' is empty"),
    ('{"question": "What is 1 + 1?", "answer": "#### two"}', "'answer' ends in no number ('#### 42'): 'two'"),
]
SCRIPTS = {  # script: (its flags besides --dataset: nothing it could reach, nothing it could load)
    "grpo_gsm8k.py": lambda: ["--model", "/nonexistent/model", "--vllm-port", str(free_port())],
    "grpo_gsm8k_lora_one_gpu.py": lambda: ["--model", "/nonexistent/model", "--vllm-port", str(free_port())],
    "eval.py": lambda: ["--model", "/nonexistent/model", "--vllm-port", str(free_port())],
    "pipeline_actor.py": lambda: [
        "--redis-url",
        f"redis://127.0.0.1:{free_port()}/0",
        "--vllm-urls",
        f"http://127.0.0.1:{free_port()}",
    ],
    # (its evaluation set: the same folder, named from the test's working directory)
    "reinforce_math_fsdp2.py": lambda: [
        "--model",
        "/nonexistent/model",
        "--vllm-port",
        str(free_port()),
        "--eval-dataset",
        "data",
    ],
}
MATH_ROW = {"problem": "What is 2 + 2?", "solution": "We add: $2 + 2 = \\boxed{4}$."}
SCHEMAS = {  # script: its good row, its names of BAD_ROWS' fields, and its words where they differ (default: GSM8K's)
    "reinforce_math_fsdp2.py": (
        MATH_ROW,
        {"question": "problem", "answer": "solution"},
        {
            "not JSON (Expecting value, column 42)": "not JSON (Expecting value, column 43)",
            "'answer' ends in no number ('#### 42'): 'two'": "'solution' has no \\boxed{} answer",
        },
    ),
}
SPLITS = {"eval.py": "test"}  # script: the split its bad row is put in, where it is not "train" (eval reads no other)


def _imported(stderr: str) -> set:
    return {x.split("|")[-1].strip().split(".")[0] for x in stderr.splitlines() if x.startswith("import time:")}


@pytest.mark.parametrize("line,said", BAD_ROWS, ids=[said.split(" (")[0] for _, said in BAD_ROWS])
@pytest.mark.parametrize("script", SCRIPTS)
def test_a_bad_row_is_refused_by_file_and_line_before_any_work(script, line, said, tmp_path):
    """Line 3 of the training file (eval.py: of the test file) is bad: the script ends with exit status 2 and one
    line, `FILE:3: what is wrong`, no traceback, before torch is imported (no model loaded, no server asked). A script
    of another schema (SCHEMAS) gets the same rows with its own field names."""
    data = tmp_path / "data"
    data.mkdir()
    split = SPLITS.get(script, "train")
    good, names, words = SCHEMAS.get(script, (GSM8K_ROW, {}, {}))
    said = words.get(said, said)
    for gsm8k, ours in names.items():
        line, said = line.replace(f'"{gsm8k}"', f'"{ours}"'), said.replace(f"'{gsm8k}'", f"'{ours}'")
    rows = [json.dumps(good), json.dumps(good), line, json.dumps(good)]
    for name in ("train", "test"):  # the other split: good rows
        (data / f"{name}.jsonl").write_text("\n".join(rows if name == split else [json.dumps(good)]) + "\n")
    cmd = [PY, "-X", "importtime", os.path.join(ROOT, script), "--dataset", str(data), *SCRIPTS[script]()]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    lines = [x for x in (r.stdout + r.stderr).splitlines() if not x.startswith("import time:")]
    assert r.returncode == 2 and lines[-1] == f"{data / f'{split}.jsonl'}:3: {said}", lines[-5:]
    assert "Traceback" not in r.stderr and "torch" not in _imported(r.stderr)


def test_the_fixtures_and_the_real_gsm8k_pass_the_checks():
    """Every row of the GSM8K-schema fixtures, and of the real GSM8K test set where ../shared/data has it, passes."""
    m = import_script("grpo_gsm8k.py")
    files = [
        os.path.join(FIXTURES, d, f)
        for d in os.listdir(FIXTURES)
        if d.startswith("gsm8k")
        for f in ("train.jsonl", "test.jsonl")
    ]
    real = os.path.join(os.path.dirname(ROOT), "shared", "data", "gsm8k_test.jsonl")
    files += [real] if os.path.isfile(real) else []
    for file in files:
        if os.path.isfile(file):
            for r in read_jsonl(file):
                prompt, gold = m.to_problem(r)  # a ValueError fails the test, naming the row
                assert prompt == r["question"] and gold == r["answer"].split("####")[-1].strip().replace(",", ""), r
