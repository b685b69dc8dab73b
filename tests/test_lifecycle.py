"""A run's lifecycle, end to end on CPU with the toy model: what a run leaves on disk (its rollout log, its checkpoints
and the arguments saved with them), what --resume makes of them, what eval.py makes of a checkpoint, and the server
that --start-server launched, stopped when the script is stopped by a signal. SCRIPT is the trainer, EVAL the
evaluator; a copy of either is tested by changing its line."""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import requests
import torch

from conftest import FIXTURES, GRADE_WORKERS, PY, ROOT, free_port, import_script, metrics_of, read_jsonl, run_ok

SCRIPT = "grpo_gsm8k.py"
EVAL = "eval.py"
G = import_script(SCRIPT)
E = import_script(EVAL)
SERVER_ARGS = "--dtype float32 --enforce-eager --kv-cache-memory-bytes 67108864 --max-model-len 1024"  # CPU, small
PROMPT = "Put the final answer in a box."  # run 1's system prompt (not the script's default)


def train_cmd(*extra) -> list:
    return [PY, os.path.join(ROOT, SCRIPT), *GRADE_WORKERS, *extra]


# ---------------------------------------------------------------------------------------------------
# processes: which are alive, and whether a signal handler is in place


def group_alive(pgid: int) -> list[int]:
    """The live processes (zombies left out: nobody may reap them in a container) of process group `pgid`."""
    alive = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:  # it ended meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        if fields[0] != "Z" and int(fields[2]) == pgid:
            alive.append(int(d))
    return alive


def wait_until_gone(pgid: int, timeout: float) -> list[int]:
    """Wait up to `timeout` s for process group `pgid` to empty; returns what is still alive ([]: gone)."""
    deadline = time.time() + timeout
    while (alive := group_alive(pgid)) and time.time() < deadline:
        time.sleep(0.5)
    return alive


