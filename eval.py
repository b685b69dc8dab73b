# docs and experiment results: docs/eval.md
"""Accuracy of a model on GSM8K or MATH-500: generate with vllm_sync_server.py, grade with math-verify.

Evaluation is the other half of RL with verifiable rewards: the verifier that hands out rewards in training
(the last \\boxed{} answer, normalised, checked by math-verify; copied from grpo_gsm8k.py) scores held-out
problems here, so this script's accuracy and grpo_gsm8k.py's reward mean the same thing. What it does:
  - one zero-shot chat prompt per problem: the model's own chat template, an optional system prompt, the
    question as it is. Defaults mirror Qwen's GSM8K evaluation (greedy, no system prompt). The template,
    applied to a placeholder question, is written to the output: the template alone moves scores by points;
  - `--n` samples per problem: accuracy of the first sample (the greedy one at temperature 0), and pass@k for
    k = 1, 2, 4, ... <= n with the unbiased estimator of Chen et al. 2021;
  - `--strict-format`: credit only for `<think>...</think>` followed by a boxed answer (the R1 format);
  - any model the server loads is a valid --model, e.g. a checkpoint directory written by grpo_gsm8k.py (a LoRA
    checkpoint: its merged model, `merged/` inside it);
  - `--base-url`: any OpenAI-compatible server (`vllm serve`, another engine) instead, through the official openai
    client's chat completions: the same messages, hence the same prompt tokens where the server applies --model's
    chat template, the same seeds, grading and output.

What it leaves out, on purpose: few-shot prompts, answer-format hints beyond the system prompt, and majority voting.
The metrics are the ALGO LOGIC section; the steps at the bottom prompt, generate, grade, summarise and write.

  # one GPU: the server is started for you; the first 250 GSM8K test problems, greedy
  python eval.py --model Qwen/Qwen2.5-0.5B-Instruct --start-server
  # against a running server (it must serve --model), all of MATH-500, 8 samples per problem: pass@1..8
  python vllm_sync_server.py --model Qwen/Qwen2.5-7B-Instruct
  python eval.py --model Qwen/Qwen2.5-7B-Instruct --task math500 --limit None --n 8 --temperature 0.6 --max-tokens 2048
  # any OpenAI-compatible server (the key, if it has one, in $VLLM_API_KEY)
  vllm serve Qwen/Qwen2.5-0.5B-Instruct --port 8000
  python eval.py --model Qwen/Qwen2.5-0.5B-Instruct --base-url http://127.0.0.1:8000/v1
"""

import contextlib
import json
import math
import multiprocessing as mp
import os
import re
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Literal, NamedTuple, Optional

import requests

# The grader and its worker processes must not pay for (or inherit) torch: heavy imports happen in main and in the
# functions that use them.


@dataclass
class Args:
    # Experiment
    model: str = "Qwen/Qwen2.5-0.5B-Instruct"
    """Hugging Face model id or local directory (a training script's checkpoint works: its system prompt is then the
    one it trained with); the server must serve it"""
    task: Literal["gsm8k", "math500"] = "gsm8k"
    """benchmark: GSM8K (gold: the number after ####) or MATH-500 (gold: the answer, or a solution's last box)"""
    dataset: Optional[str] = None
    """Hugging Face dataset, or a local directory with {split}.jsonl in its schema (None: openai/gsm8k, config main,
    or HuggingFaceH4/MATH-500)"""
    split: str = "test"
    """dataset split"""
    limit: Optional[int] = 250
    """evaluate the first `limit` problems of the split (None: all of them)"""
    system_prompt: str = ""
    """system prompt ("" for none; a chat template may then insert its own default, as Qwen2.5's does); default for a
    checkpoint of a training script: the one it trained with (its args.json)"""
    strict_format: bool = False
    """credit only `<think>...</think>` followed by a \\boxed{} answer after </think>"""
    out: Optional[str] = None
    """JSONL file: one line per problem, then a summary line (None: {task}_eval.jsonl)"""

    # Sampling
    n: int = 1
    """samples per problem; pass@k is reported for k = 1, 2, 4, ... <= n (n > 1 needs --temperature > 0)"""
    temperature: float = 0.0
    """sampling temperature (0: greedy, as Qwen's GSM8K evaluation)"""
    max_tokens: int = 512
    """maximum new tokens per completion (a truncated answer has no box: a parse error)"""
    seed: int = 1
    """seed of the sampling: sample j of problem i gets seed + i * n + j"""
    concurrency: int = 32
    """generation requests in flight"""

    # The server
    vllm_host: str = "127.0.0.1"
    """host of vllm_sync_server.py"""
    vllm_port: int = 8000
    """port of vllm_sync_server.py"""
    start_server: bool = False
    """launch vllm_sync_server.py (on GPU --vllm-gpu) with --model, wait for it, stop it at exit (on SIGTERM and
    SIGINT too)"""
    vllm_gpu: int = 0
    """GPU of the server with --start-server, among the visible ones (CUDA_VISIBLE_DEVICES)"""
    server_args: str = ""
    """extra flags for the server started by --start-server (`--server-args "--dtype float32 ..."`)"""
    base_url: Optional[str] = None
    """evaluate any OpenAI-compatible server instead (`vllm serve`, another engine) through its chat completions, with
    the openai client: its base URL, /v1 included (e.g. http://127.0.0.1:8000/v1); the key is $VLLM_API_KEY"""
    served_model_name: Optional[str] = None
    """with --base-url: the model to ask for (None: the first id the server's /v1/models lists)"""
    request_timeout_s: float = 600.0
    """with --base-url: seconds the client waits for one completion"""
    max_retries: int = 2
    """with --base-url: retries of a request that could not connect or got 408/409/429/5xx (the client's backoff)"""
    neutral_sampling: bool = True
    """with --base-url: also send top_k -1 (off), min_p 0 and repetition_penalty 1 (vLLM's extensions of the API), so
    the model's generation_config.json cannot change the sampling (--no-neutral-sampling: an engine that refuses
    unknown fields)"""

    # Grading
    grade_timeout_s: float = 5.0
    """CPU seconds a grading worker may spend on one completion (its own CPU time, so a busy machine changes no
    verdict); past them the completion scores 0 with parse_error"""
    grade_backstop_s: float = 60.0
    """wall-clock seconds after which a grading worker still on one completion is killed (a last resort, for one
    stuck in C code where the CPU limit cannot interrupt it; it scores 0 with parse_error)"""
    grade_workers: int = 4
    """grading worker processes (each imports sympy at start: about 1 s of CPU); 4 keep grading's share of a 2-core
    machine beside busy processes, more suit a machine with many cores and large batches"""


