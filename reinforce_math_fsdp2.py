# docs and experiment results: docs/reinforce_math_fsdp2.md
"""Grouped-advantage REINFORCE on MATH with FSDP2 under torchrun, in one file.

Based on grpo_gsm8k.py; what changes and why:
  - the trainer is sharded with FSDP2 over torchrun's GPUs: bf16 parameters, fp32 gradient reductions, activation
    checkpointing, gradient sync on the last micro-batch only (or each: --reduce-every-micro-batch); each rank
    generates and grades its own share of the prompts;
  - the algorithm is plainer: on-policy REINFORCE with group-relative advantages (no ratio, no clip, no KL),
    loss = -sum_i A_i sum_t log pi(o_it) / (completion tokens of the whole step): GRPO with one iteration;
  - the reward is strict (TASK's STRICT_FORMAT): `<think>...</think>` followed by a final \\boxed{} after `</think>`;
  - publishing weights: all ranks gather each full parameter (FSDP's all-gather on the torchrun group); rank 0 alone
    owns the communicator to vllm_sync_server.py and streams them one by one: it never holds a second full copy of
    the model.

What it leaves out, on purpose: PPO's ratio, clip and KL (grpo_gsm8k.py has them), tensor or pipeline parallelism of
the trainer, generating while training (pipeline_actor.py + pipeline_learner.py) and LoRA. Read it in order: Args,
the algorithm (ALGO LOGIC), the task (TASK: MATH's data and grading), main() with the loop; below MACHINERY, what a
learner can skip, FSDP2 among it (one function, setup_model).

  CUDA_VISIBLE_DEVICES=0 python vllm_sync_server.py --model Qwen/Qwen2.5-7B-Instruct --dtype bfloat16 \\
      --gpu-memory-utilization 0.8 --max-num-seqs 32
  # GPU 0 serves, GPUs 1-3 train; the other flags of docs/reinforce_math_fsdp2.md are the defaults
  CUDA_VISIBLE_DEVICES=1,2,3 torchrun --nproc_per_node=3 reinforce_math_fsdp2.py --model Qwen/Qwen2.5-7B-Instruct \\
      --limit 2048 --eval-before-start --rank0-only-output
"""

import datetime
import functools
import hashlib
import json
import math
import multiprocessing as mp
import os
import re
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

# Nothing heavy at import time: torchrun's --help must be instant, and grading workers re-import this file.


