"""The scripts' clients of vllm_sync_server.py, against tiny fake servers (no engine, seconds): every request carries
$VLLM_API_KEY and has a bounded timeout, and a server that stops answering ends in an error naming the URL and the
route, within the timeout, instead of a hang. (Each script keeps its own copy of `post`, `lines` and
`auth_headers`; all copies are checked.)"""

import ast
import functools
import json
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT, import_script

SCRIPTS = [
    "grpo_gsm8k.py",
    "grpo_gsm8k_lora_one_gpu.py",
    "reinforce_math_fsdp2.py",
    "pipeline_actor.py",
    "pipeline_learner.py",
    "eval.py",
]
STREAMING = [
    "grpo_gsm8k.py",
    "grpo_gsm8k_lora_one_gpu.py",
    "reinforce_math_fsdp2.py",
    "pipeline_learner.py",
]  # the scripts that push weights
VERSION_READER = "pipeline_actor.py"  # the script whose server_version GETs /runtime_version


class FakeServer:
    """HTTP on 127.0.0.1, one thread per connection. mode "answer": a JSON answer to anything, request headers
    recorded; "silent": reads the request, then never answers; "first_line": the headers and the first line of a
    streamed (chunked) answer, then nothing."""

    def __init__(self, mode: str):
        self.mode = mode
        self.seen = []  # (request line, headers) of every request
        self.conns = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    def serve(self, conn):
        try:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, body = data.split(b"\r\n\r\n", 1)
            lines = head.decode().split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:])}
            while len(body) < int(headers.get("content-length", 0)):
                body += conn.recv(65536)
            self.seen.append((lines[0], headers))
            if self.mode == "answer":
                out = json.dumps({"status": "ok", "version": 3, "results": [{"completions": []}]}).encode()
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                    b"Connection: close\r\n\r\n%s" % (len(out), out)
                )
            elif self.mode == "first_line":
                first = json.dumps({"status": "receiving"}).encode() + b"\n"
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n"
                    b"%x\r\n%s\r\n" % (len(first), first)
                )
        except OSError:
            pass

    def close(self):
        self.sock.close()
        for c in self.conns:  # (a client still waiting on one gets EOF)
            c.close()


@pytest.fixture
def fake(request):
    servers = []

    def start(mode):
        servers.append(FakeServer(mode))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def modules():
    return {script: import_script(script) for script in SCRIPTS}


def within(seconds: float, fn):
    """fn() in a thread; returns (its exception or result, the seconds it took). Fails if it is still waiting after
    `seconds` (the old clients waited forever: the test must end anyway)."""
    out = {}
    t0 = time.monotonic()

    def run():
        try:
            out["value"] = fn()
        except Exception as e:  # noqa: BLE001 (whatever fn raises is its result, for the caller to check)
            out["value"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still waiting after {seconds} s"
    return out["value"], time.monotonic() - t0


def test_every_request_in_the_scripts_has_a_timeout_and_the_key():
    """Statically: every requests.get/post/request call in the scripts passes headers= and a timeout= that holds
    no None (no call may wait forever), and the copies of the client helpers are identical."""
    copies = {}
    for script in SCRIPTS:
        src = Path(ROOT, script).read_text()
        calls = [
            n
            for n in ast.walk(ast.parse(src))
            if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name)
            and n.func.value.id == "requests"
            and n.func.attr in ("get", "post", "request")
        ]
        assert calls, script
        for call in calls:
            kw = {k.arg: k.value for k in call.keywords}
            where = f"{script}:{call.lineno}"
            assert "timeout" in kw and "headers" in kw, where
            assert not any(isinstance(v, ast.Constant) and v.value is None for v in ast.walk(kw["timeout"])), where
        for node in ast.parse(src).body:
            if isinstance(node, ast.FunctionDef) and node.name in ("post", "lines", "auth_headers"):
                copies.setdefault(node.name, set()).add(ast.get_source_segment(src, node))
    assert sorted(copies) == ["auth_headers", "lines", "post"] and all(len(v) == 1 for v in copies.values()), copies


def test_clients_send_the_key_from_the_environment(fake, monkeypatch):
    server = fake("answer")
    mods = modules()
    monkeypatch.setenv("VLLM_API_KEY", "secret-1")
    for m in mods.values():
        m.post(server.url, "/generate", {"prompts": [[1]]})
    mods[VERSION_READER].server_version([server.url])  # its GET /runtime_version
    assert len(server.seen) == len(mods) + 1
    assert all(h.get("authorization") == "Bearer secret-1" for _, h in server.seen), server.seen
    monkeypatch.delenv("VLLM_API_KEY")
    for m in mods.values():
        m.post(server.url, "/generate", {"prompts": [[1]]})
    assert not any("authorization" in h for _, h in server.seen[len(mods) + 1 :])


def test_a_silent_server_is_an_error_naming_the_route(fake):
    """A server that takes the request and never answers: post fails after its timeout (not retried: the server may
    be acting on it), naming the URL and the route."""
    server = fake("silent")
    for script, m in modules().items():
        post = functools.partial(m.post, server.url, "/init_communicator", {}, stream=True, timeout=1)
        err, took = within(10, post)
        assert isinstance(err, RuntimeError), (script, err)
        assert f"{server.url} did not answer /init_communicator within 1 s" in str(err), (script, err)
        assert 1 <= took < 4, (script, took)


@pytest.mark.parametrize("script", STREAMING)
def test_a_server_stalled_mid_push_is_an_error_naming_the_route(fake, script):
    """The server sends the first line of /update_param_batch ("receiving"), then nothing: the script's real
    push_weights (its broadcasts replaced by no-ops) fails after the read timeout its sync state holds, with an error
    naming the URL and route. The old clients read the second line with no timeout at all."""
    m = import_script(script)
    server = fake("first_line")
    noop = SimpleNamespace(broadcast=lambda bufs, opts: SimpleNamespace(wait=lambda: None))
    sync = {
        "url": server.url,
        "urls": [server.url],
        "pg": noop,
        "dtype": "float32",
        "device": torch.device("cpu"),
        "timeout_s": 1,
    }
    err, took = within(10, lambda: m.push_weights(sync, torch.nn.Linear(3, 2), 7))
    assert isinstance(err, RuntimeError), err
    assert f"{server.url}/update_param_batch stopped answering" in str(err), err
    assert 1 <= took < 4, took
    # and the helpers alone, as init_weight_sync uses them: the first line arrives, the second never does
    answer = m.lines(m.post(server.url, "/init_communicator", {}, stream=True, timeout=1))
    assert next(answer) == {"status": "receiving"}
    err, took = within(10, lambda: next(answer))
    assert isinstance(err, RuntimeError) and f"{server.url}/init_communicator stopped answering" in str(err), err
    assert 1 <= took < 4, took
