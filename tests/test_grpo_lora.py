"""SCRIPT with LoRA (--lora-rank): the adapters on the real toy model against a real vllm_sync_server on CPU, in both
ways the server gets the policy (--lora-sync merged: the merged base over the weight push; adapter: the adapter's
files, loaded by vLLM's LoRA). The reference for the trainer's logprobs is the server's own sampling, and the
reference for a merged checkpoint is the base plus (alpha / r) B A computed here from the saved adapter."""

import json
import os
import struct
import subprocess
import threading
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import test_grpo_gsm8k
import torch

from conftest import (
    CHECKPOINT_ROOTS,
    FIXTURES,
    GAP_PROMPTS,
    PY,
    ROOT,
    SERVER_LOGS,
    assert_learned,
    free_port,
    import_script,
    load_weights,
    max_abs_diff,
    metrics_of,
    read_jsonl,
    run_changed_behind,
    run_ok,
    server_matches,
    start_server,
    stop_server,
    stopped_by_the_check,
    worst_logprob_gap,
)

SCRIPT = "grpo_gsm8k_lora_one_gpu.py"  # LoRA lives in the one-GPU variant
G = import_script(SCRIPT)
LORA = ("--lora-rank", "8", "--lora-alpha", "16")
TOY_TRAIN = os.path.join(FIXTURES, "gsm8k_toy", "train.jsonl")  # the training problems of script_cmd's data set
HOT = ("--train-temperature", "0.7")  # the trainer's logprobs must follow the sampling temperature to agree


def script_cmd(url, *extra, **kw) -> list:
    """test_grpo_gsm8k's command line, of SCRIPT."""
    return test_grpo_gsm8k.script_cmd(url, *extra, script=SCRIPT, **kw)


def run_script(url, workdir, *extra, **kw):
    """test_grpo_gsm8k's run, of SCRIPT."""
    return test_grpo_gsm8k.run_script(url, workdir, *extra, script=SCRIPT, **kw)


