"""Benchmark: where the trainer's memory goes on the CPU, and what the allocator adds to it, side by side in one run.

grpo_gsm8k.py's own update (micro_batch, token_logprobs, policy_loss, gradient clipping, AdamW; activation
checkpointing on, as by default) on SmolLM2-135M-Instruct (tests/real_model.py's float32 conversion), 16 sequences of
30 prompt + 64 completion tokens (random ids), 3 updates. Each allocator setting runs in a fresh process:
  - glibc:         the default malloc;
  - glibc-mmap64k: glibc with a fixed 64 KiB mmap threshold (MALLOC_MMAP_THRESHOLD_): every block of 64 KiB or more is
                   mapped on its own and returned to the system when freed, so resident memory is live tensors;
  - jemalloc:      LD_PRELOAD=libjemalloc.so.2, where the system has it.
Printed per setting: resident memory after the imports, and at the end of the last update (weights, gradients freed,
AdamW state), its peak over the last update (/proc's VmHWM, reset before it), and the median seconds of an update.
The weights, the gradients and AdamW's two moments are 4 x the weights' bytes.
Run: python bench/train_memory.py   (about 2 minutes)
"""

import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
SETTINGS = {
    "glibc": {},
    "glibc-mmap64k": {"MALLOC_MMAP_THRESHOLD_": "65536"},
    "jemalloc": {"LD_PRELOAD": JEMALLOC},
}


def resident_gb() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process, in GB."""
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f)
    return int(status["VmRSS"].split()[0]) / 1e6, int(status["VmHWM"].split()[0]) / 1e6


def run() -> None:
    """One setting, in this process: prints `imports end peak median_s state_gb`."""
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    import torch
    from transformers import AutoModelForCausalLM

    import grpo_gsm8k as G
    from real_model import real_model_dir

    imports, _ = resident_gb()
    model = AutoModelForCausalLM.from_pretrained(real_model_dir(), dtype=torch.float32).train()
    model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    seqs = [torch.randint(0, vocab, (30 + 64,), generator=generator).tolist() for _ in range(16)]
    n_prompt = [30] * 16
    seconds = []
    for _ in range(3):
        with open("/proc/self/clear_refs", "w") as f:  # "5": reset VmHWM to the current resident memory
            f.write("5")
        start = time.perf_counter()
        ids, attn, mask, at = G.micro_batch(seqs, n_prompt, list(range(16)), 0, torch.device("cpu"))
        flat, _ = G.token_logprobs(model, ids, attn, at)
        logprobs = G.as_rows(flat, mask)  # [b, T]
        loss = G.policy_loss(logprobs, logprobs.detach(), torch.randn(16, generator=generator), mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
    end, peak = resident_gb()
    state = 4 * sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    print(f"{imports:.2f} {end:.2f} {peak:.2f} {statistics.median(seconds):.2f} {state:.2f}")


if __name__ == "__main__":
    if sys.argv[1:] == ["run"]:
        run()
        sys.exit()
    print(f"{'allocator':<15}{'imports':>9}{'end':>7}{'peak':>7}{'s/update':>10}   (GB, resident)")
    results = {}
    for name, env in SETTINGS.items():
        if "LD_PRELOAD" in env and not os.path.exists(env["LD_PRELOAD"]):
            print(f"{name:<15}not found ({env['LD_PRELOAD']})")
            continue
        r = subprocess.run(
            [sys.executable, __file__, "run"], capture_output=True, text=True, env=os.environ | env, check=True
        )
        imports, end, peak, median_s, state = map(float, r.stdout.split())
        results[name] = (peak, median_s)
        print(f"{name:<15}{imports:>9.2f}{end:>7.2f}{peak:>7.2f}{median_s:>10.2f}")
    print(f"weights + gradients + AdamW state: {state:.2f} GB")
    base_peak, base_s = results["glibc"]
    for name, (peak, median_s) in results.items():
        if name != "glibc":
            print(f"{name}: peak {peak - base_peak:+.2f} GB ({peak / base_peak:.2f}x), time {median_s / base_s:.2f}x")
