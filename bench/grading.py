"""Benchmark: grading throughput, serial vs the process pool, and the latency of a poisoned batch.

1. Throughput on typical completions (GSM8K-like integer answers and MATH-like LaTeX answers from the public
   case file): grpo_gsm8k.grade called in a loop in this process, against grpo_gsm8k.grade_batch with 2
   workers (this machine has 2 cores). Target: pool >= 1.8x serial.
2. A batch of typical samples with pathological ones mixed in (9^{9^{9^{9}}}, 10000000!, 100-deep \\frac,
   100 KB of garbage): its wall time against the limit per sample. Target: no batch slower than its slowest
   sample's limit (plus the restart of a killed worker).
Run: python bench/grading.py
"""

import json
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import grpo_gsm8k as G  # noqa: E402


def typical(n: int, rng: random.Random) -> list[tuple[str, str]]:
    cases = [json.loads(x) for x in open(os.path.join(ROOT, "tests", "grading_cases.jsonl"))]
    out = []
    for i in range(n):
        if i % 2:  # GSM8K-like: an integer, right 60% of the time
            gold = rng.randint(1, 5000)
            pred = gold if rng.random() < 0.6 else gold + rng.randint(1, 9)
            out.append((f"Step by step... so the total is \\boxed{{{pred:,}}} dollars.", f"#### {gold}"))
        else:  # MATH-like LaTeX from the case file
            c = rng.choice(cases)
            out.append((c["completion"], c["gold"]))
    return out


if __name__ == "__main__":
    rng = random.Random(0)
    batch = typical(600, rng)
    comps, golds = [c for c, _ in batch], [g for _, g in batch]
    G.grade_batch(comps[:4], golds[:4], timeout_s=30)  # start the workers outside the timed region
    t0 = time.perf_counter()
    serial = [G.grade(c, g) for c, g in batch]
    t_serial = time.perf_counter() - t0
    t0 = time.perf_counter()
    pooled = G.grade_batch(comps, golds, timeout_s=5.0)
    t_pool = time.perf_counter() - t0
    assert [tuple(x) for x in serial] == [tuple(x) for x in pooled]
    print(f"typical completions: serial {len(batch) / t_serial:.0f}/s, pool of 2 {len(batch) / t_pool:.0f}/s: "
          f"{t_serial / t_pool:.2f}x (target >= 1.8x); same verdicts")

    bad = [r"\boxed{9^{9^{9^{9}}}}", r"\boxed{10000000!}", r"\boxed{" + r"\frac{1}{" * 100 + "2" + "}" * 100 + "}", "x" * 100_000]
    for timeout_s in (1.0, 2.0):
        mixed = list(zip(comps[:60], golds[:60])) + [(b, "5") for b in bad]
        rng.shuffle(mixed)
        t0 = time.perf_counter()
        grades = G.grade_batch([c for c, _ in mixed], [g for _, g in mixed], timeout_s=timeout_s)
        dt = time.perf_counter() - t0
        zero = all(g.reward == 0 for (c, _), g in zip(mixed, grades) if c in bad)
        print(f"60 typical + {len(bad)} pathological, limit {timeout_s:.0f} s per sample: {dt:.2f} s "
              f"(pathological ones score 0: {zero})")
