"""ACTOR and LEARNER (pipeline RL: actors sample into a Redis queue, a learner trains on it): unit checks of the
record decoder and the loss, then the real scripts as separate processes against a real redis-server (started here
on a free port) and real vllm_sync_server.py servers on CPU (conftest's toy model: 128 tokens, every gold answer 7).
A copy of the pair is tested by changing ACTOR and LEARNER."""

import itertools
import json
import math
import os
import pickle
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import NamedTuple

import msgpack
import pytest
import redis
import requests
import torch

from conftest import (
    CHECKPOINT_ROOTS,
    FIXTURES,
    GRADE_WORKERS,
    PY,
    ROOT,
    SERVER_LOGS,
    assert_learned,
    free_port,
    help_imports,
    import_script,
    load_behind,
    log_tail,
    logprob_gap,
    metrics_of,
    other_weights,
    read_jsonl,
    run_ok,
    server_matches,
    start_logged,
    stopped_by_the_check,
)

ACTOR = "pipeline_actor.py"
LEARNER = "pipeline_learner.py"
A = import_script(ACTOR)
L = import_script(LEARNER)
TOY = os.path.join(FIXTURES, "gsm8k_toy")
pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="needs redis-server (apt-get install redis-server)"
)


# ---------------------------------------------------------------------------------------------------
# fixtures: one redis-server for the whole module (and conftest's `toy`: one toy-model server for it)
def start_redis(port: int, log_path: str):
    cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = start_logged(cmd, log_path)
    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            return proc
        except redis.ConnectionError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("redis-server did not start: " + Path(log_path).read_text())


class Redis(NamedTuple):
    url: str
    client: redis.Redis


@pytest.fixture(scope="module")
def rds(tmp_path_factory) -> Redis:
    port = free_port()
    proc = start_redis(port, str(tmp_path_factory.mktemp("redis") / "redis.log"))
    yield Redis(url=f"redis://127.0.0.1:{port}/0", client=redis.Redis(port=port))
    proc.terminate()
    proc.wait(10)


# ---------------------------------------------------------------------------------------------------
# helpers: the scripts as subprocesses (CleanRL style)
def actor_cmd(urls, redis_url, key, *extra):
    return [
        PY,
        os.path.join(ROOT, ACTOR),
        "--redis-url",
        redis_url,
        "--queue-key",
        key,
        "--vllm-urls",
        *urls,
        "--dataset",
        TOY,
        "--system-prompt",
        "",
        "--max-completion-tokens",
        "16",
        "--log-every-s",
        "0",
        *GRADE_WORKERS,
        *extra,
    ]


def start_actor(urls, redis_url, key, log_path, *extra):
    """An actor in its own process group (with its grading workers), killed by kill_actor."""
    return start_logged(actor_cmd(urls, redis_url, key, *extra), log_path, cwd=ROOT, start_new_session=True)


def kill_actor(proc, sig=signal.SIGKILL):
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        proc.wait(30)


def prefill(urls, redis_url, key, actor_id, groups, tmp_path, *extra):
    """Run an actor to completion with no learner: `groups` x 8 records of the servers' current version."""
    cmd = actor_cmd(
        urls, redis_url, key, "--actor-id", actor_id, "--max-steps", str(groups), "--max-lag", "1000", *extra
    )
    return run_ok(cmd, cwd=tmp_path, timeout=300).stdout


def learner_cmd(urls, model, redis_url, key, *extra):
    return [
        PY,
        os.path.join(ROOT, LEARNER),
        "--model",
        model,
        "--redis-url",
        redis_url,
        "--queue-key",
        key,
        "--vllm-urls",
        *urls,
        "--learning-rate",
        "3e-3",
        "--checkpoint-dir",
        "ckpt",
        "--rollout-log",
        "rollouts.jsonl",
        *extra,
    ]


def run_learner(urls, model, redis_url, key, workdir, *extra, timeout=600):
    os.makedirs(workdir, exist_ok=True)
    r = run_ok(learner_cmd(urls, model, redis_url, key, *extra), cwd=workdir, timeout=timeout)
    return r.stdout, metrics_of(r.stdout)


def wait_for(log_path, text: str, proc, timeout: float = 300) -> None:
    """Wait until `text` appears in the log of the running process `proc`."""
    deadline = time.time() + timeout
    while text not in Path(log_path).read_text():
        assert proc.poll() is None and time.time() < deadline, log_tail(log_path)
        time.sleep(0.2)


def rollouts(workdir) -> list[dict]:
    return read_jsonl(os.path.join(workdir, "rollouts.jsonl"))


def record(**over) -> dict:
    rec = {
        "schema": 1,
        "id": "t/0/0",
        "group_id": "t/0",
        "prompt_token_ids": [5, 6, 7],
        "completion_token_ids": [8, 9],
        "logprobs": [-1.5, -0.5],
        "reward": 1.0,
        "advantage": 0.5,
        "version_min": 0,
        "version_max": 0,
    }
    return {**rec, **over}


# ---------------------------------------------------------------------------------------------------
# unit checks (no server)
def test_help_is_fast_and_record_format_is_the_same_in_both_files():
    for script in (ACTOR, LEARNER):
        r, heavy = help_imports(os.path.join(ROOT, script), "--help")
        assert r.returncode == 0 and "--redis-url" in r.stdout and not heavy, (script, heavy)

    def fmt(doc):
        return doc[doc.index("Record format") : doc.index("optional, ignored by the learner")]

    assert fmt(A.__doc__) == fmt(L.__doc__)
    assert set(L.FIELDS) <= set(re.findall(r"^  (\w+)", fmt(A.__doc__), re.M))  # every required field is documented


