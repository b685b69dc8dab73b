"""Shared test plumbing: the tiny model, free ports, a real vllm_sync_server subprocess, and a test-side
weight-sync client (rank 0 over gloo) written independently of the scripts' own clients."""

import datetime
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
PY = sys.executable

from tiny_model import build_tiny_model  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny-qwen2"))


def start_server(model: str, log_path: str, *extra: str, port: int | None = None, timeout: float = 240):
    """Start vllm_sync_server.py on a free port and wait for /health. Returns (proc, url)."""
    port = port or free_port()
    cmd = [PY, os.path.join(ROOT, "vllm_sync_server.py"), "--model", model, "--port", str(port),
           "--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20),
           "--max-model-len", "1024", *extra]
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

    def init(self, world_size: int = 2):
        import torch.distributed as dist

        port = free_port()
        timeout = datetime.timedelta(seconds=self.timeout_s)
        self.store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True, timeout=timeout,
                                   wait_for_workers=False)
        r = requests.post(self.url + "/init_communicator", json={"host": "127.0.0.1", "port": port,
                          "world_size": world_size}, headers=self.headers, stream=True, timeout=self.timeout_s)
        r.raise_for_status()
        lines = read_lines(r)
        assert next(lines)["status"] == "joining"
        self.pg = dist.ProcessGroupGloo(self.store, 0, world_size, timeout)
        done = next(lines)
        assert done["status"] == "ok", done
        return done

    def push(self, named: dict, bucket_bytes: int = 1 << 20, version: int | None = None, stop_after: int | None = None):
        """Broadcast `named` tensors (name -> tensor). stop_after=k: die after k buckets (for tests)."""
        import torch
        import torch.distributed as dist

        sys.path.insert(0, ROOT)
        from vllm_sync_server import plan_buckets

        params = [{"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                  for n, t in named.items()]
        body = {"params": params, "bucket_bytes": bucket_bytes}
        if version is not None:
            body["version"] = version
        r = requests.post(self.url + "/update_param_batch", json=body, headers=self.headers, stream=True,
                          timeout=self.timeout_s)
        if not r.ok:
            return r
        lines = read_lines(r)
        assert next(lines)["status"] == "receiving"
        tensors = list(named.values())
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        i = 0
        for b, (nbytes, items) in enumerate(plan_buckets(params, bucket_bytes)):
            if stop_after is not None and b >= stop_after:
                return None
            buf = torch.zeros(nbytes, dtype=torch.uint8)
            for offset, size in items:
                buf[offset : offset + size].copy_(tensors[i].contiguous().view(-1).view(torch.uint8))
                i += 1
            self.pg.broadcast([buf], opts).wait()
        return next(lines)
