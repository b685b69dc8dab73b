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
Run: python bench/grading.py
"""

import multiprocessing as mp
import os
import random
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


if __name__ == "__main__":
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
        print(f"typical completions, run {rep}: serial {len(batch) / t_serial:.0f}/s, pool of 2 {len(batch) / t_pool:.0f}/s "
              f"= {t_serial / t_pool:.2f}x serial (target >= 1.8x; same verdicts); two independent serial processes "
              f"{len(batch) / t_ceiling:.0f}/s = {t_serial / t_ceiling:.2f}x (the machine's ceiling)")

    bad = [r"\boxed{9^{9^{9^{9}}}}", r"\boxed{10000000!}", r"\boxed{" + r"\frac{1}{" * 100 + "2" + "}" * 100 + "}", "x" * 100_000]
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
        print(f"limit {timeout_s:.0f} s per sample: 60 typical alone {t_clean:.2f} s; 60 other typical + {len(bad)} "
              f"pathological {dt:.2f} s = limit + {dt - timeout_s:.2f} s (target: <= limit + {t_clean:.2f} s); "
              f"pathological ones score 0 with parse_error: {zero}")