@pytest.fixture(scope="module")
def toy_model(toy_model, tmp_path_factory) -> str:
    """The toy model with its final norm's gain x4, for every test here (and the module's servers). LoRA leaves the
    tied embedding and lm_head frozen, and the toy's random rows (std 0.02) cap every logit at about |e_v| sqrt(H) =
    2.6: no token can get past a probability of about 0.1, and the toy task's reward stalls near 0.45. A trained
    model's final norm and embedding are far larger; x4 lets a logit reach about 10, as full fine-tuning does by
    growing the embedding."""
    import shutil

    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("lora_toy") / "toy"
    model = AutoModelForCausalLM.from_pretrained(toy_model, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(4)
    model.save_pretrained(path)
    for name in os.listdir(toy_model):  # the tokenizer, the generation config, the boxed tokens' ids
        if not name.endswith(".safetensors") and name != "config.json":
            shutil.copy(os.path.join(toy_model, name), path)
    return str(path)


@pytest.fixture(scope="module")
def checkpoint_root(toy) -> Path:
    """The --checkpoint-root of conftest's toy server: --sync-transport checkpoint saves inside it."""
    return Path(CHECKPOINT_ROOTS[toy.url])


def lora_model(path: str, seed: int = 0):
    """The toy model with rank-8 adapters whose B is random (a fresh adapter has B = 0 and changes nothing): the
    policy differs from the base, so a server still running the base would fail the comparisons."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(seed)
    return model, with_lora(model)


def with_lora(model):
    """`model` with the script's LoRA adapters (add_lora, the flags of LORA), B drawn at random instead of 0: the
    adapted policy differs from the base. Returns the peft model."""
    import tyro

    peft_model = G.add_lora(model, tyro.cli(G.Args, args=list(LORA)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return peft_model


def merged_reference(base_dir, adapter_dir) -> dict:
    """The merged policy computed from the files alone: every adapted weight W + (alpha / r) B A, from the base
    model's safetensors and the adapter's (peft names: base_model.model.<name>.lora_A.weight)."""
    from safetensors.torch import load_file

    weights = load_weights(base_dir)
    adapter = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    config = json.loads(Path(adapter_dir, "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    for key, a in adapter.items():
        if ".lora_A." in key:
            name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            b = adapter[key.replace(".lora_A.", ".lora_B.")]
            weights[name] = weights[name] + scale * (b @ a)
    return weights


# ---------------------------------------------------------------------------------------------------
# --lora-sync merged: the existing push, of the base with the adapters merged in


def test_merged_push_server_logprobs_equal_the_peft_models(toy):
    """After a merged push with the script's own client, the server's logprobs of the tokens it samples equal the
    trainer's (the model with adapters, computed the way training computes them) within 1e-4 in fp32, and unmerging
    gives the base back (within fp32 rounding)."""
    model, peft_model = lora_model(toy.model)
    base = {n: t.clone() for n, t in G.base_named(model.named_parameters())}
    sync = G.init_weight_sync(toy.url, torch.device("cpu"))
    with G.lora_merged(peft_model):
        G.push_weights(sync, model, version=100)
    assert max_abs_diff(base, dict(G.base_named(model.named_parameters()))) < 1e-6
    results = sample_gap_prompts(toy.url)
    assert worst_logprob_gap(G, model, GAP_PROMPTS, results, 1.0) < 1e-4
    with torch.no_grad():  # the control: the base's logprobs are far from the server's, so the comparison can fail
        peft_model.base_model.disable_adapter_layers()
        assert worst_logprob_gap(G, model, GAP_PROMPTS, results, 1.0) > 1e-2
        peft_model.base_model.enable_adapter_layers()


def bf16_lora_model(seed: int = 0):
    """A small Qwen2 built here in bf16 (the dtype a LoRA run's base travels in) with the script's rank-8 adapters on
    every linear layer: fp32 adapters (peft's), B random, so (alpha / r) B A moves most weights by a bf16 step or more
    (|W| ~ 0.02, a step there ~1e-4)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    return model, with_lora(model)


def merged_once(model) -> dict:
    """The weights a merged push must send, computed here apart from peft: each adapted W + (alpha / r) B A in fp32,
    rounded once to W's dtype; every other weight as it is."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    scale = float(LORA[3]) / float(LORA[1])
    out = {}
    for name, w in G.base_named(params.items()):
        layer = name.removesuffix(".weight")
        a, b = params.get(f"{layer}.lora_A.default.weight"), params.get(f"{layer}.lora_B.default.weight")
        out[name] = w.clone() if a is None else (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return out


def test_merging_leaves_a_bf16_base_bit_identical(tmp_path):
    """peft merges in place and unmerges by subtracting again: in bf16 the two roundings do not give W back, so each
    merged push or checkpoint save would move the frozen base by a step wherever B A moves it by half a step, and
    --verify-sync could not see it (both ends move together). 20 merges (as the pushes enter them) and 2 saves leave
    every base weight bit-identical; within, the weights a push reads are W + (alpha / r) B A rounded once, and so
    are those a save writes."""
    model, peft_model = bf16_lora_model()
    base = {n: t.clone() for n, t in G.base_named(model.named_parameters())}
    want = merged_once(model)
    assert all(t.dtype == torch.bfloat16 for t in base.values())
    assert sum(not torch.equal(want[n], base[n]) for n in base) == 2 * 7  # the control: every adapted weight moves

    def moved() -> int:  # base elements not bit-identical to those before
        return sum((t != base[n]).sum().item() for n, t in G.base_named(model.named_parameters()))

    for push in range(1, 21):
        with G.lora_merged(peft_model):
            pushed = dict(G.base_named(model.named_parameters()))
            off = sum((pushed[n] != want[n]).sum().item() for n in want)
            assert off == 0, f"push {push}: {off} merged elements are not W + (alpha / r) B A rounded once"
        assert moved() == 0, f"after push {push}: {moved()} base elements moved"
    for _ in range(2):
        G.save_merged(peft_model, model, str(tmp_path / "merged"))
    saved = load_weights(tmp_path / "merged")
    assert saved.keys() == want.keys()
    assert all(torch.equal(saved[n], want[n]) for n in saved)
    assert moved() == 0, f"after 2 saves: {moved()} base elements moved"


class Run(NamedTuple):
    workdir: Path
    stdout: str
    metrics: list[dict]
    sampled: list[dict]  # the server's samples of GAP_PROMPTS right after the run (generate's results)


def sample_gap_prompts(url: str, lora: str | None = None) -> list[dict]:
    """4 samples of each of GAP_PROMPTS at temperature 1, 24 tokens, seeded as a run's first step (with the adapter
    `lora` if given): what peft_gap compares a checkpoint's PEFT model with."""
    seeds = [G.rollout_seed(0, i, 4) for i in range(len(GAP_PROMPTS))]
    return G.generate(url, GAP_PROMPTS, 4, 1.0, 24, 4, seeds, lora=lora)


def peft_gap(base_model: str, checkpoint, sampled: list[dict]) -> float:
    """The worst |logprob| gap between the server's samples `sampled` and the PEFT model of a LoRA run's
    `checkpoint` (the base `base_model` with that checkpoint's adapter, loaded by the script's own add_lora)."""
    import tyro
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    G.add_lora(base, tyro.cli(G.Args, args=list(LORA)), saved=str(checkpoint))
    return worst_logprob_gap(G, base, GAP_PROMPTS, sampled, 1.0)


@pytest.fixture(scope="module")
def merged_a(toy, tmp_path_factory) -> Run:
    """Merged run A: 2 steps with rank-8 adapters over the default transport (collective), every push verified by
    checksum, a checkpoint every step, and dynamic sampling (the variant's rounds: each step trains on groups whose
    rewards differ, so both move the adapter). The server's state is read right after it, before another run pushes
    its own."""
    workdir = tmp_path_factory.mktemp("merged_A")
    extra = ("--train-steps", "2", "--save-every", "1", "--verify-sync", "--learning-rate", "3e-2", *LORA, *HOT)
    extra += ("--dynamic-sampling",)
    out, m = run_script(toy.url, workdir, *extra, model=toy.model)
    assert server_matches(toy.url, workdir / "ckpt" / "step_2" / "merged")
    return Run(workdir, out, m, sample_gap_prompts(toy.url))


def test_merged_run_trains_the_adapter_and_saves_a_merged_model(toy, merged_a):
    """Run A pushes two verified versions, its trainer agrees with the sampler, every checkpoint holds the adapter
    (peft format, no full model beside it) and in merged/ a model that transformers loads and that equals the base
    plus (alpha / r) B A of that checkpoint's adapter; the server held exactly the last one at the end, and its
    samples' logprobs equal those of the PEFT model of the last checkpoint within 1e-4, not those of the step before;
    the base moved nowhere but through the adapter. Its counters hold the W&B run's id (None: no W&B), and no data
    order (each epoch's is drawn from the seed)."""
    from transformers import AutoModelForCausalLM

    m = merged_a.metrics
    assert [int(x["version"]) for x in m] == [1, 2]
    assert all(float(x["logprob_mismatch"]) < 1e-5 for x in m), m
    for step in (1, 2):
        path = merged_a.workdir / "ckpt" / f"step_{step}"
        assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(path))
        assert "model.safetensors" not in os.listdir(path)
        state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=False)
        assert state["step"] == step and state["wandb_id"] is None and "order" not in state
        merged = load_weights(path / "merged")
        want = merged_reference(toy.model, path)
        assert set(merged) == set(want) and max_abs_diff(merged, want) < 1e-5
        assert max_abs_diff(merged, load_weights(toy.model)) > 1e-4  # the adapter moved the policy
        AutoModelForCausalLM.from_pretrained(path / "merged")
    assert peft_gap(toy.model, merged_a.workdir / "ckpt" / "step_2", merged_a.sampled) < 1e-4
    assert peft_gap(toy.model, merged_a.workdir / "ckpt" / "step_1", merged_a.sampled) > 1e-4  # tells versions apart


