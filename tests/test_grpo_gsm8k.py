"""SCRIPT (GRPO on GSM8K): its math against naive references, and the real script end to end against a real
vllm_sync_server on CPU (the toy model, GSM8K-schema fixtures). A copy of the script is tested by changing SCRIPT."""

import math
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

from conftest import (
    CHECKPOINT_ROOTS,
    FIXTURES,
    GAP_PROMPTS,
    GRADE_WORKERS,
    PY,
    ROOT,
    assert_learned,
    assert_seed_streams_distinct,
    help_imports,
    import_script,
    load_behind,
    load_weights,
    max_abs_diff,
    metrics_of,
    naive_advantages,
    other_weights,
    read_jsonl,
    run_changed_behind,
    run_ok,
    server_matches,
    server_version,
    stopped_by_the_check,
    worst_logprob_gap,
)

SCRIPT = "grpo_gsm8k.py"
G = import_script(SCRIPT)
VARIANT = "grpo_gsm8k_lora_one_gpu.py"  # the same script with the shared transport (and sleep mode, and LoRA)
V = import_script(VARIANT)


# ---------------------------------------------------------------------------------------------------
# grading of known completions (the full case file is in test_grading_cases.py)
def test_grade_known_completions():
    gold = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 1,200"
    cases = [
        ("So the answer is \\boxed{1200}.", (1.0, True, False)),
        ("So the answer is \\boxed{1,200}.", (1.0, True, False)),  # thousands separator
        ("So the answer is $\\boxed{\\$1,200.00}$", (1.0, True, False)),
        ("The answer is 1200.", (0.0, False, True)),  # unboxed: no answer
        ("First \\boxed{1200}, no wait: \\boxed{120}.", (0.0, False, False)),  # the last box counts
        ("First \\boxed{12}, no wait: \\boxed{1200}.", (1.0, True, False)),
        ("The answer is \\boxed{1200", (0.0, False, True)),  # truncated box
        ("\\boxed{}", (0.0, False, True)),
        ("}}}{{{ asdf ##@@ }{" * 50, (0.0, False, True)),  # garbage
        ("the answer is \\boxed{@@@ ###}", (0.0, False, False)),  # a text answer is an answer, a wrong one
        ("\\boxed{12.00}", (0.0, False, False)),
    ]
    for text, want in cases:
        assert tuple(G.grade(text, gold)) == want, text
    G.grade_batch(["\\boxed{1200}"], [gold], timeout_s=5.0)  # the pool started: its start is not what is bounded
    t0 = time.monotonic()
    grades = G.grade_batch(["\\boxed{9^{9^{9^{9}}}}", "\\boxed{1200}"], [gold, gold], timeout_s=1.0)
    assert grades[0].reward == 0 and grades[1].correct
    assert time.monotonic() - t0 < 60  # a bound on a hang, not a speed test: unkilled, the tower runs for minutes


# ---------------------------------------------------------------------------------------------------
# advantages and loss against naive per-element references
def test_group_advantages():
    r = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1])
    for scale in (True, False):
        got = G.group_advantages(r, 4, scale)
        assert torch.allclose(got, torch.tensor(naive_advantages(r.tolist(), 4, scale)), atol=1e-6)
    assert torch.all(G.group_advantages(r, 4)[4:8] == 0)  # equal rewards: zeros, not NaN


