"""Benchmark: peak memory and time of per-token logprobs (forward + backward) for a 151,936-token vocabulary.
The chunked pass also returns the policy's entropy, from its forward logits; a copy of it without the entropy
shows what that costs, and a copy that computes the entropy in a no-grad pass of its own over the lm_head (one more
matmul per block) shows what that way would cost instead.

grpo_gsm8k.token_logprobs (the lm_head on 128 positions at a time, recomputed in backward) against the
naive way, a full fp32 log_softmax over [T, V] then a gather; the same values either way (checked here).
T = 1,024 completion tokens, hidden size 896 (Qwen2.5-0.5B). Each way runs in a fresh process; the figures
are the growth of its peak resident memory over what it held before the computation (weights, hidden states), with
glibc made to return freed blocks (so the peak is that of live tensors), and the seconds of its forward and backward.
Run: python bench/logprobs.py   (CPU, about a minute)
"""

import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V, H, T = 151_936, 896, 1024
# glibc's malloc keeps freed blocks below its mmap threshold (which rises with use, up to 32 MiB) in its heap, where
# fragmentation can keep them resident: the peak would measure the allocator's history. With a fixed, low threshold
# every block of 64 KiB or more is mapped on its own and returned when freed, so the peak is that of live tensors.
GLIBC_RETURNS_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run(way: str, weight_grad: bool) -> None:
    import torch

    sys.path.insert(0, ROOT)
    import grpo_gsm8k

    torch.manual_seed(0)
    lm_head = torch.nn.Linear(H, V, bias=False).requires_grad_(weight_grad)
    hidden = torch.randn(1, T + 1, H, requires_grad=True)
    ids = torch.randint(0, V, (1, T + 1))

    class Stub(torch.nn.Module):  # what token_logprobs needs of a causal LM: .model(...) and .lm_head
        def __init__(self):
            super().__init__()
            self.lm_head = lm_head
            self.model = lambda input_ids, attention_mask: type("Out", (), {"last_hidden_state": hidden})()

    at = torch.arange(T)
    if way != "chunked":  # token_logprobs without the entropy it returns: the rest of it, unchanged
        grpo_gsm8k.entropy_rows = lambda z, log_z, rows=16: torch.zeros_like(log_z)
    before = rss_mb()
    start = time.perf_counter()
    if way in ("chunked", "chunked-no-entropy", "entropy-pass"):
        lp, _ = grpo_gsm8k.token_logprobs(Stub(), ids, None, at)
        if way == "entropy-pass":  # the entropy in a no-grad pass of its own: one more lm_head matmul per block
            with torch.no_grad():
                for i in range(0, T, 128):
                    z = lm_head(hidden[0, i : i + 128]).float()  # [chunk, V]
                    _ = torch.logsumexp(z, dim=-1) - torch.softmax(z, dim=-1).mul_(z).sum(dim=-1)
    else:
        logits = lm_head(hidden[0, :-1]).float()  # [T, V]
        lp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]  # [T]
    lp.sum().backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{peak - before:.0f} {lp.sum().item():.6f} {hidden.grad.abs().sum().item():.6f} {seconds:.3f}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run(sys.argv[1], sys.argv[2] == "1")
        sys.exit()
    for weight_grad in (False, True):
        out = {}  # way -> {"peak": MB, "value": sum of logprobs, "grad": |grad of hidden|, "s": seconds}
        print(
            "lm_head weight", "trained: its [V, H] gradient counts too" if weight_grad else "frozen: activations only"
        )
        for way in ("naive", "chunked-no-entropy", "entropy-pass", "chunked"):
            r = subprocess.run(
                [sys.executable, __file__, way, str(int(weight_grad))],
                capture_output=True,
                text=True,
                check=True,
                env=os.environ | GLIBC_RETURNS_FREED_MEMORY,
            )
            peak, value, grad, seconds = map(float, r.stdout.split())
            out[way] = {"peak": peak, "value": value, "grad": grad, "s": seconds}
            print(
                f"  {way:>18}: peak +{peak:,.0f} MB   {seconds:.2f} s   sum of logprobs {value:.4f}   "
                f"|grad of hidden| {grad:.4f}"
            )
        naive = out["naive"]
        chunked = out["chunked"]
        assert abs(naive["value"] - chunked["value"]) < 1e-2
        assert abs(naive["grad"] - chunked["grad"]) < 1e-3 * naive["grad"]
        ratio = chunked["peak"] / naive["peak"]
        print(f"  chunked / naive peak memory = {ratio:.1%} (target <= 25%); same values and gradients")
        entropy_cost = chunked["peak"] / out["chunked-no-entropy"]["peak"] - 1
        print(f"  the entropy it also returns costs {entropy_cost:+.1%} of peak memory (target <= +5%)")
        time_cost = chunked["s"] / out["chunked-no-entropy"]["s"] - 1
        pass_cost = out["entropy-pass"]["s"] / out["chunked-no-entropy"]["s"] - 1
        print(f"  and {time_cost:+.1%} of the time; in a pass of its own it would cost {pass_cost:+.1%}")