def test_eval_of_a_lora_checkpoint_evaluates_its_merged_model(toy, merged_a, tmp_path):
    """eval.py pointed at a LoRA checkpoint (an adapter, which no server loads as a model) evaluates the merged model
    inside it; an adapter directory without merged/ is refused with a message naming merged/, before any work."""
    import shutil
    import subprocess

    step_1 = merged_a.workdir / "ckpt" / "step_1"
    cmd = [PY, os.path.join(ROOT, "eval.py"), "--vllm-port", toy.url.rsplit(":", 1)[1], "--limit", "2"]
    cmd += ["--max-tokens", "8", "--dataset", os.path.join(FIXTURES, "gsm8k_toy"), "--out", "out.jsonl"]
    r = run_ok([*cmd, "--model", str(step_1)], cwd=tmp_path, timeout=300)
    assert f"evaluating its merged model {step_1 / 'merged'}" in r.stdout
    assert read_jsonl(tmp_path / "out.jsonl")[-1]["summary"]["model"] == str(step_1 / "merged")
    adapter_only = tmp_path / "adapter_only"
    shutil.copytree(step_1, adapter_only, ignore=shutil.ignore_patterns("merged"))
    r = subprocess.run([*cmd, "--model", str(adapter_only)], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "LoRA adapter" in r.stderr and str(adapter_only / "merged") in r.stderr


def test_resumed_lora_run_continues_the_same_adapter(toy, merged_a, tmp_path):
    """Run A resumed for a third step starts from A's adapter and optimizer state: its step-3 adapter equals that of
    the same 3 steps run straight (a fresh adapter or fresh Adam moments would differ by about the learning rate),
    and step 3 moved it."""
    from safetensors.torch import load_file

    extra = ("--train-steps", "3", "--save-every", "1", "--learning-rate", "3e-2", *LORA, *HOT, "--dynamic-sampling")
    out, m = run_script(toy.url, merged_a.workdir, *extra, "--resume", model=toy.model)
    assert "resumed from ckpt/step_2 at step 2" in out and [x["version"] for x in m] == ["3"]
    run_script(toy.url, tmp_path, *extra, model=toy.model)

    def adapter(workdir, step):
        return load_file(workdir / "ckpt" / f"step_{step}" / "adapter_model.safetensors")

    resumed = adapter(merged_a.workdir, 3)
    moved = max_abs_diff(resumed, adapter(merged_a.workdir, 2))  # Adam's step 3: about the learning rate
    diff = max_abs_diff(resumed, adapter(tmp_path, 3))  # float noise (the merges round the base differently)
    assert moved > 1e-3 and diff < 1e-3 * moved, (moved, diff)


def test_lora_learns_the_toy_task(toy, tmp_path):
    """GRPO with rank-8 adapters (lr 3e-2, 10x full fine-tuning's) pushes the toy task's mean reward up within 20
    steps (the module's toy model: see toy_model). One seed: full fine-tuning's learning test runs two more, and the
    real-model tests check that the adapters move the policy. Its 160 prompts span 2.5 epochs of the 64 training
    problems: each epoch draws every problem once, the second in another order than the first; the rollout log names
    each by to_problem's prompt and gold."""
    extra = ("--train-steps", "20", "--save-every", "100", "--seed", "1", "--learning-rate", "3e-2", *LORA)
    _, m = run_script(toy.url, tmp_path, *extra, model=toy.model)
    rewards = [float(x["reward"]) for x in m]
    print("rewards", rewards)
    assert_learned(rewards)
    rollouts = read_jsonl(tmp_path / "gsm8k_train_rollouts.jsonl")
    assert {"prompt", "gold"} <= rollouts[0].keys() and not {"question", "answer"} & rollouts[0].keys()
    drawn = [(r["prompt"], r["gold"]) for r in rollouts[::8]]  # one per group of 8 completions
    problems = [(row["question"], row["answer"].split("#### ")[-1]) for row in read_jsonl(TOY_TRAIN)]
    assert sorted(drawn[:64]) == sorted(drawn[64:128]) == sorted(problems)
    assert drawn[:64] != drawn[64:128]


# ---------------------------------------------------------------------------------------------------
# --lora-sync adapter: the server runs the base with LoRA on, and loads each version's adapter files in place


@pytest.fixture(scope="module")
def lora_server(toy_model, tmp_path_factory) -> str:
    """A server of the toy model with LoRA on (vLLM's flags; rank 8 at most), for this module."""
    log = str(tmp_path_factory.mktemp("lora_server") / "server.log")
    proc, url = start_server(toy_model, log, "--enable-lora", "--max-lora-rank", "8")
    SERVER_LOGS[url] = log
    yield url
    stop_server(proc)


def test_adapter_push_server_logprobs_equal_the_peft_models(toy, lora_server, tmp_path):
    """push_adapter writes the adapter and the server loads it in place: /generate with `lora` then samples with
    it (the trainer's logprobs of its tokens agree within 1e-4 in fp32) and reports its version; a second adapter,
    pushed as the next version, replaces the first on the very next request, and the first one's files go."""
    import requests

    model, peft_model = lora_model(toy.model, seed=0)
    G.push_adapter(lora_server, peft_model, 7, str(tmp_path))
    results = sample_gap_prompts(lora_server, "policy")
    assert {v for r in results for c in r["completions"] for v in c["versions"]} == {7}
    assert worst_logprob_gap(G, model, GAP_PROMPTS, results, 1.0) < 1e-4
    assert (
        worst_logprob_gap(G, model, GAP_PROMPTS, sample_gap_prompts(lora_server), 1.0) > 1e-2
    )  # the base alone: far off
    with torch.no_grad():  # the next version: other adapter weights
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-1.5)
    G.push_adapter(lora_server, peft_model, 8, str(tmp_path))
    results = sample_gap_prompts(lora_server, "policy")
    assert {v for r in results for c in r["completions"] for v in c["versions"]} == {8}
    assert worst_logprob_gap(G, model, GAP_PROMPTS, results, 1.0) < 1e-4
    assert os.listdir(tmp_path) == ["v8"]
    assert server_matches(lora_server, toy.model)  # every base weight checked (LoRA wraps them) and left as it was
    # vLLM's own /v1 routes know the adapter by its name too: greedy, they answer what /generate answers with it
    greedy = G.generate(lora_server, GAP_PROMPTS[:1], 1, 0.0, 12, 1, [0], lora="policy")[0]["completions"][0]
    body = {"model": "policy", "prompt": GAP_PROMPTS[0], "max_tokens": 12, "temperature": 0.0}
    v1 = requests.post(lora_server + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert v1["text"] == greedy["text"]


def test_an_adapter_without_lora_on_is_refused(toy, tmp_path):
    """A server started without --enable-lora refuses /update_adapter and says which flags it needs; /generate
    refuses an adapter name it never loaded."""
    import requests

    _, peft_model = lora_model(toy.model)
    with pytest.raises(RuntimeError, match="--enable-lora --max-lora-rank"):
        G.push_adapter(toy.url, peft_model, 1, str(tmp_path))
    r = requests.post(toy.url + "/generate", json={"prompts": [[5, 6]], "lora": "policy"}, timeout=60)
    assert r.status_code == 400 and "no adapter 'policy'" in r.text


# ---------------------------------------------------------------------------------------------------
# every way the flags let a LoRA run reach the server: --sync-transport x --lora-sync


@pytest.mark.parametrize(
    ("transport", "lora_sync"), [("shared", "merged"), ("checkpoint", "merged"), ("shared", "adapter")]
)
def test_every_transport_and_lora_sync(request, toy, checkpoint_root, tmp_path, transport, lora_sync):
    """A two-step LoRA run over each transport but the default, collective (run A: merged_a), merged, and with
    --lora-sync adapter (the adapter's files go to a server with LoRA on whatever the transport: init_transport sets
    none up, so one run, over shared). Merged: every push verified by checksum (--verify-sync), and the server ends
    with exactly the last checkpoint's merged model. Every step's sampler agrees with its trainer (pushes 0 and 1:
    logprob_mismatch under 1e-5); after the last push the server's logprobs equal those of the PEFT model of the last
    checkpoint within 1e-4, and not those of the step before. Adapter: step 1 sampled with version 0, step 2 with 1,
    only the newest adapter's files left."""
    url = toy.url if lora_sync == "merged" else request.getfixturevalue("lora_server")
    extra = ("--train-steps", "2", "--save-every", "1", "--learning-rate", "3e-2", *LORA, *HOT)
    extra += ("--lora-sync", lora_sync)  # (8 prompts x 8: no step without a reward, so every step moves the adapter)
    extra += ("--sync-transport", transport, "--sync-dir", str(checkpoint_root / f"sync_{transport}_{lora_sync}"))
    extra += ("--verify-sync",)  # merged: checksums; adapter: the server's logprobs of a probe (verify_adapter)
    before = set(os.listdir("/dev/shm"))
    out, m = run_script(url, tmp_path, *extra, model=toy.model)
    assert [int(x["version"]) for x in m] == [1, 2], out[-2000:]
    assert all(float(x["logprob_mismatch"]) < 1e-5 for x in m), m
    assert not [f for f in set(os.listdir("/dev/shm")) - before if f.startswith("cleanrlvr-")]
    step_1 = tmp_path / "ckpt" / "step_1"
    step_2 = tmp_path / "ckpt" / "step_2"
    if lora_sync == "merged":
        assert server_matches(url, step_2 / "merged")
    else:
        rollouts = read_jsonl(tmp_path / "gsm8k_train_rollouts.jsonl")
        assert [{v for r in rollouts if r["step"] == s for v in r["versions"]} for s in (1, 2)] == [{0}, {1}]
        assert os.listdir(tmp_path / "lora_adapters") == ["v2"]
    sampled = sample_gap_prompts(url, lora="policy" if lora_sync == "adapter" else None)
    assert peft_gap(toy.model, step_2, sampled) < 1e-4
    assert peft_gap(toy.model, step_1, sampled) > 1e-4  # the comparison tells the versions apart


# ---------------------------------------------------------------------------------------------------
# the adapter's files: read once per load, and not needed after it


class FileOpens:
    """Counts the opens of the files in a directory, by any process (Linux inotify): how often vLLM's workers read an
    adapter's files. Open and close events alternate, so the kernel coalesces no two opens into one event."""

    IN_OPEN = 0x20
    IN_CLOSE_NOWRITE = 0x10

    def __init__(self, path):
        import ctypes

        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK)
        assert self.fd >= 0, ctypes.get_errno()
        wd = self.libc.inotify_add_watch(self.fd, str(path).encode(), self.IN_OPEN | self.IN_CLOSE_NOWRITE)
        assert wd >= 0, ctypes.get_errno()
        self.opens = 0

    def count(self) -> int:
        """Opens of a file in the directory seen so far (the directory's own opens, a listing, do not count)."""
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return self.opens
            i = 0
            while i < len(data):  # struct inotify_event: wd, mask, cookie, len, then len bytes of name
                _, mask, _, length = struct.unpack_from("iIII", data, i)
                self.opens += bool(mask & self.IN_OPEN and length)
                i += 16 + length

    def close(self) -> None:
        os.close(self.fd)


