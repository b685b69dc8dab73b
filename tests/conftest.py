"""Shared test plumbing: the tiny model, free ports, a real vllm_sync_server subprocess, and a test-side
weight-sync client (rank 0 over gloo) written independently of the scripts' own clients."""

import datetime
import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from unittest import mock

import pytest
import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
PY = sys.executable

from tiny_model import build_tiny_model  # noqa: E402

_GIVEN: set[int] = set()


def free_port() -> int:
    """A free port below the kernel's ephemeral range. The processes the tests start (vLLM's engines, gloo, every
    outgoing connection) take their own ports from that range, so none of them can take this one in the seconds
    before the process it is meant for binds it (a server bound too late failed a CI run)."""
    lo = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    for _ in range(200):
        port = random.randrange(10000, lo) if lo > 11000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _GIVEN:  # never the same port twice in one run
            _GIVEN.add(port)
            return port
    raise RuntimeError("no free port")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny-qwen2"))


SERVER_LOGS: dict[str, str] = {}  # url -> log file of a server started by a session fixture


@pytest.fixture(scope="session")
def toy_model(tmp_path_factory) -> str:
    """The learnable toy model: a 128-token vocabulary in which each `\\boxed{d}` is one token."""
    return build_tiny_model(str(tmp_path_factory.mktemp("toy_model") / "toy"), vocab_size=128, byte_alphabet=False)


@pytest.fixture(scope="session")
def tp2_server(toy_model, tmp_path_factory):
    """A tensor-parallel server (--tensor-parallel-size 2) of the toy model: two CPU workers, one core each
    (VLLM_CPU_OMP_THREADS_BIND="0|1"; without it vLLM refuses two CPU workers on one NUMA node). Started once."""
    log = str(tmp_path_factory.mktemp("tp2_server") / "server.log")
    with mock.patch.dict(os.environ, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}):
        proc, url = start_server(toy_model, log, "--tensor-parallel-size", "2", timeout=360)
    SERVER_LOGS[url] = log
    yield url
    stop_server(proc)


def start_server(model: str, log_path: str, *extra: str, port: int | None = None, timeout: float = 240):
    """Start vllm_sync_server.py on a free port and wait for /health. Returns (proc, url). Should another process take
    the free port first (the server then fails at once, on its bind), it tries again on another one."""
    for attempt in range(3):
        try:
            return _start_server(model, log_path, *extra, port=port or free_port(), timeout=timeout)
        except RuntimeError as e:
            if port or attempt == 2 or "address already in use" not in str(e).lower():
                raise


def _start_server(model: str, log_path: str, *extra: str, port: int, timeout: float):
    cmd = [
        PY,
        os.path.join(ROOT, "vllm_sync_server.py"),
        "--model",
        model,
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        str(64 << 20),
        "--max-model-len",
        "1024",
        *extra,
    ]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; log:\n" + open(log_path).read()[-4000:])
        try:
            if requests.get(url + "/health", timeout=1).ok:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError("server did not become healthy; log:\n" + open(log_path).read()[-4000:])


def stop_server(proc) -> None:
    """Stop the server and every process it spawned (vLLM's EngineCore and workers)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------------------------------------------
# Test-side client of the weight-sync protocol (the reference the scripts' clients are checked against).


def sha256(t) -> str:
    import torch

    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy()).hexdigest()


def read_lines(resp):
    return (json.loads(line) for line in resp.iter_lines() if line)


class SyncClient:
    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 60):
        self.url, self.timeout_s = url, timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.pg = None

    def init(self, world_size: int = 2, connections: int = 4):
        """Join the server's group as rank 0: gloo over `connections` TCP connections, as the server builds its end."""
        import torch.distributed as dist

        port = free_port()
        timeout = datetime.timedelta(seconds=self.timeout_s)
        self.store = dist.TCPStore(
            "127.0.0.1", port, world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        r = requests.post(
            self.url + "/init_communicator",
            json={"host": "127.0.0.1", "port": port, "world_size": world_size, "connections": connections},
            headers=self.headers,
            stream=True,
            timeout=self.timeout_s,
        )
        r.raise_for_status()
        lines = read_lines(r)
        assert next(lines)["status"] == "joining"
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout, opts._threads = timeout, 2 * connections
        opts._devices = [dist.ProcessGroupGloo.create_default_device() for _ in range(connections)]
        self.pg = dist.ProcessGroupGloo(self.store, 0, world_size, opts)
        done = next(lines)
        assert done["status"] == "ok", done
        return done

    def push(self, named: dict, version: int | None = None, stop_after: int | None = None, before_broadcast=None):
        """Broadcast `named` tensors (name -> tensor) in order, one broadcast each, all in flight at once.
        stop_after=k: only the first k, then return (the caller dies mid-push, for tests). before_broadcast: called
        once the server has accepted the push, before the first broadcast (a test acts while the server waits)."""
        import torch
        import torch.distributed as dist

        params = [
            {"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)} for n, t in named.items()
        ]
        body = {"params": params}
        if version is not None:
            body["version"] = version
        r = requests.post(
            self.url + "/update_param_batch", json=body, headers=self.headers, stream=True, timeout=self.timeout_s
        )
        if not r.ok:
            return r
        lines = read_lines(r)
        assert next(lines)["status"] == "receiving"
        if before_broadcast is not None:
            before_broadcast()
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        bufs = [t.contiguous().view(-1).view(torch.uint8) for t in named.values()][:stop_after]
        for work in [self.pg.broadcast([b], opts) for b in bufs]:
            work.wait()
        if stop_after is not None:
            return None
        return next(lines)


def logprob_gap(module, url: str, model_path: str, temperature: float, seed: int = 0) -> float:
    """The largest |trainer logprob - server logprob| over the tokens the server samples at `temperature`, the trainer
    side computed the way `module` (a training script) trains: its micro_batch packing and its chunked token_logprobs
    at that temperature. The model's weights are pushed first with the test-side client (another test may have left
    other weights in the server)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    client = SyncClient(url)
    client.init()
    done = client.push({n: p.detach() for n, p in model.named_parameters()})
    assert done["status"] == "ok", done
    prompts = [[5, 17, 33, 2, 91], [44, 8, 120, 7, 7, 7, 7, 9], [3]]
    body = {"prompts": prompts, "n": 4, "temperature": temperature, "max_tokens": 24, "seed": seed}
    results = requests.post(url + "/generate", json=body, timeout=120).json()["results"]
    seqs, n_prompt, server_lp = [], [], []
    for p, res in zip(prompts, results):
        for c in res["completions"]:
            seqs.append(p + c["token_ids"])
            n_prompt.append(len(p))
            server_lp.append(c["logprobs"])
    worst = 0.0
    for idx in module.pack_micro_batches([len(s) for s in seqs], 64):  # a small budget: several micro-batches
        ids, attn, mask, at = module.micro_batch(seqs, n_prompt, idx, 0, torch.device("cpu"))
        with torch.no_grad():  # small chunks: several lm_head blocks
            flat, _ = module.token_logprobs(model.train(), ids, attn, at, temperature, chunk=7)
        want = torch.tensor([x for i in idx for x in server_lp[i]])
        worst = max(worst, (flat - want).abs().max().item())
    return worst
