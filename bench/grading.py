"""Benchmark: grading throughput, serial vs the process pool, and the latency of a poisoned batch.

1. Throughput on typical completions (distinct GSM8K-like integers and MATH-like LaTeX: fractions, radicals,
   tuples, intervals vs inequalities, pi, decimals, degrees): grpo_gsm8k.grade called in a loop in this
   process, against grpo_gsm8k.grade_batch with 2 workers (this machine has 2 cores), and against the
   machine's ceiling, two independent processes grading half each. Target: pool >= 1.8x serial.
2. A batch of typical samples with pathological ones mixed in (9^{9^{9^{9}}}, 10000000!, 100-deep \\frac,
   100 KB of garbage), against the same number of typical samples alone. A stuck sample is handed out at some
   point of the batch and runs out its limit from there; target: the batch takes at most that limit plus the
   time of its typical samples alone (the stuck ones cost nothing but their own limit, never the wait for a
   killed worker's replacement).
3. `--load N`: the public case file (tests/grading_cases.jsonl) through `--module`'s grade_batch on a quiet
   machine, then again while N busy processes hold the cores (each spins `--threads` threads, one per core by
   default, as an inference server's thread pool does): prints the verdicts that changed (target 0: a busy machine
   must not change a reward) and the time of each pass. Every pass gets a fresh pool, so that no worker has the
   cases in sympy's cache already.
Run: python bench/grading.py [--load N [--threads T] [--module eval] [--timeout-s 5] [--reps 3]]
"""

import argparse
import importlib
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import grpo_gsm8k as G  # noqa: E402


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


def serial_half(batch, go, conn):
    G.grade(r"\boxed{1}", "1")  # warm-up: imports sympy and builds math-verify's parsers
    conn.send(None)
    go.wait()
    t0 = time.perf_counter()
    for c, g in batch:
        G.grade(c, g)
    conn.send(time.perf_counter() - t0)


def ceiling(batch) -> float:
    """Wall time of two independent processes grading half each: what this machine's 2 cores give at best."""
    ctx = mp.get_context("spawn")
    go, pipes, procs = ctx.Event(), [], []
    for half in (batch[0::2], batch[1::2]):
        a, b = ctx.Pipe()
        procs.append(ctx.Process(target=serial_half, args=(half, go, b)))
        procs[-1].start()
        pipes.append(a)
    for a in pipes:
        a.recv()
    t0 = time.perf_counter()
    go.set()
    for a in pipes:
        a.recv()
    dt = time.perf_counter() - t0
    for p in procs:
        p.join()
    return dt


BUSY = """import hashlib, threading
data = bytes(1 << 20)
def spin():
    while True:
        hashlib.sha256(data)  # sha256 of 1 MB releases the GIL: every thread keeps a core busy
for _ in range(%d - 1):
    threading.Thread(target=spin, daemon=True).start()
spin()
"""