def test_an_adapter_is_read_once_per_load_and_outlives_its_files(toy, lora_server, tmp_path):
    """After /update_adapter the workers hold the adapter: sampling with it reads none of its files (a request that
    named the adapter with load_inplace on would make every engine step read them again). A request sent for
    version 1 (held queued in the engine by /pause) finishes every token after version 2 was loaded and version 1's
    directory deleted, and the server still samples."""
    import requests

    _, peft_model = lora_model(toy.model, seed=0)
    adapters = tmp_path / "adapters"
    peft_model.save_pretrained(adapters / "v1")
    opens = FileOpens(adapters / "v1")
    try:
        body = {"name": "policy", "path": str(adapters / "v1"), "version": 1}
        assert requests.post(lora_server + "/update_adapter", json=body, timeout=120).json()["status"] == "ok"
        loaded = opens.count()
        seeds = [G.rollout_seed(0, i, 4) for i in range(len(GAP_PROMPTS))]
        results = G.generate(lora_server, GAP_PROMPTS, 4, 1.0, 32, 4, seeds, lora="policy")  # 32 engine steps
        assert all(len(c["token_ids"]) > 0 for r in results for c in r["completions"])
        sampling = opens.count() - loaded
    finally:
        opens.close()
    assert loaded >= 1 and sampling == 0, (loaded, sampling)

    # a request for version 1 (vLLM's /v1/completions) held in the engine by the test's own hand, whatever the load:
    # /pause first (vLLM's mode keep), then the request, queued until /resume; meanwhile version 2 goes in and version
    # 1's files go. Then it runs every token.
    n_samples = 16
    n_tokens = 900
    body = {"model": "policy", "prompt": GAP_PROMPTS[0], "max_tokens": n_tokens, "ignore_eos": True, "stream": True}
    body |= {"n": n_samples, "temperature": 1.0, "seed": 0, "stream_options": {"include_usage": True}}
    events = []

    def request() -> None:  # the whole stream, in a thread: the main thread loads version 2 meanwhile
        with requests.post(lora_server + "/v1/completions", json=body, stream=True, timeout=600) as r:
            lines = (line.removeprefix(b"data: ") for line in r.iter_lines() if line)
            events.extend(json.loads(line) for line in lines if line != b"[DONE]")

    assert requests.post(lora_server + "/pause", timeout=60).json()["in_flight"] == 0
    thread = threading.Thread(target=request)
    try:
        thread.start()
        deadline = time.monotonic() + 120  # a bound on a request that never arrives, not a race: it waits queued
        while requests.post(lora_server + "/pause", timeout=60).json()["in_flight"] == 0:
            assert time.monotonic() < deadline, "the /v1 request never reached the engine"
            time.sleep(0.05)
        G.push_adapter(lora_server, peft_model, 2, str(adapters))
        assert os.listdir(adapters) == ["v2"]
    finally:
        assert requests.post(lora_server + "/resume", timeout=60).ok
        thread.join(timeout=600)
    assert "error" not in events[-1], events[-1]
    assert events[-1]["usage"]["completion_tokens"] == n_samples * n_tokens
    finished = {c["index"]: c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]}
    assert finished == dict.fromkeys(range(n_samples), "length")  # every sample ran to its last token
    assert requests.get(lora_server + "/health", timeout=10).ok
    again = G.generate(lora_server, GAP_PROMPTS[:1], 1, 1.0, 8, 1, [0], lora="policy")
    assert again[0]["completions"][0]["versions"] == [2]