# ---------------------------------------------------------------------------------------------------
# ALGO LOGIC: the metrics
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k (the chance that at least one of k samples is right) from n >= k samples of
    which c are right (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1):
        1 - C(n-c, k) / C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k / i)
    The product form never builds the huge binomials, so it is exact to float precision for any n."""
    if n - c < k:
        return 1.0  # every k-subset holds a right sample
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_ks(n: int) -> list[int]:
    """k = 1, 2, 4, ... up to n."""
    return [2**j for j in range(n.bit_length())]


def last_number_right(completion: str, gold_answer: str) -> bool:
    """Whether the completion's last number equals a numeric gold answer, boxed or not: "3 + 4 = 7" is right for 7.
    Beside `accuracy` (the boxed answer, as training rewards it) it tells the arithmetic from the format."""
    numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", completion)
    with contextlib.suppress(ValueError):  # a gold that is not a number (MATH's \frac{1}{2}): never right
        return bool(numbers) and float(numbers[-1].replace(",", "")) == float(gold_answer.replace(",", ""))
    return False


def summarize(verdicts: dict[str, list[list]]) -> dict:
    """[problems][n] verdicts (correct, parse_error, last_number_right, tokens) -> the metrics. `accuracy` and
    `last_number_accuracy` score each problem's first sample (greedy at temperature 0); rates and lengths, all."""
    flat = {key: [x for row in per_sample for x in row] for key, per_sample in verdicts.items()}
    correct = verdicts["correct"]
    n = len(correct[0])
    m = {
        "accuracy": sum(row[0] for row in correct) / len(correct),
        "last_number_accuracy": sum(row[0] for row in verdicts["last_number_right"]) / len(correct),
        "correct_rate": sum(flat["correct"]) / len(flat["correct"]),
        "parse_err_rate": sum(flat["parse_error"]) / len(flat["parse_error"]),
        "avg_completion_length": sum(flat["tokens"]) / len(flat["tokens"]),
        "total_completion_tokens": sum(flat["tokens"]),
    }
    for k in pass_ks(n):
        m[f"pass@{k}"] = sum(pass_at_k(n, sum(row), k) for row in correct) / len(correct)
    return m


def per_problem(flat: list, n: int) -> list[list]:
    """[problems * n] -> [problems][n]: each problem's n samples, in the order they were generated."""
    return [flat[i : i + n] for i in range(0, len(flat), n)]


# ---------------------------------------------------------------------------------------------------
# TRY NOT TO MODIFY: grading, copied from grpo_gsm8k.py (normalize_answer and the math-verify call are identical, so
# every copy agrees: tests/test_grading_cases.py), plus what evaluation needs: MATH golds and the strict R1 format.
class Grade(NamedTuple):
    reward: float
    correct: bool
    parse_error: bool  # no usable answer: no box, empty/truncated box, bad format, unparsable, timed out


class CpuLimit(BaseException):  # not an Exception: nothing in math-verify or sympy catches it on its way out
    pass


def on_cpu_limit(signum, frame):
    raise CpuLimit