def loaded(module: str, n_load: int, threads: int, timeout_s: float, reps: int) -> None:
    """Verdicts of the case file on a quiet machine against the same under n_load busy processes (and the times)."""
    M = importlib.import_module(module)
    kw = {"reinforce_math_fsdp2": {"strict_format": False}}.get(module, {})  # the case file is about answers
    cases = [json.loads(line) for line in open(os.path.join(ROOT, "tests", "grading_cases.jsonl")) if line.strip()]
    comps, golds = [c["completion"] for c in cases], [c["gold"] for c in cases]

    def run():  # a fresh pool, started outside the timed region
        for w in M.GRADERS:
            if w:
                w[0].kill(), w[0].join(5)
        M.GRADERS.clear()
        M.grade_batch([r"\boxed{1}"], ["1"], timeout_s=timeout_s, **kw)
        t0 = time.perf_counter()
        grades = M.grade_batch(comps, golds, timeout_s=timeout_s, **kw)
        return [(g.correct, g.parse_error) for g in grades], time.perf_counter() - t0

    quiet, t_quiet = run()
    expected = [(c["correct"], c["parse_error"]) for c in cases]
    print(
        f"{module}, timeout_s={timeout_s:g} per sample, {len(cases)} cases: quiet {t_quiet:.2f} s, "
        f"{sum(a != b for a, b in zip(quiet, expected))} verdicts differ from the case file",
        flush=True,
    )
    busy = [subprocess.Popen([sys.executable, "-c", BUSY % threads]) for _ in range(n_load)]
    try:
        time.sleep(0.5)
        for rep in range(reps):
            got, t_load = run()
            changed = [i for i, (a, b) in enumerate(zip(got, quiet)) if a != b]
            print(
                f"  under {n_load} busy processes x {threads} threads, run {rep}: {t_load:.2f} s "
                f"({t_load / t_quiet:.1f}x quiet), {len(changed)} changed verdicts (target 0)"
                f"{': cases ' + str(changed) if changed else ''}",
                flush=True,
            )
    finally:
        for p in busy:
            p.kill(), p.wait()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--load", type=int, default=0, help="busy processes: compare verdicts quiet vs loaded")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="spinning threads per busy process")
    ap.add_argument("--module", default="grpo_gsm8k", help="whose grade_batch --load uses")
    ap.add_argument("--timeout-s", type=float, default=5.0, help="grade_batch's timeout_s in --load")
    ap.add_argument("--reps", type=int, default=3, help="loaded passes in --load")
    cli = ap.parse_args()
    if cli.load:
        loaded(cli.module, cli.load, cli.threads, cli.timeout_s, cli.reps)
        sys.exit(0)
    rng = random.Random(0)
    batch = typical(600, rng)
    comps, golds = [c for c, _ in batch], [g for _, g in batch]
    assert len(set(batch)) == len(batch)
    G.grade_batch(comps[:4], golds[:4], timeout_s=30)  # start the workers (and the spares) outside the timed region
    G.grade(r"\boxed{1}", "1")  # and warm this process's grader
    time.sleep(3)
    G.grade_batch(comps[:8], golds[:8], timeout_s=30)
    assert all(ready for _, _, ready in G.GRADERS)
    for rep in range(3):
        batch = typical(600, rng)  # new samples every run: every grader meets them for the first time
        comps, golds = [c for c, _ in batch], [g for _, g in batch]
        t0 = time.perf_counter()
        serial = [G.grade(c, g) for c, g in batch]
        t_serial = time.perf_counter() - t0
        t0 = time.perf_counter()
        pooled = G.grade_batch(comps, golds, timeout_s=5.0)
        t_pool = time.perf_counter() - t0
        t_ceiling = ceiling(batch)
        assert [tuple(x) for x in serial] == [tuple(x) for x in pooled]
        print(
            f"typical completions, run {rep}: serial {len(batch) / t_serial:.0f}/s, pool of 2 {len(batch) / t_pool:.0f}/s "
            f"= {t_serial / t_pool:.2f}x serial (target >= 1.8x; same verdicts); two independent serial processes "
            f"{len(batch) / t_ceiling:.0f}/s = {t_serial / t_ceiling:.2f}x (the machine's ceiling)"
        )

    bad = [
        r"\boxed{9^{9^{9^{9}}}}",
        r"\boxed{10000000!}",
        r"\boxed{" + r"\frac{1}{" * 100 + "2" + "}" * 100 + "}",
        "x" * 100_000,
    ]
    for timeout_s in (1.0, 2.0, 1.0, 2.0):
        time.sleep(2)  # replacements of killed workers warm up, as they would during a training step
        clean = typical(60, rng)
        t0 = time.perf_counter()
        G.grade_batch([c for c, _ in clean], [g for _, g in clean], timeout_s=timeout_s)
        t_clean = time.perf_counter() - t0
        mixed = typical(60, rng) + [(b, "5") for b in bad]
        rng.shuffle(mixed)
        t0 = time.perf_counter()
        grades = G.grade_batch([c for c, _ in mixed], [g for _, g in mixed], timeout_s=timeout_s)
        dt = time.perf_counter() - t0
        zero = all(g.reward == 0 and g.parse_error for (c, _), g in zip(mixed, grades) if c in bad)
        print(
            f"limit {timeout_s:.0f} s per sample: 60 typical alone {t_clean:.2f} s; 60 other typical + {len(bad)} "
            f"pathological {dt:.2f} s = limit + {dt - timeout_s:.2f} s (target: <= limit + {t_clean:.2f} s); "
            f"pathological ones score 0 with parse_error: {zero}"
        )
