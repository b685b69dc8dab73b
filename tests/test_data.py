"""The data each script reads: the training problems less the evaluation set's (drop_eval_overlap, one copy in each
trainer that evaluates), one meaning of `--limit` in every script, and a set with nothing to train on (or evaluate)
refused at the start, before torch is imported, a server is asked or a model is loaded. The real MATH-500
(../shared/data, never copied into the repository) checks the overlap on real text; without it those tests skip.
The end-to-end run that never trains on an evaluation problem is in test_reinforce_math_fsdp2.py (it needs the toy
server of that module)."""

import ast
import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import FIXTURES, PY, ROOT, free_port, import_script, read_jsonl

TRAINERS = ("grpo_gsm8k.py", "reinforce_math_fsdp2.py")  # the scripts that drop their evaluation set's problems
COUNTS = {  # script -> its flags that count problems
    "grpo_gsm8k.py": ["--limit", "--eval-limit"],
    "reinforce_math_fsdp2.py": ["--limit", "--eval-limit"],
    "pipeline_actor.py": ["--limit"],
    "eval.py": ["--limit"],
}
MATH500 = Path(ROOT).parent / "shared" / "data" / "math500_test.jsonl"


def _need_math500():
    if not MATH500.is_file():
        pytest.skip(f"{MATH500} is absent: the real MATH-500 lives in ../shared/data beside the repository")


def _functions(script: str, names: tuple) -> dict:
    src = Path(ROOT, script).read_text()
    tree = ast.parse(src)
    return {
        n.name: ast.get_source_segment(src, n) for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names
    }


def test_the_overlap_functions_are_identical_copies():
    copies = [_functions(script, ("problem_key", "drop_eval_overlap")) for script in TRAINERS]
    assert len(copies[0]) == 2 and all(c == copies[0] for c in copies)


@pytest.mark.parametrize("script", TRAINERS)
def test_drop_eval_overlap(script):
    """Whitespace runs and the ends do not count; case, punctuation and every other character do. The kept problems
    (prompt, gold) stay in their order, duplicates of an evaluation problem all go; the golds play no part."""
    m = import_script(script)
    evaluation = [("If $x + 3 = 10$, what is $x$?", "7"), ("Find  the\n sum.", "3")]
    train = [
        ("Find the sum.", "3"),  # whitespace differs: dropped
        ("If $X + 3 = 10$, what is $X$?", "7"),  # case differs: kept
        (" If $x + 3 = 10$,\twhat is $x$? \n", "7"),  # dropped
        ("Find the sums.", "3"),  # kept
        ("Find the sum.", "4"),  # a duplicate, another gold: dropped too
    ]
    kept, dropped = m.drop_eval_overlap(train, evaluation)
    assert kept == [train[1], train[3]] and dropped == 3
    assert m.drop_eval_overlap(train, []) == (train, 0)
    assert m.drop_eval_overlap([], evaluation) == ([], 0)


@pytest.mark.parametrize("script", TRAINERS)
def test_drop_eval_overlap_on_math500(script):
    """A MATH-schema training set holding 5 MATH-500 problems (one re-spaced) among 8 others: exactly those 5 go.
    All 500 against themselves: all go."""
    _need_math500()
    m = import_script(script)
    math500 = [(r["problem"], r["answer"]) for r in read_jsonl(MATH500)]
    others = [(r["problem"], r["solution"]) for r in read_jsonl(os.path.join(FIXTURES, "math", "train.jsonl"))]
    copied = math500[100:105]
    copied[0] = ("  " + copied[0][0].replace(" ", "\n  ") + "\n", copied[0][1])
    train = others[:4] + copied + others[4:]
    kept, dropped = m.drop_eval_overlap(train, math500)
    assert dropped == 5 and kept == others
    assert m.drop_eval_overlap(math500, math500) == ([], 500)


def _run(script: str, *args: str, cwd) -> subprocess.CompletedProcess:
    """The script in one process (-X importtime: stderr lists every module it imported), to its end."""
    cmd = [PY, "-X", "importtime", os.path.join(ROOT, script), *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)


def _imported(stderr: str) -> set:
    return {x.split("|")[-1].strip().split(".")[0] for x in stderr.splitlines() if x.startswith("import time:")}


def _said(r: subprocess.CompletedProcess) -> str:
    return "\n".join(x for x in (r.stdout + r.stderr).splitlines() if not x.startswith("import time:"))


