"""The shared transport of vllm_sync_server.py (transport "shared" in /init_communicator): a staging buffer the
trainer owns and the server's worker maps. On CPU the buffer is a file in /dev/shm, with the same protocol, offsets and
copy code as CUDA IPC on a GPU. Its checks as pure functions here, and a test-side client written here (independent of
the scripts' own), which tests/test_server.py pushes with into its real servers on both load paths."""

import contextlib
import json
import os
import time
from pathlib import Path

import pytest
import requests
import torch

from conftest import ROOT, sha256


def vllm_sync_server():
    import sys

    sys.path.insert(0, ROOT)
    import vllm_sync_server

    return vllm_sync_server


# ---------------------------------------------------------------------------------------------------
# check_shared_spec and check_shared_slices: pure, no server


def shm_file(tmp_name: str, nbytes: int) -> str:
    path = f"/dev/shm/cleanrlvr-test-{os.getpid()}-{tmp_name}"
    with open(path, "wb") as f:
        f.truncate(nbytes)
    return path


@pytest.fixture
def cpu_spec():
    """A valid CPU spec of a 1000-element float32 buffer, its files really in /dev/shm (removed afterwards)."""
    spec = {
        "device": "cpu",
        "dtype": "float32",
        "numel": 1000,
        "control": shm_file("control", 16),
        "path": shm_file("buffer", 4000),
    }
    yield spec
    for k in ("control", "path"):
        if os.path.lexists(spec[k]):
            os.unlink(spec[k])


CUDA_SPEC = {  # what a trainer's reduce_tensor gives for a 1000-element bf16 buffer (handles made up: never opened)
    "device": "cuda",
    "dtype": "bfloat16",
    "numel": 1000,
    "gpu_uuid": "GPU-0000",
    "handle": "aGFuZGxl",
    "storage_size_bytes": 2048,
    "storage_offset_bytes": 0,
    "ref_counter_handle": "cmVm",
    "ref_counter_offset": 0,
    "event_handle": "",
    "event_sync_required": True,
    "tensor_offset": 0,
}


def test_check_shared_spec_accepts_a_trainers_spec(cpu_spec):
    S = vllm_sync_server()
    assert S.check_shared_spec(cpu_spec, "cpu", "float32", 1000) is None
    cuda = {**CUDA_SPEC, "control": cpu_spec["control"]}
    assert S.check_shared_spec(cuda, "cuda", "bfloat16", 1000, gpu_uuid="GPU-0000") is None


def test_check_shared_spec_refuses_before_anything_is_mapped(cpu_spec, tmp_path):
    S = vllm_sync_server()
    link = f"/dev/shm/cleanrlvr-test-{os.getpid()}-link"
    os.symlink(cpu_spec["path"], link)
    try:
        cases = {
            "bad size": ({"numel": 999}, "'path'"),  # the file holds 1000 float32
            "too small for the largest weight": ({"numel": 10}, "must hold the largest weight"),
            "missing file": ({"path": "/dev/shm/cleanrlvr-test-no-such-file"}, "no such file"),
            "unknown field": ({"pickle": "x"}, "unknown field(s) ['pickle']"),
            "missing field": ({"control": None}, "missing field(s) ['control']"),
            "a bool as a number": ({"numel": True}, "field(s) ['numel'] must be"),
            "outside /dev/shm": ({"path": str(tmp_path / "buffer")}, "not a file directly in /dev/shm"),
            "a dot-dot path": ({"path": "/dev/shm/../etc/passwd"}, "not a file directly in /dev/shm"),
            "a link": ({"path": link}, "not a regular file"),
            "another dtype": ({"dtype": "bfloat16"}, "!= the engine's float32"),
            "another device": ({"device": "cuda"}, "this server runs on 'cpu'"),
        }
        for case, (change, message) in cases.items():
            spec = {k: v for k, v in {**cpu_spec, **change}.items() if v is not None}
            problem = S.check_shared_spec(spec, "cpu", "float32", 100)
            assert problem is not None and message in problem, (case, problem)
        assert "not a file directly" in S.check_shared_spec({**cpu_spec, "control": "/tmp/c"}, "cpu", "float32", 1)
        cuda = {**CUDA_SPEC, "control": cpu_spec["control"]}
        for change, message in [
            ({"gpu_uuid": "GPU-1111"}, "this server's GPU is GPU-0000"),
            ({"handle": "not base64!"}, "'handle' is not base64"),
            ({"tensor_offset": 100}, "overruns the storage"),  # (100 + 1000) x 2 bytes > 2048
            ({"ref_counter_offset": -1}, "must not be negative"),
        ]:
            problem = S.check_shared_spec({**cuda, **change}, "cuda", "bfloat16", 100, gpu_uuid="GPU-0000")
            assert problem is not None and message in problem, (change, problem)
    finally:
        os.unlink(link)


def slices(*rounds_of_sizes, gap=0) -> list[dict]:
    """Params of a push: tensors of the given sizes per round, laid out one after the other from 0 in each round."""
    params = []
    for r, sizes in enumerate(rounds_of_sizes):
        offset = 0
        for n in sizes:
            params.append({"name": f"t{len(params)}", "dtype": "float32", "shape": [n], "offset": offset, "round": r})
            offset += n + gap
    return params