@dataclass
class Args:
    # Experiment
    model: str = "Qwen/Qwen2.5-7B-Instruct"
    """Hugging Face model id or local directory"""
    seed: int = 1
    """seed of the data order, sampling and torch"""
    dataset: str = field(default_factory=lambda: DATASET)
    """training set (its train split): a Hugging Face dataset (config DATASET_CONFIG), or a local directory with
    train.jsonl: rows that the TASK section's to_problem reads"""
    eval_dataset: str = field(default_factory=lambda: EVAL_DATASET)
    """evaluation set (its test split), read as --dataset is: a Hugging Face dataset, or a local directory with
    test.jsonl"""
    limit: Optional[int] = None
    """use only the first `limit` training problems, counted after the evaluation overlap is dropped (None: all)"""
    keep_eval_overlap: bool = False
    """also train on the training problems whose text is an evaluation problem's (by default they are dropped:
    qwedsacf/competition_math, MATH's train and test splits together, holds every MATH-500 problem)"""
    system_prompt: str = field(default_factory=lambda: SYSTEM_PROMPT)
    """system prompt of every conversation ("" for none; the default is the TASK section's)"""

    # Algorithm specific arguments
    train_steps: int = 50
    """number of policy updates"""
    rollouts_per_update: int = 8
    """prompts per step on each rank (each gets --group-size completions)"""
    group_size: int = 8
    """completions per prompt (G, 2 or more); advantages are relative to the group"""
    learning_rate: float = 1e-6
    """AdamW learning rate"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    scale_rewards: bool = True
    """divide advantages by the group's std"""
    micro_token_budget: int = 16384
    """maximum padded tokens in one forward/backward micro-batch"""
    max_seq_len: int = 1024
    """prompt + completion tokens kept for training (longer ones are truncated)"""
    mask_truncated_completions: bool = False
    """no gradient for a completion cut by --max-completion-tokens or --max-seq-len (DAPO's overlong filtering); its
    reward still counts in the statistics"""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a step draws rounds of --rollouts-per-update prompts per rank until every rank holds
    that many groups whose rewards differ (a group of equal rewards has no gradient), and trains on those"""
    max_sampling_rounds: int = 4
    """with --dynamic-sampling, the most rounds a step draws; after the last it trains on what it has, filled up with
    groups of equal rewards"""

    # FSDP2
    param_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """FSDP2 compute dtype of the parameters (gradients are reduced in fp32 either way)"""
    activation_checkpointing: bool = True
    """recompute each decoder layer in backward instead of storing its activations (--no-activation-checkpointing:
    faster steps where memory allows)"""
    reduce_every_micro_batch: bool = False
    """reduce-scatter gradients after every micro-batch: a reduce-scatter of all gradients per micro-batch instead of
    one per step, but no unsharded fp32 gradient of the whole model held on every rank between micro-batches
    (4 bytes per parameter whatever the number of ranks: README.md's memory table)"""

    # Generation
    train_temperature: float = 1.0
    """sampling temperature of the rollouts"""
    max_completion_tokens: int = 512
    """maximum new tokens per completion"""
    concurrency: int = 11
    """generation requests in flight per rank"""

    # The server and the weight sync
    vllm_host: str = "127.0.0.1"
    """host of vllm_sync_server.py"""
    vllm_port: int = 8000
    """port of vllm_sync_server.py"""
    sync_host: Optional[str] = None
    """address the server's workers reach rank 0 at, for the weight-sync group (default: rank 0's end of its
    connection to the server)"""
    verify_sync: bool = False
    """after each push, compare the server's weight checksums with the gathered weights"""
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
    eval_limit: Optional[int] = 100
    """evaluate on the first `eval_limit` problems of the evaluation set (None: all; split over the ranks)"""
    eval_concurrency: int = 32
    """evaluation requests in flight per rank"""
    eval_temperature: float = 0.0
    """sampling temperature of evaluation (0: greedy)"""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """level of the `logging` messages (warnings, checkpoints, resume)"""
    logger: str = "print"
    """comma-separated: print, rich, wandb (rank 0 logs; W&B reads WANDB_* variables)"""
    rank0_only_output: bool = False
    """silence stdout of every rank but 0"""
    rollout_log: str = "fsdp2_math_rollouts.rank{RANK}.jsonl"
    """JSONL file per rank receiving its training rollouts ({RANK} is replaced; its folder is created; an existing file
    is refused unless --resume, which appends)"""
    checkpoint_dir: str = "checkpoints_math_fsdp2"
    """where checkpoints go: step_N/ (Hugging Face format, by rank 0) + step_N/trainer/ (sharded state)"""
    save_every: int = 10
    """save a checkpoint every this many steps (and at the end, and when SIGTERM or SIGUSR1 stops the run)"""
    keep_checkpoints: int = 3
    """keep the newest this many checkpoints, deleting older ones after each save (0: keep all; the newest, at the
    end the final one, always stays)"""
    resume: bool = False
    """continue from the newest complete checkpoint in --checkpoint-dir, with the arguments saved with it (a flag given
    again overrides); on the world size that wrote it"""


# ALGO LOGIC: advantages, the loss, the policy's logprobs, micro-batches
# The algorithm: group_advantages, reinforce_loss, make_batch, update_policy (the loss's divisor: the step's tokens
# over every rank). Memory engineering, which changes no number: token_logprobs's chunked lm_head and entropy_rows (no
# [b, L, V] tensor), and the packing of sequences into micro-batches of --micro-token-budget tokens
# (pack_micro_batches, micro_batch, as_rows). FSDP2's sharding is one function, setup_model (MACHINERY).
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


def reinforce_loss(logprobs, advantages, mask, divisor=None):
    """On-policy REINFORCE with group baselines: -sum_i A_i sum_t logp_it / divisor, the tokens with a gradient of the
    whole step (update_policy; None: this batch's). logprobs, mask [B, T] (completion tokens), advantages [B].
    Relation to GRPO (grpo_gsm8k.policy_loss): its token term is -min(r A, clip(r) A) with r = pi / pi_old. Sampling
    and updating with the same weights (one optimizer step per batch), r = 1 in value and d r = d log pi, so GRPO's
    gradient is this one's; the clip never fires and there is no KL. Dividing by the step's tokens (DAPO's token-level
    mean, grpo_gsm8k's --loss-type dapo) weighs every token alike."""
    per_token = -advantages.unsqueeze(1) * logprobs  # [B, T]
    mask = mask.to(per_token.dtype)
    if divisor is None:  # this batch alone
        divisor = mask.sum().clamp(min=1)
    return (per_token * mask).sum() / divisor


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
    is exactly 0 adds 0 to every token's loss, and REINFORCE's loss has no other term: it is not fed at all (most
    groups early and late in a run have equal rewards). The loss's divisor still counts its tokens (update_policy), so
    the gradient is the one that feeding it would give."""
    G = args.group_size
    seqs = [(sample.prompt_ids + sample.completion["token_ids"])[: args.max_seq_len] for sample in samples]
    n_prompt = [len(sample.prompt_ids) for sample in samples]
    n_comp = [max(0, len(seq) - n) for seq, n in zip(seqs, n_prompt, strict=True)]
    hit_limit = [sample.completion["finish_reason"] == "length" for sample in samples]
    cut = [len(sample.prompt_ids) + len(sample.completion["token_ids"]) > args.max_seq_len for sample in samples]
    zero_std = zero_std_groups(rewards, G).tolist()
    masked = [args.mask_truncated_completions and (hit_limit[i] or cut[i]) for i in range(len(seqs))]
    trained = [0 if masked[i] else n_comp[i] for i in range(len(seqs))]
    fed = [i for i in range(len(seqs)) if trained[i] and advantages[i] != 0]
    return Batch(seqs, n_prompt, n_comp, hit_limit, cut, zero_std, masked, trained, fed)


def update_policy(model, optimizer, batch: Batch, samples, advantages, args: Args, pad_id: int, fresh: bool, check):
    """One optimizer step over this rank's micro-batches of the samples fed, every rank together. Every rank must run
    the same number of forward/backward passes (each one all-gathers parameters), so ranks with fewer micro-batches
    run empty ones that contribute 0. `check(mismatch)` runs on the step's figure over every rank's tokens, before the
    update, when no rank sampled a stale version (`fresh` on all). Returns this rank's sums (loss, mismatch, entropy,
    tokens fed), the global grad_norm, and the pass that went bad (a non-finite gradient: no update, on every rank
    alike), 0 if none did (REINFORCE makes one pass)."""
    import torch

    device = next(model.parameters()).device
    world_size = torch.distributed.get_world_size()
    lengths = [len(batch.seqs[i]) for i in batch.fed]
    micro = [[batch.fed[j] for j in mb] for mb in pack_micro_batches(lengths, args.micro_token_budget)]
    # micro-batches every rank runs: the busiest rank's, and at least one, so that a step no rank feeds still measures
    # the sampler's check and the entropy (on the empty turn below) and gets its zero gradient
    n_micro = max(1, int(all_max(device, len(micro))))
    # The divisor, once for the step: the tokens with a gradient of every sample of every rank, fed or not (a sample
    # not fed has advantage 0: fed, it would add 0 to the sum and its tokens to the count), so that no micro-batch
    # needs to know the others. FSDP's reduce-scatter averages the ranks' gradients: it divides their sum by
    # world_size. Each rank divides its summed token losses by tokens / world_size, which that average undoes: the
    # gradient every rank steps with is the sum over all ranks and micro-batches / tokens, the token mean of the whole
    # step, as one process feeding every sample would compute it (test_two_ranks_equal_one_process).
    divisor = max(1.0, all_sum(device, sum(batch.trained))[0]) / world_size
    stats = {
        "loss": 0.0,
        "mismatch_sum": 0.0,
        "entropy_sum": 0.0,
        "tokens_fed": 0,  # the tokens measured (the mismatch, the entropy): those fed, or the empty turn's if none
    }
    optimizer.zero_grad(set_to_none=True)
    for m in range(n_micro):
        real = m < len(micro)  # else an empty turn, its loss times 0: a micro-batch again, or a sample if none was fed
        idx = micro[m] if real else (micro[0] if micro else [batch.n_comp.index(max(batch.n_comp))])
        # reduce-scatter gradients once, after the last (meanwhile they accumulate unsharded), or after each
        model.set_requires_gradient_sync(args.reduce_every_micro_batch or m == n_micro - 1)
        ids, attn, mask, at = micro_batch(batch.seqs, batch.n_prompt, idx, pad_id, device)
        train_mask = mask * torch.tensor([not batch.masked[i] for i in idx], device=device)[:, None]  # [b, T]
        flat, entropy = model.token_logprobs(ids, attn, at, args.train_temperature)  # [N], [N]
        logprobs = as_rows(flat, mask)  # [b, T], under the sampler's policy
        loss = reinforce_loss(logprobs, advantages[idx].to(device), train_mask, divisor) * real
        loss.backward()
        if real:
            stats["loss"] += loss.item() / world_size  # summed over the ranks: the step's loss
        if real or (m == 0 and not micro):  # every fed token, or this rank's first empty turn when it feeds none
            vllm_lp = sampler_logprobs(samples, idx, batch.n_comp, mask)  # [b, T]
            stats["mismatch_sum"] += ((logprobs.detach() - vllm_lp).abs() * mask).sum().item()
            stats["entropy_sum"] += entropy.sum().item()
            stats["tokens_fed"] += int(mask.sum().item())
    # the sampler's policy check, before the update: the step's figure over every rank's tokens measured (one small
    # all-reduce), so that all ranks reach the same verdict and stop together
    mismatch_all, fed_all, stale_ranks = all_sum(device, stats["mismatch_sum"], stats["tokens_fed"], float(not fresh))
    if stale_ranks == 0:
        check(mismatch_all / fed_all if fed_all else float("nan"))
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
    stats["grad_norm"] = (grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm).item()
    if not math.isfinite(stats["grad_norm"]):  # every rank sees the same (global) norm, so all skip or none does
        return stats, 1
    optimizer.step()
    return stats, 0


# TASK: MATH. All that knows the task is here, and only that: its data sets and prompt, how a data row becomes a
# problem, and how a completion is graded. To train on a task of your own, rewrite this section alone
# (docs/your_own_task.md swaps in Countdown). The grading pool's workers import this file: keep it cheap to import.
DATASET = "qwedsacf/competition_math"  # --dataset's default: a Hugging Face dataset id, or a folder of train.jsonl
DATASET_CONFIG = None  # the hub datasets' configuration (None: their only one)
EVAL_DATASET = "HuggingFaceH4/MATH-500"  # --eval-dataset's default: a hub dataset id, or a folder of test.jsonl
SYSTEM_PROMPT = (  # --system-prompt's default
    "Think step by step inside <think>...</think>, then give the final answer after </think> as \\boxed{...}."
)
STRICT_FORMAT = True  # grade rewards only the R1 format (its docstring); False: the last \\boxed{} anywhere counts


class Grade(NamedTuple):
    reward: float
    correct: bool
    parse_error: bool  # no usable answer: no box, empty/truncated box, unparsable, timed out


def to_problem(row) -> tuple[str, str]:
    """One data row {problem, solution} -> (the user's message, the gold answer: the last \\boxed{} of the solution,
    which MATH and MATH-500 write in every one; MATH-500's separate `answer` is not read). A row it cannot use raises
    ValueError saying what is wrong: the run stops before any work, naming its file and line."""
    if not isinstance(row, dict):
        raise ValueError(f"not a JSON object but {type(row).__name__}")
    for name in ("problem", "solution"):
        if name not in row:
            raise ValueError(f"no '{name}' field")
        if not isinstance(row[name], str):
            raise ValueError(f"'{name}' is not a string but {type(row[name]).__name__}")
    if not row["problem"].strip():
        raise ValueError("'problem' is empty")
    if (answer := last_boxed(row["solution"])) is None:  # none, empty or unbalanced: grade could read no gold
        raise ValueError("'solution' has no \\boxed{} answer")
    return row["problem"], answer


def grade(completion: str, gold: str, cpu_s: float = 5.0) -> Grade:
    """Reward of one completion against `gold`: the answer to_problem read, or a whole MATH solution (its last
    \\boxed{} is the answer). It may spend `cpu_s` seconds of this process's CPU time (ITIMER_PROF counts CPU, not wall
    clock: load on the machine changes no verdict), then scores 0 with parse_error; math-verify's own wall-clock alarms
    are off. Call it in a main thread (the limit is a signal) or through grade_batch.
    STRICT_FORMAT (the R1 format): the completion is one think block, `<think>...</think>` with only whitespace
    before it, then the answer: the last \\boxed{} after that `</think>`. Every other think tag breaks the format (a
    `<think>` inside the block, a second block, a stray `</think>` or `<think>` after it), as do a missing block, a
    missing `</think>` and a box only inside the thinking: each is a parse error.
    """
    import signal

    from math_verify import LatexExtractionConfig, parse, verify

    if STRICT_FORMAT:  # the first </think> closes the block; only what follows it can hold the answer
        m = re.fullmatch(r"\s*<think>(.*?)</think>(.*)", completion, re.S)
        if m is None or "<think>" in m.group(1) or re.search(r"</?think>", m.group(2)):
            return Grade(0.0, False, True)  # no think block, an unclosed one, or another think tag
        completion = m.group(2)
    if (box := last_boxed(completion)) is None or len(box) > 1000:
        return Grade(0.0, False, True)
    gold = last_boxed(gold) or gold.strip()
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
GRADE_EXAMPLE = ("<think>Solve it.</think> The answer is \\boxed{x \\le 1/2}.", "(-\\infty, 1/2]")


def main() -> None:
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    args = said_once(rank, parse_args)  # before importing torch: --help is instant
    if rank and args.rank0_only_output:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (stdout for the rest of the process: never closed)
    run_args = asdict(args)  # saved with every checkpoint
    ckpts = checkpoint_steps(args.checkpoint_dir, say=rank == 0) if args.resume else []  # the complete ones
    said_once(rank, check_args, args, rank, world_size, ckpts)
    train, test = said_once(rank, load_problems, args)  # (prompt, gold) pairs, every row checked: a bad one stops here
    url = f"http://{args.vllm_host}:{args.vllm_port}"
    said_once(rank, check_server, url)  # before anything heavy: no server stops the run here, saying how to start one
    import logging
    import random

    import numpy as np
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    # TRY NOT TO MODIFY: the torchrun group (FSDP's collectives and a few sums of metrics; never the weight push)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # this rank's place on its node: its GPU
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if args.param_dtype == "bfloat16" and not torch.cuda.is_bf16_supported(including_emulation=False):
            raise SystemExit(  # every rank, before the group: the GPUs of one node are alike
                f"{torch.cuda.get_device_name(device)} has no bfloat16 (Ampere or newer): use --param-dtype float32"
            )
    # torchrun sets MASTER_ADDR; plain `python` gets a group of one (FSDP2 wants a group even then)
    alone = {} if "MASTER_ADDR" in os.environ else {"store": dist.HashStore(), "rank": 0, "world_size": 1}
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30), **alone)
    logging.basicConfig(level=args.log_level, format=f"[rank{rank}] %(levelname)s %(message)s")
    log = logging.getLogger("reinforce_math_fsdp2")
    log.info("rank %d of %d, local rank %d (on this node), device %s", rank, world_size, local_rank, device)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)  # the same on every rank
    loggers = set(args.logger.split(",")) if rank == 0 else set()

    # data (loaded above) as chat prompts (token ids); per step, rank r takes every world_size-th of the next
    # rollouts_per_update x world_size training prompts, and it evaluates every world_size-th test problem
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    eval_problems = test[rank::world_size]  # this rank's share of the evaluation problems
    eval_prompts = [prompt_ids(tokenizer, args.system_prompt, prompt) for prompt, _ in eval_problems]
    eval_golds = [gold for _, gold in eval_problems]
    # the server's context must hold the longest prompt and a whole completion: refused before the model loads, by
    # every rank alike (each measures its share of the training problems; the longest over the ranks)
    served = requests.get(url + "/runtime_version", timeout=30, headers=auth_headers()).json()
    mine = [len(prompt_ids(tokenizer, args.system_prompt, prompt)) for prompt, _ in train[rank::world_size]]
    longest = int(all_max(device, max(mine + [len(p) for p in eval_prompts], default=0)))
    said_once(rank, check_lengths, longest, args.max_completion_tokens, served["max_model_len"])

    # model: fp32 master weights, sharded; AdamW on the shards; resume
    model = setup_model(args.model, args.param_dtype, args.activation_checkpointing, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    counters = {"step": 0, "version": 0, "data_pos": 0, "wandb_id": None}  # a new run's
    if ckpts:  # the sharded model and optimizer state: each rank reads its own shards
        counters = load_trainer_state(os.path.join(args.checkpoint_dir, f"step_{ckpts[-1]}"), model, optimizer, rank)
    step = counters["step"]  # optimizer steps taken
    version = counters["version"]  # the policy version the server holds (one per push)
    data_pos = counters["data_pos"]  # training prompts drawn so far, all ranks together (the order and seeds follow)
    wandb_id = start_wandb(args, counters["wandb_id"]) if "wandb" in loggers else None  # --resume: the same W&B run
    sync = None  # rank 0 alone talks to the server, in a group of its own outside the torchrun group
    if rank == 0:
        sync = init_weight_sync(url, device, args.sync_host)
    push_weights(sync, model, version)  # all ranks gather; the server may hold other weights
    # the sampler's policy check: the limit for the dtypes both ends compute in, the same on every rank
    limit = logprob_mismatch_limit(args.max_logprob_mismatch, [served["dtype"], args.param_dtype])

    if args.eval_before_start and step == 0:
        log_metrics(evaluate(url, eval_prompts, eval_golds, args, rank, world_size, device), step, loggers)
    total_tokens = 0
    start_time = time.time()
    for signum in (signal.SIGTERM, signal.SIGUSR1):  # preemption, from here on: finish the step, save it, end
        signal.signal(signum, request_stop)
    stop = 0  # the signal that stops the run, as every rank agreed at a step's end (0: none)
    G, groups = args.group_size, args.rollouts_per_update  # groups: this rank's share of a step
    max_rounds = args.max_sampling_rounds if args.dynamic_sampling else 1  # generation rounds a step may take
    while step < args.train_steps and not stop:
        t0 = time.time()
        # 1) generate this rank's share of the step's prompts, group_size completions each; 2) grade them (TASK).
        # --dynamic-sampling (DAPO): more rounds, every rank together (the data order and the seeds stay the run's),
        # until each rank holds rollouts_per_update groups whose rewards differ
        samples, grades, rounds, short = [], [], 0, groups  # every sample this rank drew, its grade; groups to find
        while rounds < max_rounds and all_max(device, short) > 0:
            global_idx = list(range(rank, groups * world_size, world_size))
            problems = [train[problem_index(args.seed, data_pos + k, len(train))] for k in global_idx]
            seeds = [rollout_seed(args.seed, data_pos + k, G) for k in global_idx]
            data_pos += groups * world_size
            rounds += 1
            prompts = [prompt_ids(tokenizer, args.system_prompt, prompt) for prompt, _ in problems]
            results = generate(
                url, prompts, G, args.train_temperature, args.max_completion_tokens, args.concurrency, seeds
            )
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
            short = groups - int((~zero_std_groups(torch.tensor([g.reward for g in grades]), G)).sum())
        # 3) advantages, relative to each prompt's group (groups never straddle ranks); the groups this rank trains on
        rewards = torch.tensor([g.reward for g in grades], dtype=torch.float32)  # [rounds * groups * G]
        advantages = group_advantages(rewards, G, args.scale_rewards)  # [rounds * groups * G]
        kept = batch_groups(rewards, G, groups)  # [B]
        step_samples, step_advantages = [samples[i] for i in kept], advantages[kept]  # [B], [B]
        # fresh: sampled by the version pushed last, which the trainer holds (it pushes after every step)
        fresh = all(sample.completion["versions"] == [version] for sample in step_samples)

        # 4) which samples the update sees (those that can change the gradient), which of their tokens get one
        batch = make_batch(step_samples, rewards[kept], step_advantages, args)

        # 5) loss and update, every rank together; before it, the check that the server samples this policy
        check = functools.partial(
            check_logprob_mismatch, limit=limit, step=step + 1, version=version, transport="collective"
        )
        stats, bad_pass = update_policy(
            model, optimizer, batch, step_samples, step_advantages, args, tokenizer.pad_token_id, fresh, check
        )
        if bad_pass:
            log.warning("non-finite gradient at step %d: step skipped", step + 1)
        step += 1
        # 6) push weights to vLLM: all ranks gather, rank 0 broadcasts
        t_sync = time.time()
        version += 1
        push_weights(sync, model, version)
        if args.verify_sync:
            verify_weights(sync, model)
        sync_s = time.time() - t_sync
        # 7) log, evaluate, checkpoint
        new_tokens = sum(len(sample.completion["token_ids"]) for sample in samples)
        counts = {"completion_tokens": new_tokens, "total_completion_tokens": total_tokens, "version": version}
        counts["prompts_drawn"] = rounds * groups * world_size
        seconds = {"sync_s": sync_s, "step_s": time.time() - t0}
        metrics = step_metrics(grades, batch, stats, counts, seconds, device)
        total_tokens = metrics["total_completion_tokens"]
        write_rollouts(args.rollout_log.replace("{RANK}", str(rank)), step, rank, samples, grades, advantages.tolist())
        if args.eval_every and step % args.eval_every == 0:
            metrics.update(evaluate(url, eval_prompts, eval_golds, args, rank, world_size, device))
        log_metrics(metrics, step, loggers)
        # a signal reaches the ranks at different moments: they agree on it, so that all save the same step and stop
        stop = int(all_max(device, STOP_REQUESTS[0] if STOP_REQUESTS else 0))
        if step % args.save_every == 0 or step == args.train_steps or stop:
            path = os.path.join(args.checkpoint_dir, f"step_{step}")
            counters = {"step": step, "version": version, "data_pos": data_pos, "wandb_id": wandb_id}
            save_checkpoint(path, model, tokenizer, optimizer, counters, run_args, rank)  # published on every rank
            log.info("saved %s", path)
            if rank == 0:
                prune_checkpoints(args.checkpoint_dir, args.keep_checkpoints)
    print(f"done: {step} steps in {time.time() - start_time:.1f}s", flush=True)
    dist.barrier()  # a rare abort at exit was seen without it
    dist.destroy_process_group()
    if stop and step < args.train_steps:  # every rank, with the same code
        print(f"stopped by {signal.Signals(stop).name} after step {step}: --resume goes on from there", flush=True)
        raise SystemExit(128 + stop)


# MACHINERY: what a learner can skip. The step's metrics; the check that the server samples this policy; the grading
# pool and the answer-reading helpers grade uses; FSDP2 (setup_model), the client side of vllm_sync_server.py and the
# weight sync; the traps' checks; the data order and the sampling seeds; preemption; logging, evaluation, checkpoints
# and resume; the arguments' and the data's refusals.
def step_metrics(grades: list, batch: Batch, stats: dict, counts: dict, seconds: dict, device) -> dict:
    """The step's metrics (docs/reinforce_math_fsdp2.md, Logged metrics), summed over the ranks in one small
    all-reduce: from this rank's grades (every sample it drew), batch (the groups it trained on) and update `stats`,
    the run's `counts` (completion_tokens of this rank, total_completion_tokens before this step, version,
    prompts_drawn over the ranks) and `seconds` (sync_s, step_s). Every rank must call it."""
    sums = all_sum(
        device,
        len(grades),
        sum(g.reward for g in grades),
        sum(g.correct for g in grades),
        sum(g.parse_error for g in grades),
        counts["completion_tokens"],
        stats["loss"],
        stats["mismatch_sum"],
        stats["entropy_sum"],
        stats["tokens_fed"],
        sum(batch.hit_limit),
        sum(batch.cut),
        sum(batch.zero_std),
        len(batch.zero_std),
        len(batch.fed),
        len(batch.seqs),
    )
    n, r_sum, correct, parse_err, tokens, loss_all, mismatch, entropy_all, fed = sums[:9]
    n_hit_limit, n_cut, n_zero_std, n_groups, n_fed, n_batch = sums[9:]
    return {
        "loss": loss_all,
        "grad_norm": stats["grad_norm"],
        "reward": r_sum / n,
        "correct_rate": correct / n,
        "parse_err_rate": parse_err / n,
        "avg_completion_length": tokens / n,
        "completion_tokens": int(tokens),
        "total_completion_tokens": int(counts["total_completion_tokens"] + tokens),
        "entropy": entropy_all / fed if fed else float("nan"),  # nan: no token was fed
        "completion_truncated_rate": n_hit_limit / n_batch,
        "seq_len_truncated_rate": n_cut / n_batch,
        "frac_reward_zero_std": n_zero_std / n_groups,
        "frac_samples_skipped": 1 - n_fed / n_batch,  # no gradient to give: not fed (make_batch)
        "logprob_mismatch": mismatch / fed if fed else float("nan"),
        "version": counts["version"],
        "prompts_drawn": counts["prompts_drawn"],
        "sampling_rounds": counts["prompts_drawn"] // n_groups,  # rounds of --rollouts-per-update on every rank
        **seconds,
        "tokens_per_s": tokens / seconds["step_s"],
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
# verdict) and a wall-clock backstop, so it never hangs the loop; and the helpers MATH's grade reads answers with.
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
    # torchrun signals each rank's whole process group (os.killpg): a worker leaves it, so that torchrun's SIGTERM
    # does not end it in the middle of the step the rank finishes (its samples would score 0)
    os.setpgrp()
    grade(*GRADE_EXAMPLE)  # the task's own example (MATH: imports sympy, builds math-verify's parsers, ~1 s of CPU)


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


# FSDP2, and the client side of vllm_sync_server.py
def setup_model(path: str, param_dtype: str, activation_checkpointing: bool, device):
    """FSDP2 at any world size, one rank included (the same mixed precision everywhere); call on every rank of the
    default process group. A model whose forward changes its logits after the lm_head is refused (check_logits), and
    dropout is off. Rank 0 alone reads the checkpoint (fp32, host RAM); the others build the model on the meta device.
    Each decoder layer is sharded, then the root (embeddings, final norm, lm_head): a layer's parameters are
    all-gathered just before it runs and freed after. Rank 0 then broadcasts each full tensor and every rank keeps its
    shard (tied embeddings stay one parameter), and the buffers (rotary frequencies). Compute in `param_dtype`;
    gradients are reduce-scattered in fp32 (bf16 sums over ranks lose precision). fp32 master weights and AdamW state
    stay sharded."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    said_once(dist.get_rank(), check_logits, config)  # token_logprobs's lm_head shortcut must give the model's logits
    if dist.get_rank() == 0:  # the full state dict keeps the CPU tensors once fully_shard has swapped in the shards
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        full = model.state_dict()
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        full = {}
    model.train()
    disable_dropout(model)  # the policy's logprobs must be the sampler's: no random masks in training mode
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp_policy = MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype), reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    if dist.get_rank() != 0:
        model.to_empty(device=device)  # storage for the shards; set_model_state_dict fills it
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for buf in model.buffers():  # non-persistent, so not in a state dict: rank 0 computed them, the others hold garbage
        dist.broadcast(buf, src=0)
    # training calls token_logprobs, not forward: let FSDP run its pre/post-forward hooks (all-gather the root's
    # parameters, set up the backward reduce-scatter) around it too
    model.token_logprobs = token_logprobs.__get__(model)
    register_fsdp_forward_method(model, "token_logprobs")
    return model


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


