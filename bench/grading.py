"""Benchmark: the grading pool, pebble's (the scripts' grade_batch) against a hand-written pool with warm spares.

Both pools grade the same batches in one run, one after the other, each in its own warm processes (so no pool profits
from the other's sympy cache); this machine has 2 cores: the hand-written pool gets 2 workers plus its 2 warm spares,
pebble's grade_batch's default (4); `--pebble-workers K` adds pebble's pool with K workers.
1. Throughput on typical completions (distinct GSM8K-like integers and MATH-like LaTeX: fractions, radicals,
   tuples, intervals vs inequalities, pi, decimals, degrees), against grpo_gsm8k.grade in a loop in this process
   (quiet runs only). Both pools must give the serial verdicts.
2. Worst-case batch latency: 60 typical samples with 4 pathological ones mixed in (9^{9^{9^{9}}}, 10000000!,
   100-deep \\frac, 100 KB of garbage), at a CPU-time limit of 1 and 2 s per sample, against the same number of
   typical samples alone; the worst batch over the runs. Every pathological sample must score 0 with parse_error.
3. `--load N`: N busy processes hold the cores during 1 and 2 (each spins `--threads` threads, one per core by
   default, as an inference server's thread pool does), and before them the public case file
   (tests/grading_cases.jsonl) goes through a fresh pool of each kind on a quiet machine, then again under the load:
   the verdicts that changed (target 0: a busy machine must not change a reward) and the time of each pass.
Every copy of grade_batch (grpo_gsm8k, reinforce_math_fsdp2, pipeline_actor, eval) carries the same pool
(tests/test_grading_cases.py), so grpo_gsm8k's stands for all of them.
Run: python bench/grading.py [--load N [--threads T]] [--reps R] [--timeout-s 5] [--pebble-workers K]
"""

import argparse
import functools
import inspect
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import time
from multiprocessing.connection import wait

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import grpo_gsm8k as G  # noqa: E402


# ---- the reference: the hand-written pool that grade_batch replaced, verbatim from grpo_gsm8k.py at commit 7e5f5bf
# but for the names (old_ prefix, G. for the module's grade) and a noqa. `workers` samples at once, a warm spare takes
# the next sample when one runs over slow_s, the wall-clock backstop kills with SIGKILL, replacements warm up after the
# batch.
def old_grade_worker(conn) -> None:
    import logging

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeouts are off" warning: grade's CPU limit is on
    G.grade("\\boxed{x \\le 1/2}", "(-\\infty, 1/2]")  # warm-up: imports sympy and builds math-verify's parsers (~1 s)
    conn.send(None)  # ready: the deadline of its first sample may start
    while True:  # grading runs in this process's main thread, where grade's CPU-time signal works
        try:
            conn.send(tuple(G.grade(*conn.recv())))
        except EOFError:  # the trainer is gone
            return


OLD_GRADERS: list = []  # [process, pipe, ready] per worker (None: killed), started once and reused


