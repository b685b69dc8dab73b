"""bench/gpu_check.py: what only a GPU can show, in a few minutes on one GPU, without vLLM (torch, transformers, peft).

The CPU tests run everything else; these checks run the scripts' own GPU code (imported from them, never copied):
  bf16_step          grpo_gsm8k's training step (micro_batch, token_logprobs under bf16 autocast, policy_loss, AdamW)
                     on a Qwen2.5-0.5B-shaped model built from its config (random weights, no hub): finite losses,
                     peak memory, seconds a step, and the logprob gap of bf16 autocast against fp32 on the same tokens
  logprobs_vocab     bench/logprobs.py's comparison at the full 151,936-token vocabulary, on the GPU: token_logprobs
                     (chunked lm_head) against a full log_softmax, values and peak memory of each
  shared_transport   the shared transport's staging buffer: exported by one process
                     (grpo_gsm8k_lora_one_gpu.cuda_ipc_fields), checked and mapped by another
                     (vllm_sync_server.check_shared_spec and map_cuda_buffer, imported without vLLM), bytes compared
                     both ways, the GPU UUID checked, a wrong UUID refused
  fsdp2_nccl         reinforce_math_fsdp2.setup_model (FSDP2, bf16 compute, fp32 reduce) on one rank over NCCL: a
                     step, then the full state dict
  sleep_memory       grpo_gsm8k_lora_one_gpu's sleep_vllm / wake_vllm against torch.cuda.mem_get_info, with a
                     stand-in server in another process that frees and takes back GPU memory as vLLM's /sleep and
                     /wake_up do; then a wake-up the GPU has no room for, refused with the flags to lower
  lora_merge_bf16    grpo_gsm8k_lora_one_gpu.lora_merged (a merged push's merge and restore) 20 times on a bf16
                     Qwen2.5-0.5B-shaped model with the script's rank-16 adapters on q/k/v/o/gate/up/down, B random:
                     the base bit-identical after each, the merged weights against W + (alpha / r) B A computed here
                     (max |diff|), seconds a merge, GPU peak; peft's own unmerge once as the control (elements moved)
Each check runs in a process of its own, within --timeout-s; a failing or hanging one is reported and the rest run.
One table at the end. Exit status: 0 if every check passed, 1 if one did not, 2 without a CUDA GPU.
  python bench/gpu_check.py                      # all checks
  python bench/gpu_check.py --only shared_transport sleep_memory
"""

import argparse
import hashlib
import json
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN25_05B = dict(  # Qwen/Qwen2.5-0.5B-Instruct's config.json, the fields that shape the model
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    hidden_act="silu",
)
GIB = 1 << 30


def on_path() -> None:
    for path in (ROOT, os.path.join(ROOT, "bench")):
        if path not in sys.path:
            sys.path.insert(0, path)