def push_weights(sync: Optional[dict], model, version: int) -> Optional[dict]:
    """Call on every rank: each parameter is gathered whole by all ranks in turn (DTensor.full_tensor, an all-gather on
    the torchrun group); rank 0, the only one with a communicator (sync), broadcasts it, one broadcast per parameter,
    while the next ones are gathered: up to 1 GiB of gathered parameters in flight."""
    import torch

    named = list(model.named_parameters())
    full = lambda p: p.full_tensor() if hasattr(p, "full_tensor") else p  # noqa: E731 (DTensor under FSDP)
    if sync is None:  # ranks > 0: take part in the gathers, in the same order, and nothing else
        for _, p in named:  # (a loop, not a list: one gathered parameter at a time)
            full(p.detach())
        return None
    dtype = getattr(torch, sync["dtype"])
    params = [{"name": n, "dtype": sync["dtype"], "shape": list(p.shape)} for n, p in named]
    body = {"params": params, "version": version}
    answer = lines(post(sync["url"], "/update_param_batch", body, stream=True, timeout=sync["timeout_s"]))
    next(answer)  # "receiving": the server checked the metadata and waits for the broadcasts
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    inflight = []  # (bytes, work) of the broadcasts not known to be done
    ahead = 0  # their bytes
    for _, p in named:
        buf = full(p.detach()).to(dtype).contiguous().view(-1).view(torch.uint8)  # bytes, as the server receives them
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