def last_boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...} / \\fbox{...} (balanced braces) or `\\boxed 5`; else None."""
    if not (boxes := list(re.finditer(r"\\(?:boxed|fbox)(?![a-zA-Z])\s*", text))):
        return None
    i = boxes[-1].end()  # only the last box counts; if it is broken, the answer is broken
    if not text.startswith("{", i):
        return m.group(0) if (m := re.match(r"[^\s$]+", text[i:])) else None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j].strip() or None
    return None  # truncated or unbalanced


NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)"
BIG = r"[-+]?[1-9]\d{0,2}(?:[, ]\d{3})+(?:\.\d+)?"  # thousands separators: 1,234 / 1 000 (not the tuple 1,2)
SUBS = [  # cosmetic LaTeX a human grader ignores, applied in order
    (r"\\[dtc]frac", r"\\frac"),
    (r"\\(?:left|right)\s*\.", ""),
    (r"\\(?:left|right)(?![a-zA-Z])", ""),
    (r",\\!\s*", ","),
    (r"\\!|\\displaystyle", ""),
    (r"\\(?:mbox|textnormal|textrm|textbf|textit)(?![a-zA-Z])", r"\\text"),
    (r"(?<!\\)\\(?:,|;|:|quad|qquad|\s)|~|[\u2009\u202f\u00a0]", " "),
    (r"\{,\}", ","),
    (r"\\?\$|\\?%|€|£", ""),
    (r"(?:\^\s*\{?\s*\\circ\s*\}?|°|\\degree(?![a-zA-Z]))(?:\s*[CF](?![a-zA-Z]))?", ""),
    (r"\s+", " "),
]


def drop_redundant_braces(s: str) -> str:
    """`{{5}}` -> `5`, `x^{{2}}` -> `x^{2}`: a brace group that holds nothing but another group, and a group around
    the whole answer, change nothing in TeX, and dozens of levels of them would use up math-verify's CPU time.
    Escaped braces (`\\{1, 2\\}`, a set) are not groups and stay; unbalanced braces come back as they are."""
    closing = {}  # index of each group's `{` -> index of its `}`
    opened = []
    i = 0
    while i < len(s):
        if s[i] == "\\":
            i += 2  # a command or an escaped character (`\\{`, `\\}`, `\\\\`): never a group's brace
            continue
        if s[i] == "{":
            opened.append(i)
        elif s[i] == "}":
            if not opened:
                return s
            closing[opened.pop()] = i
        i += 1
    if opened:
        return s
    drop = set()
    for start, end in closing.items():
        inner = s[start + 1 : end]
        first = start + 1 + len(inner) - len(inner.lstrip())  # the group's first and last non-space characters
        last = end - 1 - (len(inner) - len(inner.rstrip()))
        if closing.get(first) == last:  # `{ {...} }`: the inner group is redundant
            drop.update((first, last))
    first = len(s) - len(s.lstrip())
    if closing.get(first) == len(s.rstrip()) - 1:  # a group around the whole answer
        drop.update((first, len(s.rstrip()) - 1))
    return "".join(ch for j, ch in enumerate(s) if j not in drop)


def normalize_answer(s: str) -> str:
    """Redundant braces, units, $, %, degrees, `x =`, thousands separators and a final period go; sets and tuples
    stay."""
    s = drop_redundant_braces(s)
    for pattern, repl in SUBS:
        s = re.sub(pattern, repl, s.strip())
    for _ in range(2):  # a second pass catches `x = 5 \text{ cm}.`
        s = s.strip().rstrip(".").strip()
        s = re.sub(r"^\\text\{\s*(" + NUM + r"[^{}]*)\}$", r"\1", s)  # \text{7 apples} -> 7 apples
        s = re.sub(r"^(.*\S)\s*\\text\{[^{}]*\}(?:\s*\^\s*\{?\d\}?)?$", r"\1", s)  # 5\text{ cm}^2 -> 5
        m = re.match(r"^(" + NUM + r")\s*(thousand|million|billion)$", s)  # 3 million -> 3\times 10^{6}
        s = rf"{m.group(1)}\times 10^{{{3 * ['thousand', 'million', 'billion'].index(m.group(2)) + 3}}}" if m else s
        s = re.sub(r"^(" + BIG + "|" + NUM + r")\s+(?!pi\b)[a-zA-Z]{2,}(?:\s+[a-zA-Z]+)*$", r"\1", s)  # 7 cats -> 7
        m = re.match(r"^(?:[a-zA-Z]|\\[a-zA-Z]+)(?:_\{?\w+\}?)?\s*=\s*([^=]+)$", s)  # x = 5 -> 5
        if m and not re.search(r"[a-zA-Z]", re.sub(r"\\[a-zA-Z]+", "", m.group(1))):
            s = m.group(1)
    if re.fullmatch(BIG, s):  # 1,234 / 1 000 -> 1234 / 1000
        s = re.sub(r"[, ]", "", s)
    s = re.sub(r"^(-?)(\d+) (\d+)/(\d+)$", r"\1(\2+\3/\4)", s)  # mixed number 7 3/4
    return re.sub(r"^(-?\d+(?:\.\d+)?)[eE]([-+]?\d+)$", r"\1\\times 10^{\2}", s).strip()  # 1.5e3


def extract_answer(completion: str, strict_format: bool = False) -> Optional[str]:
    """The answer that gets graded: the last box of the completion, or with strict_format the last box after the
    think block (None where the format is broken: see grade)."""
    if strict_format:  # the first </think> closes the block; only what follows it can hold the answer
        m = re.fullmatch(r"\s*<think>(.*?)</think>(.*)", completion, re.S)
        if m is None or "<think>" in m.group(1) or re.search(r"</?think>", m.group(2)):
            return None  # no think block, an unclosed one, or another think tag
        completion = m.group(2)
    return last_boxed(completion)


def gold_answer(gold: str, task: str) -> str:
    """GSM8K: its raw `answer` field ('... #### 1,200') -> '1200'. MATH: a `solution` -> its last box (nested
    braces kept); MATH-500's `answer` field (no box) is already the answer."""
    if task == "gsm8k":
        return re.sub(r"[,\s]", "", gold.split("####")[-1]) if "####" in gold else gold
    if task != "math500":
        raise ValueError(f"unknown task {task!r}")
    return (last_boxed(gold) or gold) if re.search(r"\\(?:boxed|fbox)(?![a-zA-Z])", gold) else gold


