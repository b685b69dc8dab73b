"""Benchmark: share of computed tokens that are real tokens (not padding) in training micro-batches.

grpo_gsm8k.py's packing (sort by length, fill each micro-batch up to --micro-token-budget padded tokens)
against fixed-size micro-batches in arrival order, each padded to its longest sequence, with the same
number of micro-batches. Lengths: a GSM8K-like distribution (Qwen2.5 chat prompts with the default system
prompt are ~90-220 tokens; completions of a 0.5B instruct model ~120-512 tokens with a tail cut at the
512-token limit), 64 prompts x 8 completions a step, groups of 8 consecutive completions per prompt.

Run: python bench/packing.py     (pure Python, a second)
"""

import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from grpo_gsm8k import pack_micro_batches  # noqa: E402 (importable once the repository root is on sys.path)


def step_lengths(rng: random.Random, prompts=64, group=8, max_new=512, max_seq=1024):
    lengths = []
    for _ in range(prompts):
        prompt = int(rng.gauss(150, 30))
        for _ in range(group):  # completions of one prompt share the prompt, vary in length
            lengths.append(min(max_seq, prompt + min(max_new, int(rng.lognormvariate(5.4, 0.45)))))
    return lengths


def real_share(lengths, batches):
    computed = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    return sum(lengths) / computed


if __name__ == "__main__":
    rng = random.Random(0)
    print(f"{'budget':>8} {'micro-batches':>14} {'packed (this script)':>21} {'fixed-size, arrival order':>26}")
    for budget in (4096, 8192, 16384, 32768):
        ours, fixed, n_batches = [], [], []
        for _ in range(20):  # 20 training steps
            lengths = step_lengths(rng)
            packed = pack_micro_batches(lengths, budget)
            size = -(-len(lengths) // len(packed))  # same number of micro-batches, fixed size
            naive = [list(range(i, min(i + size, len(lengths)))) for i in range(0, len(lengths), size)]
            ours.append(real_share(lengths, packed))
            fixed.append(real_share(lengths, naive))
            n_batches.append(len(packed))
        print(
            f"{budget:>8} {sum(n_batches) / 20:>14.1f} {100 * sum(ours) / 20:>20.1f}% {100 * sum(fixed) / 20:>25.1f}%"
        )
    print("target: packed >= 95% real tokens")