def check_bf16_step() -> str:
    """Two training steps of grpo_gsm8k on 8 sequences of 128 prompt + 384 completion tokens."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    on_path()
    from grpo_gsm8k import micro_batch, policy_loss, token_logprobs

    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    config = Qwen2Config(**QWEN25_05B)
    with torch.device(device):  # random weights, made on the GPU (fast)
        model = Qwen2ForCausalLM(config).to(torch.float32).train()
    model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    n_prompt = [128] * 8
    seqs = [torch.randint(0, config.vocab_size, (512,)).tolist() for _ in n_prompt]
    ids, attn, mask, at = micro_batch(seqs, n_prompt, list(range(8)), 0, device)
    advantages = torch.randn(8, device=device)
    losses = []
    seconds = []
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(2):
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            flat, _ = token_logprobs(model, ids, attn, at)  # [N]
            logprobs = torch.zeros(mask.shape, device=device).masked_scatter(mask.bool(), flat.float())  # [b, T]
            loss = policy_loss(logprobs, logprobs.detach(), advantages, mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated(device) / GIB
    with torch.no_grad():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            bf16, _ = token_logprobs(model, ids, attn, at)
        fp32, _ = token_logprobs(model, ids, attn, at)
    gap = (bf16.float() - fp32).abs()
    if not all(map(lambda x: x == x and abs(x) != float("inf"), losses)):
        raise AssertionError(f"non-finite loss: {losses}")
    return (
        f"losses {losses[0]:.4g}, {losses[1]:.4g} (finite); peak {peak:.2f} GiB; {seconds[1]:.2f} s/step; "
        f"bf16 vs fp32 logprobs: mean {gap.mean().item():.2e}, max {gap.max().item():.2e} (random weights)"
    )


def check_logprobs_vocab() -> str:
    """bench/logprobs.py's two ways at its sizes (V 151,936, H 896, T 1,024) on the GPU, under bf16 autocast."""
    import torch

    on_path()
    from logprobs import H, T, V

    from grpo_gsm8k import token_logprobs

    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(H, V, bias=False, device=device)
    hidden = torch.randn(1, T + 1, H, device=device, requires_grad=True)
    ids = torch.randint(0, V, (1, T + 1), device=device)

    class Stub(torch.nn.Module):  # what token_logprobs needs of a causal LM: .model(...) and .lm_head
        def __init__(self):
            super().__init__()
            self.lm_head = lm_head
            self.model = lambda input_ids, attention_mask: type("Out", (), {"last_hidden_state": hidden})()

    results = {}
    for way in ("chunked", "naive"):
        hidden.grad = None
        lm_head.weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if way == "chunked":
                lp, _ = token_logprobs(Stub(), ids, None, torch.arange(T, device=device))
            else:
                logits = lm_head(hidden[0, :-1]).float()  # [T, V]
                lp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]  # [T]
        lp.sum().backward()
        torch.cuda.synchronize()
        results[way] = (lp.detach().float(), (torch.cuda.max_memory_allocated(device) - base) / 2**20)
        del lp
    diff = (results["chunked"][0] - results["naive"][0]).abs().max().item()
    if diff > 1e-2:
        raise AssertionError(f"the two ways differ by {diff}")
    chunked, full = results["chunked"][1], results["naive"][1]
    return f"peak over base: chunked {chunked:.0f} MiB, full log_softmax {full:.0f} MiB; max |diff| {diff:.1e}"


def map_and_read(spec: dict, expected: str, conn) -> None:
    """The server's side of shared_transport, in a process of its own: check, map, read, write one element back."""
    try:
        import torch

        on_path()
        import vllm_sync_server

        vllm_loaded = any(name == "vllm" or name.startswith("vllm.") for name in sys.modules)
        here = str(torch.cuda.get_device_properties(0).uuid)
        problem = vllm_sync_server.check_shared_spec(spec, "cuda", spec["dtype"], 1, here)
        if problem is not None:
            raise AssertionError(f"check_shared_spec refused the trainer's own buffer: {problem}")
        buffer = vllm_sync_server.map_cuda_buffer(spec, torch.device("cuda", 0), getattr(torch, spec["dtype"]))
        got = hashlib.sha256(buffer.cpu().view(torch.uint8).numpy()).hexdigest()
        buffer[-1] = 7.0  # the trainer reads it back: one memory, both ways
        torch.cuda.synchronize()
        conn.send({"equal": got == expected, "uuid": here, "vllm_loaded": vllm_loaded})
    except BaseException:
        conn.send({"error": traceback.format_exc()})