def test_decode_record():
    good = record()
    assert L.decode_record(msgpack.packb(good), 128) == (good, None)
    assert L.decode_record(json.dumps(good).encode(), 128) == (good, None)
    bad = [
        pickle.dumps(good),
        b"\x00garbage",
        b'{"schema": 1',
        msgpack.packb([1, 2]),
        msgpack.packb(record(reward="1")),
        msgpack.packb({k: v for k, v in good.items() if k != "logprobs"}),
        msgpack.packb(record(logprobs=[-1.0])),
        msgpack.packb(record(completion_token_ids=[8, 128])),
        msgpack.packb(record(prompt_token_ids=[-1])),
        msgpack.packb(record(version_min=3, version_max=2)),
        msgpack.packb(record(schema=2)),
        json.dumps(record(advantage=float("nan"))).encode(),
        msgpack.packb(record(version_max=True)),
        msgpack.packb(record(prompt_token_ids=[])),
        msgpack.packb(record(logprobs=[-1.0, 3.0])),
        msgpack.packb(record(temperature=0.7)),
        msgpack.packb(record(temperature="1")),
    ]
    for raw in bad:
        rec, why = L.decode_record(raw, 128)
        assert rec is None and why, raw
    # the logprobs must be under the learner's temperature: a record says its own, or it was sampled at 1.0
    assert L.decode_record(msgpack.packb(record(temperature=0.7)), 128, 0.7)[0] is not None
    assert L.decode_record(msgpack.packb(record(temperature=1.0)), 128)[0] is not None
    rec, why = L.decode_record(msgpack.packb(good), 128, 0.7)
    assert rec is None and "no temperature field" in why and "--temperature 0.7" in why


def test_group_advantages_match_grpo():
    import grpo_gsm8k as G

    rewards = [1.0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1]
    for scale in (True, False):
        want = G.group_advantages(torch.tensor(rewards), 4, scale).tolist()
        got = [a for k in range(0, 12, 4) for a in A.group_advantages(rewards[k : k + 4], scale)]
        assert max(abs(x - y) for x, y in zip(got, want, strict=True)) < 1e-6


def test_policy_loss_is_importance_weighted():
    """On fresh data (pi = mu) both losses give REINFORCE's gradient; on stale data ppo's gradient is r A / T per
    token inside the clip range and 0 outside it, tis's is min(r, cap) A / T."""
    lp = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.9]])).requires_grad_()
    mask = torch.ones(1, 4)
    adv = torch.tensor([2.0])
    for loss in ("ppo", "tis"):
        L.policy_loss(lp, lp.detach(), adv, mask, loss=loss).backward()
        assert torch.allclose(lp.grad, torch.full((1, 4), -2.0 / 4)), loss
        lp.grad = None
    mu = lp.detach() - torch.log(torch.tensor([[1.1, 1.5, 3.0, 0.5]]))  # r = 1.1, 1.5, 3.0, 0.5
    stats = {}
    L.policy_loss(lp, mu, adv, mask, loss="ppo", clip_eps_low=0.2, clip_eps_high=0.2, stats=stats).backward()
    assert torch.allclose(lp.grad, torch.tensor([[-1.1 * 2 / 4, 0, 0, -0.5 * 2 / 4]]))
    assert stats["clipped_tokens"] == 2 and math.isclose(stats["ratio_sum"], 6.1, rel_tol=1e-5)
    lp.grad = None
    L.policy_loss(lp, mu, adv, mask, loss="tis", tis_cap=2.0).backward()
    assert torch.allclose(lp.grad, torch.tensor([[-1.1, -1.5, -2.0, -0.5]]) * 2 / 4)


def test_policy_loss_divides_by_the_steps_records():
    """The divisor is the step's records, counted once (fed or not): each micro-batch's loss is its exact share of the
    step's, and None divides by the batch's own sequences (a mean over them)."""
    lp = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.9, 0.6, 1.0]]))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([2.0, -1.0])
    whole = L.policy_loss(lp, lp, adv, mask)
    parts = sum(L.policy_loss(lp[i : i + 1], lp[i : i + 1], adv[i : i + 1], mask[i : i + 1], divisor=2) for i in (0, 1))
    assert torch.allclose(whole, parts) and torch.allclose(whole, torch.tensor(-(2.0 - 1.0) / 2))


def synthetic_records(advantages: list[float], truncated: int) -> list[dict]:
    """Records of random tokens below the tiny model's vocabulary, of different lengths, with `advantages`; the record
    at index `truncated` hit the completion limit."""
    g = torch.Generator().manual_seed(0)
    records = []
    for i, adv in enumerate(advantages):
        completion = torch.randint(5, 300, (4 + i,), generator=g).tolist()
        records.append(
            record(
                id=f"t/{i // 4}/{i % 4}",
                prompt_token_ids=torch.randint(5, 300, (3 + i % 3,), generator=g).tolist(),
                completion_token_ids=completion,
                logprobs=(-3 * torch.rand(len(completion), generator=g)).tolist(),
                advantage=adv,
                finish_reason="length" if i == truncated else "stop",
            )
        )
    return records