def grade(completion: str, gold: str, task: str, strict_format: bool = False, cpu_s: float = 5.0) -> Grade:
    """Reward of one completion against a raw gold field of `task`. It may spend `cpu_s` seconds of this process's
    CPU time (ITIMER_PROF counts CPU, not wall clock: load on the machine changes no verdict), then scores 0 with
    parse_error; math-verify's own wall-clock alarms are off. Call it in a main thread (the limit is a signal) or
    through grade_batch.
    Strict format (the R1 format): the completion is one think block, `<think>...</think>` with only whitespace
    before it, then the answer: the last \\boxed{} after that `</think>`. Every other think tag breaks the format (a
    `<think>` inside the block, a second block, a stray `</think>` or `<think>` after it), as do a missing block, a
    missing `</think>` and a box only inside the thinking: each is a parse error.
    """
    import signal

    from math_verify import LatexExtractionConfig, parse, verify

    box = extract_answer(completion, strict_format)
    if box is None or len(box) > 1000:
        return Grade(0.0, False, True)
    gold = gold_answer(gold, task)
    cfg = [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)]
    old_handler = signal.signal(signal.SIGPROF, on_cpu_limit)
    try:  # never str() a parsed object: printing a deep expression can hang
        try:  # one shot: SIGPROF comes once, after cpu_s seconds of CPU; a CpuLimit raised in `finally` lands below
            signal.setitimer(signal.ITIMER_PROF, cpu_s)
            pred = parse("\\boxed{" + normalize_answer(box) + "}", cfg, parsing_timeout=None)
            if not pred:
                return Grade(0.0, False, True)
            ref = parse("\\boxed{" + normalize_answer(gold) + "}", cfg, parsing_timeout=None)
            try:  # gold first: not symmetric. raise_on_error: an error in the strict mode is not yet a "not equal"
                ok = verify(ref, pred, allow_set_relation_comp=True, timeout_seconds=None, raise_on_error=True)
            except Exception:  # one reading failed to compare (12:00 as a ratio): the lenient mode tries the others
                ok = verify(ref, pred, allow_set_relation_comp=True, timeout_seconds=None)
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
    except (Exception, CpuLimit):  # out of CPU time, or unparsable
        return Grade(0.0, False, True)
    finally:
        signal.signal(signal.SIGPROF, old_handler)
    return Grade(float(ok), bool(ok), False)


def warm_up_grader() -> None:
    """A grading worker's start (the pool's initializer): it runs before the worker takes its first sample, so no
    sample's clock runs while sympy imports."""
    import logging
    import signal

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeouts are off" warning: grade's CPU limit is on
    # pebble ends a worker past the backstop with SIGTERM, and 3 s later SIGKILL; its own SIGTERM handler is Python,
    # which a worker stuck in C code never reaches. The default action ends the process at once, wherever it is.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # SLURM's --signal may reach every process: the trainer acts on it
    # imports sympy and builds math-verify's parsers (~1 s of CPU)
    grade("\\boxed{x \\le 1/2}", "(-\\infty, 1/2]", "math500")


GRADERS: dict = {}  # workers -> pebble.ProcessPool, started on first use and reused; stop_graders ends them


def stop_graders() -> None:
    """End every grading pool and its workers (at exit, or for a fresh pool)."""
    for pool in GRADERS.values():
        pool.stop()
        pool.join()
    GRADERS.clear()


def grade_batch(
    completions: list[str],
    golds: list[str],
    timeout_s: float,
    workers: int = 4,
    task: str = "math500",
    strict_format: bool = False,
    backstop_s: float = 60.0,
) -> list[Grade]:
    """Grade in `workers` worker processes (a pebble.ProcessPool), each sample within `timeout_s` seconds of its
    worker's CPU time (past them it scores 0, parse_error; a busy machine changes no verdict). The last resort is wall
    clock: a worker still on one sample `backstop_s` after it started it (stuck in C code) is killed and replaced, and
    that sample scores 0, parse_error, too. A worker that dies on a sample costs that sample alone. The grades come
    back in the order of `completions`. 4 workers: two per core of a 2-core machine. Beside busy processes the kernel
    shares the cores per thread, so more workers than cores keep grading's share (bench/grading.py --load 2 --threads
    8: 18 samples/s with 4, 12/s with 2); on a quiet machine they cost nothing, and CPU-time limits do not mind."""
    import atexit

    from pebble import ProcessExpired, ProcessPool

    if workers in GRADERS and not GRADERS[workers].active:  # broken (a worker could not start): start again
        stop_graders()
    if workers not in GRADERS:
        GRADERS[workers] = ProcessPool(
            max_workers=workers,
            initializer=warm_up_grader,
            context=mp.get_context("spawn"),  # spawn, so a worker never inherits threads or CUDA
        )
        # atexit runs the last registered first: registered after pebble's import, stop_graders ends the pools before
        # pebble's own exit handler kills their workers. Unregistered first, so that it is registered once.
        atexit.unregister(stop_graders)
        atexit.register(stop_graders)
    pool = GRADERS[workers]
    futures = []  # all handed to the pool at once; a sample's backstop clock starts when a worker takes it
    for completion, gold in zip(completions, golds, strict=True):
        grade_args = (completion, gold, task, strict_format, timeout_s)
        futures.append(pool.schedule(grade, args=grade_args, timeout=backstop_s))
    grades = []
    for future in futures:
        try:
            grades.append(future.result())  # a worker that cannot start breaks the pool: BrokenProcessPool raises
        except (TimeoutError, ProcessExpired):  # killed at the backstop, or its worker died on it
            grades.append(Grade(0.0, False, True))
    return grades


def grade_samples(texts: list[str], golds: list[str], args: Args) -> tuple[list[list[bool]], list[list[bool]]]:
    """Every sample against its problem's gold (`texts`: the completions as graded, [problems * n]), in worker
    processes with a CPU-time limit. Returns the verdicts correct and parse_error, [problems][n] each."""
    grades = grade_batch(
        texts,
        [g for g in golds for _ in range(args.n)],
        args.grade_timeout_s,
        task=args.task,
        strict_format=args.strict_format,
        backstop_s=args.grade_backstop_s,
        workers=args.grade_workers,
    )
    return per_problem([g.correct for g in grades], args.n), per_problem([g.parse_error for g in grades], args.n)


