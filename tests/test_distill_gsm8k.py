"""distill_gsm8k.py (on-policy distillation): its token advantages and loss against naive references, the teacher's
scores against a Hugging Face forward of the teacher, and the real script end to end on CPU: the toy model as the
student on its real vllm_sync_server, a toy model of other, sharper weights as the teacher on a second one."""

import os
import subprocess

import pytest
import requests
import torch

from conftest import (
    FIXTURES,
    GRADE_WORKERS,
    PY,
    ROOT,
    SERVER_LOGS,
    ToyServer,
    import_script,
    metrics_of,
    read_jsonl,
    run_ok,
    server_matches,
    start_server,
    stop_server,
)
from tiny_model import build_tiny_model

SCRIPT = "distill_gsm8k.py"
D = import_script(SCRIPT)


# ---------------------------------------------------------------------------------------------------
# the advantage and the loss against naive per-element references
def naive_distill_loss(lp, old, teacher, seq_adv, mask, lo, hi, loss_type):
    """GRPO's clipped loss with token t's advantage teacher[b][t] - old[b][t] + seq_adv[b], one element at a time (lp:
    a tensor whose elements carry the gradient; the rest plain numbers)."""
    B, T = len(mask), len(mask[0])
    tok = [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            adv = teacher[b][t] - old[b][t] + seq_adv[b]
            r = torch.exp(lp[b, t] - old[b][t])
            tok[b][t] = -torch.min(r * adv, torch.clamp(r, 1 - lo, 1 + hi) * adv) * mask[b][t]
    if loss_type == "grpo":
        return sum(sum(tok[b]) / max(1, sum(mask[b])) for b in range(B)) / B
    return sum(sum(row) for row in tok) / sum(map(sum, mask))  # dapo


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@pytest.mark.parametrize("on_policy", [True, False])
def test_distillation_loss_and_gradient_against_naive(loss_type, on_policy):
    """distill_advantages then grpo's policy_loss: the value and the gradient of the naive per-token loss, on-policy
    (the first pass: every ratio 1) and off it (a later pass: ratios past both clip edges)."""
    g = torch.Generator().manual_seed(0)
    B, T = 4, 6
    lp = (-torch.rand(B, T, generator=g) * 3).requires_grad_()
    old = lp.detach() if on_policy else lp.detach() + torch.randn(B, T, generator=g) * 0.4
    teacher = -torch.rand(B, T, generator=g) * 3
    seq_adv = torch.tensor([0.5, -0.5, 0.0, 0.25])
    mask = torch.ones(B, T)
    mask[1, 4:] = 0
    mask[3, 1:] = 0
    adv = D.distill_advantages(teacher, old, mask, seq_adv)
    for b in range(B):
        for t in range(T):
            want = (teacher[b, t] - old[b, t] + seq_adv[b]).item() * mask[b, t].item()
            assert abs(adv[b, t].item() - want) < 1e-6
    assert not adv.requires_grad  # a constant of the loss
    got = D.policy_loss(lp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.28, loss_type=loss_type)
    (got_grad,) = torch.autograd.grad(got, lp)
    naive = naive_distill_loss(
        lp, old.tolist(), teacher.tolist(), seq_adv.tolist(), mask.tolist(), 0.2, 0.28, loss_type
    )
    (naive_grad,) = torch.autograd.grad(naive, lp)
    assert abs(got.item() - naive.item()) < 1e-5
    assert torch.allclose(got_grad, naive_grad, atol=1e-6)
    assert got_grad[mask == 0].abs().max() == 0  # padding has no gradient


def test_teacher_server_args_take_their_value_after_a_space(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    line = ["--teacher-server-args", "--dtype float32", "--server-args", "--enforce-eager", "--seed", "3"]
    monkeypatch.setattr("sys.argv", [SCRIPT, *line])
    args = D.parse_args()
    assert (args.teacher_server_args, args.server_args, args.seed) == ("--dtype float32", "--enforce-eager", 3)


# ---------------------------------------------------------------------------------------------------
# the teacher: a toy model of other weights (another seed), sharper (its final norm x 5: its logits too), with the
# toy model's tokenizer
def sharp_toy_teacher(path: str) -> str:
    from safetensors.torch import load_file, save_file

    build_tiny_model(path, vocab_size=128, byte_alphabet=False, seed=1)
    weights = load_file(os.path.join(path, "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * 5
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> ToyServer:
    path = sharp_toy_teacher(str(tmp_path_factory.mktemp("teacher") / "teacher"))
    log = str(tmp_path_factory.mktemp("teacher_server") / "server.log")
    proc, url = start_server(path, log)
    SERVER_LOGS[url] = log
    yield ToyServer(url=url, model=path)
    stop_server(proc)


def test_the_teachers_scores_are_a_hugging_face_forward_of_the_teacher(teacher):
    """teacher_scores: each completion token's logprob under the teacher given the prompt and the tokens before it,
    from the teacher's server, equal to a Hugging Face forward of its weights in float32 (log_softmax, temperature 1),
    in one request or in several (max_seqs below the step's samples)."""
    from transformers import AutoModelForCausalLM

    seqs = [([5, 17, 33, 2, 91], [44, 8, 120, 7]), ([3], [9, 9, 60, 61, 62, 1]), ([70, 71], [72])]
    samples = [D.Sample("q", "1", prompt, {"token_ids": completion}, 0) for prompt, completion in seqs]
    model = AutoModelForCausalLM.from_pretrained(teacher.model, dtype=torch.float32).eval()
    for max_seqs in (64, 2):
        scored = D.teacher_scores(teacher.url, samples, max_seqs)
        for sample, (prompt, completion) in zip(scored, seqs, strict=True):
            ids = torch.tensor([prompt + completion])
            with torch.no_grad():
                logprobs = model(ids).logits[0, :-1].log_softmax(-1)  # [L - 1, V]: position t predicts token t + 1
            want = [logprobs[len(prompt) - 1 + j, token].item() for j, token in enumerate(completion)]
            assert len(sample.teacher_logprobs) == len(completion)
            assert max(abs(a - b) for a, b in zip(sample.teacher_logprobs, want, strict=True)) < 1e-4


def script_cmd(student: ToyServer, teacher: ToyServer, *extra, teacher_model=None) -> list:
    return [
        PY,
        os.path.join(ROOT, SCRIPT),
        "--model",
        student.model,
        "--teacher-model",
        teacher_model or teacher.model,
        "--vllm-port",
        student.url.rsplit(":", 1)[1],
        "--teacher-url",
        teacher.url,
        "--dataset",
        os.path.join(FIXTURES, "gsm8k_toy"),
        "--keep-eval-overlap",  # the toy set's test problems are among its training problems
        "--max-completion-tokens",
        "16",
        "--system-prompt",
        "",
        "--eval-every",
        "0",
        "--checkpoint-dir",
        "ckpt",
        *GRADE_WORKERS,
        *extra,
    ]


def reverse_kl(student_path: str, teacher_path: str, prompts: list[list[int]]) -> float:
    """KL(student || teacher) of the next-token distributions, exactly (over the vocabulary), averaged over every
    position of `prompts`: an outside view of what the run's reverse_kl estimates from samples."""
    from transformers import AutoModelForCausalLM

    total, count = 0.0, 0
    student, teacher = (
        AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in (student_path, teacher_path)
    )
    with torch.no_grad():
        for ids in prompts:
            s = student(torch.tensor([ids])).logits[0].log_softmax(-1)  # [L, V]
            t = teacher(torch.tensor([ids])).logits[0].log_softmax(-1)
            total += (s.exp() * (s - t)).sum().item()
            count += len(ids)
    return total / count


def test_the_student_catches_up_with_its_teacher(toy, teacher, tmp_path):
    """Four steps of distillation, 8 x 8 samples at temperature 1, --reward-weight 0.5: the run's reverse KL falls, and
    so does the exact KL(student || teacher) over the toy set's prompts, from the base weights to the last checkpoint;
    every step logs the teacher's seconds and grpo's metrics, its trainer agrees with its sampler, every push is checked
    by checksum, the server ends with the last checkpoint's weights, and each sample's reward share is 0.5 x its
    reward less its group's mean."""
    from transformers import AutoTokenizer

    flags = ["--train-steps", "4", "--learning-rate", "3e-3", "--train-temperature", "1.0", "--verify-sync"]
    flags += ["--reward-weight", "0.5"]  # the toy task's rewards are rare: the teacher's scores lead
    r = run_ok(script_cmd(toy, teacher, *flags, "--eval-every", "4", "--eval-limit", "4"), cwd=tmp_path, timeout=600)
    m = metrics_of(r.stdout)
    assert len(m) == 4 and "eval/accuracy" in m[3]
    for key in ("reverse_kl", "teacher_s", "loss", "reward", "entropy", "logprob_mismatch", "generate_s", "update_s"):
        assert all(key in x for x in m), key
    assert all(float(x["logprob_mismatch"]) < 1e-5 for x in m), m
    assert all(float(x["frac_samples_skipped"]) == 0 for x in m)  # every token has a teacher's score: all fed
    kl = [float(x["reverse_kl"]) for x in m]
    assert kl[0] > 0.3 and (kl[2] + kl[3]) / 2 < 0.9 * kl[0], kl
    tok = AutoTokenizer.from_pretrained(toy.model)
    rows = read_jsonl(os.path.join(FIXTURES, "gsm8k_toy", "test.jsonl"))[:8]
    prompts = [D.prompt_ids(tok, "", row["question"]) for row in rows]  # as the run renders them
    before = reverse_kl(toy.model, teacher.model, prompts)
    after = reverse_kl(str(tmp_path / "ckpt" / "step_4"), teacher.model, prompts)
    assert after < 0.9 * before, (before, after)
    assert server_matches(toy.url, tmp_path / "ckpt" / "step_4")
    rollouts = read_jsonl(tmp_path / "gsm8k_distill_rollouts.jsonl")
    assert len(rollouts) == 4 * 64 and any(row["reward"] for row in rollouts)
    for start in range(0, len(rollouts), 8):  # each group of 8: the reward's share, 0.5 x (reward - the group's mean)
        group = rollouts[start : start + 8]
        mean = sum(row["reward"] for row in group) / 8
        assert all(abs(row["advantage"] - 0.5 * (row["reward"] - mean)) < 1e-6 for row in group), group


def test_a_teacher_with_another_tokenizer_is_refused_before_any_work(toy, teacher, tiny_model, tmp_path):
    """The tiny model (another vocabulary) as the toy model's teacher: one line naming both, exit 2, no traceback,
    before any work: nothing pushed to the student's server (its version unchanged), no rollout written."""
    version = requests.get(toy.url + "/runtime_version", timeout=30).json()["version"]
    r = subprocess.run(
        script_cmd(toy, teacher, "--train-steps", "1", teacher_model=tiny_model),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert (
        f"the teacher {tiny_model} (" in r.stderr and f"has another tokenizer than the student {toy.model}" in r.stderr
    )
    assert requests.get(toy.url + "/runtime_version", timeout=30).json()["version"] == version
    assert not (tmp_path / "gsm8k_distill_rollouts.jsonl").exists()
