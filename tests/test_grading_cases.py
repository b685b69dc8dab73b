"""Every copy of `grade` in the project against the public case file, plus the grading pool's limits.

The case file (tests/grading_cases.jsonl) holds facts transcribed from public grader test suites, each
naming its source. Each module in MODULES carries its own copy of the grading block (CleanRL's rule:
scripts copy, they do not import each other); all of them must pass every case and agree on all of them.
tests/grading_cases_strict.jsonl holds the strict <think> format's cases, written by hand from its rule, for
the copies that grade it. Modules are imported by name from the repository root so that grade_batch's spawned
workers can too.
"""

import contextlib
import importlib
import inspect
import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = [
    "grpo_gsm8k",
    "eval",
    "reinforce_math_fsdp2",
    "pipeline_actor",
]  # every script that carries a copy of the grading block
# Extra arguments of a module's grade(completion, gold, ...): eval.py grades several tasks; its "math500" takes
# the gold as an already-extracted answer, as the case file writes it (MATH-500's `answer` field).
GRADE_ARGS = {"eval": ("math500",)}
# reinforce_math_fsdp2 rewards the strict <think> format (its TASK's STRICT_FORMAT); the case file is about answers:
# its grade runs here with STRICT_FORMAT off, and its grading workers (which import the file as it is) get each
# completion after an empty think block.
LENIENT = {"reinforce_math_fsdp2"}
CASES_FILE = ROOT / "tests" / "grading_cases.jsonl"
STRICT_FILE = ROOT / "tests" / "grading_cases_strict.jsonl"
STRICT_MODULES = {
    "reinforce_math_fsdp2": {},
    "eval": {"strict_format": True},
}  # the copies that grade the strict format

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _load(name):
    return importlib.import_module(name)


def _grade(name, completion, gold, **kw):
    m = _load(name)
    with mock.patch.object(m, "STRICT_FORMAT", False) if name in LENIENT else contextlib.nullcontext():
        return m.grade(completion, gold, *GRADE_ARGS.get(name, ()), **kw)


def _batch(name, completions, *args, **kw):
    if name in LENIENT:
        assert not any("think>" in c for c in completions)
        completions = ["<think></think>" + c for c in completions]
    return _load(name).grade_batch(completions, *args, **kw)