# ---------------------------------------------------------------------------------------------------
# The client side of vllm_sync_server.py, and the data
def auth_headers() -> dict:
    """`Authorization: Bearer $VLLM_API_KEY` when that variable is set (vLLM's convention), on every request: a server
    started with --api-key (or that variable) refuses every route but /health without it."""
    key = os.environ.get("VLLM_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def post(url: str, path: str, body: dict, stream: bool = False, retries: int = 5, timeout: float = 600):
    """POST, retried with exponential backoff when refused or cut off mid-answer; then an error naming the URL.
    `timeout`: the longest wait for the server's next bytes (stream=True: also between the lines `lines` reads)."""
    for attempt in range(retries):
        try:
            r = requests.post(url + path, json=body, stream=stream, timeout=(30, timeout), headers=auth_headers())
            if r.status_code >= 400:
                raise RuntimeError(f"{url}{path} answered {r.status_code}: {r.text}")
            return r
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as e:  # refused, or cut off
            if attempt == retries - 1:
                raise RuntimeError(f"vLLM server at {url} is not answering ({path}) after {retries} tries: {e}") from e
            time.sleep(2**attempt)
        except requests.Timeout as e:  # not retried: the server may be acting on the request
            raise RuntimeError(f"vLLM server at {url} did not answer {path} within {timeout} s: {e}") from e


def generate(
    url: str,
    prompts: list[list[int]],
    n: int,
    temperature: float,
    max_tokens: int,
    concurrency: int,
    seed: int,
    on_done=None,
):
    """One request per prompt, `concurrency` in flight; vLLM batches them. Returns one result per prompt. The
    server seeds sample j of a request with seed + j, so seed + i * n gives every sample its own seed."""

    def one(i):
        body = {
            "prompts": [prompts[i]],
            "n": n,
            "temperature": temperature,
            "max_tokens": max_tokens,
            "seed": seed + i * n,
        }
        result = post(url, "/generate", body).json()["results"][0]
        if on_done is not None:
            on_done()
        return result

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(len(prompts))))


def generate_openai(
    client,
    model: str,
    chats: list[list[dict]],
    n: int,
    temperature: float,
    max_tokens: int,
    concurrency: int,
    seed: int,
    neutral_sampling: bool,
    on_done=None,
):
    """The same samples through any OpenAI-compatible server: one chat completion per sample, `concurrency` problems
    in flight (the server batches them). Sample j of problem i asks for seed + i * n + j, as generate's do; an engine
    that honours `seed` draws what vllm_sync_server.py draws. Returns results shaped like generate's, with the
    server's count of completion tokens in place of the token ids."""
    import openai

    # the model's generation_config.json sets a server's defaults for every field a request leaves out: set them all
    extensions = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0} if neutral_sampling else None

    def one(i):
        completions = []
        for j in range(n):  # one request per sample: its own seed, and `usage` counts its tokens alone
            try:
                response = client.chat.completions.create(
                    model=model,
                    messages=chats[i],
                    n=1,
                    temperature=temperature,
                    top_p=1.0,
                    presence_penalty=0.0,
                    frequency_penalty=0.0,
                    max_completion_tokens=max_tokens,
                    seed=seed + i * n + j,
                    extra_body=extensions,
                )
            except openai.APIConnectionError as e:  # retried max_retries times already
                raise RuntimeError(f"the server at {client.base_url} stopped answering: {e}") from e
            choice = response.choices[0]
            completions.append(
                {
                    "text": choice.message.content or "",
                    "completion_tokens": response.usage.completion_tokens,
                    "finish_reason": choice.finish_reason,
                }
            )
        if on_done is not None:
            on_done()
        return {"completions": completions}

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(len(chats))))