def old_grade_batch(
    completions: list[str],
    golds: list[str],
    timeout_s: float,
    workers: int = 2,
    slow_s: float = 0.25,
    backstop_s: float = 60.0,
) -> list[G.Grade]:
    """Grade in worker processes, each sample within `timeout_s` seconds of its worker's CPU time (past them it scores
    0, parse_error; a busy machine changes no verdict). The last resort is wall clock: a worker still on one sample
    `backstop_s` after it got it (stuck in C code) is killed, and that sample scores 0, parse_error, too.
    `workers` samples run at once, plus one on a warm spare per sample running over `slow_s` (suspected stuck), so
    neither a stuck sample nor the restart of a killed worker stalls the rest."""
    ctx = mp.get_context("spawn")

    def start():  # spawn, so a worker never inherits threads or CUDA
        a, b = ctx.Pipe()
        (p := ctx.Process(target=old_grade_worker, args=(b,), daemon=True)).start()
        return [p, a, False]

    def kill(w):  # its replacement warms up (~1 s of CPU) after the batch, unless the batch needs it now
        busy.pop(w), OLD_GRADERS[w][0].kill(), OLD_GRADERS[w][0].join(1), OLD_GRADERS[w][1].close()
        OLD_GRADERS[w] = start() if sum(map(bool, OLD_GRADERS)) - 1 < workers else None

    OLD_GRADERS[:] = [g or start() for g in OLD_GRADERS] + [start() for _ in range(2 * workers - len(OLD_GRADERS))]
    results, todo, busy = [G.Grade(0.0, False, True)] * len(completions), list(range(len(completions)))[::-1], {}
    while todo or busy:
        now = time.monotonic()
        fresh = sum(now - t < slow_s for _, t in busy.values())  # samples not suspected stuck
        for w, g in enumerate(OLD_GRADERS):
            if g and g[2] and w not in busy and todo and fresh < workers:
                i, fresh = todo.pop(), fresh + 1
                g[1].send((completions[i], golds[i], timeout_s))
                busy[w] = (i, now)  # the clock starts when the sample is handed out
        pending = {g[1]: w for w, g in enumerate(OLD_GRADERS) if g and (w in busy or not g[2])}
        wake = min((t + (slow_s if now - t < slow_s else backstop_s) for _, t in busy.values()), default=now + 60)
        for conn in wait(list(pending), timeout=max(0.0, wake - time.monotonic())):
            w = pending[conn]
            try:
                if w not in busy:
                    OLD_GRADERS[w][2] = conn.recv() is None  # "ready": warmed up
                else:  # (the right-hand side runs first: no pop if recv fails)
                    results[busy.pop(w)[0]] = G.Grade(*conn.recv())
            except EOFError:  # the worker died: its sample keeps the default verdict
                if w not in busy:
                    raise RuntimeError("a grading worker died while starting: see its traceback above")  # noqa: B904
                kill(w)
        for w in [w for w, (_, t) in busy.items() if time.monotonic() - t >= backstop_s]:
            kill(w)
    OLD_GRADERS[:] = [g or start() for g in OLD_GRADERS]  # replacements warm up while the caller does something else
    return results


def old_stop() -> None:
    """End the hand-written pool's workers (for a fresh pool)."""
    for w in OLD_GRADERS:
        if w:
            w[0].kill()
            w[0].join(5)
    OLD_GRADERS.clear()


def stop_pebble(workers: int) -> None:
    """End grpo_gsm8k's pebble pool of `workers` workers alone (stop_graders ends them all)."""
    pool = G.GRADERS.pop(workers, None)
    if pool is not None:
        pool.stop()
        pool.join()


NEW_WORKERS = inspect.signature(G.grade_batch).parameters["workers"].default  # the scripts' pool
POOLS = {  # name -> (grade_batch, stop); --pebble-workers K adds pebble's pool with K workers
    "hand-written (spares)": (old_grade_batch, old_stop),
    "pebble (new)": (G.grade_batch, functools.partial(stop_pebble, NEW_WORKERS)),
}


def typical(n: int, rng: random.Random) -> list[tuple[str, str]]:
    """n distinct (completion, gold) pairs shaped like GSM8K and MATH answers, right about 60% of the time. Random
    numbers keep them distinct, so no grader profits from sympy's cache of an expression it already saw."""
    out, i = {}, 0
    while len(out) < n:
        i += 1
        a, b, c = rng.randint(2, 999), rng.randint(2, 99), rng.randint(2, 9)
        right = rng.random() < 0.6
        d = a if right else a + rng.randint(1, 9)
        form = [
            (f"\\boxed{{{d:,}}} dollars", f"Natalia sold ... #### {a}"),  # GSM8K
            (f"\\boxed{{\\frac{{{d}}}{{{b}}}}}", f"{a}/{b}"),
            (f"\\boxed{{{d}\\sqrt{{{c}}}}}", f"\\sqrt{{{a * a * c}}}"),
            (f"\\boxed{{({d}, -{b})}}", f"(\\frac{{{2 * a}}}{{2}}, -{b})"),
            (f"\\boxed{{[-{b}, {d})}}", f"-{b} \\le x < {a}"),
            (f"\\boxed{{x = {d}\\pi}}", f"\\pi \\cdot {a}"),
            (f"\\boxed{{{d}.{c}}}", f"\\frac{{{10 * a + c}}}{{10}}"),
            (f"\\boxed{{{d}^\\circ}}", f"{a}"),
        ][i % 8]
        out[(f"Step by step ... so the answer is ${form[0]}$.", form[1])] = None
    return list(out)


