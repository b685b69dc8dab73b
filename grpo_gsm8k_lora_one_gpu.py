# docs and experiment results: docs/grpo_gsm8k_lora_one_gpu.md
"""GRPO on GSM8K on one GPU, with LoRA: grpo_gsm8k.py and the machinery of a small card.

Based on grpo_gsm8k.py; what changes and why:
  - one GPU for vLLM and the trainer (`--start-server` with one GPU visible): vLLM takes
    `--vllm-gpu-memory-utilization` of it and sleeps while the trainer updates (vLLM's sleep mode; level 2 drops its
    weights, which the push rewrites, level 1 keeps them in CPU memory). The trainer makes its AdamW state before
    vLLM's first /sleep, and checks that the GPU has room before each /wake_up;
  - the shared transport (`--sync-transport shared`, forced on one GPU): NCCL joins no two ranks on one GPU, so the
    weights go through a staging buffer of this trainer's that the server maps (CUDA IPC; a /dev/shm file on CPU), a
    window reused in rounds with `--staging-mib`;
  - LoRA (`--lora-rank R`): adapters trained on a frozen base (peft), so the optimizer holds the adapters' state
    alone. The server gets the base with the adapters merged in (any transport), or the adapter alone
    (`--lora-sync adapter`, vLLM's own LoRA).
LoRA on one GPU is the usual way to fit a larger model on a small card, so the two live in one file; on two GPUs it
runs as grpo_gsm8k.py does, with LoRA if asked. The rest (the algorithm, grading, the loop, logging, checkpoints) is
grpo_gsm8k.py's: ALGO LOGIC and TASK word for word, the loop in main() with sleep mode's and LoRA's calls, and what
this file adds below # MACHINERY. tests/test_copies.py holds every function the two share identical, and lists those
that differ.

  # one GPU: vLLM beside the trainer (30% of the GPU, asleep while the trainer updates), weights through its memory
  python grpo_gsm8k_lora_one_gpu.py --model Qwen/Qwen2.5-0.5B-Instruct --start-server
  # the same with rank-16 adapters (LoRA wants a larger learning rate than full fine-tuning)
  python grpo_gsm8k_lora_one_gpu.py --model Qwen/Qwen2.5-1.5B-Instruct --start-server --lora-rank 16 \\
      --learning-rate 1e-5
"""

import contextlib
import datetime
import functools
import hashlib
import json
import multiprocessing as mp
import os
import re
import shlex
import shutil
import signal
import socket
import sys
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from typing import Literal, NamedTuple, Optional

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
    lora_rank: int = 0
    """rank of LoRA adapters trained on a frozen base (peft); 0: every weight trains"""
    lora_alpha: float = 16.0
    """LoRA's alpha: the adapters' update B A is scaled by alpha / rank"""
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """the linear layers that get adapters (the attention and MLP projections)"""

    # Generation
    train_temperature: float = 1.0
    """sampling temperature of the rollouts"""
    max_completion_tokens: int = 512
    """maximum new tokens per completion"""
    concurrency: int = 32
    """generation requests in flight"""

    # The server and the weight sync
    vllm_host: str = "127.0.0.1"
    """host of vllm_sync_server.py"""
    vllm_port: int = 8000
    """port of vllm_sync_server.py"""
    sync_host: Optional[str] = None
    """address the server's workers reach this trainer at, for the weight-sync group (default: this machine's end of
    its connection to the server)"""
    start_server: bool = False
    """launch vllm_sync_server.py (on GPU --vllm-gpu), wait for it, stop it at exit (SIGTERM, SIGINT too)"""
    vllm_gpu: int = 0
    """GPU of the server with --start-server, among the visible ones (CUDA_VISIBLE_DEVICES); training uses the next"""
    server_args: str = "--dtype bfloat16"
    """extra flags for the server started by --start-server (`--server-args "--dtype float32 ..."`)"""
    sync_every_steps: int = 1
    """push the weights to vLLM every this many steps"""
    sync_transport: Literal["collective", "shared", "checkpoint"] = "collective"
    """how the weights reach the server: `collective` broadcasts them over a group this trainer hosts (NCCL on GPU,
    gloo on CPU); `shared` writes them into a staging buffer of this trainer's that a server on this machine maps
    (CUDA IPC on one GPU, a /dev/shm file on CPU; one GPU with --start-server: `shared`); `checkpoint` saves them
    under --sync-dir and the server loads the file (no group: for a server that cannot reach this trainer's ports but
    shares its file system)"""
    staging_mib: int = 0
    """shared transport: the staging buffer's size in MiB, a window reused in rounds (0: the whole model at once)"""
    vllm_gpu_memory_utilization: float = 0.3
    """with --start-server on one GPU: the fraction of its memory vLLM may take (the trainer has the rest)"""
    vllm_sleep_level: Optional[Literal[0, 1, 2]] = None
    """vLLM sleeps while the trainer updates (1: its weights wait in CPU memory, 2: dropped, the push rewrites them;
    0: never); default: 2 when the server shares this trainer's GPU (1 with --lora-sync adapter), else 0"""
    sync_dir: str = "sync_checkpoints"
    """with --sync-transport checkpoint: where the weights are saved, a directory inside the server's
    --checkpoint-root, at the same path on both machines (--start-server makes it the server's root)"""
    verify_sync: bool = False
    """after each push, compare the server's weight checksums with the trainer's (--lora-sync adapter: sample a few
    tokens with the adapter just loaded and hold their logprobs to --max-logprob-mismatch)"""
    max_logprob_mismatch: Optional[float] = None
    """stop the run when the tokens of a step sampled by the weights this trainer pushed last and still holds differ
    from its own logprobs by more than this per token on average: the server does not compute with the weights pushed.
    Default: 1e-3 when the server and the trainer compute in float32, 0.1 when either computes in bfloat16 or float16;
    0: no check"""
    lora_sync: Literal["merged", "adapter"] = "merged"
    """with --lora-rank: push the base with the adapters merged in (any server), or only the adapter, which the server
    (started with --enable-lora --max-lora-rank R; --start-server passes them) loads from --lora-adapter-dir"""
    lora_adapter_dir: str = "lora_adapters"
    """where --lora-sync adapter writes each version's adapter: a directory the server can read"""

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