def generate_samples(
    args: Args, url: str, client, served: str, questions: list[str], prompt_ids: list[list[int]]
) -> list[list[dict]]:
    """--n samples per problem, from the --base-url server (the chat messages) or from vllm_sync_server.py (the
    prompts' token ids), with a progress bar on stderr (stdout keeps the table). Returns [problems][n] completions."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = [TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=Console(stderr=True)) as progress:
        bar = progress.add_task("generate", total=len(questions))
        sampling = {"n": args.n, "temperature": args.temperature, "max_tokens": args.max_tokens, "seed": args.seed}
        sampling |= {"concurrency": args.concurrency, "on_done": lambda: progress.advance(bar)}
        if args.base_url:  # the server applies its chat template to the same messages: the same tokens (docs)
            chats = [chat_messages(args.system_prompt, q) for q in questions]
            results = generate_openai(client, served, chats, neutral_sampling=args.neutral_sampling, **sampling)
        else:
            results = generate(url, prompt_ids, **sampling)
    return [res["completions"] for res in results]


def openai_model(client, name: Optional[str]) -> tuple[str, Optional[int]]:
    """The model a --base-url server is asked for: `name`, or the first it lists; and its context length, where the
    listing gives it (vLLM's max_model_len), else None. Listing is also the check that the server answers and takes
    the key, before any work: a clear error naming the URL otherwise."""
    import openai

    url = client.base_url
    try:
        listed = {m.id: getattr(m, "max_model_len", None) for m in client.models.list(timeout=30)}
    except openai.AuthenticationError as e:
        raise SystemExit(f"the server at {url} refused the key ($VLLM_API_KEY, or EMPTY when unset): {e}") from e
    except openai.NotFoundError as e:
        raise SystemExit(f"the server at {url} has no /models route (does --base-url end in /v1?): {e}") from e
    except openai.APIConnectionError as e:
        raise SystemExit(f"no server answers at {url} (tried {client.max_retries + 1} times): {e}") from e
    if not listed:
        raise SystemExit(f"the server at {url} lists no model")
    name = name or next(iter(listed))
    return name, listed.get(name)


def physical_gpu(index: int) -> str:
    """The GPU that this process sees as cuda:`index`, named for a child process: CUDA_VISIBLE_DEVICES renumbers the
    GPUs it lists (`4,5`: cuda:0 is GPU 4), and the server must land inside the user's set, on the GPU meant."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return str(index)
    ids = [x.strip() for x in visible.split(",") if x.strip()]
    if not 0 <= index < len(ids):
        raise SystemExit(f"--vllm-gpu {index}: CUDA_VISIBLE_DEVICES={visible} makes {len(ids)} GPU(s) visible")
    return ids[index]


def start_vllm_server(args: Args, log_path: str):
    """Launch vllm_sync_server.py next to this file, wait for /health, stop it when this process exits."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": physical_gpu(args.vllm_gpu)}
    server = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_sync_server.py")
    if not os.path.isfile(server):  # a copy of this script outside the repository: the server file stays behind
        refuse(f"--start-server needs vllm_sync_server.py beside this script: copy it to {server}")
    cmd = [sys.executable, server, "--model", args.model, "--host", args.vllm_host, "--port", str(args.vllm_port)]
    cmd += shlex.split(args.server_args)
    from vllm_sync_server import launch  # the server's own: it stops with this run, and is watched while it runs

    launch(cmd, env, log_path, f"http://{args.vllm_host}:{args.vllm_port}")


def connect(args: Args, console) -> tuple[str, object, str, Optional[int]]:
    """The server to evaluate: the --base-url one through the openai client, or vllm_sync_server.py (started first
    with --start-server). Returns its URL, the client (None for vllm_sync_server.py), the model it serves, with a
    warning when that is not --model, and its max_model_len (None: a --base-url server that does not list it)."""
    url = f"http://{args.vllm_host}:{args.vllm_port}"
    client = None
    if args.base_url:  # any OpenAI-compatible server; the client needs a key string, and vLLM ignores it when unkeyed
        import openai

        url = args.base_url
        key = os.environ.get("VLLM_API_KEY") or "EMPTY"
        client = openai.OpenAI(base_url=url, api_key=key, timeout=args.request_timeout_s, max_retries=args.max_retries)
        served, max_model_len = openai_model(client, args.served_model_name)
    else:
        if args.start_server:
            start_vllm_server(args, "vllm_server.log")
        info = requests.get(url + "/runtime_version", timeout=30, headers=auth_headers()).json()
        served, max_model_len = info.get("model"), info.get("max_model_len")
    if served != args.model:  # the tokenizer and template come from --model, the completions from the server
        console.print(f"[yellow]WARNING: the server at {url} serves {served!r}, not --model {args.model!r}")
    return url, client, served, max_model_len


def saved_args(path: str) -> dict:
    """The arguments a training script saved with the checkpoint at `path` (its args.json), those that are flags of
    this script, tuples restored from JSON's lists; {} when the checkpoint has none."""
    file = os.path.join(path, "args.json")
    if not os.path.isfile(file):
        return {}
    with open(file) as f:
        saved = json.load(f)
    defaults = Args()
    known = {f.name for f in fields(Args)}
    return {k: tuple(v) if isinstance(getattr(defaults, k), tuple) else v for k, v in saved.items() if k in known}


def command_line() -> list[str]:
    """This process's arguments, `--server-args VALUE` glued into `--server-args=VALUE`: tyro would read a VALUE that
    starts with a dash as flags of this script ("Missing value for argument '--server-args'")."""
    argv = sys.argv[1:]
    for i in reversed([i for i, arg in enumerate(argv[:-1]) if arg == "--server-args"]):
        argv[i : i + 2] = [f"--server-args={argv[i + 1]}"]
    return argv


def parse_args() -> Args:
    """The command line. When --model is a checkpoint of a training script, the system prompt it trained with (saved
    in its args.json) is the default: the evaluation scores what the training scored, and --system-prompt given
    explicitly overrides it (tyro fills every flag not on the command line from `default`)."""
    import tyro

    args = tyro.cli(Args, args=command_line(), description=__doc__)
    saved = saved_args(args.model) if os.path.isdir(args.model) else {}
    if "system_prompt" in saved:
        args = tyro.cli(
            Args, args=command_line(), description=__doc__, default=Args(system_prompt=saved["system_prompt"])
        )
        how = "its own" if args.system_prompt == saved["system_prompt"] else "the one --system-prompt gives"
        print(f"{args.model} trained with system prompt {saved['system_prompt']!r}: evaluating with {how}", flush=True)
    return args


def servable_model(model: str) -> str:
    """The model to evaluate for --model `model`: itself, or for a LoRA checkpoint of grpo_gsm8k.py (`step_N/`: the
    adapter in peft's format, which no server loads as a model) its merged model, `step_N/merged/`; an error naming
    merged/ when the directory is an adapter without one."""
    adapter_only = os.path.isfile(os.path.join(model, "adapter_config.json")) and not os.path.isfile(
        os.path.join(model, "config.json")
    )
    if not adapter_only:
        return model
    merged = os.path.join(model, "merged")
    if not os.path.isfile(os.path.join(merged, "config.json")):
        raise SystemExit(
            f"--model {model} holds a LoRA adapter (peft's format), not a model a server loads, and no merged/ "
            f"directory inside it: give --model a merged model (grpo_gsm8k.py --lora-rank writes one into every "
            f"checkpoint, {merged})"
        )
    return merged


def check_args(args: Args) -> None:
    """Refuse contradictory or empty settings before any work. A LoRA checkpoint's --model becomes, in `args`, its
    merged model."""
    if args.n > 1 and args.temperature == 0:
        raise SystemExit("--n > 1 needs --temperature > 0: greedy samples are all the same (and vLLM refuses them)")
    if args.base_url and args.start_server:
        raise SystemExit("--base-url evaluates a server that is already running: leave out --start-server")
    if (model := servable_model(args.model)) != args.model:  # a LoRA checkpoint: its merged model
        print(f"{args.model} is a LoRA checkpoint: evaluating its merged model {model}", flush=True)
        args.model = model
    if args.limit is not None and args.limit < 1:
        raise SystemExit(f"--limit is a number of problems, 1 or more (None: all of them); got {args.limit}")
    if args.grade_workers < 1:
        raise SystemExit(f"--grade-workers must be 1 or more, got {args.grade_workers}")


def check_lengths(longest_prompt: int, max_completion_tokens: int, max_model_len: int) -> None:
    """Refuse, at the start, a completion budget that the server's context cannot hold after the longest prompt: the
    server would refuse that prompt's requests steps later."""
    if longest_prompt + max_completion_tokens > max_model_len:
        raise SystemExit(
            f"--max-tokens {max_completion_tokens} after the longest prompt ({longest_prompt} tokens) "
            f"exceeds the server's max_model_len {max_model_len}: lower it, or start the server with a larger "
            "--max-model-len"
        )


DEFAULT_DATASET = {"gsm8k": "openai/gsm8k", "math500": "HuggingFaceH4/MATH-500"}
PROBLEM_FIELD = {"gsm8k": "question", "math500": "problem"}


def gold_field_of(row, task: str) -> str:
    """The field of a row that holds its gold: `answer`; for MATH without one (the original MATH), `solution`."""
    no_answer = task == "math500" and isinstance(row, dict) and not row.get("answer")
    return "solution" if no_answer and "solution" in row else "answer"


def load_split(dataset: str, split: str, task: str) -> list[dict]:
    """Rows in the task's schema: GSM8K {question, answer}; MATH-500 {problem, solution, answer, subject, level,
    unique_id} (the original MATH, without `answer`, works too). From the hub or `dataset`/{split}.jsonl. Every row is
    checked, before any work: a bad one stops the run, named by its file and line (a hub row: its split and index)."""
    if os.path.isdir(dataset):  # one JSON object per line (blank lines skipped): no need of `datasets` to read it
        rows = read_jsonl(os.path.join(dataset, f"{split}.jsonl"))
    else:
        import datasets

        hub = datasets.load_dataset(dataset, *(["main"] if task == "gsm8k" else []), split=split)  # GSM8K's config
        rows = [(f"{dataset} {split}[{i}]", row) for i, row in enumerate(hub)]
    for where, row in rows:
        field = gold_field_of(row, task)
        if problem := row_problem(row, PROBLEM_FIELD[task], field) or gold_problem(row[field], task, field):
            refuse(f"{where}: {problem}")
    return [row for _, row in rows]


def read_jsonl(file: str) -> list[tuple[str, object]]:
    """Each non-blank line of `file` as (FILE:LINE, its JSON value). A line that is not JSON stops the run there."""
    rows = []
    with open(file) as f:
        for n, line in enumerate(f, 1):
            try:
                rows += [(f"{file}:{n}", json.loads(line.rstrip("\n")))] if line.strip() else []
            except json.JSONDecodeError as e:
                refuse(f"{file}:{n}: not JSON ({e.msg}, column {e.colno})")
    return rows


def row_problem(row, problem_field: str, gold_field: str) -> Optional[str]:
    """What is wrong with a data row, or None: it must be an object whose problem and gold answer are strings, the
    problem not empty."""
    if not isinstance(row, dict):
        return f"not a JSON object but {type(row).__name__}"
    for name in (problem_field, gold_field):
        if name not in row:
            return f"no '{name}' field"
        if not isinstance(row[name], str):
            return f"'{name}' is not a string but {type(row[name]).__name__}"
    return None if row[problem_field].strip() else f"'{problem_field}' is empty"


def gold_problem(answer: str, task: str, field: str) -> Optional[str]:
    """What keeps grade from reading a gold answer of `task` (the row's `field`), or None. GSM8K: its final answer
    (after '####', or the whole field) must be a number, as every GSM8K answer is. MATH: gold_answer must find one
    (in a `solution`: its last box)."""
    if task == "gsm8k":
        final = re.sub(r"[,\s]", "", answer.split("####")[-1])
        return None if re.fullmatch(NUM, final) else f"'answer' ends in no number ('#### 42'): {final[:40]!r}"
    if field == "solution" and last_boxed(answer) is None:
        return "'solution' has no \\boxed{} answer, and no 'answer' field gives one"
    return None if gold_answer(answer, task).strip() else f"'{field}' is empty"


def refuse(message: str) -> None:
    """Stop the run on bad input: one line on stderr, no traceback, exit status 2."""
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(2)


def chat_messages(system_prompt: str, question: str) -> list[dict]:
    """A problem as chat messages: the system prompt (none if ""), then the question as it is, the user's turn."""
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return msgs + [{"role": "user", "content": question}]


def render_prompt(tokenizer, system_prompt: str, question: str) -> str:
    """What a chat route renders from chat_messages(system_prompt, question), with the same template: the prompt
    text, the assistant's turn opened."""
    msgs = chat_messages(system_prompt, question)
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


# ---------------------------------------------------------------------------------------------------
# The output: one JSONL line per problem, a summary line, a table
def write_results(
    path: str,
    args: Args,
    *,
    rows: list[dict],
    prompts: list[str],
    golds: list[str],
    samples: list[list[dict]],
    texts: list[str],
    verdicts: dict[str, list[list]],
    metrics: dict,
    served: str,
    dataset: str,
    template: str,
    start_time: float,
) -> None:
    """The JSONL file at `path`: one line per problem (its prompt, gold, completions, extracted answers and verdicts),
    then a summary line: the metrics and what produced them. `texts`: the completions as graded, [problems * n];
    `verdicts`: a field of each line (correct, parse_error, ...) -> its [problems][n] values."""
    graded = per_problem(texts, args.n)
    with open(path, "w") as f:
        for i, row in enumerate(rows):
            record = {
                "index": i,
                "id": row.get("unique_id", i),
                "prompt": prompts[i],
                "gold": golds[i],
                "gold_answer": gold_answer(golds[i], args.task),
                "completions": [c["text"] for c in samples[i]],
                "extracted": [extract_answer(t, args.strict_format) for t in graded[i]],
                **{field: values[i] for field, values in verdicts.items()},
                "finish_reason": [c["finish_reason"] for c in samples[i]],
            }
            f.write(json.dumps(record) + "\n")
        summary = {**metrics, "num_problems": len(rows), "n": args.n, "model": args.model, "served_model": served}
        summary |= {"task": args.task, "dataset": dataset, "split": args.split, "limit": args.limit}  # the problems
        summary |= {"temperature": args.temperature, "max_tokens": args.max_tokens, "system_prompt": args.system_prompt}
        summary |= {"template": template, "strict_format": args.strict_format, "seed": args.seed}
        summary["elapsed_s"] = time.time() - start_time
        f.write(json.dumps({"summary": summary}) + "\n")


def print_results(console, args: Args, metrics: dict, problems: int, template: str, out: str, started: float) -> None:
    """The metrics as a table on stdout; then the model, its template, where the lines went and the time taken."""
    from rich.table import Table

    table = Table("metric", "value", title=f"{args.task} {args.split}: {problems} problems x {args.n}")
    for k, v in metrics.items():
        table.add_row(k, f"{v:.4f}" if isinstance(v, float) else str(v))
    console.print(table)
    console.print(
        f"model {args.model}, template {template!r}; {problems + 1} lines written to {out} "
        f"in {time.time() - started:.1f}s",
        soft_wrap=True,
        markup=False,
    )


if __name__ == "__main__":
    args = parse_args()  # before the heavy imports: --help is instant
    check_args(args)
    dataset = args.dataset or DEFAULT_DATASET[args.task]
    rows = load_split(dataset, args.split, args.task)[: args.limit]  # before the server: no problems, no server
    if not rows:
        raise SystemExit(f"no problems to evaluate: {dataset} ({args.split} split) holds none")

    from rich.console import Console
    from transformers import AutoTokenizer

    # TRY NOT TO MODIFY: server, data (the only randomness is the sampling, seeded per request on the server)
    start_time = time.time()
    console = Console()
    out = args.out or f"{args.task}_eval.jsonl"
    url, client, served, max_model_len = connect(args, console)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    # what every prompt looks like; goes into the summary
    template = render_prompt(tokenizer, args.system_prompt, "{question}")
    # A template that opens the think block itself (DeepSeek-R1's does) leaves the completion without <think>
    think_prefilled = template.rstrip().endswith("<think>")

    # 1) prompts: the question as it is, in the model's chat template (zero-shot, no answer-format hint unless the
    #    system prompt gives one); gold: the raw gold field (gold_field_of)
    questions = [r[PROBLEM_FIELD[args.task]] for r in rows]
    golds = [r[gold_field_of(r, args.task)] for r in rows]
    prompts = [render_prompt(tokenizer, args.system_prompt, q) for q in questions]
    prompt_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]  # as the server counts them
    if max_model_len is not None:  # (a --base-url server that does not list it: not checked)
        check_lengths(max(map(len, prompt_ids)), args.max_tokens, max_model_len)

    # 2) generate: n samples per problem, progress on stderr (stdout keeps the table)
    samples = generate_samples(args, url=url, client=client, served=served, questions=questions, prompt_ids=prompt_ids)
    texts = [("<think>" if args.strict_format and think_prefilled else "") + c["text"] for cs in samples for c in cs]

    # 3) grade: every sample against its problem's gold, in worker processes with a CPU-time limit
    correct, parse_error = grade_samples(texts, golds, args)
    # /generate returns the token ids; a chat completion only their count
    tokens = [[len(c["token_ids"]) if "token_ids" in c else c["completion_tokens"] for c in cs] for cs in samples]

    # 4) metrics: first-sample accuracy (boxed; and the last number, boxed or not), rates over all samples, pass@k
    last_number = [
        [last_number_right(t, gold_answer(g, args.task)) for t in ts]
        for ts, g in zip(per_problem(texts, args.n), golds, strict=True)
    ]
    verdicts = {"correct": correct, "parse_error": parse_error, "last_number_right": last_number, "tokens": tokens}
    metrics = summarize(verdicts)

    # 5) log: one JSONL line per problem, a summary line, a table
    write_results(
        out,
        args,
        rows=rows,
        prompts=prompts,
        golds=golds,
        samples=samples,
        texts=texts,
        verdicts=verdicts,
        metrics=metrics,
        served=served,
        dataset=dataset,
        template=template,
        start_time=start_time,
    )
    print_results(console, args, metrics, problems=len(rows), template=template, out=out, started=start_time)