def verify_weights(sync: Optional[dict], model) -> None:
    """Call on every rank: all ranks gather the full state dict (a collective); rank 0 compares each tensor's sha256,
    in the server's dtype, with the server's per-parameter checksums (of the weights it computes with)."""
    import torch

    state = full_state_dict(model)
    if sync is None:  # not rank 0
        return
    theirs = requests.get(sync["url"] + "/weights_checksum", timeout=600, headers=auth_headers()).json()["checksums"]
    dtype = getattr(torch, sync["dtype"])
    ours = {n: hashlib.sha256(t.to(dtype).contiguous().view(torch.uint8).numpy()).hexdigest() for n, t in state.items()}
    differ = [n for n in theirs if ours.get(n) != theirs[n]]
    if differ:
        raise RuntimeError(f"weights differ after the push: {differ[:5]}")


def full_state_dict(model) -> dict:
    """Every rank must call it (it gathers); rank 0 gets plain tensors on CPU under Hugging Face names."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


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
    url: str, prompts: list[list[int]], n: int, temperature: float, max_tokens: int, concurrency: int, seeds: list[int]
):
    """One request per prompt (prompt i seeded with seeds[i]), `concurrency` in flight; vLLM batches them. Returns
    one result per prompt. A prompt's seed follows its place in the global batch, not the rank that asks: any number
    of ranks samples the same."""

    def one(i):
        body = {"prompts": [prompts[i]], "n": n, "temperature": temperature, "max_tokens": max_tokens, "seed": seeds[i]}
        return post(url, "/generate", body).json()["results"][0]

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(len(prompts))))


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
TRAINER_STATE = "trainer/.metadata"  # a checkpoint's last file (save_checkpoint): a step_N without it is incomplete


def all_sum(device, *xs: float) -> list[float]:
    """Each of `xs` summed over the ranks (a few metrics in one small all-reduce; one process: themselves)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(xs, dtype=torch.float64, device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_max(device, x: float) -> float:
    """The largest of the ranks' `x`."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64, device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


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


def prompt_ids(tokenizer, system_prompt: str, question: str) -> list[int]:
    """A problem as the model's chat prompt, in token ids: the system prompt (none if ""), the problem as the user's
    turn, the assistant's turn opened (the template's text, tokenized without adding special tokens twice)."""
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    text = tokenizer.apply_chat_template(
        msgs + [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer.encode(text, add_special_tokens=False)


def evaluate(url: str, prompts: list[list[int]], golds: list[str], args: Args, rank: int, world_size: int, device):
    """The server's policy on this rank's share of the evaluation problems (every world_size-th, from `rank`): one
    completion each at --eval-temperature (each problem its own seed), graded as in training; the counts are summed
    over the ranks, so every rank returns the whole set's figures."""
    results = generate(
        url,
        prompts,
        1,
        args.eval_temperature,
        args.max_completion_tokens,
        args.eval_concurrency,
        [eval_seed(args.seed, rank + world_size * i) for i in range(len(prompts))],
    )
    grades = grade_batch(
        [res["completions"][0]["text"] for res in results],
        golds,
        args.grade_timeout_s,
        backstop_s=args.grade_backstop_s,
        workers=args.grade_workers,
    )
    n, correct, parse_err, length = all_sum(
        device,
        len(prompts),
        sum(g.correct for g in grades),
        sum(g.parse_error for g in grades),
        sum(len(res["completions"][0]["token_ids"]) for res in results),
    )
    return {
        "eval/accuracy": correct / max(n, 1),
        "eval/parse_err_rate": parse_err / max(n, 1),
        "eval/avg_completion_length": length / max(n, 1),
    }


