"""The training diagnostics of the three trainers (entropy, truncation, zero-signal groups) and the two options that
act on them (--mask-truncated-completions, the samples not fed): each against an independent computation, then
grpo_gsm8k.py end to end against a real server."""

import math
import os

import pytest
import torch

from conftest import GRADE_WORKERS, PY, ROOT, import_script, metrics_of, read_jsonl, run_ok

SCRIPT = "grpo_gsm8k.py"  # the end-to-end test's script
grpo_gsm8k = import_script("grpo_gsm8k.py")
reinforce_math_fsdp2 = import_script("reinforce_math_fsdp2.py")
pipeline_learner = import_script("pipeline_learner.py")
TRAINERS = [grpo_gsm8k, reinforce_math_fsdp2, pipeline_learner]
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)


def batch(n_rows: int = 4, seed: int = 0):
    """Random prompts and completions of different lengths: token ids, prompt lengths."""
    g = torch.Generator().manual_seed(seed)
    seqs, n_prompt = [], []
    for r in range(n_rows):
        p, c = 3 + r, 5 + 2 * r
        seqs.append(torch.randint(3, 300, (p + c,), generator=g).tolist())
        n_prompt.append(p)
    return seqs, n_prompt


@pytest.mark.parametrize("module", TRAINERS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_equals_a_full_softmax_reference(module, model, temperature):
    """token_logprobs' entropy, computed inside the chunked lm_head pass, equals -sum p log p of a plain full forward
    at the same positions and temperature (fp32, 1e-5); its logprobs are unchanged."""
    seqs, n_prompt = batch()
    idx = list(range(len(seqs)))
    ids, attn, mask, at = module.micro_batch(seqs, n_prompt, idx, pad_id=0, device=CPU)
    with torch.no_grad():
        logprobs, entropy = module.token_logprobs(model, ids, attn, at, temperature, chunk=7)  # several blocks
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / temperature  # [b, L-1, V]
    log_p = torch.log_softmax(logits.reshape(-1, logits.shape[-1])[at], dim=-1)  # [N, V]
    want_entropy = -(log_p.exp() * log_p).sum(-1)
    want_logprobs = log_p.gather(1, ids[:, 1:].reshape(-1)[at][:, None])[:, 0]
    assert entropy.shape == logprobs.shape == (int(mask.sum()),)
    assert (entropy - want_entropy).abs().max() < 1e-5
    assert (logprobs - want_logprobs).abs().max() < 1e-5
    assert not entropy.requires_grad  # a diagnostic: no gradient flows through it


@pytest.mark.parametrize("module", TRAINERS, ids=lambda m: m.__name__)
def test_the_lm_head_runs_twice_per_block_with_a_gradient_and_the_entropy_once(module, model, monkeypatch):
    """The entropy costs no lm_head pass of its own: with a gradient, each block's lm_head runs in the forward pass and
    once more in checkpoint's recomputation in backward, and the entropy is computed once per block (not again in the
    recomputation); without a gradient, once each. The gradient equals a plain full log_softmax's."""
    seqs, n_prompt = batch()
    ids, attn, mask, at = module.micro_batch(seqs, n_prompt, list(range(len(seqs))), pad_id=0, device=CPU)
    blocks = math.ceil(int(mask.sum()) / 7)  # chunk=7 below
    calls = {"lm_head": 0, "entropy": 0}
    hook = model.lm_head.register_forward_hook(lambda *_: calls.update(lm_head=calls["lm_head"] + 1))
    entropy_rows = module.entropy_rows

    def counted(*a, **k):
        calls["entropy"] += 1
        return entropy_rows(*a, **k)

    monkeypatch.setattr(module, "entropy_rows", counted)
    try:
        model.zero_grad(set_to_none=True)
        flat, _ = module.token_logprobs(model, ids, attn, at, 0.7, chunk=7)
        assert calls == {"lm_head": blocks, "entropy": blocks}
        flat.sum().backward()
        assert calls == {"lm_head": 2 * blocks, "entropy": blocks}
        with torch.no_grad():
            module.token_logprobs(model, ids, attn, at, 0.7, chunk=7)
        assert calls == {"lm_head": 3 * blocks, "entropy": 2 * blocks}
    finally:
        hook.remove()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / 0.7  # [b, L-1, V]
    log_p = torch.log_softmax(logits.reshape(-1, logits.shape[-1])[at], dim=-1)  # [N, V]
    log_p.gather(1, ids[:, 1:].reshape(-1)[at][:, None]).sum().backward()
    assert max((got[n] - p.grad).abs().max().item() for n, p in model.named_parameters()) < 1e-5
    model.zero_grad(set_to_none=True)


def loss_of(module, model, seqs, n_prompt, rows, advantages, masked, loss_type="grpo"):
    """The loss of `rows` as the trainer computes it for one micro-batch, the masked rows' tokens left out of it."""
    ids, attn, mask, at = module.micro_batch(seqs, n_prompt, rows, pad_id=0, device=CPU)
    flat, _ = module.token_logprobs(model, ids, attn, at)
    logprobs = module.as_rows(flat, mask)  # [b, T]
    train_mask = mask * torch.tensor([not masked[i] for i in rows])[:, None]
    adv = advantages[rows]
    if module is reinforce_math_fsdp2:
        return module.reinforce_loss(logprobs, adv, train_mask)
    if module is pipeline_learner:
        return module.policy_loss(logprobs, logprobs.detach(), adv, train_mask, "ppo")
    return module.policy_loss(
        logprobs, logprobs.detach(), adv, train_mask, loss_type=loss_type, max_completion_length=16
    )


def assert_close(got, want):  # fp32, rows padded to other lengths: agreement to 1e-5 of the largest component
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), ((got - want).abs().max(), want.abs().max())