# ALGO LOGIC: advantages, the loss, the policy's logprobs, micro-batches
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
    hit_limit = [sample.completion["finish_reason"] == "length" for sample in samples]
    cut = [len(sample.prompt_ids) + len(sample.completion["token_ids"]) > args.max_seq_len for sample in samples]
    zero_std = zero_std_groups(rewards, G).tolist()
    masked = [args.mask_truncated_completions and (hit_limit[i] or cut[i]) for i in range(len(seqs))]
    trained = [0 if masked[i] else n_comp[i] for i in range(len(seqs))]
    fed = [i for i in range(len(seqs)) if trained[i] and (advantages[i] != 0 or args.beta)]
    return Batch(seqs, n_prompt, n_comp, hit_limit, cut, zero_std, masked, trained, fed)


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
    fed_tokens = sum(batch.n_comp[i] for mb in micro for i in mb)  # the tokens whose mismatch and entropy count
    stats = {"mismatch_sum": 0.0, "entropy_sum": 0.0, "loss": 0.0, "tokens_fed": fed_tokens}
    for it in range(args.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        pass_stats = stats if it == 0 else {"loss": 0.0}  # logged: pass 1's (pi_old); the clip: the last pass
        finite = True
        for m, idx in enumerate(micro):
            ids, attn, mask, at = micro_batch(batch.seqs, batch.n_prompt, idx, pad_id, device)
            train_mask = mask * torch.tensor([not batch.masked[i] for i in idx], device=device)[:, None]  # [b, T]
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
                stats["mismatch_sum"] += ((old_lp[m] - vllm_lp).abs() * mask).sum().item()
                stats["entropy_sum"] += entropy.sum().item()
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


# TASK: GSM8K. All that knows the task is here, and only that: its data set and prompt, how a data row becomes a
# problem, and how a completion is graded. To train on a task of your own, rewrite this section alone
# (docs/your_own_task.md swaps in Countdown). The grading pool's workers import this file: keep it cheap to import.
DATASET = "openai/gsm8k"  # --dataset's default: a Hugging Face dataset id, or a folder of train.jsonl and test.jsonl
DATASET_CONFIG = "main"  # the hub dataset's configuration (None: its only one)
SYSTEM_PROMPT = "First, think step by step. Then put your final answer inside \\boxed{...}."  # --system-prompt's


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


def main() -> None:
    args = parse_args()  # before the heavy imports: --help is instant
    run_args = asdict(args)  # as given (main adapts a few to the machine): saved with every checkpoint
    check_args(args)
    check_lora_args(args)
    check_run_files(args, args.rollout_log)
    ckpts = checkpoint_steps(args.checkpoint_dir, say=True) if args.resume else []
    if ckpts and ckpts[-1] >= args.train_steps:
        print(f"nothing to do: the newest checkpoint, step_{ckpts[-1]}, has --train-steps {args.train_steps}")
        raise SystemExit(0)
    train, test = load_problems(args)  # (prompt, gold) pairs, every row checked: a bad one stops the run here
    url = f"http://{args.vllm_host}:{args.vllm_port}"
    import random

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # TRY NOT TO MODIFY: seeding, devices, server, logging
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    n_gpu = torch.cuda.device_count()
    colocated = args.start_server and n_gpu == 1  # one GPU: the server beside this trainer, on the same GPU
    if colocated and args.sync_transport == "collective":  # NCCL refuses two ranks on one GPU ("Duplicate GPU")
        print(
            "one GPU: the weights travel through a staging buffer in its memory (--sync-transport shared)", flush=True
        )
        args.sync_transport = "shared"
    sleep_level = vllm_sleep_level(args, colocated)
    device = torch.device(f"cuda:{(args.vllm_gpu + 1) % n_gpu if args.start_server else 0}" if n_gpu else "cpu")
    if sleep_level and device.type != "cuda":
        raise SystemExit(f"--vllm-sleep-level {sleep_level}: vLLM's sleep mode needs a GPU (use 0 on CPU)")
    use_device(device)
    if args.start_server:
        start_vllm_server(args, "vllm_server.log", colocated=colocated, sleep_level=sleep_level)
    else:
        check_server(url)  # no server stops the run here, saying how to start one (after the settings' refusals)
    loggers = set(args.logger.split(","))

    # data (loaded above) as chat prompts (token ids)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    test_prompts = [prompt_ids(tokenizer, args.system_prompt, prompt) for prompt, _ in test]
    test_golds = [gold for _, gold in test]

    # model (fp32 master weights; bf16 autocast: see `bf16` below), optimizer, optional frozen reference, resume
    load_from = os.path.join(args.checkpoint_dir, f"step_{ckpts[-1]}") if ckpts else args.model
    model, lora = load_policy(args, url, device, load_from)  # LoRA: a frozen base and the adapter trained
    check_logits(model.config)  # token_logprobs's lm_head shortcut must compute the model's own logits
    disable_dropout(model)  # the policy's logprobs must be the sampler's: no random masks in training mode
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable()  # keep one decoder layer's activations at a time; recompute in backward
    ref_model = None
    if args.beta:
        ref_model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).eval()
    trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters alone
    optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, weight_decay=0.0)
    counters = {"step": 0, "version": 0, "skipped": 0, "data_pos": 0, "wandb_id": None}  # a new run's
    if load_from != args.model:
        counters = load_trainer_state(load_from, optimizer)  # the checkpoint's
    step = counters["step"]  # optimizer steps taken
    version = counters["version"]  # the policy version the server holds (one per push)
    skipped = counters["skipped"]  # steps skipped for a non-finite loss or gradient
    data_pos = counters["data_pos"]  # training prompts drawn so far (the data order and the sampling seeds follow it)
    wandb_id = start_wandb(args, counters["wandb_id"]) if "wandb" in loggers else None  # --resume: the same W&B run
    if sleep_level:  # vLLM's first /sleep measures what it frees against all of this trainer's memory
        init_adamw_state(optimizer)
    adapter = "policy" if lora is not None and args.lora_sync == "adapter" else None  # /generate samples with it
    sync, push = init_transport(args, url, device, model, adapter)
    if adapter is not None:  # the server runs the base it started with: only the adapter moves
        push_adapter(url, lora, version, args.lora_adapter_dir)
    else:
        with lora_merged(lora):  # LoRA: the base weights are the policy while they are pushed
            push(sync, model, version)  # the server may hold other weights (its start model, an earlier run)
    served = requests.get(url + "/runtime_version", timeout=30, headers=auth_headers()).json()
    longest = max(len(prompt_ids(tokenizer, args.system_prompt, prompt)) for prompt, _ in train + test)
    check_lengths(longest, args.max_completion_tokens, served["max_model_len"])
    # update_policy's bf16 autocast: on a GPU, and on a CPU beside a bf16 server; the mismatch limit: both ends' dtypes
    bf16 = device.type == "cuda" or served["dtype"] == "bfloat16"
    limit = logprob_mismatch_limit(args.max_logprob_mismatch, [served["dtype"], "bfloat16" if bf16 else "float32"])
    transport = "adapter" if adapter is not None else args.sync_transport
    current = True  # the trainer holds the weights of its last push (`version`): what the server samples next is fresh

    if args.eval_before_start and step == 0:
        log_metrics(evaluate(url, test_prompts, test_golds, args, adapter), step, loggers)
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
            results = generate(
                url, prompts, G, args.train_temperature, args.max_completion_tokens, args.concurrency, seeds, adapter
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

        # 5) loss and update: num_iterations optimizer steps, each over all micro-batches of the samples fed.
        # Sharing the GPU, vLLM sleeps meanwhile: level 2 drops its weights, only when this step pushes new ones
        pushes = (step + 1) % args.sync_every_steps == 0
        if sleep_level:
            asleep_bytes = sleep_vllm(url, device, sleep_level if pushes else 1)
        check = None  # a step sampled by the weights pushed last (and still held) must match their logprobs
        if fresh:
            check = functools.partial(
                check_logprob_mismatch, limit=limit, step=step + 1, version=version, transport=transport
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
        # 6) push weights to vLLM (asleep: its weights' memory comes back first, its KV cache after the push)
        sync_s = 0.0
        if sleep_level:  # vLLM maps its memory again: the gradients' and torch's cached blocks must be free first
            optimizer.zero_grad(set_to_none=True)
            asleep_bytes = wake_vllm(url, device, asleep_bytes, ["weights"])
        # the server holds the trainer's weights from here if this step pushes them: an updated step, or a skipped one
        # after vLLM dropped its weights (level 2), whose weights go again as a new version (they may differ from the
        # last push's: the updates since, with --sync-every-steps above 1)
        current = (updated or sleep_level == 2) and pushes
        if current:
            version += 1
            sync_s = push_policy(url, sync, push, model, lora, adapter, version, args)
        if sleep_level:  # (torch's cache emptied again: LoRA's merge and unmerge, the push, left blocks in it)
            wake_vllm(url, device, asleep_bytes)
        if args.verify_sync and adapter is not None and current:  # no checksums of an adapter: logprobs
            probe = verify_adapter(url, model, step_samples[0].prompt_ids, version, args, tokenizer.pad_token_id, bf16)
            check_logprob_mismatch(probe, limit, step, version, "adapter")
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
        write_rollouts(args.rollout_log, step, samples, grades, advantages.tolist())
        if args.eval_every and step % args.eval_every == 0:
            metrics.update(evaluate(url, test_prompts, test_golds, args, adapter))
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
            save_checkpoint(path, model, lora, tokenizer, optimizer, counters, run_args)
            prune_checkpoints(args.checkpoint_dir, args.keep_checkpoints)
    if progress is not None:
        progress.stop()
    print(f"done: {step} steps in {time.time() - start_time:.1f}s", flush=True)
    if STOP_REQUESTS and step < args.train_steps:  # (atexit stops a server this run started)
        print(f"stopped by {signal.Signals(STOP_REQUESTS[0]).name} after step {step}: --resume goes on from there")
        raise SystemExit(128 + STOP_REQUESTS[0])


# MACHINERY: what a learner can skip. The step's metrics; the check that the server samples this policy; the grading
# pool and the answer-reading helpers grade uses; the client side of vllm_sync_server.py and the weight sync; the
# server's start; preemption; logging, evaluation, checkpoints and resume; the arguments' and the data's refusals.
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
# weights than those pushed (a push or adapter load that did not take, the base model kept, weights another process
# loaded) shows as a gap between its logprobs and the trainer's on the tokens it sampled. A sound run's gap per token
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

    if sync.get("transport") == "shared":
        return push_shared(sync, model, version)
    dtype = getattr(torch, sync["dtype"])
    named = base_named(model.named_parameters())  # LoRA: the merged base weights, under their own names
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


def staging_layout(numels: list[int], window: Optional[int], align: int = 64) -> tuple[list[tuple[int, int]], int]:
    """Where each tensor (of `numels` elements, in push order) goes in the shared transport's staging buffer: its
    (round, element offset), each offset a multiple of `align` elements (whole cache lines for the copies). With a
    `window` (elements) a tensor that does not fit in what is left of the window starts the next round at 0;
    without, all go in round 0. Returns the places and the buffer's size in elements (a window grows to the largest
    tensor: a tensor is never split)."""
    cap = max(window, max(numels)) if window else None
    places = []
    round_ = 0
    offset = 0  # where the next tensor may start in the current round
    size = 0
    for n in numels:
        if cap is not None and offset > 0 and offset + n > cap:
            round_ += 1
            offset = 0
        places.append((round_, offset))
        size = max(size, offset + n)
        offset = -(-(offset + n) // align) * align  # rounded up
    return places, size


def init_shared_sync(url: str, device, model, staging_mib: int = 0) -> dict:
    """The shared transport: this trainer owns one flat staging buffer in the server's dtype, and the server's worker
    maps it once (the server runs on this machine: one GPU is enough, since no NCCL group joins two ranks on it). On
    CUDA the buffer is GPU memory shared by CUDA IPC (the fields of torch's reduce_tensor, as JSON, and the GPU's
    UUID); on CPU a file in /dev/shm. A second file there holds two control words (int64): tensors written (ours) and
    tensors copied (the server's), so that the copies on both sides overlap and a window can be reused in rounds.
    Both files are unlinked once mapped: a killed trainer leaves nothing behind in /dev/shm."""
    import torch

    info = requests.get(url + "/runtime_version", timeout=30, headers=auth_headers()).json()
    if info["device"] != device.type:  # CUDA IPC and /dev/shm each need both ends on one kind of device
        raise RuntimeError(f"the server at {url} runs on {info['device']} and this trainer on {device.type}")
    if device.type == "cuda":  # before anything is made
        alloc_conf = os.environ.get("PYTORCH_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
        if (problem := staging_alloc_problem(alloc_conf, torch.cuda.memory.get_allocator_backend())) is not None:
            raise RuntimeError(problem)
    dtype = getattr(torch, info["dtype"])
    itemsize = torch.empty((), dtype=dtype).element_size()
    numels = [p.numel() for _, p in base_named(model.named_parameters())]  # push_shared's tensors (LoRA: the base's)
    places, numel = staging_layout(numels, (staging_mib << 20) // itemsize if staging_mib else None)
    stem = f"/dev/shm/cleanrlvr-{os.getpid()}-{os.urandom(4).hex()}"
    control = torch.from_file(stem + ".control", shared=True, size=2, dtype=torch.int64)  # (creates the file)
    control.zero_()
    spec = {"device": device.type, "dtype": info["dtype"], "numel": numel, "control": stem + ".control"}
    files = [stem + ".control"]
    if device.type == "cuda":
        buffer = torch.empty(numel, dtype=dtype, device=device)  # [numel]
        spec |= cuda_ipc_fields(buffer)
    else:
        buffer = torch.from_file(stem + ".buffer", shared=True, size=numel, dtype=dtype)  # [numel]
        spec["path"] = stem + ".buffer"
        files.append(stem + ".buffer")
    wait_s = 2 * info["sync_timeout_s"] + 180  # the server's 2nd line: after one collective queued before ours
    try:
        answer = lines(
            post(url, "/init_communicator", {"transport": "shared", "shared": spec}, stream=True, timeout=wait_s)
        )
        next(answer)  # "mapping"
        done = next(answer)
    finally:
        for f in files:  # mapped (or refused): the mappings keep the memory, the names go
            os.unlink(f)
    if done["status"] != "ok":
        raise RuntimeError(f"{url}/init_communicator (shared transport) failed: {done}")
    return {
        "url": url,
        "transport": "shared",
        "buffer": buffer,
        "control": control,
        "places": places,
        "dtype": info["dtype"],
        "device": device,
        "timeout_s": wait_s,
        "round_timeout_s": info["sync_timeout_s"],
    }


def cuda_ipc_fields(buffer) -> dict:
    """The shared transport's CUDA fields for the staging buffer `buffer`: the arguments of torch's reduce_tensor
    (torch/multiprocessing/reductions.py) that rebuild_cuda_tensor takes, as plain JSON (bytes as base64), and the
    GPU's UUID. The tensor and storage classes, shape, stride and device index are the server's to fix."""
    import base64

    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    (_, _, _, tensor_offset, _, _, _, handle, size_bytes, offset_bytes, _, rc_handle, rc_offset, event, sync) = (
        reduce_tensor(buffer)[1]
    )
    return {
        "gpu_uuid": str(torch.cuda.get_device_properties(buffer.device).uuid),
        "handle": base64.b64encode(handle).decode(),
        "storage_size_bytes": size_bytes,
        "storage_offset_bytes": offset_bytes,
        "ref_counter_handle": base64.b64encode(rc_handle).decode(),
        "ref_counter_offset": rc_offset,
        "event_handle": base64.b64encode(event or b"").decode(),
        "event_sync_required": bool(sync),
        "tensor_offset": tensor_offset,
    }


def staging_alloc_problem(alloc_conf: str, backend: str) -> Optional[str]:
    """Why torch's CUDA allocator cannot give the shared transport its staging buffer, or None. `alloc_conf`: the value
    of PYTORCH_ALLOC_CONF (or PYTORCH_CUDA_ALLOC_CONF); `backend`: torch.cuda.memory.get_allocator_backend(). The
    buffer must be plain cudaMalloc memory, the kind reduce_tensor exports with cudaIpcGetMemHandle: expandable
    segments export through file descriptors or fabric handles instead, and the cudaMallocAsync backend refuses to
    export at all (its shareIpcHandle raises)."""
    settings = dict(item.split(":", 1) for item in alloc_conf.replace(" ", "").split(",") if ":" in item)
    if settings.get("expandable_segments", "").lower() == "true":
        why = "expandable_segments:True"
    elif backend == "cudaMallocAsync":
        why = "the cudaMallocAsync backend"
    else:
        return None
    return (
        f"the shared transport hands its staging buffer to the server through CUDA IPC, which torch's allocator with "
        f"{why} (PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF) does not give it: run this trainer without it, or use "
        "--sync-transport checkpoint"
    )


def push_shared(sync: dict, model, version: int) -> dict:
    """Post /update_param_batch with each parameter's slice of the staging buffer (offset, round), then write every
    parameter into its slice (cast to the server's dtype: the one copy on this side), counting each one written:
    the server copies each into the engine's tensor as soon as it is counted, while we write the next (the two copies
    overlap). The first tensor of round r waits until the server counted round r - 1 copied out of the window.
    Returns the server's report."""
    import torch

    named = base_named(model.named_parameters())  # LoRA: the merged base weights, under their own names
    buffer = sync["buffer"]  # [numel], the server's dtype
    control = sync["control"]  # [2] int64: tensors written (ours), tensors copied (the server's)
    places = sync["places"]
    params = [
        {"name": n, "dtype": sync["dtype"], "shape": list(p.shape), "offset": offset, "round": round_}
        for (n, p), (round_, offset) in zip(named, places, strict=True)
    ]
    control.zero_()  # (the last push's server copied every tensor: the counts start again)
    body = {"params": params, "version": version}
    answer = lines(post(sync["url"], "/update_param_batch", body, stream=True, timeout=sync["timeout_s"]))
    next(answer)  # "receiving": the server checked the metadata and copies each tensor once counted
    for i, ((_, p), (round_, offset)) in enumerate(zip(named, places, strict=True)):
        if i > 0 and round_ != places[i - 1][0]:  # a new round over the window: the last one must be copied out
            deadline = time.monotonic() + sync["round_timeout_s"]
            while control[1].item() < i:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{sync['url']} did not copy round {round_ - 1} in time: {next(answer, {})}")
                time.sleep(0.0002)
        buffer[offset : offset + p.numel()].view_as(p).copy_(p)
        if buffer.is_cuda:
            torch.cuda.current_stream().synchronize()  # in GPU memory before the server's copy reads it
        control[0] = i + 1
    done = next(answer)
    if done["status"] != "ok":
        raise RuntimeError(f"weight push to {sync['url']} failed: {done}")
    return done


def init_checkpoint_sync(url: str, sync_dir: str) -> dict:
    """The checkpoint transport's end: no group, only the directory the server loads from and the dtype it computes
    in. The path posted is absolute: the server resolves it, not relative to this process's directory."""
    info = requests.get(url + "/runtime_version", timeout=30, headers=auth_headers()).json()
    os.makedirs(sync_dir, exist_ok=True)
    return {"url": url, "dir": os.path.abspath(sync_dir), "dtype": info["dtype"], "previous": None}


def save_and_load_weights(sync: dict, model, version: int) -> dict:
    """Save every parameter, cast to the server's dtype, under the names push_weights sends, as one safetensors file;
    POST /load_checkpoint with its path; delete the previous file. The file is written under a temporary name and
    renamed (atomic on one file system): the server never reads half a file. Returns the server's report, `seconds`
    counting the save too."""
    import torch
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    dtype = getattr(torch, sync["dtype"])
    tensors = {n: p.to("cpu", dtype).contiguous() for n, p in base_named(model.named_parameters())}  # LoRA: merged
    path = os.path.join(sync["dir"], f"weights_v{version}.safetensors")
    save_file(tensors, path + ".tmp")
    os.replace(path + ".tmp", path)
    done = post(sync["url"], "/load_checkpoint", {"path": path, "version": version}).json()
    if sync["previous"] not in (None, path):  # the server holds the new weights: the old file is of no more use
        os.remove(sync["previous"])
    sync["previous"] = path
    return {**done, "seconds": time.perf_counter() - t0}


def verify_weights(sync: dict, model) -> int:
    """Compare the server's per-parameter sha256 (of the weights it computes with) with ours."""
    import torch

    dtype = getattr(torch, sync["dtype"])
    ours = {
        n: hashlib.sha256(p.detach().to(dtype).cpu().contiguous().view(torch.uint8).numpy()).hexdigest()
        for n, p in base_named(model.state_dict().items())
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


# LoRA (--lora-rank): low-rank adapters (peft) on a frozen base, and the two ways the server gets the policy they make
def add_lora(model, args: Args, saved: Optional[str] = None):
    """Adapters on --lora-target-modules of `model` (a Hugging Face model, changed in place: its layers now hold the
    adapters and it computes the policy): fresh ones (B = 0, so the policy starts as the base) or those saved in the
    checkpoint `saved`. Only the adapters require a gradient. Returns the peft model, which saves and merges them. No
    dropout: the trainer's logprobs must be those of the policy vLLM samples from."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if saved is not None:
        return PeftModel.from_pretrained(model, saved, is_trainable=True)
    config = LoraConfig(
        r=args.lora_rank,
        lora_alpha=args.lora_alpha,
        target_modules=list(args.lora_target_modules),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def base_named(items) -> list:
    """(name, tensor) pairs under the base model's Hugging Face names, as the server knows them: the base weight of a
    layer with an adapter (`q_proj.base_layer.weight`) is `q_proj.weight`, and the adapters' own matrices stay here.
    Without adapters every pair passes unchanged."""
    return [(name.replace(".base_layer.", "."), t.detach()) for name, t in items if ".lora_" not in name]


@contextlib.contextmanager
def lora_merged(peft_model):
    """Within: every adapter merged into its base weight in place (peft's merge_adapter), so the base weights are the
    policy, W + (alpha / r) B A rounded once to W's dtype. After: the base exactly as it was. peft's unmerge subtracts
    the update rounded to W's dtype and rounds again, which in bf16 does not give W back: each push and save would walk
    the frozen base a step wherever the update is half a step or more, both ends alike (--verify-sync cannot see it).
    So the adapted layers' base tensors are copied first, to pinned CPU memory torch keeps cached for the next push (7B
    in bf16: 12.2 GiB, 1.5B: 2.4 GiB; on the GPU a 7B trainer on a 24 GB card has no room), and copied back after the
    unmerge, in stream order (0.5B on an H200: 14-18 ms a push over peft's own 25-55 ms). Nothing without adapters."""
    import torch
    from peft.tuners.tuners_utils import BaseTunerLayer

    if peft_model is None:
        yield
        return
    layers = [m.get_base_layer() for m in peft_model.modules() if isinstance(m, BaseTunerLayer)]
    base = [p for layer in layers for p in layer.parameters(recurse=False)]  # what merging writes to
    with torch.no_grad():
        saved = [p.to("cpu", copy=True, non_blocking=True) for p in base]
        peft_model.merge_adapter()
    try:
        yield
    finally:
        with torch.no_grad():
            peft_model.unmerge_adapter()  # (peft's record of what is merged)
            for p, copy in zip(base, saved, strict=True):
                p.copy_(copy, non_blocking=True)


def push_adapter(url: str, peft_model, version: int, adapter_dir: str) -> float:
    """--lora-sync adapter: write the adapter (peft's safetensors) to `adapter_dir`/v`version` and have the server
    load it in place of the previous one under the name `policy` (POST /update_adapter). A new directory per version:
    vLLM's prefix cache keys a LoRA request's blocks by its name and path, so blocks computed with an older adapter
    are never reused. The previous version's files go once the server holds the new one. Returns the seconds taken."""
    import shutil

    t0 = time.time()
    path = os.path.abspath(os.path.join(adapter_dir, f"v{version}"))
    peft_model.save_pretrained(path)
    done = post(url, "/update_adapter", {"name": "policy", "path": path, "version": version}).json()
    if done["status"] != "ok":
        raise RuntimeError(f"{url} could not load the adapter {path}: {done}")
    for old in os.listdir(adapter_dir):
        if old != f"v{version}":
            shutil.rmtree(os.path.join(adapter_dir, old), ignore_errors=True)
    return time.time() - t0


def load_policy(args: Args, url: str, device, load_from: str):
    """The model trained, and its LoRA adapter (None without --lora-rank), on `device`. LoRA: a frozen base from
    --model in the dtype weights travel in (the server's: half of fp32's memory in bf16), and fp32 adapters, fresh or
    those of the checkpoint at `load_from`. Without: fp32 master weights from `load_from` (bf16 autocast on GPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    if not args.lora_rank:
        return AutoModelForCausalLM.from_pretrained(load_from, dtype=torch.float32).to(device).train(), None
    wire_dtype = requests.get(url + "/runtime_version", timeout=30, headers=auth_headers()).json()["dtype"]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, wire_dtype)).to(device).train()
    return model, add_lora(model, args, saved=None if load_from == args.model else load_from)


def init_transport(args: Args, url: str, device, model, adapter: Optional[str]):
    """The transport's end (`sync`) and its push function, by --sync-transport; (None, None) for an `adapter`: the
    server keeps the base it started with, and only the adapter's files move (push_adapter)."""
    if adapter is not None:
        return None, None
    if args.sync_transport == "checkpoint":
        return init_checkpoint_sync(url, args.sync_dir), save_and_load_weights
    if args.sync_transport == "shared":  # push_weights then writes into the staging buffer (push_shared)
        return init_shared_sync(url, device, model, args.staging_mib), push_weights
    return init_weight_sync(url, device, args.sync_host), push_weights


def push_policy(url: str, sync: Optional[dict], push, model, lora, adapter: Optional[str], version: int, args: Args):
    """Step 6 of the loop: the policy to the server at `url` as `version`; returns the seconds taken. --lora-sync
    adapter: the adapter's files (push_adapter), checked later by its logprobs (verify_adapter: vLLM's KV cache must be
    back). Else the weights, LoRA merged into the base while they travel, by `push` over `sync` (the transport's),
    compared with the server's checksums after with --verify-sync."""
    if adapter is not None:
        return push_adapter(url, lora, version, args.lora_adapter_dir)
    with lora_merged(lora):  # LoRA: the base weights are the policy while they are pushed
        seconds = push(sync, model, version)["seconds"]
        if args.verify_sync:
            verify_weights(sync, model)
    return seconds


def verify_adapter(url: str, model, prompt: list[int], version: int, args: Args, pad_id: int, bf16: bool) -> float:
    """--verify-sync with --lora-sync adapter. vLLM holds an adapter in its own layout (stacked, padded to its
    --max-lora-rank), so no checksum compares it with the trainer's; its logprobs do. Sample 4 short completions of
    `prompt` with the adapter just loaded and return the mean |trainer logprob - server logprob| per token, the figure
    --max-logprob-mismatch bounds. An answer sampled by another adapter version than `version` is an error."""
    import torch

    body = {
        "prompts": [prompt],
        "n": 4,
        "temperature": args.train_temperature,
        "max_tokens": min(16, args.max_completion_tokens),
        "lora": "policy",
    }
    completions = post(url, "/generate", body).json()["results"][0]["completions"]  # [4]
    if any(c["versions"] != [version] for c in completions):
        raise RuntimeError(
            f"--verify-sync: {url} sampled adapter versions {[c['versions'] for c in completions]}, "
            f"not the version {version} just pushed"
        )
    device = next(model.parameters()).device
    seqs = [prompt + c["token_ids"] for c in completions]
    ids, attn, mask, at = micro_batch(seqs, [len(prompt)] * len(seqs), list(range(len(seqs))), pad_id, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)  # as training
    with torch.no_grad(), autocast:
        ours, _ = token_logprobs(model, ids, attn, at, args.train_temperature)  # [N]
    theirs = torch.tensor([lp for c in completions for lp in c["logprobs"]], device=device)  # [N]
    return (ours.float() - theirs).abs().mean().item() if theirs.numel() else float("nan")


def save_merged(peft_model, model, path: str) -> None:
    """The policy as a plain Hugging Face model in `path` (base names, adapters merged in), for vLLM and
    transformers."""
    with lora_merged(peft_model):
        model.save_pretrained(path, state_dict=dict(base_named(model.state_dict().items())))


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
    lora: Optional[str] = None,
):
    """One request per prompt (prompt i seeded with seeds[i]), `concurrency` in flight; vLLM batches them. `lora`: the
    name of an adapter the server loaded (--lora-sync adapter), to sample with. Returns one result per prompt."""

    def one(i):
        body = {"prompts": [prompts[i]], "n": n, "temperature": temperature, "max_tokens": max_tokens, "seed": seeds[i]}
        if lora is not None:
            body["lora"] = lora
        return post(url, "/generate", body).json()["results"][0]

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(len(prompts))))


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


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vLLM takes (MaxLoRARanks)


def vllm_lora_rank(rank: int) -> int:
    """The smallest --max-lora-rank that vLLM accepts (vllm/config/lora.py: MaxLoRARanks) and that holds adapters of
    rank `rank`; an error past the largest."""
    if rank > VLLM_LORA_RANKS[-1]:
        raise SystemExit(f"--lora-rank {rank}: vLLM serves LoRA adapters up to rank {VLLM_LORA_RANKS[-1]}")
    return min(r for r in VLLM_LORA_RANKS if r >= rank)


def vllm_sleep_level(args: Args, colocated: bool) -> int:
    """--vllm-sleep-level, or its default: sharing the trainer's GPU (`colocated`) 2, which drops vLLM's weights while
    the trainer updates (the push rewrites them), or 1 with --lora-sync adapter, which keeps them in CPU memory (no
    push rewrites the base); else 0. Level 2 with --lora-sync adapter is refused: the base would never come back."""
    adapter_sync = args.lora_rank > 0 and args.lora_sync == "adapter"
    level = args.vllm_sleep_level
    if level is None:
        level = (1 if adapter_sync else 2) if colocated else 0
    if level == 2 and adapter_sync:
        raise SystemExit("--lora-sync adapter pushes no base weights: use --vllm-sleep-level 1 (or 0)")
    return level


def start_vllm_server(args: Args, log_path: str, colocated: bool = False, sleep_level: int = 0):
    """Launch vllm_sync_server.py next to this file, wait for /health, stop it when this process exits. Colocated
    (one GPU for both): vLLM takes --vllm-gpu-memory-utilization of it, and sleep mode lets it free its memory while
    this trainer updates."""
    import torch

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": physical_gpu(args.vllm_gpu)}
    # vLLM on CPU keeps a core for its scheduler; this trainer waits while it samples: give it every core
    if not torch.cuda.is_available() and "tensor-parallel" not in args.server_args:
        cores = sorted(os.sched_getaffinity(0))
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    colocation = ["--gpu-memory-utilization", str(args.vllm_gpu_memory_utilization)] if colocated else []
    if sleep_level:
        colocation.append("--enable-sleep-mode")
    server = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_sync_server.py")
    if not os.path.isfile(server):  # a copy of this script outside the repository: the server file stays behind
        refuse(f"--start-server needs vllm_sync_server.py beside this script: copy it to {server}")
    cmd = [sys.executable, server, "--model", args.model, "--host", args.vllm_host, "--port", str(args.vllm_port)]
    cmd += colocation  # before the user's flags: theirs win
    cmd += shlex.split(args.server_args)
    if args.sync_transport == "checkpoint":  # the server may load only what lies under its root
        os.makedirs(args.sync_dir, exist_ok=True)
        cmd += ["--checkpoint-root", os.path.abspath(args.sync_dir)]
    if args.lora_rank and args.lora_sync == "adapter":  # the server loads the adapter: vLLM's LoRA, on, for rank R
        given = shlex.split(args.server_args)
        if "--enable-lora" not in given:
            cmd.append("--enable-lora")
        if not any(flag.startswith("--max-lora-rank") for flag in given):
            cmd += ["--max-lora-rank", str(vllm_lora_rank(args.lora_rank))]
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


# One GPU for both: vLLM sleeps while this trainer updates, and must find its memory free when it wakes
WAKE_MARGIN = 256 << 20  # bytes kept free beyond what vLLM takes back (a margin, not a measured figure)


def wake_problem(free_bytes: int, asleep_bytes: int) -> Optional[str]:
    """Why vLLM must not be woken now, or None: it maps again the `asleep_bytes` it released at /sleep, and the GPU has
    `free_bytes` free (torch.cuda.mem_get_info, after torch's cache was emptied). A wake-up that runs out of memory
    fails inside vLLM's engine and leaves it dead; refused here, the run stops with the flags that make room."""
    if free_bytes >= asleep_bytes + WAKE_MARGIN:
        return None
    return (
        f"vLLM takes back {asleep_bytes / 2**30:.2f} GiB when it wakes up and the GPU has {free_bytes / 2**30:.2f} GiB "
        f"free (with {WAKE_MARGIN >> 20} MiB to spare): waking it would fail inside its engine. Lower this trainer's "
        "share (--micro-token-budget, --max-seq-len; --lora-rank for a smaller optimizer state; --staging-mib for the "
        "staging buffer) or vLLM's (--vllm-gpu-memory-utilization)"
    )


def sleep_vllm(url: str, device, level: int) -> int:
    """POST /sleep; returns the bytes it freed on this GPU (torch.cuda.mem_get_info before and after), which vLLM will
    take back at /wake_up. Only this trainer allocates meanwhile, and it waits for the answer."""
    import torch

    free = torch.cuda.mem_get_info(device)[0]
    post(url, "/sleep", {"level": level})
    return max(0, torch.cuda.mem_get_info(device)[0] - free)


def wake_vllm(url: str, device, asleep_bytes: int, tags: Optional[list[str]] = None) -> int:
    """POST /wake_up (`tags`: those only; None: all) once the GPU has room for the `asleep_bytes` vLLM has still to take
    back (all of them, even for a partial wake-up: better to stop before the first than between the two). torch's
    cache goes first: its blocks are free to torch alone. Returns the bytes still asleep after."""
    import torch

    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info(device)[0]
    if (problem := wake_problem(free, asleep_bytes)) is not None:
        raise SystemExit(problem)  # vLLM stays asleep, and is stopped at exit (start_vllm_server)
    post(url, "/wake_up", {"tags": tags} if tags else {})
    return max(0, asleep_bytes - (free - torch.cuda.mem_get_info(device)[0]))


def init_adamw_state(optimizer) -> None:
    """AdamW's moments, made now as its first step would make them (zeros) instead of at that step: beside a sleeping
    vLLM, this trainer's memory must all be there before vLLM's first /sleep, whose freed bytes are what it takes back
    (wake_vllm). A step on zero gradients makes them: with no weight decay every parameter stays bit for bit, and the
    step count goes back to 0, so the first real step is the one it would have been. Does nothing to a resumed
    optimizer (its state is loaded) or one with weight decay."""
    import torch

    if optimizer.state or any(group["weight_decay"] for group in optimizer.param_groups):
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for state in optimizer.state.values():
        state["step"].zero_()


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


def evaluate(url: str, prompts: list[list[int]], golds: list[str], args: Args, lora: Optional[str] = None) -> dict:
    """The server's policy on the test problems: one completion each at --eval-temperature (each problem its own
    seed), graded as in training."""
    import numpy as np

    results = generate(
        url,
        prompts,
        1,
        args.eval_temperature,
        args.max_completion_tokens,
        args.concurrency,
        [eval_seed(args.seed, i) for i in range(len(prompts))],
        lora=lora,
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
    }


def write_rollouts(path: str, step: int, samples: list, grades: list, advantages: list[float]) -> None:
    """Append the step's rollouts to the JSONL file at `path`, one line per completion: the problem, the completion,
    its grade, advantage, the policy versions that sampled it and its seed."""
    with open(path, "a") as rollout_log:
        for sample, grade_, advantage in zip(samples, grades, advantages, strict=True):
            record = {
                "step": step,
                "prompt": sample.prompt,
                "gold": sample.gold,
                "completion": sample.completion["text"],
                **grade_._asdict(),
                "advantage": advantage,
                "versions": sample.completion["versions"],
                "finish_reason": sample.completion["finish_reason"],
                "seed": sample.seed,
            }
            rollout_log.write(json.dumps(record) + "\n")


def save_checkpoint(path: str, model, lora, tokenizer, optimizer, counters: dict, run_args: dict) -> None:
    """A checkpoint at `path`: the model in Hugging Face format (vLLM and transformers load it), the tokenizer, the
    run's arguments (--resume and eval.py read them) and trainer_state.pt (the optimizer, `counters`, the random
    generators' states). LoRA: the adapter in peft's format (resume loads it) and, in merged/, the merged policy with
    its own tokenizer and arguments (eval.py, given the checkpoint, evaluates merged/). Written whole in `path`.tmp,
    then published under `path` at once (publish_checkpoint)."""
    import random

    import numpy as np
    import torch

    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # a save of this step cut short before
    if lora is None:
        model.save_pretrained(tmp)
    else:
        lora.save_pretrained(tmp)
        save_merged(lora, model, os.path.join(tmp, "merged"))
        tokenizer.save_pretrained(os.path.join(tmp, "merged"))
        with open(os.path.join(tmp, "merged", "args.json"), "w") as f:
            json.dump(run_args, f, indent=1)
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


def check_lora_args(args: Args) -> None:
    """The LoRA flags that do not go together, refused before any work."""
    if args.lora_sync == "adapter" and not args.lora_rank:
        raise SystemExit("--lora-sync adapter needs --lora-rank")
    if args.lora_sync == "adapter" and args.verify_sync and args.max_logprob_mismatch == 0:
        raise SystemExit("--verify-sync with --lora-sync adapter checks logprobs: it needs --max-logprob-mismatch > 0")


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
