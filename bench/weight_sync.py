"""Benchmark: a full weight push into a running vllm_sync_server, against the transport's limits, side by side in one
run.

  1. this project's protocol: one POST /update_param_batch, then every tensor in order, one broadcast each, on a
     gloo group of CONNECTIONS connections; on the server's two load paths: straight into the engine's tensors
     (the default) and vLLM's layerwise reload;
  2. the raw limits between two plain processes (no server, no HTTP, no engine), the bytes landing in memory
     touched before, as the engine's weights are:
       - one broadcast of all the bytes (the issue's raw limit), on 1 connection and on CONNECTIONS;
       - one broadcast per tensor, on 1 connection and on CONNECTIONS;
       - packed: the tensors copied into two reused 64 MiB buffers, broadcast, copied out (the other answer to
         "one by one or packed?": it decided for one by one);
  3. the shared transport (transport "shared", one GPU's way: CUDA IPC there, a /dev/shm file here): the server maps
     a staging buffer of the trainer's; a push writes every tensor into its slice and counts it written, the server
     copies each into the engine as soon as it is counted. Its limit: torch copying the same bytes once (one flat
     copy_, memory touched before), in the same round;
  4. a per-parameter protocol as TRL's vllm_serve does it: one HTTP request, one broadcast and one barrier (the
     request's completion) per tensor. vLLM fuses q/k/v and gate/up, which must travel together (see the server),
     so those go as one request of 3 or 2 broadcasts: slightly kinder to this baseline than one per tensor.

With --transports, instead: how long new weights take from the trainer's memory to the first token sampled with them,
on each way a trainer can hand them over, side by side in one run on the same model, round after round:
  - restart: save a Hugging Face checkpoint, stop the server, start it on the checkpoint, generate one token;
  - checkpoint: save one safetensors file under the server's --checkpoint-root, POST /load_checkpoint, one token;
  - broadcast: the push of 1. (a group joined beforehand, as a trainer does once), one token;
  - shared: the push of 3. (the buffer mapped beforehand, as a trainer does once), one token.

Model: a random Qwen2 built locally (no hub): by default 304 MB in 291 fp32 tensors; with --shape qwen2.5-0.5b, the
shapes of Qwen2.5-0.5B-Instruct, the scripts' default model, in 290 tensors: with --dtype bfloat16 (the engine's and
the push's dtype) exactly the bytes of its push on GPU, 988 MB.
Run: .venv/bin/python bench/weight_sync.py [--shape qwen2.5-0.5b --dtype bfloat16]   (CPU, about 5 / 10 minutes)
     .venv/bin/python bench/weight_sync.py --transports [--shape ... --dtype ...]      (CPU, about 3 / 6 minutes)
"""

import argparse
import contextlib
import datetime
import functools
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import requests
import torch
import torch.distributed as dist
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from tiny_model import build_tiny_model  # noqa: E402 (tests/ holds the model builder the tests use too)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, log_path: str, *extra: str, timeout: float = 300):
    """vllm_sync_server.py on a free port, on CPU; returns (process, url) once /health answers."""
    port = free_port()
    cmd = [sys.executable, os.path.join(ROOT, "vllm_sync_server.py"), "--model", model, "--port", str(port)]
    cmd += ["--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "1024", *extra]
    with open(log_path, "w") as log:  # the server keeps its own copy of the file descriptor
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: see {log_path}")
        try:
            if requests.get(url + "/health", timeout=1).ok:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"the server did not answer in {timeout} s: see {log_path}")