def gradient(model, loss) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


CASES = [(grpo_gsm8k, "grpo"), (grpo_gsm8k, "dapo"), (grpo_gsm8k, "dr_grpo"), (reinforce_math_fsdp2, None)]
CASES += [(pipeline_learner, None)]


def token_mean(module, loss_type) -> bool:  # aggregations over all tokens of the batch (the others: over sequences)
    return loss_type == "dapo" or module is reinforce_math_fsdp2


@pytest.mark.parametrize("module,loss_type", CASES, ids=lambda x: getattr(x, "__name__", str(x)))
def test_a_masked_truncated_completion_has_no_gradient(module, loss_type, model):
    """--mask-truncated-completions: a truncated completion's tokens are left out of the loss. Its gradient
    contribution is zero: the batch's gradient equals the gradient without that sample, up to the normaliser the
    sample still counts in (aggregations over sequences: B; over tokens: nothing, its tokens are not counted)."""
    seqs, n_prompt = batch()
    advantages = torch.tensor([0.7, -1.3, 0.4, 0.2])
    with_it = gradient(model, loss_of(module, model, seqs, n_prompt, [0, 1, 2], advantages, [0, 1, 0, 0], loss_type))
    without = gradient(model, loss_of(module, model, seqs, n_prompt, [0, 2], advantages, [0, 0, 0, 0], loss_type))
    scale = 1.0 if token_mean(module, loss_type) else 3 / 2  # sequences: a mean over 3 rows against one over 2
    assert_close(with_it * scale, without)
    unmasked = gradient(model, loss_of(module, model, seqs, n_prompt, [0, 1, 2], advantages, [0, 0, 0, 0], loss_type))
    assert (unmasked * scale - without).abs().max() > 1e-2 * without.abs().max()  # it did contribute before


def step_divisor(module, loss_type, seqs, n_prompt) -> float:
    """The whole step's divisor, as each trainer counts it once per step: every row, fed or not."""
    n_comp = [len(s) - p for s, p in zip(seqs, n_prompt, strict=True)]
    if module is reinforce_math_fsdp2:
        return float(sum(n_comp))  # the step's tokens (one process: world_size 1)
    if module is pipeline_learner:
        return float(len(seqs))  # the step's records
    return module.loss_divisor(loss_type, len(seqs), sum(n_comp), 16)


@pytest.mark.parametrize("module,loss_type", CASES, ids=lambda x: getattr(x, "__name__", str(x)))
def test_samples_with_a_zero_advantage_change_nothing_under_the_steps_divisor(module, loss_type, model):
    """A group whose rewards are all equal has zero advantages: its rows add 0 to every token's loss. With the
    divisor counted once for the whole step, the gradient of the rows fed without them equals the gradient of all
    rows, so the trainers do not feed them. (With a micro-batch's own divisor it would not: the control.)"""
    seqs, n_prompt = batch()
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0])  # groups of 2: the first is all 1
    assert grpo_gsm8k.zero_std_groups(rewards, 2).tolist() == [True, False]
    advantages = grpo_gsm8k.group_advantages(rewards, 2)
    assert advantages[:2].tolist() == [0.0, 0.0]
    divisor = step_divisor(module, loss_type, seqs, n_prompt)
    nothing_masked = [0, 0, 0, 0]

    def loss(rows, divisor):
        ids, attn, mask, at = module.micro_batch(seqs, n_prompt, rows, pad_id=0, device=CPU)
        flat, _ = module.token_logprobs(model, ids, attn, at)
        logprobs = module.as_rows(flat, mask)
        if module is reinforce_math_fsdp2:
            return module.reinforce_loss(logprobs, advantages[rows], mask, divisor)
        if module is pipeline_learner:
            return module.policy_loss(logprobs, logprobs.detach(), advantages[rows], mask, "ppo", divisor=divisor)
        kwargs = {"loss_type": loss_type, "max_completion_length": 16, "divisor": divisor}
        return module.policy_loss(logprobs, logprobs.detach(), advantages[rows], mask, **kwargs)

    full = gradient(model, loss([0, 1, 2, 3], divisor))
    assert_close(gradient(model, loss([2, 3], divisor)), full)
    assert_close(
        full,
        gradient(model, loss_of(module, model, seqs, n_prompt, [0, 1, 2, 3], advantages, nothing_masked, loss_type)),
    )
    own = gradient(model, loss([2, 3], None))  # the control: the fed rows' own divisor scales the gradient
    assert (own - full).abs().max() > 1e-2 * full.abs().max()