def check_shared_transport() -> str:
    import multiprocessing as mp

    import torch

    on_path()
    from grpo_gsm8k_lora_one_gpu import cuda_ipc_fields
    from vllm_sync_server import check_shared_spec

    device = torch.device("cuda", 0)
    numel = 64 << 20  # 128 MiB of bf16
    buffer = torch.randn(numel, device=device).to(torch.bfloat16)  # [numel]
    torch.cuda.synchronize()
    expected = hashlib.sha256(buffer.cpu().view(torch.uint8).numpy()).hexdigest()
    control = f"/dev/shm/cleanrlvr-gpucheck-{os.getpid()}.control"
    torch.from_file(control, shared=True, size=2, dtype=torch.int64).zero_()  # (check_shared_spec wants the file)
    try:
        spec = {"device": "cuda", "dtype": "bfloat16", "numel": numel, "control": control} | cuda_ipc_fields(buffer)
        wrong = check_shared_spec({**spec, "gpu_uuid": "GPU-00000000-0000-0000-0000-000000000000"}, "cuda",
                                  "bfloat16", 1, spec["gpu_uuid"])  # fmt: skip
        if wrong is None or "gpu_uuid" not in wrong:
            raise AssertionError(f"a buffer on another GPU was not refused: {wrong}")
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=map_and_read, args=(json.loads(json.dumps(spec)), expected, child))  # as JSON
        proc.start()
        if not parent.poll(120):
            proc.kill()
            raise TimeoutError("the mapping process did not answer within 120 s")
        answer = parent.recv()
        proc.join(30)
    finally:
        os.unlink(control)
    if "error" in answer:
        raise AssertionError("the mapping process failed:\n" + answer["error"])
    back = buffer[-1].item()
    if not answer["equal"] or back != 7.0 or answer["uuid"] != spec["gpu_uuid"]:
        raise AssertionError(
            f"bytes equal {answer['equal']}, written back {back}, UUIDs {answer['uuid']} / {spec['gpu_uuid']}"
        )
    return (
        f"128 MiB mapped by another process: bytes equal, its write seen here; UUID {spec['gpu_uuid']}; a wrong UUID "
        f"refused; vLLM imported by the server's module: {'yes' if answer['vllm_loaded'] else 'no'}"
    )


def check_fsdp2_nccl() -> str:
    import tempfile

    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import Qwen2Config, Qwen2ForCausalLM

    on_path()
    from reinforce_math_fsdp2 import micro_batch, setup_model

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    small = {**QWEN25_05B, "num_hidden_layers": 4}  # 4 of the 24 layers: the sharding is the same per layer
    with tempfile.TemporaryDirectory() as path:
        torch.manual_seed(0)
        Qwen2ForCausalLM(Qwen2Config(**small)).save_pretrained(path)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
        try:
            model = setup_model(path, "bfloat16", True, device)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
            seqs = [torch.randint(0, small["vocab_size"], (256,)).tolist() for _ in range(4)]
            ids, attn, mask, at = micro_batch(seqs, [64] * 4, list(range(4)), 0, device)
            flat, _ = model.token_logprobs(ids, attn, at)
            loss = -flat.float().mean()
            loss.backward()
            optimizer.step()
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            dist.barrier()
        finally:
            dist.destroy_process_group()
    if not torch.isfinite(loss).item():
        raise AssertionError(f"non-finite loss {loss.item()}")
    return (
        f"loss {loss.item():.4g} (finite); full state dict: {len(full)} tensors on {next(iter(full.values())).device}"
    )