def stop_server(proc) -> None:
    """The server and every process it started (its engine and workers): they share its process group."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


REPEATS = 9
PACKED = 64 << 20  # bytes per buffer of the packed way
TIMEOUT = datetime.timedelta(seconds=300)
CONNECTIONS = 8  # gloo TCP connections of the push's group (the clients' default)
SHAPES = {  # build_tiny_model's arguments
    "small": dict(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    "qwen2.5-0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
}


def lines(resp):
    return (json.loads(x) for x in resp.iter_lines() if x)


def gloo(store, rank, connections):
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout, opts._threads = TIMEOUT, 2 * connections
    opts._devices = [dist.ProcessGroupGloo.create_default_device() for _ in range(connections)]
    return dist.ProcessGroupGloo(store, rank, 2, opts)


def make_group(url):
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
    r = requests.post(
        url + "/init_communicator",
        stream=True,
        json={"host": "127.0.0.1", "port": port, "world_size": 2, "connections": CONNECTIONS},
    )
    it = lines(r)
    next(it)
    pg = gloo(store, 0, CONNECTIONS)
    assert next(it)["status"] == "ok"
    return pg, store


def push(url, pg, named):
    """The clients' push_weights: one POST, then every tensor in order, one broadcast each, up to 1 GiB in flight."""
    params = [
        {"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)} for n, t in named.items()
    ]
    r = requests.post(url + "/update_param_batch", json={"params": params}, stream=True)
    r.raise_for_status()
    it = lines(r)
    next(it)
    opts, inflight, ahead = dist.BroadcastOptions(), [], 0
    opts.rootRank = 0
    for t in named.values():
        inflight.append((t.nbytes, pg.broadcast([t.view(-1).view(torch.uint8)], opts)))  # bytes, as the server receives
        ahead += t.nbytes
        while ahead > 1 << 30:
            nbytes, work = inflight.pop(0)
            work.wait()
            ahead -= nbytes
    for _, work in inflight:
        work.wait()
    done = next(it)
    assert done["status"] == "ok", done
    return done


def map_shared(url, named, stem):
    """The shared transport's mapping: every tensor's slice in a /dev/shm file (64-element aligned, as the scripts lay
    it out) and the two control words. The files stay (unlinked at the end): re-mapped after each gloo round."""
    dtype = next(iter(named.values())).dtype
    offsets, numel = [], 0
    for t in named.values():
        offsets.append(numel)
        numel = -(-(numel + t.numel()) // 64) * 64
    buffer = torch.from_file(stem + ".buffer", shared=True, size=numel, dtype=dtype)
    control = torch.from_file(stem + ".control", shared=True, size=2, dtype=torch.int64)
    spec = {"device": "cpu", "dtype": str(dtype).removeprefix("torch."), "numel": numel}
    spec |= {"path": stem + ".buffer", "control": stem + ".control"}
    it = lines(requests.post(url + "/init_communicator", json={"transport": "shared", "shared": spec}, stream=True))
    assert next(it)["status"] == "mapping"
    assert next(it)["status"] == "ok"
    return buffer, control, offsets


def push_shared(url, shared, named):
    """The scripts' shared push: one POST, then each tensor written into its slice and counted (the server copies
    each out as soon as it is counted)."""
    buffer, control, offsets = shared
    params = [
        {"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": o, "round": 0}
        for (n, t), o in zip(named.items(), offsets, strict=True)
    ]
    control.zero_()
    r = requests.post(url + "/update_param_batch", json={"params": params}, stream=True)
    r.raise_for_status()
    it = lines(r)
    next(it)
    for i, (t, offset) in enumerate(zip(named.values(), offsets, strict=True)):
        buffer[offset : offset + t.numel()].view_as(t).copy_(t)
        control[0] = i + 1
    done = next(it)
    assert done["status"] == "ok", done
    return done


def push_per_parameter(url, pg, named, groups):
    """The per-parameter protocol: one request (and its broadcasts) per group of `per_parameter_groups`."""
    for group in groups:
        push(url, pg, {n: named[n] for n in group})


def per_parameter_groups(names):
    """Requests of the per-parameter protocol: one tensor each, except vLLM's fused siblings."""
    groups, seen = [], set()
    fused = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")]
    for n in names:
        if n in seen:
            continue
        group = [n]
        for parts in fused:
            for p in parts:
                if f".{p}." in n:
                    group = [n.replace(f".{p}.", f".{q}.") for q in parts]
        groups.append(group)
        seen.update(group)
    return groups


def raw_transfer(pg, way, bufs, staging=None, rank=0):
    """Move `bufs` (uint8 tensors) from rank 0 to rank 1, all broadcasts posted at once ("one", "each") or through
    two reused staging buffers ("packed"), then a 1-element broadcast: the sender's clock stops when the receiver
    has it all."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    if way != "packed":
        for work in [pg.broadcast([b], opts) for b in bufs]:
            work.wait()
    else:
        buckets, size = [], PACKED  # consecutive tensors up to PACKED bytes; a larger one alone
        for b in bufs:
            if size + b.numel() > PACKED:
                buckets, size = buckets + [[]], 0
            buckets[-1].append((size, b))
            size += b.numel()
        alone = [bucket[0][1].numel() > PACKED for bucket in buckets]  # too big to stage: broadcast in place
        works = {}

        def finish(i):  # bucket i's broadcast is done: the receiver unpacks it, its staging buffer is free again
            works.pop(i).wait()
            for off, b in buckets[i] if rank == 1 and not alone[i] else []:
                b.copy_(staging[i % 2][off : off + b.numel()])

        for i, bucket in enumerate(buckets):
            if i >= 2:
                finish(i - 2)
            if alone[i]:
                works[i] = pg.broadcast([bucket[0][1]], opts)
                continue
            buf, nbytes = staging[i % 2], bucket[-1][0] + bucket[-1][1].numel()
            for off, b in bucket if rank == 0 else []:
                buf[off : off + b.numel()].copy_(b)
            works[i] = pg.broadcast([buf[:nbytes]], opts)
        for i in sorted(works):
            finish(i)
    pg.broadcast([torch.zeros(1)], opts).wait()


RAW = [(1, "one"), (CONNECTIONS, "one"), (1, "each"), (CONNECTIONS, "each"), (1, "packed"), (CONNECTIONS, "packed")]


def pattern(n):
    return (torch.arange(n, dtype=torch.int32) % 251).to(torch.uint8)


def raw_groups(store, rank):
    return {(c, way): gloo(dist.PrefixStore(f"{c}{way}", store), rank, c) for c, way in RAW}


def raw_receiver(port, sizes, rounds):
    """Rank 1 of the raw ways: mirrors the sender's rounds (pushes to the server do not involve it)."""
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=TIMEOUT)
    pgs = raw_groups(store, 1)
    # touched once, like the engine's weights: no page faults timed
    one, each = [torch.zeros(sum(sizes), dtype=torch.uint8)], [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    staging = [torch.zeros(PACKED, dtype=torch.uint8) for _ in range(2)]
    for _ in range(rounds):
        for (_connections, way), pg in pgs.items():
            raw_transfer(pg, way, one if way == "one" else each, staging, rank=1)
    assert all(torch.equal(b, pattern(b.numel())) for b in each)  # the packed way (last) delivered every byte


def main(shape: str, dtype: str, tmp: str) -> None:
    model_dir = build_tiny_model(os.path.join(tmp, "bench-qwen2"), **SHAPES[shape])
    named = {
        k: (torch.randn_like(v) * 0.02).to(getattr(torch, dtype))
        for k, v in load_file(os.path.join(model_dir, "model.safetensors")).items()
    }
    nbytes = sum(t.numel() * t.element_size() for t in named.values())
    sizes = [t.numel() * t.element_size() for t in named.values()]
    print(f"model: {len(named)} tensors, {nbytes / 1e6:.1f} MB ({dtype}); torch threads {torch.get_num_threads()}")

    # The raw ways and the pushes alternate, round after round, so that both see the same machine (a shared VM's
    # speed drifts by 2x within minutes); the ratios are medians of per-round ratios.
    port, rounds = free_port(), 2 * (REPEATS + 1)
    raw_store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
    receiver = mp.get_context("spawn").Process(target=raw_receiver, args=(port, sizes, rounds))
    receiver.start()
    raw_pgs = raw_groups(raw_store, 0)
    one, each, staging = [pattern(nbytes)], [pattern(n) for n in sizes], [pattern(PACKED) for _ in range(2)]
    names = {"one": "one broadcast", "each": "one broadcast per tensor", "packed": "packed, 64 MiB buffers"}
    flat = torch.cat([t.reshape(-1) for t in named.values()])  # the memory copy's source and target, touched before
    flat_copy = torch.empty_like(flat).copy_(flat)
    stem = os.path.join("/dev/shm", f"cleanrlvr-bench-{os.getpid()}")
    times, ratios = {}, {}

    def clock(label, fn, keep=True):
        # vLLM's engine core (outside the server's sync_ RPCs) and worker busy-wait (sched_yield) for 1 s after each
        # message they read; on 2 cores that slows whatever runs next. Start every measurement after they went idle.
        time.sleep(1.2)
        t0 = time.perf_counter()
        fn()
        if keep:
            times.setdefault(label, []).append(time.perf_counter() - t0)
        return time.perf_counter() - t0

    for mode, flags in (("direct", []), ("layerwise reload", ["--no-direct-load"])):
        proc, url = start_server(
            model_dir, os.path.join(tmp, f"server-{mode}.log"), "--max-num-seqs", "8", "--dtype", dtype, *flags
        )
        try:
            for r in range(REPEATS + 1):  # round 0: warm-up, not counted
                pg, store = make_group(url)  # (the gloo group and the shared mapping replace each other, untimed)
                assert push(url, pg, named)["direct"] == (mode == "direct"), "the server did not take this load path"
                raw = {}
                for (c, way), rpg in raw_pgs.items():
                    transfer = functools.partial(
                        raw_transfer, pg=rpg, way=way, bufs=one if way == "one" else each, staging=staging, rank=0
                    )
                    raw[c, way] = clock(f"raw, {names[way]}, {c} connection(s)", transfer, keep=r > 0)
                label = f"this protocol ({mode})"
                pushed = clock(label, functools.partial(push, url=url, pg=pg, named=named), keep=r > 0)
                shared = map_shared(url, named, stem)
                assert push_shared(url, shared, named)["direct"] == (mode == "direct")  # (its pages mapped, untimed)
                copied = clock(
                    "raw, torch copying the bytes once", functools.partial(flat_copy.copy_, flat), keep=r > 0
                )
                pushed_shared = clock(
                    f"shared transport ({mode})", functools.partial(push_shared, url, shared, named), keep=r > 0
                )
                if r > 0:
                    ratios.setdefault(f"shared ({mode}) / one memory copy", []).append(pushed_shared / copied)
                    ratios.setdefault(f"shared ({mode}) / this protocol ({mode})", []).append(pushed_shared / pushed)
                    for c in (1, CONNECTIONS):
                        ratios.setdefault(f"{label} / one broadcast, {c} connection(s)", []).append(
                            pushed / raw[c, "one"]
                        )
                    ratios.setdefault(f"{label}, per round fastest", []).append(
                        pushed / min(raw[1, "one"], raw[CONNECTIONS, "one"])
                    )
                    ratios.setdefault(f"{label}, per tensor", []).append(pushed / raw[CONNECTIONS, "each"])
            if mode == "direct":
                pg, store = make_group(url)
                groups = per_parameter_groups(list(named))
                per_param = clock(
                    f"per-parameter protocol ({len(groups)} requests)",
                    functools.partial(push_per_parameter, url=url, pg=pg, named=named, groups=groups),
                )
                ratios["per-parameter"] = [per_param / statistics.median(times["this protocol (direct)"])]
        finally:
            stop_server(proc)
    receiver.join()
    for suffix in (".buffer", ".control"):
        os.unlink(stem + suffix)

    med = {k: statistics.median(v) for k, v in times.items()}
    raw = min(med["raw, one broadcast, 1 connection(s)"], med[f"raw, one broadcast, {CONNECTIONS} connection(s)"])
    print(
        f"\nmedians over {REPEATS} rounds per server, {2 * REPEATS} for the raw ways; "
        "x raw: vs the better one-broadcast"
    )
    print(f"{'way':<52} {'seconds':>8} {'GB/s':>6} {'x raw':>6}")
    for k, v in med.items():
        print(f"{k:<52} {v:8.3f} {nbytes / v / 1e9:6.2f} {v / raw:6.2f}")
    r = {k: statistics.median(v) for k, v in ratios.items()}
    # The raw limit: the one-broadcast configuration (1 or CONNECTIONS connections) with the lower median, measured in
    # the same round as each push. (Dividing by the faster of the two in each round would compare one noisy sample with
    # the minimum of two, which is biased low: printed too, as a bound.)
    best = min((1, CONNECTIONS), key=lambda c: med[f"raw, one broadcast, {c} connection(s)"])
    key = f"this protocol (direct) / one broadcast, {best} connection(s)"
    per_round = " ".join(f"{x:.2f}" for x in ratios[key])
    print(
        f"\nthis protocol / raw one broadcast ({best} connection(s)), same round (median) = {r[key]:.2f}x "
        f"(target <= 1.3x); per round: {per_round}"
    )
    fastest = r["this protocol (direct), per round fastest"]
    print(f"this protocol / the faster raw one broadcast of each round       = {fastest:.2f}x")
    per_tensor = r["this protocol (direct), per tensor"]
    print(f"this protocol / raw one broadcast per tensor, same round        = {per_tensor:.2f}x")
    print(f"per-parameter / this protocol                          = {r['per-parameter']:.1f}x (target >= 3x)")
    for mode in ("direct", "layerwise reload"):
        vs_copy = r[f"shared ({mode}) / one memory copy"]
        vs_gloo = r[f"shared ({mode}) / this protocol ({mode})"]
        print(
            f"shared transport ({mode}) / one memory copy, same round = {vs_copy:.2f}x; "
            f"/ the gloo push, same round = {vs_gloo:.2f}x (target < 1)"
        )


TRANSPORT_ROUNDS = 3  # each restart starts an engine: tens of seconds


def first_token(url) -> None:
    """One token sampled by the server: it is up, and computes with the weights it holds."""
    body = {"prompts": [[1, 2, 3]], "max_tokens": 1, "temperature": 0.0}
    requests.post(url + "/generate", json=body, timeout=300).raise_for_status()


def checksums_match(url, named) -> bool:
    """The server computes with exactly `named` (a tied lm_head is reported as the embedding)."""
    got = requests.get(url + "/weights_checksum", timeout=600).json()["checksums"]
    return all(got[k] == hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest() for k, t in named.items())


def transports(shape: str, dtype: str, tmp: str) -> None:
    """Restart, checkpoint reload, broadcast and the shared transport, round after round on the same machine, each from
    new weights in the trainer's memory to the first token sampled with them."""
    from safetensors.torch import save_file

    model_dir = build_tiny_model(os.path.join(tmp, "bench-qwen2"), **SHAPES[shape])
    root = os.path.join(tmp, "checkpoint-root")  # the server's --checkpoint-root
    restart_dir = os.path.join(root, "restart")  # a Hugging Face checkpoint: the model's files, new weights
    shutil.copytree(model_dir, restart_dir)
    base = load_file(os.path.join(model_dir, "model.safetensors"))  # (fp32: the shapes, the new weights' base)
    nbytes = sum(v.numel() for v in base.values()) * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    flags = ["--max-num-seqs", "8", "--dtype", dtype, "--checkpoint-root", root]
    print(f"model: {shape}, {len(base)} tensors, {nbytes / 1e6:.1f} MB in {dtype}; {TRANSPORT_ROUNDS} rounds")
    proc, url = start_server(model_dir, os.path.join(tmp, "server-0.log"), *flags)
    times = {}  # way -> [seconds]
    parts = {}  # way, part -> [seconds]
    stem = os.path.join("/dev/shm", f"cleanrlvr-bench-{os.getpid()}")  # the shared transport's files
    try:
        for r in range(TRANSPORT_ROUNDS):
            for way in ("broadcast", "shared", "checkpoint", "restart"):
                torch.manual_seed(r)
                named = {k: (torch.randn_like(v) * 0.02).to(getattr(torch, dtype)) for k, v in base.items()}
                # joined once per server, as a trainer does, so not timed (a group and a mapping replace each other)
                if way == "broadcast":
                    pg, store = make_group(url)
                elif way == "shared":  # (and one push: a trainer's buffer has its pages after the first step)
                    shared = map_shared(url, named, stem)
                    push_shared(url, shared, named)
                time.sleep(1.2)  # vLLM's processes idle again (see clock in main)
                t0 = time.perf_counter()
                if way == "broadcast":
                    push(url, pg, named)
                elif way == "shared":
                    push_shared(url, shared, named)
                elif way == "checkpoint":
                    path = os.path.join(root, f"weights_r{r}.safetensors")
                    save_file(named, path + ".tmp")  # as grpo_gsm8k.py saves: a temporary name, then renamed
                    os.replace(path + ".tmp", path)
                    parts.setdefault((way, "save"), []).append(time.perf_counter() - t0)
                    r_load = requests.post(url + "/load_checkpoint", json={"path": path}, timeout=600)
                    assert r_load.ok and r_load.json()["status"] == "ok", r_load.text
                    parts.setdefault((way, "load (server)"), []).append(r_load.json()["seconds"])
                else:
                    save_file(named, os.path.join(restart_dir, "model.safetensors"), metadata={"format": "pt"})
                    t_saved = time.perf_counter()
                    stop_server(proc)
                    t_stopped = time.perf_counter()
                    proc, url = start_server(restart_dir, os.path.join(tmp, f"server-{r + 1}.log"), *flags)
                    t_started = time.perf_counter()
                    for part, seconds in (
                        ("save", t_saved - t0),
                        ("stop", t_stopped - t_saved),
                        ("start, until /health answers", t_started - t_stopped),
                    ):
                        parts.setdefault((way, part), []).append(seconds)
                t_updated = time.perf_counter()
                first_token(url)
                parts.setdefault((way, "first token"), []).append(time.perf_counter() - t_updated)
                times.setdefault(way, []).append(time.perf_counter() - t0)
                assert checksums_match(url, named), f"{way}: the server does not compute with the new weights"
                if way == "checkpoint":
                    os.remove(path)
    finally:
        stop_server(proc)
        for suffix in (".buffer", ".control"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stem + suffix)
    print(
        f"\nnew weights in the trainer's memory -> first token sampled with them; median of {TRANSPORT_ROUNDS} rounds"
    )
    print(f"{'way':<44} {'seconds':>8} {'x broadcast':>12}")
    base = statistics.median(times["broadcast"])
    for way in ("restart", "checkpoint", "broadcast", "shared"):
        v = statistics.median(times[way])
        print(f"{way:<44} {v:8.3f} {v / base:12.1f}")
        for (w, part), xs in parts.items():
            if w == way:
                print(f"  {part:<42} {statistics.median(xs):8.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="small", help="the random model's shapes")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed rounds per server (1: a quick check)")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="the engine's and the push's"
    )
    parser.add_argument(
        "--transports",
        action="store_true",
        help="restart, checkpoint reload, broadcast and the shared transport, side by side, instead",
    )
    args, tmp = parser.parse_args(), tempfile.mkdtemp()
    REPEATS = args.repeats
    try:
        if args.transports:
            transports(args.shape, args.dtype, tmp)
        else:
            main(args.shape, args.dtype, tmp)
    finally:
        shutil.rmtree(tmp)  # the model (2 GB for qwen2.5-0.5b)