def test_with_beta_a_zero_advantage_still_has_a_kl_gradient(model):
    """Why make_batch feeds every sample when --beta is set: the k3 KL penalty of a zero-advantage row has a
    gradient, so leaving those rows out changes the step even with the step's divisor."""
    seqs, n_prompt = batch()
    advantages = grpo_gsm8k.group_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0]), 2)  # the first group: zeros

    def grpo_loss_with_kl(rows):
        ids, attn, mask, at = grpo_gsm8k.micro_batch(seqs, n_prompt, rows, pad_id=0, device=CPU)
        flat, _ = grpo_gsm8k.token_logprobs(model, ids, attn, at)
        logprobs = grpo_gsm8k.as_rows(flat, mask)
        ref = logprobs.detach() + 0.1 * torch.ones_like(logprobs)  # a reference the policy has moved away from
        return grpo_gsm8k.policy_loss(
            logprobs, logprobs.detach(), advantages[rows], mask, ref_logprobs=ref, beta=0.5, divisor=4.0
        )

    full = gradient(model, grpo_loss_with_kl([0, 1, 2, 3]))
    fed = gradient(model, grpo_loss_with_kl([2, 3]))
    assert (full - fed).abs().max() > 1e-3 * fed.abs().max()  # the skipped rows' KL gradient would be missing


def test_end_to_end_truncation_and_zero_std_groups_are_counted(tp2_server, toy_model, tmp_path):
    """The real script, two steps with both options on and a 3-token limit: most completions stop at the limit.
    Every step's completion_truncated_rate and frac_reward_zero_std equal what its rollout log shows, the entropy is
    that of a distribution over the 128-token vocabulary and the mismatch that of fp32 numerics (a step that feeds no
    sample measures them too), frac_samples_skipped is the share of samples with a zero advantage or masked, and no
    sample was cut by --max-seq-len."""
    port = tp2_server.rsplit(":", 1)[1]
    cmd = [PY, os.path.join(ROOT, SCRIPT), "--model", toy_model, "--dataset", os.path.join(FIXTURES, "gsm8k_toy")]
    cmd += ["--vllm-port", port, "--max-completion-tokens", "3", "--rollouts-per-update", "4", "--group-size", "4"]
    cmd += ["--train-steps", "2", "--system-prompt", "", "--eval-every", "0", "--checkpoint-dir", "ckpt"]
    cmd += ["--learning-rate", "3e-3", "--mask-truncated-completions", *GRADE_WORKERS]
    metrics = metrics_of(run_ok(cmd, cwd=tmp_path, timeout=600).stdout)
    rollouts = read_jsonl(tmp_path / "gsm8k_train_rollouts.jsonl")
    assert len(metrics) == 2 and len(rollouts) == 2 * 16
    for step, m in enumerate(metrics, start=1):
        mine = [x for x in rollouts if x["step"] == step]
        truncated = sum(x["finish_reason"] == "length" for x in mine) / len(mine)
        groups = [[x["reward"] for x in mine[k : k + 4]] for k in range(0, 16, 4)]
        zero_std = sum(len(set(g)) == 1 for g in groups) / len(groups)
        assert float(m["completion_truncated_rate"]) == pytest.approx(truncated)
        assert float(m["frac_reward_zero_std"]) == pytest.approx(zero_std)
        assert float(m["seq_len_truncated_rate"]) == 0.0  # 3 tokens fit the default --max-seq-len
        not_fed = sum(x["advantage"] == 0 or x["finish_reason"] == "length" for x in mine) / len(mine)
        assert float(m["frac_samples_skipped"]) == pytest.approx(not_fed)  # no gradient to give: zero or masked
        # every step measures the policy: a step that feeds no sample runs one micro-batch anyway (loss times 0)
        assert 0.0 < float(m["entropy"]) <= math.log(128) + 1e-6 and float(m["logprob_mismatch"]) < 1e-4, m
    assert any(float(m["completion_truncated_rate"]) > 0.5 for m in metrics)  # the limit did bite