# ---------------------------------------------------------------------------------------------------
# --lora-sync adapter --start-server: the script starts a server with vLLM's LoRA on


def test_vllm_lora_rank_is_one_vllm_takes():
    """--max-lora-rank for the server --start-server launches: the smallest value vLLM's LoRAConfig accepts that holds
    the adapter's rank; the script's list is vLLM's own."""
    import typing

    from vllm.config.lora import MaxLoRARanks

    assert typing.get_args(MaxLoRARanks) == G.VLLM_LORA_RANKS
    assert [G.vllm_lora_rank(r) for r in (1, 2, 8, 9, 16, 100, 300, 512)] == [1, 8, 8, 16, 16, 128, 320, 512]
    with pytest.raises(SystemExit, match="up to rank 512"):
        G.vllm_lora_rank(513)


def test_start_server_turns_lora_on_for_adapter_sync(monkeypatch, tmp_path, process_hooks):
    """--start-server with --lora-sync adapter launches the server with --enable-lora --max-lora-rank R (the rank
    rounded up to one vLLM takes; the user's own flags win), and with --lora-sync merged without them. Sharing the GPU,
    vLLM then sleeps at level 1 by default (its base weights kept), and level 2 is refused."""
    import tyro

    launched = []

    class Exited:  # the launch is recorded, then the "server" exits at once
        pid = 0
        returncode = 1

        def __init__(self, cmd, env, **kw):
            launched.append(cmd)

        def poll(self):
            return 1

    monkeypatch.setattr(subprocess, "Popen", Exited)  # (vllm_sync_server.launch starts it)
    monkeypatch.chdir(tmp_path)
    for flags in (
        ["--lora-rank", "10", "--lora-sync", "adapter"],
        ["--lora-rank", "8", "--lora-sync", "adapter", "--server-args=--enable-lora --max-lora-rank=64"],
        ["--lora-rank", "8", "--lora-sync", "merged"],
    ):
        args = tyro.cli(G.Args, args=["--start-server", *flags])
        with pytest.raises(SystemExit, match="the server this run started, exited with status 1; its log: "):
            G.start_vllm_server(args, str(tmp_path / "server.log"))
    assert launched[0][-3:] == ["--enable-lora", "--max-lora-rank", "16"]
    assert launched[1].count("--enable-lora") == 1 and "--max-lora-rank" not in launched[1]
    assert "--enable-lora" not in launched[2]
    adapter = tyro.cli(G.Args, args=["--lora-rank", "8", "--lora-sync", "adapter"])
    merged = tyro.cli(G.Args, args=["--lora-rank", "8"])
    assert [G.vllm_sleep_level(adapter, True), G.vllm_sleep_level(merged, True)] == [1, 2]
    assert [G.vllm_sleep_level(adapter, False), G.vllm_sleep_level(merged, False)] == [0, 0]
    with pytest.raises(SystemExit, match="--vllm-sleep-level 1"):
        G.vllm_sleep_level(
            tyro.cli(G.Args, args=["--lora-rank", "8", "--lora-sync", "adapter", "--vllm-sleep-level", "2"]), True
        )


