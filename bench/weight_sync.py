"""Benchmark: a full weight push into a running vllm_sync_server, three ways, side by side in one run.

  1. this project's protocol: one POST /update_param_batch, tensors packed into buckets (and, to decide
     the bucket question, the same protocol with one broadcast per tensor: bucket_bytes=0), on the server's
     two load paths: straight into the engine's tensors (the default) and vLLM's layerwise reload;
  2. the raw limit: one gloo broadcast of the same number of bytes between two plain processes;
  3. a per-parameter protocol as TRL's vllm_serve does it: one HTTP request, one broadcast and one
     barrier (the request's completion) per tensor. vLLM fuses q/k/v and gate/up, which must travel
     together (see the server), so those go as one request of 3 or 2 broadcasts: slightly kinder to this
     baseline than one request per tensor.

Model: a random Qwen2 of about 290 MB (fp32) in about 290 tensors, built locally (no hub).
Run: .venv/bin/python bench/weight_sync.py   (CPU, about 3 minutes)
"""

import datetime
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time

import requests
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from conftest import start_server, stop_server  # noqa: E402
from tiny_model import build_tiny_model  # noqa: E402
from vllm_sync_server import plan_buckets  # noqa: E402

REPEATS = 3
BUCKETS = (0, 1 << 20, 8 << 20, 64 << 20)
TIMEOUT = datetime.timedelta(seconds=300)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lines(resp):
    return (json.loads(x) for x in resp.iter_lines() if x)


def make_group(url):
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
    r = requests.post(url + "/init_communicator", json={"host": "127.0.0.1", "port": port, "world_size": 2},
                      stream=True)
    it = lines(r)
    next(it)
    pg = dist.ProcessGroupGloo(store, 0, 2, TIMEOUT)
    assert next(it)["status"] == "ok"
    return pg, store


def push(url, pg, named, bucket_bytes):
    params = [{"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)} for n, t in named.items()]
    r = requests.post(url + "/update_param_batch", json={"params": params, "bucket_bytes": bucket_bytes}, stream=True)
    r.raise_for_status()
    it = lines(r)
    next(it)
    tensors, i, inflight = list(named.values()), 0, []
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    for nbytes, items in plan_buckets(params, bucket_bytes):
        if len(items) == 1:  # a tensor alone travels as itself: no packing copy
            buf = tensors[i].contiguous().view(-1).view(torch.uint8)
        else:  # pack while the previous bucket is on the wire
            buf = torch.empty(nbytes, dtype=torch.uint8)
            for (offset, size), t in zip(items, tensors[i : i + len(items)]):
                buf[offset : offset + size].copy_(t.contiguous().view(-1).view(torch.uint8))
        inflight.append(pg.broadcast([buf], opts))
        if len(inflight) > 2:
            inflight.pop(0).wait()
        i += len(items)
    for w in inflight:
        w.wait()
    done = next(it)
    assert done["status"] == "ok", done
    return done


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


def raw_transfer(pg, bufs):
    """One broadcast per buffer, all posted at once, then a 1-element broadcast: the sender's clock stops when the
    receiver has it all."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    for work in [pg.broadcast([b], opts) for b in bufs]:
        work.wait()
    pg.broadcast([torch.zeros(1)], opts).wait()


def raw_receiver(port, sizes):
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=TIMEOUT)
    pg = dist.ProcessGroupGloo(store, 1, 2, TIMEOUT)
    # touched once, like the engine's weights: no page faults timed
    one, each = [torch.zeros(sum(sizes), dtype=torch.uint8)], [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    for bufs in [one] * (REPEATS + 1) + [each] * (REPEATS + 1):
        raw_transfer(pg, bufs)


def raw_broadcast(sizes):
    """The transport's limits between two plain processes: the same bytes as one broadcast, and as one per tensor."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
    proc = mp.get_context("spawn").Process(target=raw_receiver, args=(port, sizes))
    proc.start()
    pg = dist.ProcessGroupGloo(store, 0, 2, TIMEOUT)
    one = [torch.randint(0, 255, (sum(sizes),), dtype=torch.uint8)]
    each = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in sizes]
    out = [timed(lambda: raw_transfer(pg, bufs)) for bufs in (one, each)]
    proc.join()
    return out


def timed(fn, repeats=REPEATS):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


if __name__ == "__main__":
    tmp = tempfile.mkdtemp()
    model_dir = build_tiny_model(os.path.join(tmp, "bench-qwen2"), vocab_size=8192, hidden_size=512,
                                 intermediate_size=1408, num_hidden_layers=24, num_attention_heads=8,
                                 num_key_value_heads=2, tie_word_embeddings=False)
    from safetensors.torch import load_file

    sd = load_file(os.path.join(model_dir, "model.safetensors"))
    named = {k: torch.randn_like(v) * 0.02 for k, v in sd.items()}
    nbytes = sum(t.numel() * t.element_size() for t in named.values())
    print(f"model: {len(named)} tensors, {nbytes / 1e6:.1f} MB (fp32); torch threads {torch.get_num_threads()}")

    results, raw = {}, None
    for mode, flags in (("direct", []), ("layerwise reload", ["--no-direct-load"])):
        proc, url = start_server(model_dir, os.path.join(tmp, f"server-{mode}.log"), "--max-num-seqs", "8", *flags)
        try:
            pg, store = make_group(url)
            if raw is None:
                raw, raw_each = raw_broadcast([t.numel() * t.element_size() for t in named.values()])
                results["raw broadcast (2 plain processes)"] = raw
                results["raw, one broadcast per tensor (2 plain processes)"] = raw_each
            for bucket in BUCKETS if mode == "direct" else (0,):
                label = f"this protocol ({mode}), " + (f"bucket_bytes={bucket / 2**20:g} MiB" if bucket else "one broadcast per tensor")
                results[label] = timed(lambda: push(url, pg, named, bucket))
            if mode == "direct":
                groups = per_parameter_groups(list(named))

                def per_param():
                    for g in groups:
                        push(url, pg, {n: named[n] for n in g}, 0)

                results[f"per-parameter protocol ({len(groups)} requests)"] = timed(per_param, repeats=1)
        finally:
            stop_server(proc)

    default = results["this protocol (direct), one broadcast per tensor"]
    per_param_t = [v for k, v in results.items() if k.startswith("per-parameter")][0]
    print(f"\n{'way':<56} {'seconds':>8} {'GB/s':>6} {'x raw':>6}")
    for k, v in results.items():
        print(f"{k:<56} {v:8.3f} {nbytes / v / 1e9:6.2f} {v / raw:6.2f}")
    print(f"\nthis protocol (default: per tensor) / raw broadcast = {default / raw:.2f}x (target <= 1.3x)")
    print(f"this protocol / raw one broadcast per tensor     = {default / results['raw, one broadcast per tensor (2 plain processes)']:.2f}x")
    print(f"per-parameter / this protocol                   = {per_param_t / default:.1f}x (target >= 3x)")