@pytest.mark.parametrize("loss", ["ppo", "tis"])
def test_records_without_a_gradient_are_not_fed_and_change_nothing(tiny_model, loss):
    """make_batch feeds only the records that can change the gradient: a zero advantage (a group of equal rewards) adds
    0 to every token's loss, ppo's and tis's, as does a completion masked by --mask-truncated-completions. The divisor
    is the step's records, fed or not, so the step that skips them is the step that feeds them: the same gradient norm
    and the same weights (SGD: the update is linear in the gradient; small micro-batches). A step with nothing to feed
    still steps AdamW, as feeding its records would (a zero gradient: the momentum moves the weights)."""
    import tyro
    from transformers import AutoModelForCausalLM

    records = synthetic_records([0.0, 0.0, 1.2, -0.4, 0.0, 0.7, -1.5, 0.0], truncated=5)
    args = tyro.cli(L.Args, args=["--loss", loss, "--mask-truncated-completions", "--micro-token-budget", "40"])
    batch = L.make_batch(records, args)
    assert batch.fed == [2, 3, 6] and batch.masked[5]  # not the zero advantages (0, 1, 4, 7) nor the masked one (5)
    after = {}
    stats = {}
    for name, fed in (("skipped", batch.fed), ("all fed", list(range(len(records))))):
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).train()
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        stats[name], updated = L.update_policy(
            model, optimizer, batch._replace(fed=fed), records, args, 0, 0, None, False
        )
        assert updated
        after[name] = dict(model.named_parameters())
    g_skip, g_all = stats["skipped"]["grad_norm"], stats["all fed"]["grad_norm"]
    assert g_all > 0 and abs(g_skip - g_all) < 1e-5 * g_all, (g_skip, g_all)
    assert abs(stats["skipped"]["loss"] - stats["all fed"]["loss"]) < 1e-5 * abs(stats["all fed"]["loss"])
    before = dict(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).named_parameters())
    diff = max((after["skipped"][k] - after["all fed"][k]).abs().max().item() for k in before)
    moved = max((after["skipped"][k] - before[k]).abs().max().item() for k in before)
    assert diff < 1e-5 * moved, (diff, moved)

    # nothing to feed: a step of AdamW after one with a gradient, fed nothing or fed every record of advantage 0
    zeros = [{**rec, "advantage": 0.0} for rec in records]
    empty = L.make_batch(zeros, args)
    assert empty.fed == []
    for name, fed in (("skipped", []), ("all fed", list(range(len(records))))):
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        L.update_policy(model, optimizer, batch, records, args, 0, 0, None, False)
        stats[name], updated = L.update_policy(
            model, optimizer, empty._replace(fed=fed), zeros, args, 0, 0, None, False
        )
        assert updated and stats[name]["grad_norm"] == 0.0 and stats[name]["loss"] == 0.0
        assert {int(s["step"]) for s in optimizer.state_dict()["state"].values()} == {2}
        after[name] = dict(model.named_parameters())
    assert all(torch.equal(after["skipped"][k], after["all fed"][k]) for k in before)


def test_the_learner_trains_with_dropout_off_and_refuses_a_model_that_changes_its_logits(tiny_model, tmp_path):
    """load_model: a model with attention dropout 0.3 (two forwards in training mode differ: the control) comes back in
    training mode, which activation checkpointing needs, with its dropout off: two forwards agree, and agree with eval
    mode. A model that soft-caps its logits (Gemma 2's final_logit_softcapping) is refused, naming the setting:
    token_logprobs's lm_head shortcut would not compute its logprobs."""
    from transformers import AutoModelForCausalLM

    for name, setting, value in (("dropout", "attention_dropout", 0.3), ("softcap", "final_logit_softcapping", 30.0)):
        model = AutoModelForCausalLM.from_pretrained(tiny_model)
        setattr(model.config, setting, value)
        model.save_pretrained(tmp_path / name)
    ids = torch.tensor([[5, 17, 33, 2, 91, 44, 8, 120]])
    torch.manual_seed(0)
    control = AutoModelForCausalLM.from_pretrained(tmp_path / "dropout").train()
    assert not torch.equal(control(ids).logits, control(ids).logits)
    model = L.load_model(str(tmp_path / "dropout"), torch.device("cpu"), activation_checkpointing=True)
    assert model.training
    first, second = model(ids).logits, model(ids).logits
    assert torch.equal(first, second) and torch.allclose(first, model.eval()(ids).logits, atol=1e-6)
    with pytest.raises(SystemExit, match=r"changes its logits after the lm_head \(final_logit_softcapping=30.0\)"):
        L.load_model(str(tmp_path / "softcap"), torch.device("cpu"), activation_checkpointing=False)


