"""Benchmark: peak memory of per-token logprobs (forward + backward) for a 151,936-token vocabulary.
The chunked pass also returns the policy's entropy; a copy of it without the entropy shows what that costs.

grpo_gsm8k.token_logprobs (the lm_head on 128 positions at a time, recomputed in backward) against the
naive way, a full fp32 log_softmax over [T, V] then a gather; the same values either way (checked here).
T = 1,024 completion tokens, hidden size 896 (Qwen2.5-0.5B). Each way runs in a fresh process; the figure
is the growth of its peak resident memory over what it held before the computation (weights, hidden states).
Run: python bench/logprobs.py   (CPU, about a minute)
"""

import os
import resource
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V, H, T = 151_936, 896, 1024


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run(way: str, weight_grad: bool) -> None:
    import torch

    sys.path.insert(0, ROOT)
    from grpo_gsm8k import token_logprobs

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
    before = rss_mb()
    if way == "chunked":
        lp, _ = token_logprobs(Stub(), ids, None, at)
    elif way == "chunked-no-entropy":  # the same chunked pass without the entropy it also returns
        from torch.utils.checkpoint import checkpoint

        def block(h_c, t_c):
            logits = lm_head(h_c).float()  # [chunk, V]
            return logits.gather(1, t_c[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)

        h, targets = hidden[0, :-1], ids[0, 1:]
        lp = torch.cat(
            [checkpoint(block, h[i : i + 128], targets[i : i + 128], use_reentrant=False) for i in range(0, T, 128)]
        )
    else:
        logits = lm_head(hidden[0, :-1]).float()  # [T, V]
        lp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]  # [T]
    lp.sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{peak - before:.0f} {lp.sum().item():.6f} {hidden.grad.abs().sum().item():.6f}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run(sys.argv[1], sys.argv[2] == "1")
        sys.exit()
    for weight_grad in (False, True):
        out = {}  # way -> {"peak": MB, "value": sum of logprobs, "grad": |grad of hidden|}
        print(
            "lm_head weight", "trained: its [V, H] gradient counts too" if weight_grad else "frozen: activations only"
        )
        for way in ("naive", "chunked-no-entropy", "chunked"):
            r = subprocess.run(
                [sys.executable, __file__, way, str(int(weight_grad))], capture_output=True, text=True, check=True
            )
            peak, value, grad = map(float, r.stdout.split())
            out[way] = {"peak": peak, "value": value, "grad": grad}
            print(f"  {way:>18}: peak +{peak:,.0f} MB   sum of logprobs {value:.4f}   |grad of hidden| {grad:.4f}")
        naive = out["naive"]
        chunked = out["chunked"]
        assert abs(naive["value"] - chunked["value"]) < 1e-2
        assert abs(naive["grad"] - chunked["grad"]) < 1e-3 * naive["grad"]
        ratio = chunked["peak"] / naive["peak"]
        print(f"  chunked / naive peak memory = {ratio:.1%} (target <= 25%); same values and gradients")
        entropy_cost = chunked["peak"] / out["chunked-no-entropy"]["peak"] - 1
        print(f"  the entropy it also returns costs {entropy_cost:+.1%} of peak memory (target <= +5%)")