def server_child(pid: int) -> int | None:
    """The pid of the vllm_sync_server.py process that process `pid` started, if it has started one."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = Path(f"/proc/{d}/cmdline").read_bytes()
        except OSError:
            continue
        if ppid == pid and b"vllm_sync_server.py" in cmdline:
            return int(d)
    return None


def catches(pid: int, signum: int) -> bool:
    """Process `pid` has a handler of its own for `signum` (the SigCgt mask of /proc/PID/status)."""
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("SigCgt:"))
    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)


def kill_all(proc: subprocess.Popen, server: int | None) -> None:
    """Test clean-up: whatever is left of a script started in its own session and of its server."""
    for pgid in (proc.pid, server):
        if pgid is not None and group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)
    proc.wait(timeout=30)


# ---------------------------------------------------------------------------------------------------
# tis_weight without --tis-cap


def test_policy_loss_reports_tis_weights_only_when_it_applies_them():
    """With --tis-cap, policy_loss sums the truncated weights min(exp(old - sampler), cap) over the masked tokens;
    without it, it reports none (0 would be logged as the mean weight: the caller's fallback, 1 per token, applies)."""
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(3, 5, generator=g)
    old = lp + 0.1 * torch.randn(3, 5, generator=g)
    samp = old + 0.5 * torch.randn(3, 5, generator=g)
    mask = torch.ones(3, 5)
    mask[2, 3:] = 0
    adv = torch.tensor([1.0, -1.0, 0.5])
    stats = {}
    G.policy_loss(lp, old, adv, mask, sampling_logprobs=samp, tis_cap=1.2, stats=stats)
    want = sum(min(float(torch.exp(old[b, t] - samp[b, t])), 1.2) for b in range(3) for t in range(5) if mask[b, t])
    assert abs(stats["tis_weight_sum"] - want) < 1e-5
    stats = {}
    G.policy_loss(lp, old, adv, mask, sampling_logprobs=samp, stats=stats)
    assert "tis_weight_sum" not in stats and stats["clipped_tokens"] >= 0


# ---------------------------------------------------------------------------------------------------
# run 1 (against the module's server), run 2 (run 1 resumed with --start-server, retyping nothing)


class Run(NamedTuple):
    workdir: Path
    stdout: str
    metrics: list[dict]


@pytest.fixture(scope="module")
def run1(toy, tmp_path_factory) -> Run:
    """2 steps of 4 prompts x 4 completions, a checkpoint every step of which 1 is kept, a rollout log in a folder that
    does not exist yet, a system prompt of its own; --server-args is saved for a resumed run that starts a server."""
    workdir = tmp_path_factory.mktemp("run1")
    r = run_ok(
        train_cmd(
            "--model",
            toy.model,
            "--dataset",
            os.path.join(FIXTURES, "gsm8k_toy"),
            "--vllm-port",
            toy.url.rsplit(":", 1)[1],
            "--max-completion-tokens",
            "16",
            "--rollouts-per-update",
            "4",
            "--group-size",
            "4",
            "--learning-rate",
            "3e-3",
            "--system-prompt",
            PROMPT,
            "--eval-every",
            "0",
            "--train-steps",
            "2",
            "--save-every",
            "1",
            "--keep-checkpoints",
            "1",
            "--checkpoint-dir",
            "ckpt",
            "--rollout-log",
            "logs/new/rollouts.jsonl",
            f"--server-args={SERVER_ARGS}",
        ),
        cwd=workdir,
        timeout=600,
    )
    return Run(workdir, r.stdout, metrics_of(r.stdout))


def test_a_run_creates_its_log_folder_keeps_n_checkpoints_and_saves_its_args(run1):
    """The rollout log's folder is created; --keep-checkpoints 1 leaves the last checkpoint alone, with the run's
    arguments beside it; tis_weight is 1 without --tis-cap (no correction: every weight is 1); a checkpoint costs
    4 bytes per parameter of fp32 weights and 8 of AdamW state (the figure the docs give)."""
    rows = read_jsonl(run1.workdir / "logs" / "new" / "rollouts.jsonl")
    assert len(rows) == 2 * 4 * 4 and {x["step"] for x in rows} == {1, 2}
    assert sorted(os.listdir(run1.workdir / "ckpt")) == ["step_2"]
    saved = json.loads((run1.workdir / "ckpt" / "step_2" / "args.json").read_text())
    assert saved["group_size"] == 4 and saved["system_prompt"] == PROMPT and saved["server_args"] == SERVER_ARGS
    assert [x["tis_weight"] for x in run1.metrics] == ["1", "1"], run1.metrics
    from safetensors import safe_open

    with safe_open(run1.workdir / "ckpt" / "step_2" / "model.safetensors", "pt") as f:
        n_params = sum(f.get_tensor(k).numel() for k in f.keys())  # noqa: SIM118 (safe_open has no __iter__)
    weights = os.path.getsize(run1.workdir / "ckpt" / "step_2" / "model.safetensors")
    state = os.path.getsize(run1.workdir / "ckpt" / "step_2" / "trainer_state.pt")
    assert abs(weights / n_params - 4) < 0.2 and abs(state / n_params - 8) < 0.4, (n_params, weights, state)


def test_a_new_run_refuses_another_runs_files(run1):
    """A run without --resume that names run 1's rollout log (another --checkpoint-dir) is refused before any work, and
    nothing of run 1 changes; so is one that names run 1's --checkpoint-dir (--keep-checkpoints would delete run 1's
    checkpoints)."""
    log = run1.workdir / "logs" / "new" / "rollouts.jsonl"
    before = log.read_bytes()
    cmd = train_cmd("--checkpoint-dir", "ckpt_new", "--rollout-log", "logs/new/rollouts.jsonl")
    r = subprocess.run(cmd, cwd=run1.workdir, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "exists" in r.stderr and "--resume" in r.stderr, r.stderr[-2000:]
    assert log.read_bytes() == before and not (run1.workdir / "ckpt_new").exists()
    cmd = train_cmd("--checkpoint-dir", "ckpt", "--rollout-log", "other.jsonl")
    r = subprocess.run(cmd, cwd=run1.workdir, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "holds checkpoints" in r.stderr, r.stderr[-2000:]
    assert not (run1.workdir / "other.jsonl").exists() and sorted(os.listdir(run1.workdir / "ckpt")) == ["step_2"]


@pytest.fixture(scope="module")
def run2(run1) -> Run:
    """Run 1 resumed to step 3, retyping nothing but --resume, --start-server (on a port of its own) and the steps:
    the model, the data, the batch shape, the prompt, the server's flags come from run 1's args.json."""
    port = free_port()
    cmd = train_cmd("--resume", "--checkpoint-dir", "ckpt", "--start-server", "--vllm-port", str(port))
    r = run_ok([*cmd, "--train-steps", "3"], cwd=run1.workdir, timeout=600)
    with pytest.raises(requests.RequestException):  # the server it started stopped at its exit
        requests.get(f"http://127.0.0.1:{port}/health", timeout=5)
    return Run(run1.workdir, r.stdout, metrics_of(r.stdout))


def test_resume_reuses_the_saved_arguments_and_starts_its_server(run2):
    """Run 2 starts its server, continues at step 3 from step_2 with run 1's batch shape (4 x 4 rollouts of at most
    16 tokens, into run 1's rollout log) and prompt, keeps 1 checkpoint, and saves its own arguments (the flags given
    again included)."""
    assert "resumed from ckpt/step_2 at step 2" in run2.stdout
    assert [x["version"] for x in run2.metrics] == ["3"] and (run2.workdir / "vllm_server.log").exists()
    rows = read_jsonl(run2.workdir / "logs" / "new" / "rollouts.jsonl")
    step3 = [x for x in rows if x["step"] == 3]
    assert len(rows) == 3 * 16 and len(step3) == 16  # run 1's 2 steps, then step 3's 4 x 4
    assert float(run2.metrics[0]["avg_completion_length"]) <= 16
    assert sorted(os.listdir(run2.workdir / "ckpt")) == ["step_3"]
    saved = json.loads((run2.workdir / "ckpt" / "step_3" / "args.json").read_text())
    assert saved["system_prompt"] == PROMPT and saved["group_size"] == 4 and saved["train_steps"] == 3
    assert saved["start_server"] and saved["rollout_log"] == "logs/new/rollouts.jsonl"


def test_a_finished_run_has_nothing_to_do(run2):
    """--resume of a run whose last checkpoint is its last step: it says so and exits 0, starting no server (its saved
    arguments say --start-server)."""
    server_log = run2.workdir / "vllm_server.log"
    mtime = server_log.stat().st_mtime
    r = run_ok(train_cmd("--resume", "--checkpoint-dir", "ckpt"), cwd=run2.workdir, timeout=120)
    assert "nothing to do" in r.stdout and "step_3" in r.stdout
    assert server_log.stat().st_mtime == mtime


def test_eval_of_a_checkpoint_uses_the_system_prompt_it_trained_with(toy, run2, tmp_path):
    """eval.py pointed at a checkpoint renders its prompts with the system prompt of the training run (its
    args.json); --system-prompt given explicitly overrides it, "" included."""
    ckpt = str(run2.workdir / "ckpt" / "step_3")
    common = ["--dataset", os.path.join(FIXTURES, "gsm8k_toy"), "--vllm-port", toy.url.rsplit(":", 1)[1]]
    common += ["--limit", "2", "--max-tokens", "8"]
    for extra, want in [([], PROMPT), (["--system-prompt", ""], "")]:
        out = tmp_path / f"eval{len(extra)}.jsonl"
        r = run_ok(
            [PY, os.path.join(ROOT, EVAL), *GRADE_WORKERS, "--model", ckpt, *common, *extra, "--out", str(out)],
            cwd=tmp_path,
            timeout=300,
        )
        lines = read_jsonl(out)
        assert lines[-1]["summary"]["system_prompt"] == want, r.stdout[-2000:]
        assert all((PROMPT in x["prompt"]) == bool(want) for x in lines[:-1])


def test_sigterm_stops_the_server_it_started(run2):
    """A trainer that started its server (run 2 resumed once more, with --start-server from its saved arguments) and
    is stopped with SIGTERM once the server's engine runs (kill, timeout, a preemption) takes the server's whole
    process group with it: the engine's processes, which hold the memory, included."""
    port = free_port()
    cmd = train_cmd("--resume", "--checkpoint-dir", "ckpt", "--train-steps", "1000", "--vllm-port", str(port))
    with open(run2.workdir / "sigterm.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=run2.workdir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = None
    try:
        deadline = time.time() + 400
        while server is None or len(group_alive(server)) < 2 or not catches(proc.pid, signal.SIGTERM):
            assert proc.poll() is None and time.time() < deadline, (run2.workdir / "sigterm.log").read_text()[-3000:]
            server = server or server_child(proc.pid)
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGTERM)  # the trainer alone, as `kill` or `timeout` do
        assert wait_until_gone(server, timeout=90) == []
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        kill_all(proc, server)


def test_a_server_that_dies_mid_run_is_named_within_seconds(run2):
    """The server a trainer started killed mid-run (SIGKILL, as the kernel's out-of-memory killer sends it, to the
    server's main process alone): within seconds the trainer says in one line that the server was killed by SIGKILL,
    perhaps out of memory, and where its log is; it ends with exit status 1, no traceback, and the rest of the
    server's process group (its engine and workers) goes too."""
    port = free_port()
    cmd = train_cmd("--resume", "--checkpoint-dir", "ckpt", "--train-steps", "1000", "--vllm-port", str(port))
    log_path = run2.workdir / "server_killed.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=run2.workdir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = None
    try:
        deadline = time.time() + 400
        while server is None or not re.search(r"^step \d+: ", log_path.read_text(), re.M):  # a step done: mid-run
            assert proc.poll() is None and time.time() < deadline, log_path.read_text()[-3000:]
            server = server or server_child(proc.pid)
            time.sleep(0.2)
        os.kill(server, signal.SIGKILL)
        killed = time.monotonic()
        want = "vllm_sync_server.py, the server this run started, was killed by SIGKILL, perhaps out of memory"
        while want not in log_path.read_text() and time.monotonic() - killed < 10:
            time.sleep(0.1)
        said = time.monotonic() - killed  # the watcher's: a second to notice (post's retries alone would take 15 s)
        code = proc.wait(timeout=60)  # (sampling threads may still end their requests' retries first)
        out = log_path.read_text()
        assert said < 10 and code == 1 and want in out and "Traceback" not in out, (said, code, out[-3000:])
        assert f"its log: {run2.workdir / 'vllm_server.log'}" in out, out[-3000:]
        assert wait_until_gone(server, timeout=30) == []
    finally:
        kill_all(proc, server)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_server_eval_is_starting(toy_model, tmp_path, signum):
    """eval.py stopped by SIGTERM (kill, timeout) or interrupted by SIGINT (Ctrl-C) while the server it launched is
    still starting stops that server too, then ends as the signal would. The signal goes out once eval.py has its
    handlers in place (SIGTERM is caught, and it is set last)."""
    port = free_port()
    cmd = [PY, os.path.join(ROOT, EVAL), "--model", toy_model, "--start-server", f"--server-args={SERVER_ARGS}"]
    cmd += ["--dataset", os.path.join(FIXTURES, "gsm8k_toy")]  # (eval.py reads its problems before the server starts)
    with open(tmp_path / "eval.log", "w") as log:
        proc = subprocess.Popen(
            [*cmd, "--vllm-port", str(port)], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    server = None
    try:
        deadline = time.time() + 120
        while server is None or not catches(proc.pid, signal.SIGTERM):
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "eval.log").read_text()[-3000:]
            server = server or server_child(proc.pid)
            time.sleep(0.2)
        os.kill(proc.pid, signum)
        assert wait_until_gone(server, timeout=90) == []
        code = proc.wait(timeout=60)
        if signum == signal.SIGTERM:
            assert code == 128 + signal.SIGTERM
        else:
            assert code != 0 and "KeyboardInterrupt" in (tmp_path / "eval.log").read_text()
    finally:
        kill_all(proc, server)


# ---------------------------------------------------------------------------------------------------
# a flag that counts something and is 0


@pytest.mark.parametrize("script", ["grpo_gsm8k.py", "reinforce_math_fsdp2.py", "pipeline_learner.py"])
def test_a_count_of_zero_is_refused_before_any_work(script, monkeypatch, tmp_path):
    """Every flag that counts something (COUNTS: --save-every, --group-size, --micro-token-budget, ...) given as 0 is
    refused by name as the arguments are read, not met as a ZeroDivisionError at the first checkpoint; 1 is taken."""
    module = import_script(script)
    monkeypatch.chdir(tmp_path)
    for name in module.COUNTS:
        flag = "--" + name.replace("_", "-")
        for value, refused in (("0", True), ("1", False)):
            monkeypatch.setattr("sys.argv", [script, flag, value])
            if refused:
                with pytest.raises(SystemExit, match=f"^{flag} must be 1 or more, got 0$"):
                    module.parse_args()
            else:
                assert getattr(module.parse_args(), name) == 1
    r = subprocess.run(
        [PY, os.path.join(ROOT, script), "--save-every", "0"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1 and "--save-every must be 1 or more, got 0" in r.stderr
