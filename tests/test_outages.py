"""Outages mid-run, end to end on CPU with the toy model: the vLLM server SIGKILLed under grpo_gsm8k.py, one torchrun
rank of reinforce_math_fsdp2.py SIGKILLed, and the pipeline's Redis restarted empty on its port. Each run ends as it
must (an error naming the server, within a bound; every process gone, the server still usable; the run carried on),
never a silent hang: every wait here is bounded, and whatever a test starts is killed in its `finally`."""

import inspect
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis
from test_grpo_gsm8k import G, script_cmd
from test_lifecycle import group_alive, wait_until_gone
from test_pipeline import kill_actor, learner_cmd, start_actor, start_redis, wait_for
from test_reinforce_math_fsdp2 import CKPT, TORCHRUN, script_args
from test_reinforce_math_fsdp2 import run as run_fsdp2

from conftest import free_port, log_tail, metrics_of, server_matches, start_logged, start_server, stop_server

GRACE_S = 30  # a busy 2-core machine's slack on top of what a script's own constants allow


def killpg_all(*pgids) -> None:
    """Test clean-up: SIGKILL to every process group still holding a live process."""
    for pgid in pgids:
        if pgid is not None and group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------------
# 1. the server dies under the trainer


def test_server_killed_mid_run_ends_the_trainer_naming_the_server(base_toy_model, tmp_path):
    """Fault: the vLLM server's whole process group SIGKILLed while grpo_gsm8k.py trains against it (after step 2).
    Must hold: the trainer ends with exit status 1 and a traceback whose error names the server's URL, neither
    hanging nor ending before its retries are spent: post's "not answering ... after N tries", or, should the kill
    land during a weight push (the test leaves the moment to chance on purpose), push_weights' "broke off the weight
    push" as soon as gloo's group breaks.

    The bound, from the client's constants (read from the script, not copied): `post` makes `retries` tries (5) and
    sleeps 2**attempt s after each failed one but the last, 1 + 2 + 4 + 8 = 15 s in all; a dead server on loopback
    refuses each connection at once, so neither the 30 s connect timeout nor the 600 s read timeout comes into play
    (a request in flight at the kill fails at once too: its connection is reset). The generate threads retry side by
    side, so the run ends 15 s after the kill, plus GRACE_S for a busy machine and the process's exit; and not before
    the 15 s of back-off (measured: about 16 s)."""
    retries = inspect.signature(G.post).parameters["retries"].default
    backoff_s = sum(2**attempt for attempt in range(retries - 1))
    server, url = start_server(base_toy_model, str(tmp_path / "server.log"))
    log = tmp_path / "trainer.log"
    trainer = None
    try:
        cmd = script_cmd(url, "--train-steps", "1000", model=base_toy_model)
        trainer = start_logged(cmd, log, cwd=tmp_path, start_new_session=True)
        wait_for(log, "step 2:", trainer, timeout=300)
        os.killpg(server.pid, signal.SIGKILL)
        killed = time.monotonic()
        try:
            code = trainer.wait(timeout=backoff_s + GRACE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the trainer still runs {backoff_s + GRACE_S} s after its server died:\n" + log_tail(log))
        took = time.monotonic() - killed
        out = log.read_text()
        assert code == 1, out[-3000:]
        errors = [line for line in out.splitlines() if line.startswith("RuntimeError: ")]
        assert "Traceback" in out and errors, out[-3000:]
        named = rf"RuntimeError: vLLM server at {re.escape(url)} "
        if re.match(named + "broke off the weight push: ", errors[-1]):  # killed mid-push: gloo's group broke
            return
        assert took >= backoff_s - 1, (took, out[-3000:])  # between pushes: it retried for the whole back-off
        assert re.match(named + rf"is not answering \(/\w+\) after {retries} tries", errors[-1]), out[-3000:]
    finally:
        if trainer is not None:
            killpg_all(trainer.pid)
            trainer.wait(timeout=30)
        stop_server(server)


# ---------------------------------------------------------------------------------------------------
# 2. one torchrun rank dies


def torchrun_workers(launcher_pid: int) -> dict[int, int]:
    """RANK -> pid of the workers torchrun started (its children whose environment holds RANK)."""
    workers = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = Path(f"/proc/{d}/environ").read_bytes().split(b"\0") if ppid == launcher_pid else []
        except OSError:  # it ended meanwhile
            continue
        env = dict(x.decode(errors="replace").partition("=")[::2] for x in environ if x)
        if "RANK" in env:
            workers[int(env["RANK"])] = int(d)
    return workers


def test_a_rank_killed_ends_the_run_and_leaves_the_server_usable(toy, tmp_path):
    """Fault: rank 1 of reinforce_math_fsdp2.py under `torchrun --nproc_per_node=2` SIGKILLed after step 1. Must hold:
    torchrun (exit status not 0, rank 1's SIGKILL in its report) and rank 0 end within 30 s (measured: under 1 s on
    a quiet machine), no worker process or any of theirs (grading pools: each worker leads a process group of its
    own) is left alive, and the server was not wedged by the dead rank: a new 1-step run on it pushes its weights
    (checked by the run's --verify-sync and against its checkpoint). 30 s is also torchrun's own wait between its
    SIGTERM to the surviving ranks and its SIGKILL: a rank 0 that noticed nothing and waited for that would fail."""
    bound_s = 30
    os.makedirs(tmp_path / "killed")
    log = tmp_path / "killed.log"
    args = script_args(toy.url, toy.model, "--train-steps", "1000", "--rollouts-per-update", "2")
    cmd = [TORCHRUN, "--nproc_per_node=2", *args, "--save-every", "1000", "--rank0-only-output"]
    launcher = start_logged(cmd, log, cwd=tmp_path / "killed", start_new_session=True)
    workers = {}
    try:
        wait_for(log, "step 1:", launcher, timeout=300)
        workers = torchrun_workers(launcher.pid)
        assert sorted(workers) == [0, 1], workers
        os.kill(workers[1], signal.SIGKILL)
        killed = time.monotonic()
        try:
            code = launcher.wait(timeout=bound_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"torchrun still runs {bound_s} s after rank 1 was killed:\n" + log_tail(log))
        assert code != 0, log_tail(log)
        assert re.search(rf"exitcode\s*: -9 \(pid: {workers[1]}\)", log.read_text()), log_tail(log)  # its report
        left = {
            rank: wait_until_gone(pid, max(0.0, killed + bound_s - time.monotonic())) for rank, pid in workers.items()
        }
        assert left == {0: [], 1: []}, (left, log_tail(log))
    finally:
        killpg_all(launcher.pid, *workers.values())
        launcher.wait(timeout=30)
    out, m = run_fsdp2(
        toy.url,
        toy.model,
        tmp_path / "again",
        "--train-steps",
        "1",
        "--rollouts-per-update",
        "2",
        "--save-every",
        "1",
        "--verify-sync",
        nproc=0,
    )
    assert [x["version"] for x in m] == ["1"], out[-3000:]
    assert server_matches(toy.url, tmp_path / "again" / CKPT / "step_1")


# ---------------------------------------------------------------------------------------------------
# 3. Redis restarted, empty


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server (apt-get install redis-server)")
def test_redis_restarted_empty_mid_run(toy, tmp_path):
    """Fault: the pipeline's redis-server stopped once the learner has logged step 1, and a new, empty one started on
    the same port (the records queued and the actor's counter lost). Must hold: the learner, still running, logs two
    more steps (so it trained on a batch popped from the new Redis), the actor, still running, pushed records to the
    new Redis that the learner consumed (the new server's `<key>:pushed` counter above its queue's length), and SIGTERM
    then ends the learner as it ends a healthy one.

    The learner is frozen (SIGSTOP) from the moment this test sees step 1 until the new Redis is up, so the restart
    falls between two of its pops however late the test is; its --train-steps is far more than it can take meanwhile.
    The actor keeps at most one group (8 records) queued (--max-queue 0, --concurrency 1), so the old Redis holds
    under one batch. Its version budget is left wide (--records-per-version 1000): the records lost in the restart
    still count as submitted in it, and with a budget of one batch per version they could leave the actor waiting
    for a push that a starved learner never makes."""
    port = free_port()
    redis_url = f"redis://127.0.0.1:{port}/0"
    key = "outage"
    old = start_redis(port, str(tmp_path / "redis_old.log"))
    new = learner = actor = None
    os.makedirs(tmp_path / "L")
    log = tmp_path / "learner.log"
    try:
        cmd = learner_cmd([toy.url], toy.model, redis_url, key, "--train-steps", "1000", "--batch-size", "16")
        learner = start_logged([*cmd, "--max-lag", "1000"], log, cwd=tmp_path / "L")
        actor_extra = ("--records-per-version", "1000", "--max-queue", "0", "--concurrency", "1")
        actor = start_actor([toy.url], redis_url, key, tmp_path / "actor.log", *actor_extra)
        wait_for(log, "step 1:", learner, timeout=300)
        learner.send_signal(signal.SIGSTOP)  # no pops while the Redis is replaced
        logged = len(metrics_of(log.read_text()))
        old.terminate()
        old.wait(timeout=10)
        new = start_redis(port, str(tmp_path / "redis_new.log"))
        learner.send_signal(signal.SIGCONT)
        # step logged + 1 may hold records popped before the restart; step logged + 2 was popped from the new Redis
        wait_for(log, f"step {logged + 2}:", learner, timeout=300)
        client = redis.Redis(port=port)
        pushed = int(client.get(key + ":pushed") or 0)  # the new server's counter: records pushed since the restart
        assert pushed > client.llen(key), (logged, pushed, client.llen(key), log_tail(tmp_path / "actor.log"))
        learner.send_signal(signal.SIGTERM)
        code = learner.wait(timeout=120)
        out = log.read_text()
        assert code == 128 + signal.SIGTERM and "stopped by SIGTERM after step" in out, out[-3000:]
        assert actor.poll() is None, log_tail(tmp_path / "actor.log")  # the actor carries on
    finally:
        if actor is not None:
            kill_actor(actor)
        if learner is not None and learner.poll() is None:
            learner.kill()
            learner.wait(timeout=30)
        for proc in (old, new):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=10)