@pytest.mark.parametrize("value", ["0", "-3"])
@pytest.mark.parametrize("script,flag", [(s, f) for s, flags in COUNTS.items() for f in flags])
def test_a_count_below_one_is_refused(script, flag, value, tmp_path):
    """Every flag that counts problems means "the first N" (None: all); 0 and negatives are refused at once."""
    r = _run(script, flag, value, cwd=tmp_path)
    assert r.returncode != 0 and f"{flag} is a number of problems, 1 or more (None: all of them); got {value}" in _said(
        r
    ), _said(r)[-2000:]
    assert "torch" not in _imported(r.stderr)


@pytest.mark.parametrize("script", ["eval.py", "pipeline_actor.py"])
def test_no_grading_workers_is_refused(script, tmp_path):
    """--grade-workers 0 (a pool that would grade nothing) is refused by name before any work (the trainers refuse it
    with their other counts: test_lifecycle)."""
    r = _run(script, "--grade-workers", "0", cwd=tmp_path)
    assert r.returncode != 0 and "--grade-workers must be 1 or more, got 0" in _said(r), _said(r)[-2000:]
    assert "torch" not in _imported(r.stderr)


def _split(directory: Path, name: str, rows: list[dict]) -> None:
    directory.mkdir(exist_ok=True)
    (directory / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


NO_MODEL = ["--model", "/nonexistent/model"]  # a model that cannot load: a run that got that far fails otherwise


@pytest.mark.parametrize("script", TRAINERS)
def test_a_training_set_of_evaluation_problems_is_refused_before_a_model_loads(script, tmp_path):
    """Every training problem is an evaluation problem: all are dropped, and the run stops before torch is imported,
    with a message that says so. --keep-eval-overlap keeps them (the run goes on: to the model that cannot load)."""
    rows = read_jsonl(os.path.join(FIXTURES, "gsm8k" if script == "grpo_gsm8k.py" else "math500", "test.jsonl"))
    data = tmp_path / "data"
    _split(data, "train", rows)
    _split(data, "test", rows)
    flags = [*NO_MODEL, "--dataset", str(data), "--vllm-port", str(free_port())]
    flags += ["--eval-dataset", str(data)] if script == "reinforce_math_fsdp2.py" else []
    r = _run(script, *flags, cwd=tmp_path)
    n = len(rows)
    assert r.returncode != 0, _said(r)[-2000:]
    assert f"of them {'test' if script == 'grpo_gsm8k.py' else 'evaluation'} problems: dropped" in _said(r)
    assert f"no training problems: {data} holds {n}, and the {n} that are" in _said(r), _said(r)[-2000:]
    assert "torch" not in _imported(r.stderr)
    r = _run(script, *flags, "--keep-eval-overlap", "--limit", "3", cwd=tmp_path)
    assert r.returncode != 0 and "no training problems" not in _said(r)
    assert f"training problems: {n} in {data}, {n} of them" in _said(r) and "kept (--keep-eval-overlap)" in _said(r)
    assert "no server answers at http://127.0.0.1:" in _said(r)  # it went on, past the data, to the server check


@pytest.mark.parametrize("script", [*TRAINERS, "pipeline_actor.py"])
def test_an_empty_training_file_is_refused_before_a_model_loads(script, tmp_path):
    data = tmp_path / "data"
    _split(data, "train", [])
    schema = "math500" if script == "reinforce_math_fsdp2.py" else "gsm8k"
    _split(data, "test", read_jsonl(os.path.join(FIXTURES, schema, "test.jsonl")))
    flags = ["--dataset", str(data)]
    flags += [*NO_MODEL, "--vllm-port", str(free_port())] if script in TRAINERS else []
    flags += ["--redis-url", f"redis://127.0.0.1:{free_port()}/0"] if script == "pipeline_actor.py" else []
    flags += ["--eval-dataset", str(data)] if script == "reinforce_math_fsdp2.py" else []
    r = _run(script, *flags, cwd=tmp_path)
    said = "holds none" if script == "pipeline_actor.py" else "holds 0"
    assert r.returncode != 0 and f"no training problems: {data} {said}" in _said(r), _said(r)[-2000:]
    assert "torch" not in _imported(r.stderr)


def test_eval_refuses_an_empty_split_before_asking_a_server(tmp_path):
    data = tmp_path / "data"
    _split(data, "test", [])
    r = _run("eval.py", *NO_MODEL, "--dataset", str(data), "--vllm-port", str(free_port()), cwd=tmp_path)
    assert r.returncode != 0 and f"no problems to evaluate: {data} (test split) holds none" in _said(r), _said(r)
    assert "torch" not in _imported(r.stderr)