def test_adapter_sync_with_start_server(toy_model, tmp_path):
    """--lora-rank 8 --lora-sync adapter --start-server: the script starts its own server with LoRA on (rank 8) and
    trains two steps, each sampled with the adapter of the step before. --beta feeds every sample (its KL term has a
    gradient), so the trainer's logprobs are held to the server's on every token, whatever the rewards (a step of
    equal rewards feeds none without it, and logs no figure)."""
    port = free_port()
    server_args = "--dtype float32 --enforce-eager --kv-cache-memory-bytes 67108864 --max-model-len 1024"
    extra = ("--start-server", f"--server-args={server_args}", "--lora-sync", "adapter", "--train-steps", "2")
    extra += ("--rollouts-per-update", "4", "--group-size", "4", "--learning-rate", "3e-2", "--beta", "0.01")
    extra += (*LORA, *HOT)
    out, m = run_script(f"http://127.0.0.1:{port}", tmp_path, *extra, model=toy_model)
    assert [int(x["version"]) for x in m] == [1, 2], out[-2000:]
    assert all(float(x["logprob_mismatch"]) < 1e-5 for x in m), m
    rollouts = read_jsonl(tmp_path / "gsm8k_train_rollouts.jsonl")
    assert [{v for r in rollouts if r["step"] == s for v in r["versions"]} for s in (1, 2)] == [{0}, {1}]