def write_rollouts(path: str, step: int, rank: int, samples: list, grades: list, advantages: list[float]) -> None:
    """Append this rank's rollouts of the step to the JSONL file at `path`, one line per completion: the problem, the
    completion, its grade, advantage, the policy versions that sampled it and its seed."""
    with open(path, "a") as rollout_log:
        for sample, grade_, advantage in zip(samples, grades, advantages, strict=True):
            record = {
                "step": step,
                "rank": rank,
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


def save_checkpoint(path: str, model, tokenizer, optimizer, counters: dict, run_args: dict, rank: int) -> None:
    """A checkpoint at `path`, written by every rank: rank 0 writes the gathered model in Hugging Face format (vLLM,
    transformers and eval.py load it), the tokenizer and the run's arguments (--resume and eval.py read them); each
    rank writes trainer/rank{R}.pt (`counters`, its random generators' states) and its shards of the model and the
    optimizer (DCP: resume loads them, in parallel), whose metadata rank 0 writes last (TRAINER_STATE). Written whole
    in `path`.tmp, then published under `path` at once by rank 0 (publish_checkpoint). Every rank must call it."""
    import random

    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict

    tmp = path + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save of this step cut short before
    dist.barrier()  # before any rank writes into tmp
    sd = full_state_dict(model)  # every rank gathers; rank 0 alone writes the Hugging Face checkpoint
    if rank == 0:
        model.config.save_pretrained(tmp)  # (these two create the directory)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "args.json"), "w") as f:
            json.dump(run_args, f, indent=1)
        if model.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        save_file(
            {k: v.contiguous() for k, v in sd.items()},
            os.path.join(tmp, "model.safetensors"),
            metadata={"format": "pt"},
        )
    del sd
    os.makedirs(os.path.join(tmp, "trainer"), exist_ok=True)
    state = {
        **counters,
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state(),
    }
    torch.save(state, os.path.join(tmp, "trainer", f"rank{rank}.pt"))  # before DCP's, whose metadata comes last
    msd, osd = get_state_dict(model, optimizer)  # sharded: each rank writes its own shards, in parallel
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(tmp, "trainer"))
    # every rank has written all its files before rank 0 renames the folder they all write into: a file still being
    # written would miss the fsync, or land in a folder renamed under it, and a checkpoint without it would look whole
    dist.barrier()
    if rank == 0:
        publish_checkpoint(tmp, path)
    dist.barrier()  # no rank goes on (prunes, stops, exits) before the checkpoint exists


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


