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
    m = import_script("grpo_gsm8k.py")
    problem, gold = ("question", "answer") if folder.endswith("gsm8k") else ("problem", "solution")
    train = read_jsonl(os.path.join(FIXTURES, folder, "train.jsonl"))
    test = read_jsonl(os.path.join(FIXTURES, folder, "test.jsonl"))
    assert (len(train), len(test)) == (96, 32)
    assert not {r[problem] for r in train} & {r[problem] for r in test}
    for row in train + test:
        assert m.row_problem(row, problem, gold) is None
        if problem == "question":  # GSM8K: the number after ####
            assert m.gold_problem(row["answer"]) is None
            answer = row["answer"].split("####")[-1].strip()
        else:  # MATH: the solution's box, which is also the row's answer
            answer = m.last_boxed(row["solution"])
            assert answer == row["answer"]
        assert m.grade(f"The answer is \\boxed{{{answer}}}.", answer).correct
        assert not m.grade(f"The answer is \\boxed{{{int(answer) + 1}}}.", answer).correct
