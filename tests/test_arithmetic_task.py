"""The arithmetic task's data (tests/fixtures/make_arithmetic.py): what is committed is what the script writes, the
held-out problems are not training problems, and every row passes the scripts' data checks and grades its own answer
as correct."""

import filecmp
import os
import subprocess

import pytest

from conftest import FIXTURES, PY, import_script, read_jsonl

FOLDERS = [f"arithmetic_{tier}_{schema}" for tier in ("one_digit", "harder") for schema in ("gsm8k", "math")]


def test_the_committed_files_are_what_the_generator_writes(tmp_path):
    subprocess.run([PY, os.path.join(FIXTURES, "make_arithmetic.py"), "--out", str(tmp_path)], check=True, timeout=60)
    for folder in FOLDERS:
        for split in ("train.jsonl", "test.jsonl"):
            assert filecmp.cmp(tmp_path / folder / split, os.path.join(FIXTURES, folder, split), shallow=False)


@pytest.mark.parametrize("folder", FOLDERS)
def test_held_out_problems_are_disjoint_and_every_row_grades_its_own_answer(folder):
    """Each folder through the to_problem and grade of the trainer of its schema: GSM8K's (grpo_gsm8k.py: the gold is
    the number after ####) or MATH's (reinforce_math_fsdp2.py: the solution's box, which is also the row's answer)."""
    m = import_script("grpo_gsm8k.py" if folder.endswith("gsm8k") else "reinforce_math_fsdp2.py")
    train = read_jsonl(os.path.join(FIXTURES, folder, "train.jsonl"))
    test = read_jsonl(os.path.join(FIXTURES, folder, "test.jsonl"))
    assert (len(train), len(test)) == (96, 32)
    assert not {m.to_problem(r)[0] for r in train} & {m.to_problem(r)[0] for r in test}
    for row in train + test:
        _, gold = m.to_problem(row)  # the row passes the script's data checks
        if folder.endswith("gsm8k"):
            assert gold == row["answer"].split("####")[-1].strip()
        else:
            assert gold == m.last_boxed(row["solution"]) == row["answer"]
        # (a think block: MATH's trainer grades the strict format by default; GSM8K's reads the last box alone)
        assert m.grade(f"<think>Add them.</think> The answer is \\boxed{{{gold}}}.", gold).correct
        assert not m.grade(f"<think>Add them.</think> The answer is \\boxed{{{int(gold) + 1}}}.", gold).correct