PATHOLOGICAL = [
    r"\boxed{9^{9^{9^{9}}}}",
    r"\boxed{10000000!}",
    r"\boxed{" + r"\frac{1}{" * 100 + "2" + "}" * 100 + "}",
    "x" * 100_000,
]

BUSY = """import hashlib, threading
data = bytes(1 << 20)
def spin():
    while True:
        hashlib.sha256(data)  # sha256 of 1 MB releases the GIL: every thread keeps a core busy
for _ in range(%d - 1):
    threading.Thread(target=spin, daemon=True).start()
spin()
"""


def fresh(name: str) -> None:
    """Stop the pool `name`, then start it again outside any timed region: its first batch starts its workers."""
    grade_batch, stop = POOLS[name]
    stop()
    grade_batch([r"\boxed{1}"], ["1"], timeout_s=30)
    time.sleep(3)  # the hand-written pool's spares warm up after its first batch


def timed(name: str, batch: list[tuple[str, str]], timeout_s: float) -> tuple[list[tuple], float]:
    grade_batch, _ = POOLS[name]
    t0 = time.perf_counter()
    grades = grade_batch([c for c, _ in batch], [g for _, g in batch], timeout_s=timeout_s)
    return [tuple(g) for g in grades], time.perf_counter() - t0


def case_file(timeout_s: float) -> dict:
    """The public case file through a fresh pool of each kind: {pool: {"verdicts": [...], "seconds": ...}}."""
    with open(os.path.join(ROOT, "tests", "grading_cases.jsonl")) as f:
        cases = [json.loads(line) for line in f if line.strip()]
    batch = [(c["completion"], c["gold"]) for c in cases]
    out = {}
    for name in POOLS:
        fresh(name)
        grades, seconds = timed(name, batch, timeout_s)
        verdicts = [(correct, parse_error) for _, correct, parse_error in grades]
        out[name] = {"verdicts": verdicts, "seconds": seconds}
    return out