def load_trainer_state(path: str, model, optimizer, rank: int) -> dict:
    """What save_checkpoint saved at `path` besides the Hugging Face model, on every rank: the model's and the
    optimizer's shards into `model` and `optimizer` (DCP: each rank reads its own), and this rank's random generators.
    Returns the run's counters (step, version, data_pos, wandb_id)."""
    import random

    import numpy as np
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizer)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=os.path.join(path, "trainer"))
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
    state = torch.load(os.path.join(path, "trainer", f"rank{rank}.pt"), map_location="cpu", weights_only=False)
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    np.random.set_state(state["numpy_rng"])
    print(f"resumed from {path} at step {state['step']}", flush=True)
    return {name: state.get(name) for name in ("step", "version", "data_pos", "wandb_id")}


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
    "micro_token_budget",
    "max_seq_len",
    "max_completion_tokens",
    "concurrency",
    "eval_concurrency",
    "save_every",
    "grade_workers",
    "max_sampling_rounds",
)


def parse_args() -> Args:
    """The command line. With --resume and a checkpoint in --checkpoint-dir, the arguments saved with the newest one
    are the defaults: the run goes on as it was started, and a flag given again overrides its saved value (tyro fills
    every flag not on the command line from `default`)."""
    import tyro

    args = tyro.cli(Args, description=__doc__)
    steps = checkpoint_steps(args.checkpoint_dir) if args.resume else []
    saved = saved_args(os.path.join(args.checkpoint_dir, f"step_{steps[-1]}")) if steps else {}
    if saved:  # the checkpoint is where this run found it, whatever folder the saved run named
        args = tyro.cli(Args, description=__doc__, default=Args(**{**saved, "checkpoint_dir": args.checkpoint_dir}))
    for name in COUNTS:  # 0 would divide by zero, or do nothing, steps later
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be 1 or more, got {getattr(args, name)}")
    return args