def stand_in_server(port_conn, sizes: dict) -> None:
    """A stand-in for vLLM's /sleep and /wake_up: holds `sizes` bytes per tag on the GPU, frees them at /sleep (every
    tag) and takes them back at /wake_up (the tags asked, or all), as vLLM's CuMemAllocator unmaps and maps again."""
    from http.server import BaseHTTPRequestHandler, HTTPServer

    import torch

    held = {tag: torch.empty(n, dtype=torch.uint8, device="cuda:0") for tag, n in sizes.items()}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            if self.path == "/sleep":
                held.clear()
            else:
                for tag in body.get("tags") or list(sizes):
                    held.setdefault(tag, torch.empty(sizes[tag], dtype=torch.uint8, device="cuda:0"))
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # (vLLM unmaps: the memory goes back to the GPU at once)
            answer = json.dumps({"status": "ok", "asleep": sorted(set(sizes) - set(held))}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    port_conn.send(server.server_address[1])
    server.serve_forever()


def check_sleep_memory() -> str:
    import multiprocessing as mp

    import torch

    on_path()
    from grpo_gsm8k_lora_one_gpu import WAKE_MARGIN, sleep_vllm, wake_vllm

    device = torch.device("cuda", 0)
    sizes = {"weights": 1 * GIB, "kv_cache": 2 * GIB}
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=stand_in_server, args=(child, sizes), daemon=True)
    proc.start()
    try:
        if not parent.poll(120):
            raise TimeoutError("the stand-in server did not start within 120 s")
        url = f"http://127.0.0.1:{parent.recv()}"
        freed = sleep_vllm(url, device, 2)
        if not sum(sizes.values()) - GIB // 16 <= freed < sum(sizes.values()) + GIB // 4:
            raise AssertionError(
                f"/sleep freed {freed / GIB:.3f} GiB, the stand-in held {sum(sizes.values()) / GIB} GiB"
            )
        # the trainer's blocks in torch's cache count as used on the GPU until wake_vllm empties it
        scratch = torch.empty(GIB, dtype=torch.uint8, device=device)
        del scratch
        cached = torch.cuda.memory_reserved(device)
        left = wake_vllm(url, device, freed, ["weights"])
        if torch.cuda.memory_reserved(device) >= cached:
            raise AssertionError("torch's cache was not emptied before the wake-up")
        left = wake_vllm(url, device, left)
        if not 0 <= left < GIB // 4:
            raise AssertionError(f"{left / GIB:.3f} GiB still counted asleep after the full wake-up")
        # now the trainer holds what the stand-in needs: the wake-up is refused before it is sent
        freed = sleep_vllm(url, device, 2)
        room = torch.cuda.mem_get_info(device)[0] - freed  # free beyond what the stand-in takes back
        hog = torch.empty(room - WAKE_MARGIN // 2, dtype=torch.uint8, device=device)  # less than the margin is left
        try:
            wake_vllm(url, device, freed, ["weights"])
            raise AssertionError("a wake-up with no room was sent")
        except SystemExit as e:
            message = str(e)
        del hog
        wake_vllm(url, device, freed)
    finally:
        proc.kill()
    if "--vllm-gpu-memory-utilization" not in message:
        raise AssertionError(message)
    return (
        f"/sleep freed {freed / GIB:.3f} GiB (stand-in: 3 GiB); torch's cache ({cached / GIB:.2f} GiB) emptied before "
        f"each wake-up; after both, {left / 2**20:.0f} MiB counted asleep; no room: refused ({message[:60]}...)"
    )


def check_lora_merge_bf16() -> str:
    """grpo_gsm8k_lora_one_gpu.lora_merged, entered and left as a merged push does, 20 times on a bf16 model with the
    script's rank-16 adapters (add_lora) on q/k/v/o/gate/up/down, B random: within, the weights a push reads against
    W + (alpha / r) B A computed here in fp32 and rounded once; after, the base bit for bit. peft's own merge and
    unmerge, once, is the control (the drift the script's copy prevents)."""
    import functools

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    on_path()
    from grpo_gsm8k_lora_one_gpu import Args, add_lora, base_named, lora_merged

    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    with torch.device(device):  # random weights, made on the GPU (fast)
        model = Qwen2ForCausalLM(Qwen2Config(**QWEN25_05B)).to(torch.bfloat16)
    args = Args(lora_rank=16, lora_alpha=32.0)
    peft_model = add_lora(model, args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # (a fresh B is 0): updates of about a third of |W|
    params = {n: p.detach() for n, p in model.named_parameters()}
    before = {n: t.clone() for n, t in base_named(params.items())}
    lora = {
        n: (params[f"{n[:-7]}.lora_A.default.weight"], params[f"{n[:-7]}.lora_B.default.weight"])
        for n in before
        if f"{n[:-7]}.lora_A.default.weight" in params
    }  # n[:-7]: the layer (".weight" off)
    scale = args.lora_alpha / args.lora_rank

    def moved() -> int:  # base elements not bit-identical to those before
        return sum((t != before[n]).sum().item() for n, t in base_named(model.named_parameters()))

    def timed(step) -> tuple[float, float]:  # seconds and GPU peak (MiB over before) of an entry or an exit
        torch.cuda.synchronize()
        base_bytes = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        return time.perf_counter() - t0, (torch.cuda.max_memory_allocated(device) - base_bytes) / 2**20

    worst, off, seconds, peak = 0.0, 0, 0.0, 0.0
    for push in range(1, 21):
        merged = lora_merged(peft_model)  # entered and left by hand: each timed apart from the comparison between
        enter_s, enter_mib = timed(merged.__enter__)
        pushed = dict(base_named(model.named_parameters()))
        with torch.no_grad():
            for n, (a, b) in lora.items():
                want = (before[n].float() + scale * (b.float() @ a.float())).to(before[n].dtype)
                worst = max(worst, (pushed[n].float() - want.float()).abs().max().item())
                off += (pushed[n] != want).sum().item()
        exit_s, exit_mib = timed(functools.partial(merged.__exit__, None, None, None))
        seconds, peak = seconds + enter_s + exit_s, max(peak, enter_mib, exit_mib)
        if moved():
            raise AssertionError(f"after merge {push}: {moved()} base elements moved")
    if off:
        raise AssertionError(f"{off} merged elements are not W + (alpha / r) B A rounded once (max |diff| {worst})")
    with torch.no_grad():  # the control: peft alone
        peft_model.merge_adapter()
        peft_model.unmerge_adapter()
    drift = moved()
    adapted = sum(before[n].numel() for n in lora)
    return (
        f"20 merges: base bit-identical ({adapted:,} adapted elements); merged vs W + (a/r) B A: max |diff| "
        f"{worst:.1e}; {seconds / 20:.3f} s a merge and restore, GPU peak +{peak:.0f} MiB; "
        f"control, peft's unmerge once: {drift:,} elements moved"
    )


CHECKS = {
    "bf16_step": check_bf16_step,
    "logprobs_vocab": check_logprobs_vocab,
    "shared_transport": check_shared_transport,
    "fsdp2_nccl": check_fsdp2_nccl,
    "sleep_memory": check_sleep_memory,
    "lora_merge_bf16": check_lora_merge_bf16,
}


def run_one(name: str, conn) -> None:
    """A check's process: its result line (or its traceback) goes back through `conn`."""
    t0 = time.perf_counter()
    try:
        detail = CHECKS[name]()
        conn.send(("ok", detail, time.perf_counter() - t0))
    except BaseException as e:
        conn.send(("FAIL", f"{type(e).__name__}: {e}".splitlines()[0][:300], time.perf_counter() - t0))
        traceback.print_exc()


def run_check(name: str, timeout_s: float) -> tuple[str, str, float]:
    """Run one check in a process of its own (a hang or a crash costs that check alone), within timeout_s."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # a fresh CUDA context per check
    parent, child = ctx.Pipe(duplex=False)
    t0 = time.perf_counter()
    proc = ctx.Process(target=run_one, args=(name, child))
    proc.start()
    if parent.poll(timeout_s):
        result = parent.recv()
    else:
        result = ("TIMEOUT", f"no result within {timeout_s:.0f} s", time.perf_counter() - t0)
        proc.kill()
    proc.join(30)
    if proc.is_alive():
        proc.kill()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=list(CHECKS), help="run these checks only")
    parser.add_argument("--timeout-s", type=float, default=240.0, help="the longest a check may run (default 240)")
    args = parser.parse_args()  # before torch is imported: --help is instant
    import torch

    if not torch.cuda.is_available():
        print(
            f"bench/gpu_check.py needs a CUDA GPU, and torch {torch.__version__} sees none "
            f"(CUDA build: {torch.version.cuda or 'no'}; "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})",
            file=sys.stderr,
        )
        sys.exit(2)
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.total_memory / GIB:.0f} GiB, torch {torch.__version__} (CUDA {torch.version.cuda})")
    rows = []
    for name in args.only or list(CHECKS):
        print(f"running {name} ...", flush=True)
        rows.append((name, *run_check(name, args.timeout_s)))
    width = max(len(name) for name, *_ in rows)
    print(f"\n{'check':<{width}}  result   seconds  detail")
    for name, result, detail, seconds in rows:
        print(f"{name:<{width}}  {result:<7}  {seconds:7.1f}  {detail}")
    sys.exit(0 if all(result == "ok" for _, result, _, _ in rows) else 1)


if __name__ == "__main__":
    main()