def main(cli) -> None:
    rng = random.Random(0)
    loaded = cli.load > 0
    where = f"under {cli.load} busy processes x {cli.threads} threads" if loaded else "quiet"
    changed = {}
    busy = []
    try:
        if loaded:  # the case file on a quiet machine, then under the load
            quiet = case_file(cli.timeout_s)
            busy = [subprocess.Popen([sys.executable, "-c", BUSY % cli.threads]) for _ in range(cli.load)]
            time.sleep(0.5)
            under = case_file(cli.timeout_s)
            for name in POOLS:
                pairs = zip(quiet[name]["verdicts"], under[name]["verdicts"], strict=True)
                changed[name] = [i for i, (a, b) in enumerate(pairs) if a != b]
                print(
                    f"{name}: {len(quiet[name]['verdicts'])} public cases, timeout_s={cli.timeout_s:g}: "
                    f"quiet {quiet[name]['seconds']:.2f} s, {where} {under[name]['seconds']:.2f} s, "
                    f"{len(changed[name])} changed verdicts (target 0)"
                    f"{': cases ' + str(changed[name]) if changed[name] else ''}",
                    flush=True,
                )
        for name in POOLS:
            fresh(name)
        G.grade(r"\boxed{1}", "1")  # warm this process's grader too (the serial reference)
        throughput = {name: [] for name in POOLS}
        latency = {(name, limit): [] for name in POOLS for limit in (1.0, 2.0)}
        alone = {(name, limit): [] for name in POOLS for limit in (1.0, 2.0)}
        zero = {name: True for name in POOLS}  # every pathological sample scored 0 with parse_error
        for rep in range(cli.reps):
            order = list(POOLS) if rep % 2 == 0 else list(POOLS)[::-1]  # neither pool always runs first
            batch = typical(cli.n, rng)  # new samples every run: every grader meets them for the first time
            verdicts = {}
            line = f"{where}, run {rep}, {len(batch)} typical samples:"
            if not loaded:
                t0 = time.perf_counter()
                serial = [tuple(G.grade(c, g)) for c, g in batch]
                t_serial = time.perf_counter() - t0
                line += f" serial {len(batch) / t_serial:.0f}/s;"
            for name in order:
                verdicts[name], seconds = timed(name, batch, 5.0)
                throughput[name].append(len(batch) / seconds)
                line += f" {name} {len(batch) / seconds:.0f}/s"
                line += f" (= {t_serial / seconds:.2f}x serial);" if not loaded else ";"
            same = all(verdicts[name] == verdicts[order[0]] for name in order)
            if not loaded:
                same = same and verdicts[order[0]] == serial
            print(f"{line} same verdicts: {same}", flush=True)
            for limit in (1.0, 2.0):
                clean = typical(60, rng)
                mixed = typical(60, rng) + [(b, "5") for b in PATHOLOGICAL]
                rng.shuffle(mixed)
                line = f"  limit {limit:g} CPU s per sample, 60 typical alone / 60 other typical + 4 pathological:"
                for name in order:
                    time.sleep(1)  # as between training steps: a killed worker's replacement warms up
                    _, t_clean = timed(name, clean, limit)
                    grades, t_mixed = timed(name, mixed, limit)
                    pairs = zip(mixed, grades, strict=True)
                    zeros = all(g == (0.0, False, True) for (c, _), g in pairs if c in PATHOLOGICAL)
                    zero[name] = zero[name] and zeros
                    alone[(name, limit)].append(t_clean)
                    latency[(name, limit)].append(t_mixed)
                    line += f" {name} {t_clean:.2f} / {t_mixed:.2f} s (pathological: 0 with parse_error: {zeros});"
                print(line, flush=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    print(f"\nsummary, {where}, {cli.reps} runs (worst-case: the slowest poisoned batch):")
    print(
        "| pool | throughput | 60 typical alone, 1 s / 2 s | worst-case poisoned batch, 1 s / 2 s "
        "| pathological: 0, parse_error | changed verdicts (case file) |"
    )
    print("| --- | ---: | ---: | ---: | --- | ---: |")
    for name in POOLS:
        speeds = throughput[name]
        alone_s = " / ".join(f"{max(alone[(name, limit)]):.2f} s" for limit in (1.0, 2.0))
        worst = " / ".join(f"{max(latency[(name, limit)]):.2f} s" for limit in (1.0, 2.0))
        print(
            f"| {name} | {min(speeds):.0f}-{max(speeds):.0f}/s | {alone_s} | {worst} | {zero[name]} | "
            f"{len(changed[name]) if loaded else '-'} |"
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--load", type=int, default=0, help="busy processes during the whole run (and the case file)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="spinning threads per busy process")
    ap.add_argument("--timeout-s", type=float, default=5.0, help="grade_batch's timeout_s for the case file")
    ap.add_argument("--reps", type=int, default=2, help="runs of the throughput and the poisoned batches")
    ap.add_argument("--n", type=int, default=300, help="typical samples per throughput run")
    ap.add_argument("--pebble-workers", type=int, default=0, help="also pebble's pool with this many workers")
    cli = ap.parse_args()
    if cli.pebble_workers:
        POOLS[f"pebble, {cli.pebble_workers} workers"] = (
            functools.partial(G.grade_batch, workers=cli.pebble_workers),
            functools.partial(stop_pebble, cli.pebble_workers),
        )
    main(cli)