def test_verify_sync_of_an_adapter_compares_logprobs(toy, lora_server, tmp_path):
    """--verify-sync with --lora-sync adapter (verify_adapter): right after a push the server's logprobs of a few
    tokens it samples with the adapter equal the trainer's (the figure is far below fp32's limit 1e-3); with adapter
    weights the server was never given, far over it; an answer from another adapter version is an error."""
    import tyro

    model, peft_model = lora_model(toy.model, seed=0)
    args = tyro.cli(G.Args, args=["--max-completion-tokens", "16"])
    G.push_adapter(lora_server, peft_model, 11, str(tmp_path))
    assert G.verify_adapter(lora_server, model, GAP_PROMPTS[1], 11, args, pad_id=0, bf16=False) < 1e-5
    with torch.no_grad():  # adapter weights the server does not hold
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-1.5)
    assert G.verify_adapter(lora_server, model, GAP_PROMPTS[1], 11, args, pad_id=0, bf16=False) > 1e-2
    with pytest.raises(RuntimeError, match="not the version 12 just pushed"):
        G.verify_adapter(lora_server, model, GAP_PROMPTS[1], 12, args, pad_id=0, bf16=False)


def test_an_adapter_changed_behind_the_trainer_stops_the_run(lora_server, toy_model, tmp_path):
    """--lora-sync adapter: between the trainer's adapter push of step 1 and its sampling of step 2, another process
    loads another adapter under the name and version the trainer pushed (/update_adapter, conftest's
    run_changed_behind). Step 2 is fresh and its logprobs stray: the run stops there, before step 2's update, naming
    the step, the version, the adapter transport and the figure."""
    import requests

    _, other = lora_model(toy_model, seed=1)
    other.save_pretrained(tmp_path / "other_adapter")
    fifo = str(tmp_path / "rollouts.jsonl")
    extra = ("--train-steps", "3", "--save-every", "1", "--learning-rate", "3e-2", *LORA, "--lora-sync", "adapter")
    cmd = script_cmd(lora_server, *extra, "--rollout-log", fifo, model=toy_model)

    def change():
        body = {"name": "policy", "path": str(tmp_path / "other_adapter"), "version": 1}
        assert requests.post(lora_server + "/update_adapter", json=body, timeout=120).json()["version"] == 1

    adapters = tmp_path / "lora_adapters"
    code, out = run_changed_behind(
        cmd, tmp_path, fifo, pushed=lambda: adapters.is_dir() and os.listdir(adapters) == ["v1"], change=change
    )
    stop = stopped_by_the_check(out)
    print(stop)
    assert code != 0 and stop is not None, out[-3000:]
    assert stop[:3] == (2, 1, "adapter") and stop.mismatch > 1e-2, stop
    assert [x["version"] for x in metrics_of(out)] == ["1"] and os.listdir(tmp_path / "ckpt") == ["step_1"]