CASES = [json.loads(line) for line in CASES_FILE.read_text().splitlines() if line.strip()]
STRICT = [json.loads(line) for line in STRICT_FILE.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("cases", [CASES, STRICT], ids=["cases", "strict"])
def test_case_file_shape(cases):
    assert len(cases) >= (170 if cases is CASES else 20)
    for c in cases:
        assert set(c) == {"completion", "gold", "correct", "parse_error", "source", "note"}
        assert not (c["correct"] and c["parse_error"])


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("case", CASES, ids=[f"{i}-{c['source'].split(' (')[0]}" for i, c in enumerate(CASES)])
def test_grade(module, case):
    g = _grade(module, case["completion"], case["gold"])
    assert (g.correct, g.parse_error) == (case["correct"], case["parse_error"]), case["note"]
    assert g.reward == (1.0 if case["correct"] else 0.0)


def test_all_copies_agree():
    verdicts = {m: [tuple(_grade(m, c["completion"], c["gold"])) for c in CASES] for m in MODULES}
    first = verdicts[MODULES[0]]
    for v in verdicts.values():
        assert v == first, [i for i, (a, b) in enumerate(zip(v, first, strict=True)) if a != b]


def _grade_strict(name, completion, gold):
    return _load(name).grade(completion, gold, *GRADE_ARGS.get(name, ()), **STRICT_MODULES[name])


@pytest.mark.parametrize("module", list(STRICT_MODULES))
@pytest.mark.parametrize("case", STRICT, ids=[str(i) for i in range(len(STRICT))])
def test_grade_strict(module, case):
    g = _grade_strict(module, case["completion"], case["gold"])
    assert (g.correct, g.parse_error) == (case["correct"], case["parse_error"]), case["note"]


def test_all_strict_copies_agree():
    """Every copy that grades the strict format gives every strict case the same verdict, through grade and through
    grade_batch (the trainer's and the evaluation's path)."""
    verdicts = {m: [tuple(_grade_strict(m, c["completion"], c["gold"])) for c in STRICT] for m in STRICT_MODULES}
    for m, kw in STRICT_MODULES.items():
        batch = _load(m).grade_batch([c["completion"] for c in STRICT], [c["gold"] for c in STRICT], timeout_s=5, **kw)
        assert [tuple(g) for g in batch] == verdicts[m], m
    first = verdicts["eval"]
    for m, v in verdicts.items():
        assert v == first, (m, [STRICT[i]["note"] for i, (a, b) in enumerate(zip(v, first, strict=True)) if a != b])


@pytest.mark.parametrize("module", MODULES)
def test_extraction(module):
    m = _load(module)
    gsm8k = ("gsm8k",) if module == "eval" else ()  # golds in GSM8K's raw form
    if module != "reinforce_math_fsdp2":  # a MATH trainer: its golds are MATH solutions
        assert m.grade(
            "So she pays $\\boxed{1,200}$.", "She pays 3 * 400 = <<3*400=1200>>1200.\n#### 1,200", *gsm8k
        ).correct
        assert m.grade("\\boxed{-7}", "#### -7", *gsm8k).correct
    else:
        assert _grade(module, "So she pays $\\boxed{1,200}$.", r"She pays $\boxed{1200}$ dollars.").correct
    assert m.last_boxed(r"\boxed{1} then \boxed{2}") == "2"
    assert m.last_boxed(r"\boxed{5 + ") is None and m.last_boxed(r"\boxed{}") is None
    assert m.last_boxed(r"$\boxed 5$.") == "5" and m.last_boxed(r"\fbox{x^{2}}") == "x^{2}"
    assert m.last_boxed(r"\boxed{\frac{\sqrt{3}}{2}}") == r"\frac{\sqrt{3}}{2}"
    assert m.normalize_answer("1,2") == "1,2" and m.normalize_answer("1,234,567") == "1234567"
    assert m.normalize_answer("1,600 dollars") == "1600" and m.normalize_answer("1,25 apples") == "1,25 apples"


@pytest.mark.parametrize("module", MODULES)
def test_redundant_braces(module):
    """Groups that hold only another group, or the whole answer, go; escaped braces (sets), arguments and
    unbalanced input stay. 40 levels around a plain answer grade right within 1 CPU second (math-verify's parser on
    the unstripped answer runs out of 5). Every copy is the same code."""
    m = _load(module)
    deep = "{" * 40 + "5" + "}" * 40
    assert m.drop_redundant_braces(deep) == "5" and m.drop_redundant_braces("{ {5} }").strip() == "5"
    assert m.drop_redundant_braces(r"\frac{{1}}{2}") == r"\frac{1}{2}" and m.drop_redundant_braces("x^{{2}}") == "x^{2}"
    for kept in (r"\frac{1}{2}", r"\{1,2\}", "{1}+{2}", "1{,}000", "{{5}", "5}}", r"\\{5}", r"\left\{1\right\}"):
        assert m.drop_redundant_braces(kept) == kept
    assert m.drop_redundant_braces(r"{\{1,2\}}") == r"\{1,2\}"
    _grade(module, r"\boxed{1}", "1")  # sympy's first parse outside the limit below
    g = _grade(module, r"\boxed{" + deep + "}", "5", cpu_s=1.0)
    assert g == m.Grade(1.0, True, False)
    assert inspect.getsource(m.drop_redundant_braces) == inspect.getsource(_load(MODULES[0]).drop_redundant_braces)


# ---- grade_batch: CPU-time limit, wall-clock backstop, worker replacement, threads, load -----------
NORMAL = [  # (completion, gold, correct)
    (r"The answer is $\boxed{\frac{1}{2}}$.", "0.5", True),
    (r"So the total is $\boxed{1,200}$ dollars.", "1200", True),
    (r"Thus $x \in \boxed{[-2, 7]}$.", r"-2 \le x \le 7", True),
    (r"Hence $\boxed{12}$.", "1.2", False),
    (r"The roots are $\boxed{1, -2}$.", "-2, 1", True),
    (r"We get $\boxed{15}$.", "150", False),
]
PATHOLOGICAL = [
    r"The answer is $\boxed{9^{9^{9^{9}}}}$.",
    r"The answer is $\boxed{10000000!}$.",
    r"The answer is $\boxed{" + r"\frac{1}{" * 100 + "2" + "}" * 100 + "}$.",
    "x" * 100_000,  # 100 KB of garbage, no box
    r"$\boxed{" + "(a+b)" * 190 + "}$",  # long but under the length cap
]
# Wall-clock backstop of the tests that check the CPU limit: far above what any sample here takes even on a loaded
# machine, so a batch ending before it (and no worker replaced) means the CPU limit ended the stuck samples.
BACKSTOP_S = 60.0


def _check(grades, kinds):
    for g, kind in zip(grades, kinds, strict=True):
        if kind is None:  # pathological: must score 0
            assert g.reward == 0.0 and not g.correct
        else:
            assert g.correct == kind and g.parse_error is False


def _pids(m):
    """Pids of the grading workers alive in this process: those of every copy's pool (pebble names its workers
    `pebble_pool_worker`). Only `m`'s pool works during a test, so a change is a change in `m`'s pool."""
    return sorted(p.pid for p in multiprocessing.active_children() if p.name == "pebble_pool_worker")


# CPU seconds per sample: 1 in every copy; 5 (the scripts' default) burns 5 s per stuck sample, so in one copy only:
# the CPU limit is the same code in each (tests/test_copies.py), and the 1 s runs show every copy's
@pytest.mark.parametrize(("timeout_s", "module"), [(1.0, m) for m in MODULES] + [(5.0, MODULES[0])])
def test_grade_batch_pathological_mixed(module, timeout_s):
    m = _load(module)
    _batch(module, ["\\boxed{1}"], ["1"], timeout_s=30)  # start the pool outside the timed region
    comps = [PATHOLOGICAL[0], NORMAL[0][0], NORMAL[1][0], PATHOLOGICAL[2], NORMAL[2][0], NORMAL[3][0]]
    golds = ["5", NORMAL[0][1], NORMAL[1][1], "5", NORMAL[2][1], NORMAL[3][1]]
    kinds = [None, True, True, None, True, False]
    pids = _pids(m)
    t = time.monotonic()
    grades = _batch(module, comps, golds, timeout_s=timeout_s, backstop_s=BACKSTOP_S)
    elapsed = time.monotonic() - t
    print(f"{module}: 2 pathological + 4 normal, {timeout_s} CPU s per sample: {elapsed:.2f}s")
    assert elapsed < BACKSTOP_S
    _check(grades, kinds)
    assert grades[0].parse_error and grades[3].parse_error  # a timeout is a parse error, never a plain "wrong"
    assert len(m.GRADERS) == 1 and all(pool.active for pool in m.GRADERS.values())  # one pool, still running
    assert _pids(m) == pids  # each worker ended its stuck sample itself (CPU limit): none was killed


@pytest.mark.parametrize("module", MODULES)
def test_grade_batch_all_pathological_then_normal(module):
    """Behaviour, not a race: normal samples need milliseconds of CPU, far from the 1 s CPU limit, so a busy
    machine cannot push them over it; stuck samples end by the CPU limit, in their own worker."""
    m = _load(module)
    _batch(module, ["\\boxed{1}"], ["1"], timeout_s=30)
    comps = PATHOLOGICAL + [c for c, _, _ in NORMAL]
    golds = ["5"] * len(PATHOLOGICAL) + [g for _, g, _ in NORMAL]
    kinds = [None] * len(PATHOLOGICAL) + [k for _, _, k in NORMAL]
    pids = _pids(m)
    t = time.monotonic()
    grades = _batch(module, comps, golds, timeout_s=1.0, backstop_s=BACKSTOP_S)
    elapsed = time.monotonic() - t
    print(f"{module}: {len(PATHOLOGICAL)} pathological + {len(NORMAL)} normal: {elapsed:.2f}s")
    assert elapsed < BACKSTOP_S
    _check(grades, kinds)
    assert grades[3] == m.Grade(0.0, False, True)  # garbage without a box
    assert grades[0].parse_error and grades[1].parse_error  # out of CPU time: parse errors
    assert _pids(m) == pids  # no worker was killed: the pool is whole and warm
    _check(_batch(module, [c for c, _, _ in NORMAL], [g for _, g, _ in NORMAL], timeout_s=5), [k for _, _, k in NORMAL])


@pytest.mark.parametrize("module", MODULES)
def test_grade_batch_backstop_kills_stuck_worker(module):
    """The wall-clock backstop (for a sample stuck in C code, which the CPU limit cannot interrupt): with a CPU limit
    out of reach, workers still on a pathological sample at the backstop are killed and replaced, their samples score
    0 with parse_error, and the pool grades the next batch normally."""
    m = _load(module)
    _batch(module, ["\\boxed{1}"], ["1"], timeout_s=30)
    pids = _pids(m)
    t = time.monotonic()
    grades = _batch(module, PATHOLOGICAL[:2], ["5", "5"], timeout_s=600, backstop_s=1.0)
    elapsed = time.monotonic() - t
    print(f"{module}: 2 pathological, backstop 1 s: {elapsed:.2f}s")
    assert grades == [m.Grade(0.0, False, True)] * 2
    assert elapsed < 30  # the backstop ended them (unkilled, each would run for minutes)
    assert len(set(pids) - set(_pids(m))) == 2  # two workers were killed
    deadline = time.monotonic() + 10
    while len(set(_pids(m)) - set(pids)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)  # pebble starts the replacements just after it hands back the killed samples' verdicts
    assert len(set(_pids(m)) - set(pids)) == 2  # and replaced
    _check(_batch(module, [c for c, _, _ in NORMAL], [g for _, g, _ in NORMAL], timeout_s=5), [k for _, _, k in NORMAL])


BUSY = """import hashlib, os, threading
data = bytes(1 << 20)
def spin():
    while True:
        hashlib.sha256(data)  # sha256 of 1 MB releases the GIL: every thread keeps a core busy
for _ in range(os.cpu_count() - 1):
    threading.Thread(target=spin, daemon=True).start()
spin()
"""


def test_grade_batch_under_load_changes_no_verdict():
    """The whole case file through a fresh pool of one copy, while 2 busy processes (each spinning one thread per
    core, as an inference server's thread pool does) hold the cores: every verdict is the case file's. The limit is
    4 CPU seconds, twice what the costliest case takes on a fresh worker on a quiet machine (0.75 s on one 2-core VM,
    1.6-2.0 s on another: latex2sympy's ANTLR parser builds its prediction cache as it first meets a construct); a
    wall-clock limit that tight turns those cases into parse errors here, where a worker gets a third of a core or
    less. A fresh pool, so that no worker has these cases in sympy's cache already; the whole file takes 10-30 s."""
    m = _load("grpo_gsm8k")
    m.stop_graders()  # a fresh pool
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(2)]
    try:
        time.sleep(0.5)
        assert all(p.poll() is None for p in busy)
        t = time.monotonic()
        grades = m.grade_batch([c["completion"] for c in CASES], [c["gold"] for c in CASES], timeout_s=4.0)
        elapsed = time.monotonic() - t
        assert all(p.poll() is None for p in busy)  # the load lasted the whole batch
    finally:
        for p in busy:
            p.kill(), p.wait()
    print(f"{len(CASES)} cases under 2 busy processes ({os.cpu_count()} threads each): {elapsed:.1f}s")
    changed = [
        (i, CASES[i]["note"], tuple(g))
        for i, (g, c) in enumerate(zip(grades, CASES, strict=True))
        if (g.correct, g.parse_error) != (c["correct"], c["parse_error"])
    ]
    assert changed == []


@pytest.mark.parametrize("module", MODULES)
def test_grade_batch_from_non_main_thread(module):
    out = {}

    def run():
        try:
            out["grades"] = _batch(
                module, [c for c, _, _ in NORMAL] + [PATHOLOGICAL[1]], [g for _, g, _ in NORMAL] + ["5"], timeout_s=2.0
            )
        except BaseException as e:  # surfaced below
            out["error"] = e

    th = threading.Thread(target=run)
    th.start()
    th.join(120)  # a bound on a hang, not a speed test: a fresh pool starts slowly on a loaded machine
    assert not th.is_alive() and "error" not in out, out.get("error")
    _check(out["grades"], [k for _, _, k in NORMAL] + [None])


@pytest.mark.parametrize("module", MODULES)
def test_grade_batch_matches_grade(module):
    sample = [c for c in CASES[::7] if module not in LENIENT or "think>" not in c["completion"]]
    grades = _batch(module, [c["completion"] for c in sample], [c["gold"] for c in sample], timeout_s=10.0)
    assert [(g.correct, g.parse_error) for g in grades] == [(c["correct"], c["parse_error"]) for c in sample]