def test_the_actor_refuses_a_group_of_one(tmp_path):
    """--group-size 1: a group of one is its own baseline (its advantage 0, its std NaN). Refused at once, exit 2, one
    line naming the flag, before the data, the servers or Redis are looked at (none is there)."""
    cmd = actor_cmd([f"http://127.0.0.1:{free_port()}"], f"redis://127.0.0.1:{free_port()}/0", "one")
    r = subprocess.run([*cmd, "--group-size", "1"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == "--group-size must be 2 or more (each completion is scored against its group's), got 1"


@pytest.mark.parametrize("script", [ACTOR, LEARNER])
def test_no_server_is_named_in_one_line(script, tmp_path):
    """The newcomer who forgot to start a server: one line naming its URL and how to start one, exit 1, no traceback,
    before Redis is asked (none is there) or a model is loaded."""
    url = f"http://127.0.0.1:{free_port()}"
    redis_url = f"redis://127.0.0.1:{free_port()}/0"
    cmd = actor_cmd([url], redis_url, "none") if script == ACTOR else learner_cmd([url], "/no/model", redis_url, "none")
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    said = f"no server answers at {url}: start one (python vllm_sync_server.py --model MODEL --port PORT) and name it "
    assert r.stderr.strip().splitlines()[-1] == said + "in --vllm-urls"


# ---------------------------------------------------------------------------------------------------
# the real scripts: actor, learner, Redis, vLLM as separate processes
def test_end_to_end_versions_checksums_and_resume(toy, rds, tmp_path):
    """1. The learner completes its steps, the servers' version rises with every push and their weights equal the
    learner's after each push (--verify-sync) and its last checkpoint; requests in flight during the pushes are
    paused and resumed, not dropped; --resume pushes the checkpoint first. (Where a push lands inside a request
    depends on this machine's speed: test_server.py's test_full_and_partial_push checks that case as such.)"""
    url, model = toy
    redis_url = rds.url
    v_start = requests.get(url + "/runtime_version").json()["version"]
    actor = start_actor(
        [url], redis_url, "e2e", tmp_path / "actor.log", "--records-per-version", "16", "--max-lag", "2"
    )
    long_runs = []  # the long requests' completions
    stop = threading.Event()

    def long_requests():  # a bounded number of long requests while the learner pushes: a server decoding nonstop
        for _ in range(3):  # would starve the actor and the learner of the two cores
            if stop.is_set():
                return
            res = requests.post(
                url + "/generate", json={"prompts": [[5, 6, 7]], "max_tokens": 300, "ignore_eos": True}, timeout=300
            )
            long_runs.append(res.json()["results"][0]["completions"][0])

    thread = threading.Thread(target=long_requests, daemon=True)
    learner = start_logged(
        learner_cmd(
            [url],
            model,
            redis_url,
            "e2e",
            "--train-steps",
            "3",
            "--batch-size",
            "16",
            "--max-lag",
            "3",
            "--verify-sync",
            "--save-every",
            "1",
        ),
        tmp_path / "learner.log",
        cwd=tmp_path,
    )
    try:
        # from just before the learner's first push, not earlier: a server decoding nonstop slows the learner's
        # start-up many times over on a 2-core machine. A push lands in a long request, and the requests stop.
        wait_for(tmp_path / "learner.log", "joining the workers", learner)
        thread.start()
        assert learner.wait(300) == 0, log_tail(tmp_path / "learner.log")
        stop.set()
        thread.join()
        m = metrics_of((tmp_path / "learner.log").read_text())
        versions = [int(x["version"]) for x in m]
        assert len(m) == 3 and versions == [v_start + 2, v_start + 3, v_start + 4], (v_start, versions)
        for key in (
            "loss",
            "reward",
            "lag_hist",
            "dropped",
            "dropped_total",
            "samples_per_s",
            "idle_frac",
            "queue_len",
            "clip_frac",
            "ratio",
            "logprob_mismatch",
            "entropy",
            "completion_truncated_rate",
            "seq_len_truncated_rate",
            "frac_reward_zero_std",
            "frac_samples_skipped",
            "sync_s",
            "grad_norm",
        ):
            assert key in m[0], key
        # paused and resumed, not dropped: every request ran to its end; its version spans cover its tokens in order
        assert long_runs and all(len(c["token_ids"]) == 300 and c["finish_reason"] == "length" for c in long_runs)
        for c in long_runs:
            spans = c["version_spans"]
            assert spans[0]["start"] == 0 and spans[-1]["end"] == 300, spans
            pairs = list(itertools.pairwise(spans))
            assert all(a["end"] == b["start"] and a["version"] < b["version"] for a, b in pairs), spans
        assert requests.get(url + "/runtime_version").json()["version"] == versions[-1]
        assert server_matches(url, tmp_path / "ckpt" / "step_3")
        out, m = run_learner(
            [url],
            model,
            redis_url,
            "e2e",
            tmp_path,
            "--train-steps",
            "4",
            "--batch-size",
            "16",
            "--max-lag",
            "3",
            "--verify-sync",
            "--resume",
        )
        assert "resumed from ckpt/step_3 at step 3" in out and f"as version {versions[-1] + 1}" in out
        assert [x["version"] for x in m] == [str(versions[-1] + 2)] and server_matches(
            url, tmp_path / "ckpt" / "step_4"
        )
        # the run is at its last step: --resume, retyping nothing (args.json), has nothing to do; a new run is refused
        # the rollout log of this one
        learner_path = os.path.join(ROOT, LEARNER)
        r = run_ok([PY, learner_path, "--resume", "--checkpoint-dir", "ckpt"], cwd=tmp_path, timeout=120)
        assert "nothing to do" in r.stdout
        cmd = [PY, learner_path, "--checkpoint-dir", "new", "--rollout-log", "rollouts.jsonl"]
        r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and "rollouts.jsonl exists" in r.stderr, r.stderr[-2000:]
    finally:
        stop.set()
        kill_actor(actor)
        if learner.poll() is None:
            learner.kill()
    assert "Traceback" not in (tmp_path / "actor.log").read_text()


def test_max_lag_drops_stale_records(toy, rds, tmp_path):
    """2. A large --max-lag trains on records generated before the learner's first push; --max-lag 0 drops all of
    them, trains only on records of its current version, and counts the drops in the log and the metrics."""
    url, model = toy
    redis_url = rds.url
    prefill([url], redis_url, "lag", "old", 2, tmp_path)
    _, m = run_learner(
        [url],
        model,
        redis_url,
        "lag",
        tmp_path / "big",
        "--train-steps",
        "1",
        "--batch-size",
        "16",
        "--max-lag",
        "1000",
    )
    rows = rollouts(tmp_path / "big")
    assert m[0]["dropped_total"] == "0" and m[0]["trained_total"] == "16" and m[0]["lag_hist"] == "1:16"
    assert m[0]["logprob_mismatch"] == "nan"  # no record of lag 0: nothing to compare (and nothing was checked)
    assert len(rows) == 16 and all(x["status"] == "trained" and x["id"].startswith("old/") for x in rows)

    # sampled at temperature 0.7: the learner's logprobs must follow it to agree with the fresh records'
    hot = ("--temperature", "0.7")
    prefill([url], redis_url, "lag", "old2", 2, tmp_path, *hot)
    actor = start_actor(
        [url],
        redis_url,
        "lag",
        tmp_path / "actor.log",
        "--actor-id",
        "new",
        "--max-lag",
        "0",
        "--records-per-version",
        "16",
        *hot,
    )
    try:
        _, m = run_learner(
            [url],
            model,
            redis_url,
            "lag",
            tmp_path / "zero",
            "--train-steps",
            "2",
            "--batch-size",
            "16",
            "--max-lag",
            "0",
            *hot,
        )
    finally:
        kill_actor(actor)
    rows = rollouts(tmp_path / "zero")
    dropped = [x for x in rows if x["status"] == "dropped"]
    trained = [x for x in rows if x["status"] == "trained"]
    assert {x["id"] for x in dropped} >= {f"old2/{g}/{i}" for g in range(2) for i in range(8)}
    assert all(x["lag"] > 0 for x in dropped) and all(x["lag"] == 0 for x in trained) and len(trained) == 32
    assert int(m[-1]["dropped_total"]) == len(dropped) == sum(int(x["dropped"]) for x in m)
    assert any(x["version_min"] == x["version_max"] for x in trained)  # sampled by exactly the learner's weights:
    figures = [float(x["logprob_mismatch"]) for x in m]  # the learner's logprobs equal the sampler's (nan: a step
    assert all(f < 1e-4 for f in figures if not math.isnan(f)) and not all(map(math.isnan, figures)), m  # of none)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_alignment_learner_logprobs_equal_server_logprobs(toy, temperature):
    """The learner's logprobs of sampled tokens (its micro-batches, chunked lm_head, the sampling temperature) equal
    the server's for the same weights, fp32."""
    url, model = toy
    assert logprob_gap(L, url, model, temperature) < 1e-4


def test_actor_killed_and_restarted(toy, rds, tmp_path):
    """3. The actor dies (SIGKILL) mid-run and a new one starts: the learner keeps training, and every record that
    reached Redis is popped by the learner or still queued (the actor's pushed counter is atomic with its RPUSH)."""
    url, model = toy
    redis_url = rds.url
    extra = ("--records-per-version", "16", "--max-lag", "0")  # a1 is at most 64 records ahead: a2 must supply the rest
    os.makedirs(tmp_path / "L")
    learner = start_logged(
        learner_cmd([url], model, redis_url, "kill", "--train-steps", "6", "--batch-size", "16", "--max-lag", "1000"),
        tmp_path / "learner.log",
        cwd=tmp_path / "L",
    )
    actor = start_actor([url], redis_url, "kill", tmp_path / "a1.log", "--actor-id", "a1", *extra)
    try:
        wait_for(tmp_path / "learner.log", "step 2:", learner)
        kill_actor(actor)
        actor = start_actor([url], redis_url, "kill", tmp_path / "a2.log", "--actor-id", "a2", *extra)
        assert learner.wait(300) == 0, log_tail(tmp_path / "learner.log")
    finally:
        kill_actor(actor)
        if learner.poll() is None:
            learner.kill()
    m = metrics_of((tmp_path / "learner.log").read_text())
    rows = rollouts(tmp_path / "L")
    ids = [x["id"] for x in rows]
    assert len(m) == 6 and len(set(ids)) == len(ids)
    assert any(i.startswith("a1/") for i in ids) and any(i.startswith("a2/") for i in ids)
    assert int(rds.client.get("kill:pushed")) == len(rows) + rds.client.llen("kill")


def test_bad_records_are_rejected(toy, rds, tmp_path):
    """4. Records that are not JSON/msgpack, lack fields or hold bad values are rejected with a logged reason; a
    pickle is never unpickled; the learner trains on the good records around them."""
    url, model = toy
    redis_url = rds.url
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    bad = [
        pickle.dumps(Evil()),
        b"hello",
        msgpack.packb({"schema": 1, "id": "x"}),
        b'{"schema": 1, "id": "x"}',
        msgpack.packb(record(completion_token_ids=[8, 999])),
        msgpack.packb(record(logprobs=[-1.0])),
        msgpack.packb(record(temperature=0.6)),
    ]
    good = [msgpack.packb(record(id=f"good/{i}")) for i in range(8)]
    rds.client.rpush("bad", *(bad[:3] + good[:4] + bad[3:] + good[4:]))
    flags = ("--train-steps", "1", "--batch-size", "8", "--max-lag", "1000000")
    # (without activation checkpointing: the flag's other path trains too; grpo_gsm8k's test shows the same step)
    out, m = run_learner([url], model, redis_url, "bad", tmp_path, *flags, "--no-activation-checkpointing")
    reasons = re.findall(r"WARNING: rejected a record of \d+ bytes: (.*)", out)
    assert len(reasons) == len(bad) and m[0]["rejected_total"] == str(len(bad)) and m[0]["trained_total"] == "8", out
    assert "neither JSON nor msgpack" in reasons[0] and "token ids" in reasons[4] and "logprobs" in reasons[5]
    assert "temperature 0.6" in reasons[6]
    assert not marker.exists()


def test_learning_on_toy_task(toy, rds, tmp_path):
    """5. Pipeline RL pushes the toy task's mean reward up within 20 steps, one version of lag allowed."""
    url, model = toy
    redis_url = rds.url
    actor = start_actor(
        [url],
        redis_url,
        "learn",
        tmp_path / "actor.log",
        "--records-per-version",
        "64",
        "--max-lag",
        "1",
        "--concurrency",
        "8",
    )
    try:
        _, m = run_learner(
            [url],
            model,
            redis_url,
            "learn",
            tmp_path,
            "--train-steps",
            "20",
            "--batch-size",
            "64",
            "--max-lag",
            "1",
            "--save-every",
            "100",
        )
    finally:
        kill_actor(actor)
    rewards = [float(x["reward"]) for x in m]
    print(
        "rewards",
        rewards,
        "step_s",
        [x["step_s"] for x in m],
        "idle_frac",
        [x["idle_frac"] for x in m],
        "sync_s",
        [x["sync_s"] for x in m],
    )
    assert_learned(rewards)


def test_two_servers_one_tensor_parallel_receive_the_same_weights(toy, rds, tp2_server, tmp_path):
    """6. One learner, two servers in one collective group, the second with two workers (tensor parallel 2): the
    learner sizes the group from the servers' /health (ranks 1, then 2-3); both serve generation and both hold the
    learner's weights, with the same version, after every push."""
    url, model = toy
    redis_url = rds.url
    url2 = tp2_server
    served_before = Path(SERVER_LOGS[url2]).read_text().count("POST /generate")
    actor = start_actor(
        [url, url2],
        redis_url,
        "two",
        tmp_path / "actor.log",
        "--records-per-version",
        "16",
        "--max-lag",
        "2",
        "--concurrency",
        "4",
    )
    try:
        _, m = run_learner(
            [url, url2],
            model,
            redis_url,
            "two",
            tmp_path,
            "--train-steps",
            "2",
            "--batch-size",
            "16",
            "--max-lag",
            "3",
            "--verify-sync",
            "--save-every",
            "1",
        )
        print("two servers:", [{k: x[k] for k in ("version", "sync_s", "step_s")} for x in m])
        assert [requests.get(u + "/runtime_version").json()["version"] for u in (url, url2)] == [
            int(m[-1]["version"])
        ] * 2
        assert server_matches(url, tmp_path / "ckpt" / "step_2") and server_matches(url2, tmp_path / "ckpt" / "step_2")
        assert requests.get(url2 + "/runtime_version").json()["communicator"]["ranks"] == [2, 3]
        kill_actor(actor)
        assert (
            Path(SERVER_LOGS[url2]).read_text().count("POST /generate") > served_before
        )  # the actor used both servers
        # the TP server samples the learner's policy (nan: a step without a record of lag 0)
        assert all(float(x["logprob_mismatch"]) < 1e-4 for x in m if x["logprob_mismatch"] != "nan"), m
    finally:
        kill_actor(actor)


def test_actor_waits_for_redis(toy, tmp_path):
    """Redis down: the actor says so, retries with backoff, and pushes once Redis is up."""
    url, _ = toy
    port = free_port()
    actor = start_actor([url], f"redis://127.0.0.1:{port}/0", "late", tmp_path / "actor.log", "--max-steps", "1")
    proc = None
    try:
        wait_for(tmp_path / "actor.log", "is not reachable", actor)
        proc = start_redis(port, str(tmp_path / "redis.log"))
        assert actor.wait(120) == 0, log_tail(tmp_path / "actor.log")
        assert redis.Redis(port=port).llen("late") == 8
    finally:
        kill_actor(actor)
        if proc is not None:
            proc.terminate()
            proc.wait(10)


def test_the_actor_reshuffles_the_data_every_epoch_and_records_its_problems(toy, rds, tmp_path):
    """--limit 4, 12 groups: three epochs of the 4 problems, each problem drawn once per epoch, in an order of each
    epoch's own (drawn from --seed and the actor's id); every record names its problem as to_problem gave it (prompt,
    gold)."""
    prefill([toy.url], rds.url, "epochs", "e", 12, tmp_path, "--limit", "4", "--group-size", "2", "--concurrency", "4")
    records = [msgpack.unpackb(raw) for raw in rds.client.lrange("epochs", 0, -1)]
    problem = {int(rec["group_id"].split("/")[1]): (rec["prompt"], rec["gold"]) for rec in records}
    rows = read_jsonl(os.path.join(TOY, "train.jsonl"))[:4]
    assert len(records) == 24 and sorted(problem) == list(range(12))
    epochs = [[problem[g] for g in range(k, k + 4)] for k in (0, 4, 8)]
    assert all(sorted(epoch) == sorted(A.to_problem(row) for row in rows) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) > 1, epochs
    assert rows[0]["answer"].endswith("#### 7") and {gold for _, gold in problem.values()} == {"7"}


def test_dynamic_sampling_queues_no_group_of_equal_rewards_and_counts_it(toy, rds, tmp_path):
    """--dynamic-sampling: 16 groups of 4 on the toy task (a random policy: most groups score alike) end the actor;
    no group in the queue has equal rewards, the counter of records pushed agrees with the queue, and the groups
    pushed and dropped, as the actor counts them, add up to the 16 (each dropped one is named in no record)."""
    out = prefill([toy.url], rds.url, "dyn", "d", 16, tmp_path, "--group-size", "4", "--dynamic-sampling")
    records = [msgpack.unpackb(raw) for raw in rds.client.lrange("dyn", 0, -1)]
    groups = {}
    for rec in records:
        groups.setdefault(rec["group_id"], []).append(rec["reward"])
    assert all(len(rewards) == 4 and len(set(rewards)) > 1 for rewards in groups.values()), groups
    assert int(rds.client.get("dyn:pushed")) == len(records)
    done = re.search(r"done, (\d+) groups \((\d+) records\) pushed in .*, (\d+) submitted, (\d+) dropped", out)
    pushed, pushed_records, submitted, dropped = (int(x) for x in done.groups())
    assert pushed == len(groups) and pushed_records == len(records) and pushed + dropped == submitted == 16, out
    assert dropped > 0  # the toy task's random policy: most of its groups of 4 score alike


def test_learner_resume_continues_the_same_wandb_run(toy, rds, tmp_path):
    """--logger wandb, offline (WANDB_MODE=offline: the run is written under WANDB_DIR, nothing is sent): a run of 1
    step on queued records, then --resume to step 2. Both write to the W&B run of the same id, which the checkpoint
    saved."""
    url, model = toy
    rds.client.rpush("wandb", *(msgpack.packb(record(id=f"w/{i}")) for i in range(16)))
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    flags = ("--batch-size", "8", "--max-lag", "1000000", "--logger", "print,wandb", "--save-every", "1")
    run_ok(
        learner_cmd([url], model, rds.url, "wandb", "--train-steps", "1", *flags), cwd=tmp_path, timeout=600, env=env
    )
    saved = torch.load(tmp_path / "ckpt" / "step_1" / L.TRAINER_STATE, weights_only=True)["wandb_id"]
    cmd = learner_cmd([url], model, rds.url, "wandb", "--train-steps", "2", "--resume", *flags)
    assert "resumed from ckpt/step_1 at step 1" in run_ok(cmd, cwd=tmp_path, timeout=600, env=env).stdout
    runs = sorted(p.name for p in (tmp_path / "wandb").iterdir() if p.name.startswith("offline-run-"))
    assert len(runs) == 2 and all(name.endswith(f"-{saved}") for name in runs), (runs, saved)


def test_weights_changed_behind_the_learner_stop_it(toy, rds, tmp_path):
    """7. Another process loads other weights into the server under the version the learner pushed at its start, and
    only then does an actor sample: every record has lag 0 and one version, the learner's, yet comes from other
    weights. The learner stops at step 1, before its update, naming the step, the version, the transport and the
    figure; a run with the check off (--max-logprob-mismatch 0) trains on the same kind of records to its end. (The
    other weights seldom earn a reward, and records of equal rewards carry no gradient: the learner feeds them to no
    forward, so nothing would be measured. The test gives the records it queues advantages of +-1.)"""
    url, model = toy
    other = other_weights(model, os.path.join(CHECKPOINT_ROOTS[url], "other_pipeline.safetensors"))
    log = tmp_path / "learner.log"
    for key, extra in [("behind", ()), ("behind_off", ("--max-logprob-mismatch", "0"))]:
        learner = start_logged(
            learner_cmd([url], model, rds.url, key, "--train-steps", "1", "--batch-size", "16", *extra),
            log,
            cwd=tmp_path,
        )
        try:
            wait_for(log, "as version", learner)
            version = int(re.search(r"as version (\d+)", log.read_text())[1])
            load_behind(url, other, version)  # the learner's own number
            prefill([url], rds.url, key + ":sampled", "x", 2, tmp_path)  # 16 records of that version, sampled by
            sampled = [msgpack.unpackb(raw) for raw in rds.client.lrange(key + ":sampled", 0, -1)]  # other weights
            rds.client.rpush(key, *(msgpack.packb({**rec, "advantage": (-1.0) ** i}) for i, rec in enumerate(sampled)))
            code = learner.wait(300)
        finally:
            if learner.poll() is None:
                learner.kill()
        out = log.read_text()
        stop = stopped_by_the_check(out)
        print(key, stop)
        if not extra:
            assert code != 0 and stop is not None, out[-3000:]
            assert stop[:3] == (1, version, "collective") and stop.limit == 1e-3 and stop.mismatch > 1e-2, stop
            assert metrics_of(out) == []
        else:
            m = metrics_of(out)
            assert code == 0 and stop is None and m[0]["lag_hist"] == "0:16", out[-3000:]
            assert float(m[0]["logprob_mismatch"]) > 1e-2, m


# ---------------------------------------------------------------------------------------------------
# stopping and refusing: SIGTERM to the actor, then to the learner (on the actor's records); a budget over the context
class StoppedActor(NamedTuple):
    code: int
    seconds: float  # from the signal to the exit
    log: str
    pushed_at_signal: int  # the queue's counter of records pushed, read right after the signal
    key: str


@pytest.fixture(scope="module")
def stopped_actor(toy, rds, tmp_path_factory) -> StoppedActor:
    """An actor that never holds back (no lag or queue limit, 2 groups in flight) gets SIGTERM once 104 records are
    in Redis; its queue then feeds the learner's preemption test."""
    tmp = tmp_path_factory.mktemp("stopped_actor")
    key = "stop"
    unlimited = ("--max-lag", "1000000", "--max-queue", "1000000", "--concurrency", "2", "--actor-id", "s")
    actor = start_actor([toy.url], rds.url, key, tmp / "actor.log", *unlimited)
    try:
        deadline = time.time() + 300
        while int(rds.client.get(key + ":pushed") or 0) < 104:
            assert actor.poll() is None and time.time() < deadline, log_tail(tmp / "actor.log")
            time.sleep(0.05)
        os.kill(actor.pid, signal.SIGTERM)  # the actor alone, as a pod's eviction does (its graders are its own)
        t0 = time.time()
        pushed = int(rds.client.get(key + ":pushed"))
        code = actor.wait(120)
        seconds = time.time() - t0
    finally:
        kill_actor(actor)
    return StoppedActor(code, seconds, (tmp / "actor.log").read_text(), pushed, key)


def test_actor_sigterm_pushes_the_groups_in_flight_and_exits_0(stopped_actor, rds):
    """SIGTERM: the actor submits no new group, generates, grades and pushes those in flight, and exits 0 within
    seconds. Every group it submitted is in Redis, whole (8 records each): the records pushed after the signal are
    those of the groups in flight, at most 2 in flight and 2 being graded."""
    s = stopped_actor
    print(f"actor: exit {s.code} {s.seconds:.1f} s after SIGTERM")
    assert s.code == 0 and s.seconds < 30, s.log[-3000:]
    assert "waiting: SIGTERM: no new group; those in flight are pushed, then the actor ends" in s.log
    groups, records, submitted = map(
        int, re.search(r"done, (\d+) groups \((\d+) records\) .* (\d+) submitted", s.log).groups()
    )
    ids = [msgpack.unpackb(raw)["group_id"] for raw in rds.client.lrange(s.key, 0, -1)]
    assert groups == submitted and records == 8 * groups == len(ids) == int(rds.client.get(s.key + ":pushed"))
    assert sorted(set(ids)) == sorted(f"s/{g}" for g in range(groups)) and len(ids) == 8 * len(set(ids))
    after = records - s.pushed_at_signal
    print(f"actor: {after} records pushed after the signal")
    assert 8 <= after <= 8 * 4, (s.pushed_at_signal, records)


def test_learner_sigterm_saves_its_last_step_and_resume_goes_on(toy, rds, stopped_actor, tmp_path):
    """The queue holds 3 batches and half of a 4th. SIGTERM at step 3 (the learner waiting for the rest of step 4's
    batch, with --save-every 100): after 5 s of an empty queue it gives step 4 up (its 8 records popped are lost),
    saves step 3 and exits 128 + SIGTERM. With 3 more batches queued, --resume goes on from step 3, with the step
    counter, the record counts and the optimizer state (AdamW's step count) saved, to the final step 6."""
    url, model = toy
    key = stopped_actor.key
    raws = rds.client.lrange(key, 0, 103)
    rds.client.delete(key)
    rds.client.rpush(key, *raws[:56])
    flags = ("--train-steps", "6", "--batch-size", "16", "--max-lag", "1000000", "--save-every", "100")
    log = tmp_path / "learner.log"
    learner = start_logged(learner_cmd([url], model, rds.url, key, *flags), log, cwd=tmp_path)
    try:
        wait_for(log, "step 3:", learner)
        while rds.client.llen(key):  # step 4 has popped the last 8 records: it waits for more
            time.sleep(0.05)
        learner.send_signal(signal.SIGTERM)
        t0 = time.time()
        code = learner.wait(60)
    finally:
        if learner.poll() is None:
            learner.kill()
    out = log.read_text()
    print(f"learner: exit {code} {time.time() - t0:.1f} s after SIGTERM")
    assert code == 128 + signal.SIGTERM and time.time() - t0 < 60, out[-3000:]
    assert "the queue is dry: the step is given up, and the 8 records popped for it are lost" in out
    assert "stopped by SIGTERM after step 3: --resume goes on from there" in out
    assert L.checkpoint_steps(str(tmp_path / "ckpt")) == [3] and not list(tmp_path.glob("ckpt/*.tmp"))
    state = torch.load(tmp_path / "ckpt" / "step_3" / L.TRAINER_STATE, weights_only=True)
    assert state["step"] == 3 and state["counts"] == {"trained": 48, "lost": 8}, state["counts"]
    rds.client.rpush(key, *raws[56:104])
    out, m = run_learner([url], model, rds.url, key, tmp_path, *flags, "--resume")
    assert "resumed from ckpt/step_3 at step 3" in out and len(m) == 3 and m[-1]["trained_total"] == "96", out[-3000:]
    state = torch.load(tmp_path / "ckpt" / "step_6" / L.TRAINER_STATE, weights_only=True)
    assert state["step"] == 6 and state["counts"] == {"trained": 96, "lost": 8}, state["counts"]
    assert {int(s["step"]) for s in state["optimizer"]["state"].values()} == {6}  # 3 steps saved + 3 resumed


def test_actor_refuses_a_completion_budget_the_servers_context_cannot_hold(toy, rds, tmp_path):
    """--max-completion-tokens one over what the server's max_model_len leaves after the longest prompt: the actor
    stops at start, exit status 1, naming both numbers and the prompt's length, counted as the server counts it (the
    model's chat template, then its tokenizer without special tokens, as computed here), before any record is
    pushed."""
    from transformers import AutoTokenizer

    url, model = toy
    tok = AutoTokenizer.from_pretrained(model)
    chats = [
        tok.apply_chat_template(
            [{"role": "user", "content": row["question"]}], tokenize=False, add_generation_prompt=True
        )
        for row in read_jsonl(os.path.join(TOY, "train.jsonl"))
    ]
    longest = max(len(tok.encode(chat, add_special_tokens=False)) for chat in chats)
    max_model_len = requests.get(url + "/runtime_version").json()["max_model_len"]
    budget = max_model_len - longest + 1
    cmd = actor_cmd([url], rds.url, "too_long", "--max-completion-tokens", str(budget), "--max-steps", "1")
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    said = (
        f"--max-completion-tokens {budget} after the longest prompt ({longest} tokens) exceeds the server's "
        f"max_model_len {max_model_len}"
    )
    assert r.returncode == 1 and said in r.stderr.splitlines()[-1], r.stdout[-2000:] + r.stderr[-2000:]
    assert rds.client.llen("too_long") == 0 and rds.client.get("too_long:pushed") is None