def said_once(rank: int, work, *args):
    """work(*args) on every rank, what it prints said once: under torchrun rank 0 prints (--help, a refusal), the
    other ranks run it quietly (stdout and stderr to /dev/null). When it stops the run they exit 5 s after rank 0, since
    torchrun stops every rank once one has exited and would kill rank 0 before it printed; with nothing to do (exit 0)
    every rank exits at once."""
    import contextlib

    with open(os.devnull, "w") as devnull, contextlib.ExitStack() as quiet:
        for redirect in (contextlib.redirect_stdout, contextlib.redirect_stderr) if rank else ():
            quiet.enter_context(redirect(devnull))
        try:
            return work(*args)
        except SystemExit as e:
            time.sleep(0 if rank == 0 or not e.code else 5)
            raise


def check_args(args: Args, rank: int, world_size: int, ckpts: list[int]) -> None:
    """Before any work, on every rank (said_once): exit 0 when the newest checkpoint (`ckpts`: their steps, with
    --resume) has --train-steps already, else refuse what cannot run."""
    try:  # the last training prompt the run can draw (over resumes) must still sample from the run's own streams
        rounds = args.max_sampling_rounds if args.dynamic_sampling else 1
        rollout_seed(args.seed, args.train_steps * args.rollouts_per_update * world_size * rounds - 1, args.group_size)
    except ValueError as e:
        refuse(str(e))
    if args.group_size < 2:  # a group of one is its own baseline: its advantage is 0 (its std NaN) and nothing learns
        refuse(f"--group-size must be 2 or more (each completion is scored against its group's), got {args.group_size}")
    if ckpts and ckpts[-1] >= args.train_steps:
        print(f"nothing to do: the newest checkpoint, step_{ckpts[-1]}, has --train-steps {args.train_steps}")
        raise SystemExit(0)
    check_run_files(args, args.rollout_log.replace("{RANK}", str(rank)))
    # DCP would reshard the model and optimizer state, but not the rest of it: each rank's data share, RNG streams
    # and rollout log belong to its RANK
    saved_ranks = world_size
    if ckpts:
        trainer_dir = os.path.join(args.checkpoint_dir, f"step_{ckpts[-1]}", "trainer")
        saved_ranks = len([f for f in os.listdir(trainer_dir) if re.fullmatch(r"rank\d+\.pt", f)])
    if saved_ranks != world_size:
        raise SystemExit(
            f"step_{ckpts[-1]} in {args.checkpoint_dir} was written by {saved_ranks} ranks: resume it on "
            f"{saved_ranks} (--nproc-per-node x nodes), not {world_size}"
        )
    if args.max_logprob_mismatch is not None and args.max_logprob_mismatch < 0:
        raise SystemExit(f"--max-logprob-mismatch must be >= 0 (0: no check), got {args.max_logprob_mismatch}")
    for flag, value in (("--limit", args.limit), ("--eval-limit", args.eval_limit)):
        if value is not None and value < 1:
            raise SystemExit(f"{flag} is a number of problems, 1 or more (None: all of them); got {value}")


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
    """Before torch is imported, on every rank (said_once): the (prompt, gold) problems. The training problems less
    those of the evaluation set (its whole test split, not only --eval-limit's share), then --limit; and the first
    --eval-limit evaluation problems. load_split checks every row: a bad one stops the run, as a set with nothing to
    train on does."""
    train = load_split(args.dataset, "train")
    test = load_split(args.eval_dataset, "test")
    clean, overlap = drop_eval_overlap(train, test)
    fate = "kept (--keep-eval-overlap)" if args.keep_eval_overlap else "dropped"
    print(
        f"training problems: {len(train)} in {args.dataset}, {overlap} of them evaluation problems: {fate}", flush=True
    )
    kept = (train if args.keep_eval_overlap else clean)[: args.limit]
    if not kept:
        dropped = f", and the {overlap} that are evaluation problems were dropped" if overlap else ""
        raise SystemExit(f"no training problems: {args.dataset} holds {len(train)}{dropped}")
    return kept, test[: args.eval_limit]


if __name__ == "__main__":
    main()
