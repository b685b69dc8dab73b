"""Every row of the real GSM8K test set and of MATH-500, loaded through each script's own loader and gold, graded
against its own answer written in a box: every one must be correct (a row that is not is a false reject of the
grader). The data lives beside the repository in ../shared/data (never copied into it); without it these tests skip.
Grading goes through each script's grade_batch (2 workers): a few seconds per pass over a whole set.
"""

from pathlib import Path

import pytest

from conftest import ROOT, import_script, read_jsonl

SCRIPTS = ["grpo_gsm8k.py", "pipeline_actor.py", "eval.py"]  # the scripts that grade GSM8K, each checked alone
EVAL = "eval.py"  # its loader and grader take the task: it grades MATH-500 too
MATH_TRAINER = "reinforce_math_fsdp2.py"  # the script that trains on MATH (its gold: a solution's box)
DATA = Path(ROOT).parent / "shared" / "data"
GSM8K = DATA / "gsm8k_test.jsonl"
MATH500 = DATA / "math500_test.jsonl"


def _need(path: Path):
    if not path.is_file():
        pytest.skip(
            f"{path} is absent: the real GSM8K / MATH-500 test sets live in ../shared/data beside the repository"
        )


def _as_test_split(path: Path, tmp_path: Path) -> str:
    """A directory holding the file as test.jsonl (a symlink), the layout every script's loader takes."""
    (tmp_path / "test.jsonl").symlink_to(path)
    return str(tmp_path)


def _rejects(grades, comps, golds):
    return [
        (i, comps[i][-80:], golds[i][-80:], tuple(g))
        for i, g in enumerate(grades)
        if not (g.correct and not g.parse_error)
    ]


def _gsm8k_forms(number: str) -> dict:
    """The answer after '####' as a model might box it: as GSM8K writes it, with thousands separators, and with
    thousands separators and a unit word."""
    n = int(number.replace(",", ""))  # every GSM8K test answer is an integer (checked below)
    return {
        "plain": f"So the answer is $\\boxed{{{number}}}$.",
        "separators": f"The answer is $\\boxed{{{n:,}}}$.",
        "separators+unit": f"So the total is $\\boxed{{{n:,} dollars}}$.",
    }


@pytest.mark.parametrize("script", SCRIPTS)
def test_gsm8k_every_row(script, tmp_path):
    _need(GSM8K)
    m = import_script(script)
    directory = _as_test_split(GSM8K, tmp_path)
    if script == EVAL:
        rows = m.load_split(directory, "test", "gsm8k")
        assert all(set(r) >= {"question", "answer"} for r in rows)
        golds = [r["answer"] for r in rows]  # the raw field, as eval.py hands it to grade_batch
    else:  # to_problem's (prompt, gold): the question, and the number after '####'
        problems = m.load_split(directory, "test")
        assert [prompt for prompt, _ in problems] == [r["question"] for r in read_jsonl(GSM8K)]
        golds = [gold for _, gold in problems]
    assert len(golds) == 1319
    numbers = [g.split("####")[-1].strip() for g in golds]
    assert all(n.replace(",", "").lstrip("-").isdigit() for n in numbers)
    if script == EVAL:  # its own gold extraction agrees with the '####' number
        assert [m.gold_answer(g, "gsm8k") for g in golds] == [n.replace(",", "") for n in numbers]
    kw = {"task": "gsm8k"} if script == EVAL else {}
    for form in ("plain", "separators", "separators+unit"):
        comps = [_gsm8k_forms(n)[form] for n in numbers]
        grades = m.grade_batch(comps, golds, timeout_s=5.0, **kw)
        assert _rejects(grades, comps, golds) == [], form


def test_math500_every_row_reinforce(tmp_path):
    """MATH_TRAINER's gold is the last box of a row's `solution` (to_problem's): a strict completion boxing it, or the
    row's separate `answer` field (the same answer, often written differently), is correct against it; so is the box
    against the whole solution (which grade also takes) and against the bare `answer` as gold, where no extraction can
    cancel out."""
    _need(MATH500)
    m = import_script(MATH_TRAINER)
    problems = m.load_split(_as_test_split(MATH500, tmp_path), "test")
    rows = read_jsonl(MATH500)
    assert len(problems) == 500 and [prompt for prompt, _ in problems] == [r["problem"] for r in rows]
    boxes = [gold for _, gold in problems]  # the script's gold
    assert all(boxes) and boxes == [m.last_boxed(r["solution"]) for r in rows]
    solutions = [r["solution"] for r in rows]
    answers = [r["answer"] for r in rows]
    for name, boxed, golds in (
        ("solution's box", boxes, boxes),
        ("answer field", answers, boxes),
        ("solution's box vs the whole solution", boxes, solutions),
        ("solution's box vs bare answer", boxes, answers),
    ):
        comps = [f"<think>Let me solve it.</think>\nThe answer is $\\boxed{{{a}}}$." for a in boxed]
        grades = m.grade_batch(comps, golds, timeout_s=5.0)  # the strict format (TASK: STRICT_FORMAT)
        assert _rejects(grades, comps, golds) == [], name


def test_math500_every_row_eval(tmp_path):
    """EVAL's gold is a row's `answer` field (the solution when a row has none): a completion boxing it, or the
    solution's last box, is correct, in the default and in the strict format."""
    _need(MATH500)
    m = import_script(EVAL)
    rows = m.load_split(_as_test_split(MATH500, tmp_path), "test", "math500")
    assert len(rows) == 500
    golds = [r.get("answer") or r["solution"] for r in rows]  # as the script's main picks them
    for name, answers in (
        ("answer field", [m.gold_answer(g, "math500") for g in golds]),
        ("solution's box", [m.last_boxed(r["solution"]) for r in rows]),
    ):
        for strict in (False, True):
            comps = [
                ("<think>Let me solve it.</think>\n" if strict else "") + f"The answer is $\\boxed{{{a}}}$."
                for a in answers
            ]
            grades = m.grade_batch(comps, golds, timeout_s=5.0, task="math500", strict_format=strict)
            assert _rejects(grades, comps, golds) == [], (name, strict)