def test_check_shared_slices():
    S = vllm_sync_server()
    assert S.check_shared_slices(slices([10, 20, 30]), 60) is None  # one round, exactly full
    assert S.check_shared_slices(slices([10, 20], [30], [25, 5]), 30) is None  # a window reused in three rounds
    bad = {
        "overrun": (slices([10, 20, 31]), 60, "elements 30..61 overrun the buffer's 60"),
        "overlap": (slices([10, 20], gap=-5), 60, "'t0' and 't1' overlap in round 0"),
        "a round skipped": (slices([10], [], [10]), 60, "round 2 after round 0"),
        "not from round 0": ([{**slices([10])[0], "round": 1}], 60, "round 1 after round 0"),
        "back to an earlier round": (slices([10], [10]) + slices([10]), 60, "round 0 after round 1"),
        "negative offset": ([{**slices([10])[0], "offset": -1}], 60, "must be integers >= 0"),
        "no offset": ([{k: v for k, v in slices([10])[0].items() if k != "offset"}], 60, "must be integers"),
        "a bool round": ([{**slices([10])[0], "round": False}], 60, "must be integers"),
    }
    for case, (params, numel, message) in bad.items():
        problem = S.check_shared_slices(params, numel)
        assert problem is not None and message in problem, (case, problem)


# ---------------------------------------------------------------------------------------------------
# A test-side client: maps its own files, writes each tensor at its own offsets, counts rounds in the control words.


class SharedClient:
    """Rank-free: the staging buffer is a file in /dev/shm of `numel` float32, tensors packed one after the other
    (no alignment, unlike the scripts) in rounds of at most `numel` elements."""

    def __init__(self, url: str, numel: int, headers: dict | None = None):
        self.url = url
        self.numel = numel
        self.headers = headers  # the server's key, where it has one
        stem = f"/dev/shm/cleanrlvr-test-{os.getpid()}-{os.urandom(3).hex()}"
        self.paths = {"path": stem + ".buf", "control": stem + ".ctl"}
        self.buffer = torch.from_file(self.paths["path"], shared=True, size=numel, dtype=torch.float32)
        self.control = torch.from_file(self.paths["control"], shared=True, size=2, dtype=torch.int64)

    def init(self, unlink: bool = True, **changes):
        spec = {"device": "cpu", "dtype": "float32", "numel": self.numel, **self.paths, **changes}
        r = requests.post(
            self.url + "/init_communicator",
            json={"transport": "shared", "shared": spec},
            headers=self.headers,
            stream=True,
        )
        if r.ok:
            lines = [json.loads(x) for x in r.iter_lines() if x]
            assert lines[0]["status"] == "mapping", lines
            r.done = lines[1]
        if unlink:  # as a trainer does: the mapping keeps the memory, nothing stays in /dev/shm
            for path in self.paths.values():
                if os.path.exists(path):
                    os.unlink(path)
        return r

    def layout(self, named: dict) -> list[dict]:
        params = []
        round_ = 0
        offset = 0
        for name, t in named.items():
            if offset + t.numel() > self.numel:
                round_ += 1
                offset = 0
            params.append({"name": name, "dtype": "float32", "shape": list(t.shape), "offset": offset, "round": round_})
            offset += t.numel()
        return params

    def push(self, named: dict, stop_after_round: int | None = None) -> dict | None:
        """Post the push, then write each tensor and count it written (control word 0); the first tensor of a round
        waits until the server counted every tensor before it copied (word 1). stop_after_round=k: write rounds 0..k,
        then return without writing more (the caller dies mid-push, for tests)."""
        params = self.layout(named)
        self.control.zero_()
        body = {"params": params}
        r = requests.post(self.url + "/update_param_batch", json=body, headers=self.headers, stream=True, timeout=120)
        if not r.ok:
            return r
        lines = (json.loads(x) for x in r.iter_lines() if x)
        assert next(lines)["status"] == "receiving"
        for i, (p, t) in enumerate(zip(params, named.values(), strict=True)):
            if i > 0 and p["round"] != params[i - 1]["round"]:
                if stop_after_round is not None and p["round"] > stop_after_round:
                    return None
                while self.control[1].item() < i:
                    time.sleep(0.001)
            self.buffer[p["offset"] : p["offset"] + t.numel()] = t.reshape(-1)
            self.control[0] = i + 1
        return next(lines)


def named_weights(model_path: str, scale: float) -> dict:
    """The tiny model's weights times `scale` (new weights the server cannot have by chance), HF names, with the
    tied lm_head listed too (the server accepts it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return {n: p.detach() * scale for n, p in model.named_parameters()}


def checksums_equal(url: str, named: dict, headers: dict | None = None) -> bool:
    got = requests.get(url + "/weights_checksum", headers=headers, timeout=60).json()["checksums"]
    want = {**named, "lm_head.weight": named["model.embed_tokens.weight"]}
    return all(got[k] == sha256(want[k]) for k in got) and set(got) == set(want)


def process_tree(pid: int) -> list[int]:
    kids = [
        int(c)
        for t in os.listdir(f"/proc/{pid}/task")
        for c in Path(f"/proc/{pid}/task/{t}/children").read_text().split()
    ]
    return [pid] + [p for kid in kids for p in process_tree(kid)]


def mapped_files(pid: int) -> str:
    """The memory maps of the server's whole process tree (vLLM's engine and worker included): a file the worker
    mapped is listed there, unlinked or not, until it is unmapped."""
    maps = ""
    for p in process_tree(pid):
        with contextlib.suppress(FileNotFoundError):
            maps += Path(f"/proc/{p}/maps").read_text()
    return maps


# a trainer that dies mid-push (tests/test_server.py runs it against its servers): argv url, tests dir, model, key
KILLED_TRAINER = """
import os, signal, sys
sys.path[:0] = sys.argv[1:3]
import test_shared_transport as T
named = T.named_weights(sys.argv[3], 2.0)
auth = {"Authorization": f"Bearer {sys.argv[4]}"}
client = T.SharedClient(sys.argv[1], max(t.numel() for t in named.values()) + 1000, headers=auth)
print(client.paths["path"], flush=True)
assert client.init().done["status"] == "ok"
client.push(named, stop_after_round=0)  # round 0 written, the server copies it and waits for round 1
print("pushing", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