def naive_loss(lp, old, adv, mask, lo, hi, loss_type, ref=None, beta=0.0, samp=None, cap=None, lmax=None):
    import math

    B, T = len(lp), len(lp[0])
    tok = [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            r = math.exp(lp[b][t] - old[b][t])
            v = -min(r * adv[b], min(max(r, 1 - lo), 1 + hi) * adv[b])
            if cap is not None:
                v *= min(math.exp(old[b][t] - samp[b][t]), cap)
            if beta:
                d = ref[b][t] - lp[b][t]
                v += beta * (math.exp(d) - d - 1)
            tok[b][t] = v * mask[b][t]
    if loss_type == "grpo":
        return sum(sum(tok[b]) / max(1, sum(mask[b])) for b in range(B)) / B
    if loss_type == "dapo":
        return sum(map(sum, tok)) / sum(map(sum, mask))
    return sum(map(sum, tok)) / (B * (lmax or T))


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_policy_loss_against_naive(loss_type):
    g = torch.Generator().manual_seed(0)
    B, T = 4, 7
    lp = -torch.rand(B, T, generator=g) * 3
    old = lp + torch.randn(B, T, generator=g) * 0.4  # ratios well outside [0.8, 1.2]: both edges clip
    samp = old + torch.randn(B, T, generator=g) * 0.3
    ref = lp + torch.randn(B, T, generator=g) * 0.2
    adv = torch.tensor([1.5, -0.7, 0.0, -2.0])
    mask = torch.ones(B, T)
    mask[1, 5:] = 0
    mask[3, 2:] = 0
    for kw, naive_kw in [
        ({}, {}),
        ({"ref_logprobs": ref, "beta": 0.1}, {"ref": ref.tolist(), "beta": 0.1}),
        ({"sampling_logprobs": samp, "tis_cap": 2.0}, {"samp": samp.tolist(), "cap": 2.0}),
        ({"max_completion_length": 16}, {"lmax": 16}),
    ]:
        got = G.policy_loss(lp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.28, loss_type=loss_type, **kw)
        want = naive_loss(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.28, loss_type, **naive_kw)
        assert abs(got.item() - want) < 1e-5, (kw.keys(), got.item(), want)


def test_clipping_edges_stop_the_gradient():
    # positive advantage, ratio above 1 + eps_high: clipped, no gradient; below: gradient flows
    # negative advantage, ratio below 1 - eps_low: clipped, no gradient; above: gradient flows
    old = torch.zeros(1, 4)
    lp = torch.log(torch.tensor([[1.5, 1.1, 0.5, 0.9]])).requires_grad_()
    mask = torch.ones(1, 4)
    clip = {"clip_eps_low": 0.2, "clip_eps_high": 0.3, "loss_type": "dapo"}
    G.policy_loss(lp, old, torch.tensor([1.0]), mask, **clip).backward()
    assert lp.grad[0, 0] == 0 and lp.grad[0, 1] != 0 and lp.grad[0, 2] != 0
    lp.grad = None
    G.policy_loss(lp, old, torch.tensor([-1.0]), mask, **clip).backward()
    assert lp.grad[0, 2] == 0 and lp.grad[0, 3] != 0 and lp.grad[0, 0] != 0
    stats = {}
    G.policy_loss(lp, old, torch.tensor([1.0]), mask, **clip, stats=stats)
    assert stats["clipped_tokens"] == 2  # 1.5 > 1.3 and 0.5 < 0.8


def naive_objective(lp, old, adv, mask, lo, hi, loss_type, samp=None, mis=(None, None)):
    """The 2025 objectives written out sequence by sequence and token by token, in torch scalars (autograd gives the
    reference gradient): gspo's ratio per sequence, cispo's detached clipped weight, masked importance sampling."""
    B, T = lp.shape
    total, seqs, tokens = 0.0, 0, 0
    for b in range(B):
        n = int(sum(mask[b].tolist()))
        if n == 0:
            continue
        seqs += 1
        if samp is not None:
            w = math.exp(sum((old[b, t] - samp[b, t]).item() for t in range(n)))
            if (mis[0] is not None and w < mis[0]) or (mis[1] is not None and w > mis[1]):
                tokens += n
                continue  # masked: no gradient, still counted in the averages
        if loss_type == "gspo":
            s = torch.exp(sum(lp[b, t] - old[b, t] for t in range(n)) / n)
            total = total + (-torch.minimum(s * adv[b], torch.clamp(s, 1 - lo, 1 + hi) * adv[b])) / B
            continue
        for t in range(n):
            r = math.exp((lp[b, t] - old[b, t]).item())
            total = total - min(max(r, 1 - lo), 1 + hi) * adv[b] * lp[b, t]  # cispo: the weight is a number
            tokens += 1
    return total / tokens if loss_type == "cispo" else total


@pytest.mark.parametrize("mis", [(None, None), (0.5, 2.0)])
@pytest.mark.parametrize("loss_type", ["gspo", "cispo"])
def test_2025_objectives_against_naive(loss_type, mis):
    """gspo and cispo, with and without masked importance sampling: the value and the gradient equal the naive
    reference's, with ratios far enough from 1 that both clip edges and both mask edges are met."""
    g = torch.Generator().manual_seed(1)
    B, T = 6, 5
    base = -torch.rand(B, T, generator=g) * 3
    old = base + torch.randn(B, T, generator=g) * 0.3
    samp = old + torch.randn(B, T, generator=g) * 0.5
    adv = torch.tensor([1.5, -0.7, 0.3, -2.0, 1.0, -1.0])
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    mask[3, 1:] = 0
    lo, hi = (0.2, 0.28) if loss_type == "cispo" else (0.05, 0.08)
    kw = {"sampling_logprobs": samp, "mis_low": mis[0], "mis_high": mis[1]}
    lp = base.clone().requires_grad_()
    got = G.policy_loss(lp, old, adv, mask, clip_eps_low=lo, clip_eps_high=hi, loss_type=loss_type, **kw)
    got.backward()
    ref_lp = base.clone().requires_grad_()
    want = naive_objective(ref_lp, old, adv, mask, lo, hi, loss_type, samp if mis[0] else None, mis)
    want.backward()
    assert abs(got.item() - want.item()) < 1e-5
    assert torch.allclose(lp.grad, ref_lp.grad, atol=1e-6), (lp.grad, ref_lp.grad)
    if mis[0]:
        seq_w = torch.exp(((old - samp) * mask).sum(1))
        dropped = (seq_w < mis[0]) | (seq_w > mis[1])
        assert dropped.any() and not dropped.all()  # the case tests both kinds of sequence
        assert (lp.grad[dropped] == 0).all() and (lp.grad[~dropped] != 0).any()
        stats = {}
        G.policy_loss(lp, old, adv, mask, clip_eps_low=lo, clip_eps_high=hi, loss_type=loss_type, stats=stats, **kw)
        assert stats["mis_masked"] == dropped.sum().item()


def test_gspo_clips_whole_sequences_and_cispo_no_token():
    """gspo: a sequence whose ratio (the geometric mean of its tokens') is past the clip loses the gradient of all its
    tokens, even of a token whose own ratio is inside; inside, all its tokens keep it. cispo: every token keeps its
    gradient, -clip(r) * A / N, whatever its ratio."""
    old = torch.zeros(2, 2)
    lp = torch.log(torch.tensor([[1.5, 1.0], [1.05, 1.0]])).requires_grad_()  # sequence ratios 1.22 and 1.02
    mask = torch.ones(2, 2)
    clip = {"clip_eps_low": 0.1, "clip_eps_high": 0.1}
    G.policy_loss(lp, old, torch.tensor([1.0, 1.0]), mask, loss_type="gspo", **clip).backward()
    assert (lp.grad[0] == 0).all() and (lp.grad[1] != 0).all()
    lp.grad = None
    G.policy_loss(lp, old, torch.tensor([1.0, 1.0]), mask, loss_type="cispo", **clip).backward()
    want = -torch.tensor([[1.1, 1.0], [1.05, 1.0]]) / 4  # -clip(r) * A / N, N = 4 tokens
    assert torch.allclose(lp.grad, want, atol=1e-6)


def test_gspo_is_grpo_when_every_sequence_has_one_token():
    """With one token per sequence the sequence's ratio is the token's: gspo's value and gradient are grpo's."""
    g = torch.Generator().manual_seed(2)
    old = torch.randn(5, 1, generator=g)
    base = old + torch.randn(5, 1, generator=g) * 0.3
    adv = torch.randn(5, generator=g)
    grads = {}
    for loss_type in ("gspo", "grpo"):
        lp = base.clone().requires_grad_()
        loss = G.policy_loss(lp, old, adv, torch.ones(5, 1), 0.1, 0.1, loss_type)
        loss.backward()
        grads[loss_type] = (loss.item(), lp.grad)
    assert abs(grads["gspo"][0] - grads["grpo"][0]) < 1e-7 and torch.allclose(grads["gspo"][1], grads["grpo"][1])


def test_rollout_seeds_are_distinct_by_construction():
    """vLLM seeds sample j of a request with seed + j: requests spaced by the group size never share a stream, over
    prompts and steps (the prompt index counts on across steps), evaluation draws from another range, and so do other
    --seed values, modulo 2^32 (a CPU's generator keeps 32 bits). A seed or a run that would leave its block of 32-bit
    streams is refused."""
    assert_seed_streams_distinct(G)
    assert (G.rollout_seed(2, 0, 8) - G.rollout_seed(3, 0, 8)) % 2**32 != 0  # another --seed, other streams on a CPU
    assert G.eval_seed(G.MAX_SEED, 2**24 - 1) == 2**32 - 1  # the last stream of the last seed: the top of 32 bits
    for run_seed, prompt in ((G.MAX_SEED + 1, 0), (-1, 0), (1, 2**24 // 8)):
        with pytest.raises(ValueError, match="outside the run's block"):
            G.rollout_seed(run_seed, prompt, 8)


def test_start_server_puts_the_server_on_the_visible_gpu_meant(monkeypatch, tmp_path, process_hooks):
    """--vllm-gpu counts among this process's visible GPUs, as torch does: with CUDA_VISIBLE_DEVICES=4,5 the server
    gets GPU 4 (not the machine's GPU 0, outside the user's set), with 1,0 and --vllm-gpu 1 it gets GPU 0."""
    import tyro

    launched = []

    class Exited:  # the launch is recorded, then the "server" exits at once
        pid = 0
        returncode = 1

        def __init__(self, cmd, env, **kw):
            launched.append(env["CUDA_VISIBLE_DEVICES"])

        def poll(self):
            return 1

    monkeypatch.setattr(subprocess, "Popen", Exited)  # (vllm_sync_server.launch starts it)
    for visible, gpu, want in [("4,5", "0", "4"), ("1,0", "1", "0"), (None, "2", "2")]:
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        args = tyro.cli(G.Args, args=["--vllm-gpu", gpu, "--start-server"])
        with pytest.raises(SystemExit, match="the server this run started, exited with status 1; its log: "):
            G.start_vllm_server(args, str(tmp_path / "server.log"))
        assert launched[-1] == want, (visible, gpu, launched)
    # each launch left its clean-up: the server stopped at exit, and on SIGINT and SIGTERM (recorded, not installed)
    assert [f.__name__ for f in process_hooks["atexit"]] == ["stop_server"] * 3
    assert sorted(process_hooks["signal"]) == sorted([signal.SIGINT, signal.SIGTERM])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(SystemExit, match="1 GPU"):
        G.physical_gpu(1)


def test_batch_groups_takes_the_first_groups_whose_rewards_differ():
    """DAPO's dynamic sampling keeps, of every group a step drew, the first --rollouts-per-update whose rewards differ,
    in the order drawn; short of them, the first groups of equal rewards fill the batch (a naive reference)."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        size, wanted, drawn = rng.choice([2, 4]), rng.randint(1, 4), rng.randint(1, 12)
        rewards = [float(rng.random() < 0.3) for _ in range(drawn * size)]
        groups = [rewards[g * size : (g + 1) * size] for g in range(drawn)]
        differ = [g for g in range(drawn) if len(set(groups[g])) > 1]
        equal = [g for g in range(drawn) if len(set(groups[g])) == 1]
        chosen = sorted((differ + equal)[:wanted])
        expected = [g * size + j for g in chosen for j in range(size)]
        assert G.batch_groups(torch.tensor(rewards), size, wanted) == expected, (rewards, size, wanted)


@pytest.mark.parametrize(
    "script", ["grpo_gsm8k.py", "grpo_gsm8k_lora_one_gpu.py", "grpo_gsm8k_python_tool.py", "eval.py"]
)
def test_server_args_take_their_value_after_a_space(script, monkeypatch, tmp_path):
    """`--server-args "--dtype float32 --enforce-eager"`, as a shell user writes a value, is that value (tyro alone
    reads it as flags and refuses the line); `--server-args=...` still works, and the flags around it keep theirs."""
    module = import_script(script)
    monkeypatch.chdir(tmp_path)
    for line in (
        ["--server-args", "--dtype float32 --enforce-eager"],
        ["--server-args=--dtype float32 --enforce-eager"],
    ):
        monkeypatch.setattr("sys.argv", [script, "--model", "m", *line, "--seed", "3"])
        args = module.parse_args()
        assert args.server_args == "--dtype float32 --enforce-eager" and args.seed == 3 and args.model == "m"


@pytest.mark.parametrize(
    "script", ["grpo_gsm8k.py", "grpo_gsm8k_lora_one_gpu.py", "grpo_gsm8k_python_tool.py", "eval.py"]
)
def test_a_copy_without_the_server_file_says_where_to_put_it(script, tmp_path):
    """A script copied alone out of the repository (a copier's first move) with --start-server: one line naming
    vllm_sync_server.py and the path it must be copied to, exit 2, no traceback, no server started."""
    import shutil

    copy = tmp_path / script
    shutil.copy(os.path.join(ROOT, script), copy)
    data = ["--dataset", os.path.join(FIXTURES, "gsm8k_toy")]
    r = subprocess.run(
        [PY, str(copy), "--model", "m", "--start-server", *data],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    want = f"--start-server needs vllm_sync_server.py beside this script: copy it to {tmp_path / 'vllm_sync_server.py'}"
    assert r.returncode == 2 and want in r.stderr and "Traceback" not in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    assert not (tmp_path / "vllm_server.log").exists()


def test_pack_micro_batches():
    lengths = [5, 300, 40, 41, 290, 7, 100, 120, 8]
    batches = G.pack_micro_batches(lengths, 400)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(max(lengths[i] for i in b) * len(b) <= 400 for b in batches)
    assert G.pack_micro_batches([500], 100) == [[0]]  # a sequence over budget still trains, alone


# ---------------------------------------------------------------------------------------------------
# the real script against the real server (conftest's `toy`: the toy model's server, one for this module)
def script_cmd(url, *extra, model, dataset="gsm8k_toy", script=SCRIPT) -> list:
    """The command line of `script` against the server at `url`: one small step's worth of rollouts by default."""
    return [
        PY,
        os.path.join(ROOT, script),
        "--model",
        model,
        "--dataset",
        os.path.join(FIXTURES, dataset),
        "--vllm-port",
        url.rsplit(":", 1)[1],
        "--max-completion-tokens",
        "16",
        "--rollouts-per-update",
        "8",
        "--group-size",
        "8",
        "--learning-rate",
        "3e-3",
        "--system-prompt",
        "",
        "--eval-every",
        "0",
        "--checkpoint-dir",
        "ckpt",
        "--keep-eval-overlap",  # the toy set's test problems are among its training problems (8 sums in all)
        *GRADE_WORKERS,
        *extra,
    ]


def run_script(url, workdir, *extra, model, dataset="gsm8k_toy", timeout=600, script=SCRIPT):
    """`script` in `workdir` against the server at `url` (script_cmd). Returns its stdout and its metrics (one dict
    per step)."""
    os.makedirs(workdir, exist_ok=True)
    r = run_ok(script_cmd(url, *extra, model=model, dataset=dataset, script=script), cwd=workdir, timeout=timeout)
    return r.stdout, metrics_of(r.stdout)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_alignment_trainer_logprobs_equal_server_logprobs(toy, temperature):
    """The trainer's fp32 logprobs of sampled tokens, computed the way training computes them (packed
    micro-batches, chunked lm_head, the sampling temperature), equal the server's for the same weights, pushed and
    sampled with the script's own client."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(toy.model, dtype=torch.float32)
    sync = G.init_weight_sync(toy.url, torch.device("cpu"))
    G.push_weights(sync, model, version=100)  # the server may hold another test's weights
    seeds = [G.rollout_seed(0, i, 4) for i in range(len(GAP_PROMPTS))]
    results = G.generate(toy.url, GAP_PROMPTS, n=4, temperature=temperature, max_tokens=24, concurrency=4, seeds=seeds)
    worst = worst_logprob_gap(G, model, GAP_PROMPTS, results, temperature)
    assert worst < 1e-4, worst


def test_two_seeds_draw_differently_on_the_cpu_server(toy):
    """The run seed reaches the CPU sampler: the same prompt's group under --seed 1 and --seed 2 draws other
    completions (with seeds spaced by 2^40, as once, a CPU drew the same ones: it keeps 32 bits), the same --seed draws
    the same again, and evaluation's stream draws another than training's."""
    prompts = GAP_PROMPTS[:1]

    def draw(seed):
        results = G.generate(toy.url, prompts, n=8, temperature=1.0, max_tokens=16, concurrency=1, seeds=[seed])
        return [c["token_ids"] for c in results[0]["completions"]]

    first, again, other = draw(G.rollout_seed(1, 0, 8)), draw(G.rollout_seed(1, 0, 8)), draw(G.rollout_seed(2, 0, 8))
    assert first == again
    assert sum(a != b for a, b in zip(first, other, strict=True)) >= 6, (first, other)  # 8 of 8 but for a rare tie
    assert draw(G.eval_seed(1, 0))[0] != first[0]
    assert draw(2**40 + G.rollout_seed(1, 0, 8)) == first  # why: above bit 31 a CPU seed changes nothing


def test_alignment_over_the_shared_transport(toy):
    """The same agreement when the weights travel through the shared transport (a /dev/shm staging buffer on CPU, the
    protocol and copy code of CUDA IPC): the variant's own init_shared_sync and push, other weights than the
    server's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(toy.model, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.25)  # weights the server cannot hold already
    sync = V.init_shared_sync(toy.url, torch.device("cpu"), model)
    assert sync["places"][-1][0] == 0  # the whole model in one round
    done = V.push_weights(sync, model, version=200)
    assert done["status"] == "ok" and done["version"] == 200, done
    seeds = [G.rollout_seed(0, i, 4) for i in range(len(GAP_PROMPTS))]
    results = G.generate(toy.url, GAP_PROMPTS, n=4, temperature=1.0, max_tokens=24, concurrency=4, seeds=seeds)
    assert worst_logprob_gap(G, model, GAP_PROMPTS, results, 1.0) < 1e-4
    assert V.verify_weights(sync, model) > 0


def test_staging_layout():
    """Every tensor in its round fits the buffer, starts aligned, overlaps no other of its round; rounds count up in
    push order; without a window everything is in round 0."""
    numels = [1000, 3, 64, 5000, 7, 7, 4096, 1]
    for window in (None, 5000, 6000, 100):
        places, size = V.staging_layout(numels, window, align=64)
        assert size >= max(numels) and (window is None or size <= max(window, max(numels)))
        rounds = [r for r, _ in places]
        assert (
            rounds == sorted(rounds)
            and rounds[0] == 0
            and all(b - a <= 1 for a, b in zip(rounds, rounds[1:], strict=False))
        )
        for r in set(rounds):
            spans = sorted((o, o + n) for (rr, o), n in zip(places, numels, strict=True) if rr == r)
            assert all(o % 64 == 0 and end <= size for o, end in spans)
            assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))
        if window is None:
            assert set(rounds) == {0}
    places, size = V.staging_layout(numels, 100)
    assert size == 5000 and places[-1][0] == 2  # a window grows to the largest tensor, which is never split


def test_shared_transport_end_to_end(toy, tmp_path):
    """--sync-transport shared on CPU: the variant pushes through a /dev/shm staging buffer used as a window in rounds
    (--staging-mib 1 < the toy model's 1.3 MB), verifies every push by checksum (--verify-sync), and the trainer's
    logprobs agree with the sampler's. Nothing is left in /dev/shm. (The variant starting its own server:
    tests/test_grpo_lora.py's adapter sync with --start-server.)"""
    before = set(os.listdir("/dev/shm"))
    out, m = run_script(
        toy.url,
        tmp_path,
        "--sync-transport",
        "shared",
        "--staging-mib",
        "1",
        "--train-steps",
        "2",
        "--verify-sync",
        model=toy.model,
        script=VARIANT,
    )
    assert [int(x["version"]) for x in m] == [1, 2], out[-2000:]
    assert all(float(x["logprob_mismatch"]) < 1e-5 for x in m), m
    assert not [f for f in set(os.listdir("/dev/shm")) - before if f.startswith("cleanrlvr-")]


# Runs A (2 steps), B (A resumed for a third) and C (3 steps straight) are shared by the tests below through
# module-scoped fixtures: each runs once, whichever tests ask for it.
HOT = ("--train-temperature", "0.7")  # sampling at 0.7: the trainer's logprobs must follow it to agree with vLLM's
TINY_MICRO_BATCHES = ("--micro-token-budget", "48")  # several micro-batches per step


class RunA(NamedTuple):
    workdir: Path
    metrics: list[dict]
    rollouts: list[dict]  # its rollout log, read before run B appends to it
    server_matched_step_2: bool  # the server held exactly step 2's weights when the run ended


@pytest.fixture(scope="module")
def run_a(toy, tmp_path_factory) -> RunA:
    """Run A: 2 steps, tiny micro-batches, a checkpoint every step, every push verified by checksum (--verify-sync),
    an evaluation at step 2, sampling at temperature 0.7. What a later run changes (the rollout log, the server's
    weights) is read right after it."""
    workdir = tmp_path_factory.mktemp("A")
    _, m = run_script(
        toy.url,
        workdir,
        "--train-steps",
        "2",
        "--save-every",
        "1",
        "--verify-sync",
        *TINY_MICRO_BATCHES,
        "--eval-every",
        "2",
        "--eval-limit",
        "4",
        *HOT,
        model=toy.model,
    )
    return RunA(
        workdir=workdir,
        metrics=m,
        rollouts=read_jsonl(workdir / "gsm8k_train_rollouts.jsonl"),
        server_matched_step_2=server_matches(toy.url, workdir / "ckpt" / "step_2"),
    )


class RunB(NamedTuple):
    workdir: Path  # run A's, now with a step_3 checkpoint
    stdout: str
    metrics: list[dict]
    seeds: list[int]  # the seed of every sample of A and B, from the rollout log


@pytest.fixture(scope="module")
def run_b(toy, run_a) -> RunB:
    """Run B: run A resumed in its own directory for one more step (3 in all), as A ran. Before it, two saves cut
    short lie beside A's checkpoints, as a kill during a save (or an older version's) leaves them: a step_3 with half
    its model file and no trainer state, and a step_4.tmp."""
    cut = run_a.workdir / "ckpt" / "step_3"
    cut.mkdir()
    model_file = (run_a.workdir / "ckpt" / "step_2" / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(model_file[: len(model_file) // 2])
    (run_a.workdir / "ckpt" / "step_4.tmp").mkdir()
    out, m = run_script(
        toy.url,
        run_a.workdir,
        "--train-steps",
        "3",
        "--save-every",
        "1",
        *TINY_MICRO_BATCHES,
        "--resume",
        *HOT,
        model=toy.model,
    )
    seeds = [row["seed"] for row in read_jsonl(run_a.workdir / "gsm8k_train_rollouts.jsonl")]
    return RunB(workdir=run_a.workdir, stdout=out, metrics=m, seeds=seeds)


def test_two_steps_log_checkpoint_and_sync(run_a):
    """Run A logs every metric at every step (and the evaluation at step 2), its trainer's logprobs agree with the
    sampler's at temperature 0.7, its rollout log holds every sample, the server ends with exactly the weights of
    its last checkpoint, and that checkpoint loads in transformers as it is."""
    m = run_a.metrics
    assert [int(x["version"]) for x in m] == [1, 2] and "eval/accuracy" in m[1]
    for key in (
        "loss",
        "reward",
        "correct_rate",
        "parse_err_rate",
        "avg_completion_length",
        "total_completion_tokens",
        "clip_frac",
        "kl",
        "logprob_mismatch",
        "entropy",
        "completion_truncated_rate",
        "seq_len_truncated_rate",
        "frac_reward_zero_std",
        "prompts_drawn",
        "sampling_rounds",
        "generate_s",
        "grade_s",
        "update_s",
        "sync_s",
        "step_s",
        "tokens_per_s",
    ):
        assert key in m[0], key
    for x in m:  # the toy model's 128-token vocabulary bounds its entropy; its 16-token completions often hit the limit
        assert 0 < float(x["entropy"]) <= 4.86, x  # log(128) = 4.852
    assert all(float(x["logprob_mismatch"]) < 1e-5 for x in m), m  # the trainer agrees with the sampler
    assert all(float(x["clip_frac"]) == 0 for x in m), m  # one pass a step: every ratio is 1
    rollouts = run_a.rollouts
    assert len(rollouts) == 2 * 64 and {"completion", "reward", "advantage", "versions"} <= set(rollouts[0])
    assert run_a.server_matched_step_2
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run_a.workdir / "ckpt" / "step_2")


def test_resume_continues_at_the_saved_step(run_b):
    """Run B (run A resumed) starts at step 3 from A's last checkpoint, and every sample of A and B, over prompts,
    samples, steps and the resume, drew its own random stream."""
    assert "resumed from ckpt/step_2 at step 2" in run_b.stdout and [x["version"] for x in run_b.metrics] == ["3"]
    assert len(run_b.seeds) == 3 * 64 and len(set(run_b.seeds)) == len(run_b.seeds)


def test_resume_skips_saves_cut_short_and_saves_over_them(run_b):
    """Run B names the incomplete step_3 and the leftover step_4.tmp in one line each, resumes from step_2, the
    newest complete checkpoint, and its own save of step 3 replaces the one cut short: whole, with the weights step 3
    moved. The leftover stays, ignored. (That a resumed run takes the steps of one never stopped:
    test_sigterm_saves_the_last_step_and_resume_equals_an_uninterrupted_run.)"""
    assert "skipped ckpt/step_3: cut short while it was saved (no trainer_state.pt)" in run_b.stdout
    assert "skipped ckpt/step_4.tmp: cut short while it was saved" in run_b.stdout
    assert "resumed from ckpt/step_2 at step 2" in run_b.stdout
    assert (run_b.workdir / "ckpt" / "step_3" / "trainer_state.pt").is_file()
    step_3 = load_weights(run_b.workdir / "ckpt" / "step_3")  # (half a file would not load)
    assert max_abs_diff(step_3, load_weights(run_b.workdir / "ckpt" / "step_2")) > 1e-4
    assert not (run_b.workdir / "ckpt" / "step_3.tmp").exists() and (run_b.workdir / "ckpt" / "step_4.tmp").is_dir()


def test_sigterm_saves_the_last_step_and_resume_equals_an_uninterrupted_run(toy, tmp_path):
    """SIGTERM at step 3 (a preemption) with --save-every 100: the step in progress finishes, is saved, and the run
    ends with 128 + SIGTERM within 60 s. --resume then goes on to step 6 with the prompts, the seeds and the weights of
    a run that was never stopped."""
    stopped, straight = tmp_path / "stopped", tmp_path / "straight"
    stopped.mkdir()
    cmd = script_cmd(toy.url, "--train-steps", "6", "--save-every", "100", *HOT, model=toy.model)
    proc = subprocess.Popen(cmd, cwd=stopped, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        said = []
        for line in proc.stdout:  # the run's lines, until step 3 is logged
            said.append(line)
            if line.startswith("step 3: "):
                break
        os.kill(proc.pid, signal.SIGTERM)
        t0 = time.time()
        said += proc.stdout.readlines()
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
    assert time.time() - t0 < 60 and code == 128 + signal.SIGTERM, "".join(said)[-3000:]
    last = int(re.search(r"stopped by SIGTERM after step (\d+): --resume goes on from there", "".join(said))[1])
    assert 3 <= last < 6 and (stopped / "ckpt" / f"step_{last}" / "trainer_state.pt").is_file()
    assert G.checkpoint_steps(str(stopped / "ckpt")) == [last]
    resumed, _ = run_script(
        toy.url, stopped, "--train-steps", "6", "--save-every", "100", "--resume", *HOT, model=toy.model
    )
    assert f"resumed from ckpt/step_{last} at step {last}" in resumed
    run_script(toy.url, straight, "--train-steps", "6", "--save-every", "100", *HOT, model=toy.model)
    samples = [
        [(r["step"], r["prompt"], r["seed"]) for r in read_jsonl(d / "gsm8k_train_rollouts.jsonl")]
        for d in (stopped, straight)
    ]
    assert samples[0] == samples[1] and len(samples[0]) == 6 * 64
    assert max_abs_diff(load_weights(stopped / "ckpt" / "step_6"), load_weights(straight / "ckpt" / "step_6")) < 1e-6


def test_dynamic_sampling_draws_rounds_until_groups_differ_and_resumes_exactly(toy, tmp_path):
    """--dynamic-sampling on the toy task (a random policy: most groups of 8 score alike): a step draws rounds of 8
    prompts until 8 groups' rewards differ, within --max-sampling-rounds; it logs the prompts drawn and the rounds,
    trains on groups whose rewards differ (all of them unless the rounds ran out), logs every sample drawn, each on its
    own seed. Two steps, then --resume for a third: the prompts, seeds and weights of three straight steps."""
    flags = ("--dynamic-sampling", "--max-sampling-rounds", "3", "--save-every", "1", "--keep-checkpoints", "0")
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    _, m = run_script(toy.url, straight, "--train-steps", "3", *flags, *HOT, model=toy.model)
    rollouts = read_jsonl(straight / "gsm8k_train_rollouts.jsonl")
    for step, x in enumerate(m, start=1):
        rounds = int(x["sampling_rounds"])
        assert 1 <= rounds <= 3 and int(x["prompts_drawn"]) == 8 * rounds, x
        rows = [r for r in rollouts if r["step"] == step]
        assert len(rows) == 64 * rounds
        groups = [[r["reward"] for r in rows[k : k + 8]] for k in range(0, len(rows), 8)]
        differ = sum(len(set(g)) > 1 for g in groups)
        assert (differ >= 8) == (float(x["frac_reward_zero_std"]) == 0), (groups, x)  # the batch: 8 differing groups
        assert rounds == 3 or differ >= 8  # no fewer rounds than needed
        assert sum(len(set(g)) > 1 for g in groups[:-8]) < 8  # and none more: before the last, too few differed
    assert sum(int(x["sampling_rounds"]) for x in m) > 3  # the toy task needs more than one round a step
    seeds = [r["seed"] for r in rollouts]
    assert len(set(seeds)) == len(seeds)
    run_script(toy.url, stopped, "--train-steps", "2", *flags, *HOT, model=toy.model)
    out, _ = run_script(toy.url, stopped, "--train-steps", "3", "--resume", *flags, *HOT, model=toy.model)
    assert "resumed from ckpt/step_2 at step 2" in out
    samples = [
        [(r["step"], r["prompt"], r["seed"]) for r in read_jsonl(d / "gsm8k_train_rollouts.jsonl")]
        for d in (stopped, straight)
    ]
    assert samples[0] == samples[1]
    assert max_abs_diff(load_weights(stopped / "ckpt" / "step_3"), load_weights(straight / "ckpt" / "step_3")) < 1e-6


def test_a_completion_budget_the_server_cannot_hold_is_refused_at_start(toy, tmp_path):
    """--max-completion-tokens past the server's max_model_len (1024) after the longest prompt is refused at the
    start, with both numbers, before a step is taken (every other run here, at 16, goes on)."""
    cmd = script_cmd(toy.url, "--train-steps", "1", "--max-completion-tokens", "1020", model=toy.model)
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    said = "--max-completion-tokens 1020 after the longest prompt ("
    tail = "exceeds the server's max_model_len 1024: lower it, or start the server with a larger --max-model-len"
    assert r.returncode == 1 and said in r.stderr and tail in r.stderr, r.stderr[-3000:]
    assert "step 1:" not in r.stdout and not (tmp_path / "ckpt").exists()


def test_clip_frac_counts_the_last_pass(toy, tmp_path):
    """With --num-iterations 2, the second pass over the batch sees the ratios the first update moved: at a clip range
    of 1e-6 nearly every trained token falls outside it, and clip_frac says so. Pass 1's ratios are all exactly 1: a
    clip_frac read from it is 0 whatever the range (run A, one pass a step, logs 0)."""
    clip = ("--clip-eps-low", "1e-6", "--clip-eps-high", "1e-6")
    extra = ("--train-steps", "1", "--rollouts-per-update", "16", "--num-iterations", "2", *clip)
    _, m = run_script(toy.url, tmp_path, *extra, model=toy.model)
    assert float(m[0]["grad_norm"]) > 0, m  # some group had a gradient: the first update moved the weights
    assert float(m[0]["clip_frac"]) > 0.5, m


def synthetic_step(vocab_size: int, prompts: int, group: int) -> tuple[list, torch.Tensor]:
    """A step's samples without a server: random prompts of 3-8 tokens, completions of 2-12 (some cut by the length
    limit), logprobs near the model's, and rewards that vary in all groups but one (a zero-std group)."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for p in range(prompts):
        prompt = torch.randint(1, vocab_size, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        for j in range(group):
            n = int(torch.randint(2, 13, (1,), generator=g))
            completion = {
                "token_ids": torch.randint(1, vocab_size, (n,), generator=g).tolist(),
                "logprobs": (-torch.rand(n, generator=g) * 4).tolist(),
                "finish_reason": "length" if n == 12 else "stop",
                "versions": [0],
            }
            samples.append(G.Sample("What is 3 + 4?", "7", prompt, completion, 100 * p + j))
    rewards = torch.tensor([float((3 * i + i // group) % 4 == 0) for i in range(prompts * group)])  # [B]
    rewards[:group] = 0.0  # the first group: all wrong, no gradient
    return samples, rewards


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "gspo", "cispo"])
def test_micro_batches_add_up_to_the_step(tiny_model, loss_type):
    """update_policy over micro-batches of at most 48 tokens (activation checkpointing on) takes the step it takes over
    one micro-batch (off), for every loss type, over two passes of the batch (--num-iterations 2: the second pass's
    ratios are not 1, and its clip acts): the loss normalisation does not depend on the split. The same gradient norm
    (Adam's first step would hide a uniform scaling error), and the same weights after both updates."""
    import tyro
    from transformers import AutoModelForCausalLM

    samples, rewards = synthetic_step(vocab_size=384, prompts=4, group=4)
    assert len(G.pack_micro_batches([len(s.prompt_ids) + len(s.completion["token_ids"]) for s in samples], 48)) > 4
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    after = {}
    stats = {}
    for budget, checkpointing in ((48, True), (100000, False)):
        flags = ["--loss-type", loss_type, "--num-iterations", "2", "--micro-token-budget", str(budget)]
        flags += ["--group-size", "4", "--max-completion-tokens", "12"]
        args = tyro.cli(G.Args, args=flags)
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # linear in the gradient (Adam's first steps amplify
        # the float noise of near-zero gradients), and large enough that the second pass's ratios meet the clip
        advantages = G.group_advantages(rewards, args.group_size, args.scale_rewards)  # [B]
        batch = G.make_batch(samples, rewards, advantages, args)
        stats[budget], bad_pass = G.update_policy(
            model, None, optimizer, batch, samples, advantages, args, 0, None, False
        )
        assert bad_pass == 0
        after[budget] = dict(model.named_parameters())
    g_small = stats[48]["grad_norm"]
    g_big = stats[100000]["grad_norm"]
    assert g_big > 0 and abs(g_small - g_big) < 1e-4 * g_big, (g_small, g_big)
    assert stats[48]["clipped_tokens"] > 0  # the second pass met the clip
    before = dict(base.named_parameters())
    diff = max((after[48][k] - after[100000][k]).abs().max().item() for k in before)
    moved = max((after[48][k] - before[k]).abs().max().item() for k in before)
    assert diff < 1e-4 * moved, (diff, moved)


def test_bf16_autocast_on_cpu(tiny_model):
    """update_policy's `bf16` (main's choice beside a bf16 server, on a CPU too): the forward runs in bfloat16, so the
    step's logprobs and gradient move by bf16's rounding, a little and not 0, while the master weights, the gradient
    and the optimizer's state stay float32."""
    import tyro
    from transformers import AutoModelForCausalLM

    samples, rewards = synthetic_step(vocab_size=384, prompts=4, group=4)
    args = tyro.cli(G.Args, args=["--group-size", "4", "--max-completion-tokens", "12"])
    advantages = G.group_advantages(rewards, args.group_size, args.scale_rewards)  # [B]
    batch = G.make_batch(samples, rewards, advantages, args)
    stats = {}
    for bf16 in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        stats[bf16], bad_pass = G.update_policy(model, None, optimizer, batch, samples, advantages, args, 0, None, bf16)
        assert bad_pass == 0
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert {s["exp_avg"].dtype for s in optimizer.state.values()} == {torch.float32}
    for key in ("grad_norm", "mismatch_sum"):
        fp32, bf16 = stats[False][key], stats[True][key]
        assert 0 < abs(bf16 - fp32) < 0.05 * abs(fp32), (key, fp32, bf16)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "gspo", "cispo"])
def test_samples_without_a_gradient_are_not_fed_and_change_nothing(tiny_model, loss_type):
    """make_batch feeds only the samples that can change the gradient: a zero advantage (a group of equal rewards)
    with no KL term, or a completion masked by --mask-truncated-completions, adds 0 to every token's loss. Since the
    divisor is the whole step's (loss_divisor), the step that skips them is the step that feeds them: the same
    gradient norm and the same weights after two passes (SGD: the update is linear in the gradient). With --beta they
    are all fed (their KL term has a gradient)."""
    import tyro
    from transformers import AutoModelForCausalLM

    samples, rewards = synthetic_step(vocab_size=384, prompts=4, group=4)
    flags = ["--loss-type", loss_type, "--num-iterations", "2", "--group-size", "4", "--max-completion-tokens", "12"]
    args = tyro.cli(G.Args, args=[*flags, "--mask-truncated-completions"])
    advantages = G.group_advantages(rewards, args.group_size, args.scale_rewards)  # [B]
    batch = G.make_batch(samples, rewards, advantages, args)
    no_gradient = [i for i in range(len(samples)) if advantages[i] == 0 or batch.masked[i]]
    assert 4 <= len(no_gradient) < len(samples) and set(batch.fed).isdisjoint(no_gradient)  # the zero-std group, more
    with_beta = G.make_batch(samples, rewards, advantages, tyro.cli(G.Args, args=[*flags, "--beta", "0.1"]))
    assert with_beta.fed == list(range(len(samples)))
    after = {}
    stats = {}
    for name, fed in (("skipped", batch.fed), ("all fed", list(range(len(samples))))):
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).train()
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        stats[name], bad_pass = G.update_policy(
            model, None, optimizer, batch._replace(fed=fed), samples, advantages, args, 0, None, False
        )
        assert bad_pass == 0
        after[name] = dict(model.named_parameters())
    g_skip, g_all = stats["skipped"]["grad_norm"], stats["all fed"]["grad_norm"]
    assert g_all > 0 and abs(g_skip - g_all) < 1e-5 * g_all, (g_skip, g_all)
    before = dict(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).named_parameters())
    diff = max((after["skipped"][k] - after["all fed"][k]).abs().max().item() for k in before)
    moved = max((after["skipped"][k] - before[k]).abs().max().item() for k in before)
    assert diff < 1e-5 * moved, (diff, moved)


def test_a_step_that_feeds_nothing_is_the_step_that_feeds_zeros(tiny_model):
    """Two AdamW steps: one with a gradient, then one whose rewards are all equal (nothing to feed). Skipping every
    sample of the second gives the weights that feeding them all gives: a zero gradient, and Adam's momentum from the
    first step still moves the weights (a step skipped outright would not: the control)."""
    import tyro
    from transformers import AutoModelForCausalLM

    samples, rewards = synthetic_step(vocab_size=384, prompts=2, group=4)
    args = tyro.cli(G.Args, args=["--group-size", "4", "--max-completion-tokens", "12", "--learning-rate", "1e-3"])
    flat = torch.zeros_like(rewards)  # the second step: every group's rewards equal
    weights = {}
    for name in ("skipped", "all fed", "no step"):
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
        for step_rewards in (rewards, flat):
            advantages = G.group_advantages(step_rewards, args.group_size)
            batch = G.make_batch(samples, step_rewards, advantages, args)
            if step_rewards is flat:
                assert batch.fed == []
                if name == "no step":
                    break
                batch = batch if name == "skipped" else batch._replace(fed=list(range(len(samples))))
            G.update_policy(model, None, optimizer, batch, samples, advantages, args, 0, None, False)
        weights[name] = {k: v.detach().clone() for k, v in model.named_parameters()}
    diff = max((weights["skipped"][k] - weights["all fed"][k]).abs().max().item() for k in weights["all fed"])
    moved = max((weights["all fed"][k] - weights["no step"][k]).abs().max().item() for k in weights["all fed"])
    assert moved > 0 and diff <= 1e-6 * moved, (diff, moved)


def test_the_scripts_micro_batch_split_does_not_change_its_step(toy, tmp_path):
    """The script end to end, step 1 of dapo (the split weighted by tokens) with one big micro-batch and with tiny
    ones: the same gradient norm and the same update, on samples of the real server (the other loss types: in
    process, above). 128 samples: some are right, so the gradient is not zero. The big micro-batch runs without
    activation checkpointing: recomputing the layers in backward changes nothing either."""
    weights = {}
    logged = {}
    for budget, checkpointing in (("48", "--activation-checkpointing"), ("100000", "--no-activation-checkpointing")):
        workdir = tmp_path / budget
        _, m = run_script(
            toy.url,
            workdir,
            *("--train-steps", "1", "--save-every", "1", "--micro-token-budget", budget, checkpointing),
            *("--loss-type", "dapo", "--rollouts-per-update", "16"),
            model=toy.model,
        )
        weights[budget] = load_weights(workdir / "ckpt" / "step_1")
        logged[budget] = m[0]
    # the gradient's size (Adam's first step would hide a uniform scaling error) ...
    g_small = float(logged["48"]["grad_norm"])
    g_big = float(logged["100000"]["grad_norm"])
    assert g_big > 0 and abs(g_small - g_big) < 1e-4 * g_big, (g_small, g_big)
    # ... and its direction: the same update (Adam amplifies float noise of near-zero gradients a bit)
    base = load_weights(toy.model)
    diff = max_abs_diff(weights["48"], weights["100000"])
    moved = max_abs_diff(weights["48"], base)
    assert diff < 1e-2 * moved, (diff, moved)


def test_resume_a_state_saved_on_another_gpu(toy, tmp_path):
    """A trainer state saved on cuda:1 (another GPU layout) resumes on a machine without that GPU: the script loads
    every tensor to the CPU first (the optimizer then moves its state to the parameters' device)."""
    url, model = toy
    run_script(url, tmp_path, "--train-steps", "1", "--save-every", "1", model=model)
    path = tmp_path / "ckpt" / "step_1" / "trainer_state.pt"
    state = torch.load(path, weights_only=False)
    torch.serialization.register_package(-1, lambda storage: "cuda:1", lambda obj, location: None)
    try:  # while registered, every storage saved says it lives on cuda:1
        torch.save(state, path)
    finally:
        torch.serialization._package_registry[:] = [p for p in torch.serialization._package_registry if p[0] != -1]
    with pytest.raises(RuntimeError, match="CUDA"):  # the file really names a GPU: a plain load fails here
        torch.load(path, weights_only=False)
    out, m = run_script(url, tmp_path, "--train-steps", "2", "--resume", model=model)
    assert "resumed from ckpt/step_1 at step 1" in out and [x["version"] for x in m] == ["2"]


def test_a_tensor_parallel_server(tp2_server, toy_model, tmp_path):
    """Against a server with two workers (tensor parallel 2) the script sizes its group from /health: every push
    reaches both workers (--verify-sync checks the weights they compute with), and the logprobs still agree."""
    _, m = run_script(tp2_server, tmp_path, "--train-steps", "2", "--verify-sync", model=toy_model)
    assert [int(x["version"]) for x in m] == [1, 2]
    assert all(float(x["logprob_mismatch"]) < 1e-4 for x in m), m


def test_checkpoint_transport(toy, tmp_path):
    """The variant's --sync-transport checkpoint (grpo_gsm8k.py has the collective one alone): no collective group;
    after every step the weights are saved in the server's dtype under --sync-dir and loaded by the server
    (--verify-sync: its checksums equal the trainer's), the sampler then agrees with the trainer, and only the last
    file is left."""
    from safetensors.torch import load_file

    sync_dir = Path(CHECKPOINT_ROOTS[toy.url]) / f"sync_{tmp_path.name}"  # under the server's --checkpoint-root
    assert requests.post(toy.url + "/close_communicator", timeout=60).ok  # (an earlier test's group, if one is open)
    _, m = run_script(
        toy.url,
        tmp_path,
        "--train-steps",
        "2",
        "--save-every",
        "1",
        "--verify-sync",
        "--sync-transport",
        "checkpoint",
        "--sync-dir",
        str(sync_dir),
        *HOT,
        model=toy.model,
        script=VARIANT,
    )
    state = requests.get(toy.url + "/runtime_version", timeout=10).json()
    assert state["communicator"] is None and state["version"] == 2, state  # no group was joined
    assert server_matches(toy.url, tmp_path / "ckpt" / "step_2")
    assert [int(x["version"]) for x in m] == [1, 2], m
    assert all(float(x["logprob_mismatch"]) < 1e-5 for x in m), m  # step 2 sampled with step 1's loaded weights
    assert os.listdir(sync_dir) == ["weights_v2.safetensors"]
    saved = load_file(sync_dir / "weights_v2.safetensors")
    step_2 = load_weights(tmp_path / "ckpt" / "step_2")
    assert saved.keys() == step_2.keys() and max_abs_diff(saved, step_2) == 0


def test_start_server_makes_the_sync_dir_the_servers_checkpoint_root(monkeypatch, tmp_path, process_hooks):
    """The variant's --sync-transport checkpoint: --start-server gives the server --checkpoint-root = --sync-dir,
    absolute."""
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
    for transport in ("checkpoint", "collective"):
        args = tyro.cli(V.Args, args=["--start-server", "--sync-transport", transport, "--sync-dir", "s"])
        with pytest.raises(SystemExit, match="the server this run started, exited with status 1; its log: "):
            V.start_vllm_server(args, str(tmp_path / "server.log"))
    assert launched[0][-2:] == ["--checkpoint-root", str(tmp_path / "s")] and (tmp_path / "s").is_dir()
    assert "--checkpoint-root" not in launched[1]


def test_learning_on_toy_task(toy, tmp_path):
    """GRPO pushes the toy task's mean reward up within 20 steps (measured: ~0.03 -> 1.0) at seed 2 as at seed 1, the
    default, which the CPU demo trains (tests/test_demo_cpu.py): a seed whose samples reuse each other's random
    numbers could draw the same wrong completions step after step."""
    url, model = toy
    _, m = run_script(url, tmp_path, "--train-steps", "20", "--save-every", "100", "--seed", "2", model=model)
    rewards = [float(x["reward"]) for x in m]
    print("rewards", rewards)
    assert_learned(rewards)


def test_help_is_fast():
    r, heavy = help_imports(os.path.join(ROOT, SCRIPT), "--help")
    assert r.returncode == 0 and "--micro-token-budget" in r.stdout and not heavy, heavy
    assert "--sync-transport" not in r.stdout and "--lora-rank" not in r.stdout  # the collective transport alone
    r, heavy = help_imports(os.path.join(ROOT, VARIANT), "--help")
    assert r.returncode == 0 and "--micro-token-budget" in r.stdout and not heavy, heavy
    assert re.search(r"--sync-transport \{[a-z,]*shared", r.stdout) and "--vllm-sleep-level" in r.stdout


# ---------------------------------------------------------------------------------------------------
# the sampler's policy check (--max-logprob-mismatch): a server whose weights change behind the trainer's back
def changed_behind(toy, workdir, *extra, transport: str = "collective") -> tuple[int, str]:
    """A 3-step run (a checkpoint every step) during which another process loads other weights into the server
    (/load_checkpoint, labelled version 1, the trainer's own number) between the trainer's push of step 1 and its
    sampling of step 2 (conftest's run_changed_behind). The server first loads them as version 1000, so that version 1
    is the trainer's push. Returns the exit code and the output."""
    root = CHECKPOINT_ROOTS[toy.url]
    other = other_weights(toy.model, os.path.join(root, f"other_{os.path.basename(workdir)}.safetensors"))
    load_behind(toy.url, other, 1000)
    script = SCRIPT if transport == "collective" else VARIANT
    if transport == "shared":
        extra += ("--sync-transport", "shared")
    if transport == "checkpoint":  # its files inside the server's root
        extra += (
            "--sync-transport",
            "checkpoint",
            "--sync-dir",
            os.path.join(root, f"sync_{os.path.basename(workdir)}"),
        )
    fifo = os.path.join(workdir, "rollouts.jsonl")
    cmd = script_cmd(
        toy.url,
        "--train-steps",
        "3",
        "--save-every",
        "1",
        "--rollout-log",
        fifo,
        *extra,
        model=toy.model,
        script=script,
    )
    return run_changed_behind(
        cmd,
        workdir,
        fifo,
        pushed=lambda: server_version(toy.url) == 1,
        change=lambda: load_behind(toy.url, other, 1),
    )


@pytest.mark.parametrize("transport", ["collective", "shared", "checkpoint"])
def test_weights_changed_behind_the_trainer_stop_the_run(toy, tmp_path, transport):
    """Step 2 samples with weights another process loaded under the version the trainer pushed last: a fresh step
    whose logprobs stray from the trainer's. The run stops there, before step 2's update (no step-2 metrics, no step-2
    checkpoint), with an error naming the step, the version, the transport and the figure (far over fp32's default
    limit 1e-3); step 1, sound, logged a figure far below it."""
    code, out = changed_behind(toy, tmp_path, transport=transport)
    stop = stopped_by_the_check(out)
    print(stop)
    assert code != 0 and stop is not None, out[-3000:]
    assert stop[:3] == (2, 1, transport) and stop.limit == 1e-3 and stop.mismatch > 1e-2, stop
    m = metrics_of(out)
    assert [x["version"] for x in m] == ["1"] and float(m[0]["logprob_mismatch"]) < 1e-5, m
    assert os.listdir(tmp_path / "ckpt") == ["step_1"]


def test_max_logprob_mismatch_0_turns_the_check_off(toy, tmp_path):
    """The same change with --max-logprob-mismatch 0: the run goes on to its end, and step 2 logs the figure the check
    would have stopped it at (the control of the test above: the check, not something else, stopped those runs)."""
    code, out = changed_behind(toy, tmp_path, "--max-logprob-mismatch", "0")
    m = metrics_of(out)
    assert code == 0 and stopped_by_the_check(out) is None, out[-3000:]
    assert [x["version"] for x in m] == ["1", "2", "3"] and float(m[1]["logprob_mismatch"]) > 1e-2, m


def test_stale_steps_are_not_checked(toy, tmp_path):
    """--sync-every-steps 2: step 2 samples the version pushed before step 1, which the trainer no longer holds. Its
    figure measures step 1's update (lr 3e-2: far over the limit 1e-3), and the run goes on: a stale step by design
    is not checked. Step 1, fresh and sound, is."""
    extra = ("--train-steps", "2", "--sync-every-steps", "2", "--learning-rate", "3e-2", "--rollouts-per-update", "16")
    _, m = run_script(toy.url, tmp_path, *extra, model=toy.model)
    assert [x["version"] for x in m] == ["0", "1"], m
    assert float(m[0]["logprob_mismatch"]) < 1e-5 and float(m[1]["logprob_mismatch"]) > 1e-3, m
