# docs and experiment results: docs/pipeline.md
"""Pipeline RL, the learner: pop rollouts from a Redis queue, train on them, push the weights into every vLLM server.

Pipeline RL splits GRPO's loop (grpo_gsm8k.py) into processes that do not wait for each other: pipeline_actor.py
samples and grades completions on vllm_sync_server.py servers and pushes one record per completion to a Redis list;
this learner pops batches, takes one optimizer step per batch, and every --sync-every-steps pushes the weights into
all the servers, a new policy version. The servers pause the requests in flight during a push and resume them with
the new weights (in-flight updates, as in PipelineRL, Piche et al. 2025): one completion may span two versions.

What this learner does, and how:
  - a batch is --batch-size records in queue order (BLPOP waits for the first, LPOP takes the rest); the actor
    computed the group advantages, so a batch need not hold whole groups. A record whose advantage is 0 changes no
    gradient: it is not fed through the model, and the loss's divisor still counts it (make_batch);
  - staleness: lag = this learner's version - the record's version_max. Records with lag > --max-lag are dropped,
    counted and logged (lag_hist, dropped); the others are off-policy by up to max_lag versions, and the loss
    corrects for it with an importance ratio against the sampling logprobs the record carries (see policy_loss);
  - a record that is not a msgpack map or JSON object with the fields below (token ids inside the vocabulary) is
    rejected with its reason in the log; msgpack and json build plain data only: nothing queued can run code here;
  - weight sync: this learner owns one collective group with the workers of every server (world size 1 +
    number of servers; it is rank 0 and hosts the TCPStore, server k's worker is rank 1 + k). A push posts
    /update_param_batch to every server, broadcasts each tensor once (one broadcast reaches all the servers), and
    tells every server the same new version. At start, and first thing after --resume, it pushes its weights with
    a version above every server's, so records sampled by whatever the servers held before count as stale;
  - records popped but not trained when the learner dies are lost (most would be stale after a restart anyway);
  - records of lag 0 sampled by one version, while the learner still holds that version's weights, must carry its
    own logprobs up to numerics: past --max-logprob-mismatch the servers are not running its policy, and it stops.

What it leaves out, on purpose: sharding the learner over GPUs (reinforce_math_fsdp2.py shows FSDP2), a replay
buffer, a KL penalty and LoRA. It reads no data set (the actor does: its TASK section). The reading order: Args; ALGO
LOGIC (the off-policy loss and the update); main() with the loop that pops, trains and pushes; then MACHINERY, what a
reader can skip.

Record format (one Redis list entry per completion: a msgpack map, or a JSON object; never pickle):
  schema                int    1
  id                    str    unique: "<actor id>/<group number>/<index in the group>"
  group_id              str    "<actor id>/<group number>": the completions of one prompt
  prompt_token_ids      [int]  the prompt as the server tokenized it (chat template applied)
  completion_token_ids  [int]  the sampled tokens (the eos token included when the model stopped)
  logprobs              [float] log mu(token) of every completion token under the policy that sampled it
                               (vLLM's processed logprobs: after temperature), as long as completion_token_ids
  reward                float  the actor's grade of the completion (GSM8K: 1.0 if the last \\boxed{} equals the
                               gold answer, else 0.0)
  advantage             float  reward - group mean (/ (group std + 1e-4) with --scale-rewards)
  version_min           int    oldest policy version that sampled a token of this completion
  version_max           int    newest one (they differ when a push landed mid-completion); lag = learner's
                               version - version_max
  temperature           float  optional, 1.0 when absent: the sampling temperature the logprobs are under; the
                               learner refuses a record sampled at another temperature than its --temperature
  finish_reason         str    optional: "length" when the completion hit the token limit (the learner counts it
                               as truncated), "stop" otherwise
  optional, ignored by the learner: prompt, gold (the problem), text, correct, parse_error, actor, time

  python pipeline_learner.py --model Qwen/Qwen2.5-0.5B-Instruct --redis-url redis://localhost:6379/0 \\
      --queue-key gsm8k_rollouts --vllm-urls http://127.0.0.1:8000 http://127.0.0.1:8001 --batch-size 64 --max-lag 2
"""

import datetime
import functools
import hashlib
import json
import math
import os
import re
import shutil
import signal
import socket
import sys
import time
import urllib.parse
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from typing import Literal, NamedTuple, Optional

import requests  # torch and transformers are imported in main, after the arguments are parsed


@dataclass
class Args:
    # Experiment
    model: str = "Qwen/Qwen2.5-0.5B-Instruct"
    """Hugging Face model id or local directory: the policy the servers started from"""

    # Algorithm specific arguments
    train_steps: int = 100
    """number of optimizer steps"""
    batch_size: int = 64
    """records (completions) per step"""
    max_lag: int = 2
    """drop records sampled more than this many versions before the learner's current version"""
    temperature: float = 1.0
    """sampling temperature of the actors (records sampled at another one are refused): the logprobs of the loss are
    those of softmax(logits / temperature), the policy that sampled"""
    learning_rate: float = 1e-6
    """AdamW learning rate"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    loss: Literal["ppo", "tis"] = "ppo"
    """off-policy correction: PPO's clipped ratio against the sampling policy, or truncated importance sampling"""
    clip_eps_low: float = 0.2
    """ppo: lower clip of the ratio (1 - eps)"""
    clip_eps_high: float = 0.2
    """ppo: upper clip of the ratio (1 + eps); DAPO's clip-higher uses 0.28"""
    tis_cap: float = 2.0
    """tis: cap of the per-token importance weight"""
    micro_token_budget: int = 16384
    """maximum padded tokens in one forward/backward micro-batch"""
    activation_checkpointing: bool = True
    """recompute each decoder layer in backward instead of storing its activations (--no-activation-checkpointing:
    faster steps where memory allows)"""
    max_seq_len: int = 1024
    """prompt + completion tokens kept for training (longer ones are truncated)"""
    mask_truncated_completions: bool = False
    """no gradient for a completion the actor's server cut at its token limit (the record's finish_reason "length") or
    cut by --max-seq-len (DAPO's overlong filtering); its reward still counts in the statistics"""

    # The queue
    redis_url: str = "redis://localhost:6379/0"
    """Redis server that holds the queue"""
    queue_key: str = "gsm8k_rollouts"
    """Redis list the actors push records to"""

    # The servers and the weight sync
    vllm_urls: list[str] = field(default_factory=lambda: ["http://127.0.0.1:8000"])
    """vllm_sync_server.py servers to push the weights into (any tensor-parallel size each)"""
    sync_host: Optional[str] = None
    """address the servers' workers reach this learner at, for the weight-sync group (default: this machine's end of
    its connection to the first server)"""
    sync_every_steps: int = 1
    """push the weights to the servers every this many steps (each push is a new version)"""
    verify_sync: bool = False
    """after each push, compare every server's weight checksums with the learner's"""
    max_logprob_mismatch: Optional[float] = None
    """stop the run when the tokens of a step sampled by the weights this trainer pushed last and still holds differ
    from its own logprobs by more than this per token on average: the server does not compute with the weights pushed.
    Default: 1e-3 when the server and the trainer compute in float32, 0.1 when either computes in bfloat16 or float16;
    0: no check"""

    # Logging and checkpoints
    logger: str = "print"
    """comma-separated: print, wandb (W&B reads WANDB_* variables)"""
    rollout_log: Optional[str] = "pipeline_rollouts.jsonl"
    """JSONL file with one line per popped record: its id, status (trained, dropped, rejected), lag, reward (its
    folder is created; an existing file is refused unless --resume, which appends)"""
    checkpoint_dir: str = "checkpoints_pipeline"
    """where checkpoints go (Hugging Face format + trainer state)"""
    save_every: int = 50
    """save a checkpoint every this many steps (and at the end)"""
    keep_checkpoints: int = 3
    """keep the newest this many checkpoints, deleting older ones after each save (0: keep all; the newest, at the
    end the final one, always stays)"""
    resume: bool = False
    """continue from the newest checkpoint in --checkpoint-dir (its weights are pushed first), with the arguments saved
    with it (a flag given again overrides)"""


# ALGO LOGIC: the off-policy loss, the policy's logprobs, micro-batches
# The algorithm: policy_loss, make_batch, update_policy. Memory engineering, which changes no number:
# token_logprobs's chunked lm_head and entropy_rows (no [b, L, V] tensor), and the packing of sequences into
# micro-batches of --micro-token-budget tokens (pack_micro_batches, micro_batch, as_rows).
# Shapes: B sequences in a batch (b in a micro-batch), L tokens of the longest prompt + completion in a micro-batch,
# T completion tokens of its longest completion, N completion tokens of all its rows, V vocabulary, H hidden size.
def policy_loss(
    logprobs,
    sampling_logprobs,
    advantages,
    mask,
    loss="ppo",
    clip_eps_low=0.2,
    clip_eps_high=0.2,
    tis_cap=2.0,
    divisor=None,
    stats=None,
):
    """Policy gradient on data sampled by an older policy mu. logprobs (pi_theta, with grad), sampling_logprobs
    (log mu, from the record: each token's logprob under the version that sampled it), mask [B, T]; advantages [B].

    The data is off-policy: the servers sampled it up to max_lag versions ago (and vLLM's numerics differ a little
    from ours even at lag 0). The policy gradient E_pi[A grad log pi] estimated from samples of mu needs the
    importance weight r = pi_theta / mu per token (the per-token ratio, as PPO and GRPO use, not the product over
    the sequence, whose variance explodes with length). Unbounded r has unbounded variance, hence:
      ppo: per token -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)   (PPO, Schulman et al. 2017, with the
           sampling policy as the "old" policy, as asynchronous PPO variants do). Its gradient is r A grad log pi
           while r is inside the clip range; once r has left it in the direction A pushes, the token's gradient is
           0: the policy has already moved that far away from the data, which no longer gets a say.
      tis: per token -min(r, tis_cap).detach() A log pi   (truncated importance sampling, IMPALA's rho-bar,
           Espeholt et al. 2018): every token keeps a gradient, its weight capped; bias in place of variance.
    Fresh data (lag 0) has r = 1 up to numerics: both reduce to REINFORCE with GRPO's group baseline.
    Aggregation: each sequence's token mean (GRPO), summed over the sequences and divided by `divisor`, the step's
    records counted once, fed through the model or not (update_policy), so that each micro-batch adds its exact share
    (None: this batch's sequences)."""
    import torch

    ratio = torch.exp((logprobs - sampling_logprobs) * mask)  # [B, T]: pi_theta / mu (padding: 1)
    adv = advantages.unsqueeze(1)  # [B, 1]
    if loss == "ppo":
        clipped = torch.clamp(ratio, 1 - clip_eps_low, 1 + clip_eps_high)  # [B, T]
        per_token = -torch.min(ratio * adv, clipped * adv)  # [B, T]
        inactive = (ratio * adv > clipped * adv).float()  # [B, T]: the clip holds the objective, no gradient
    else:  # tis
        per_token = -torch.clamp(ratio, max=tis_cap).detach() * adv * logprobs  # [B, T]
        inactive = (ratio > tis_cap).float()  # [B, T]: weight truncated
    mask = mask.to(per_token.dtype)
    if stats is not None:  # sums over tokens, so micro-batches add up
        for key, x in (("clipped_tokens", inactive), ("ratio_sum", ratio), ("tokens", torch.ones_like(ratio))):
            stats[key] = stats.get(key, 0.0) + (x.detach() * mask).sum().item()
    per_sequence = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)  # [B]
    return per_sequence.sum() / (mask.shape[0] if divisor is None else divisor)


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


def sampler_logprobs(records: list[dict], idx: list[int], n_comp: list[int], mask):
    """log mu: the logprobs the records of the micro-batch's rows `idx` carry (each token's, under the version that
    sampled it), laid out as its completion mask [b, T] (0 at padding, and past a truncation to --max-seq-len)."""
    import torch

    T = mask.shape[1]
    rows = [records[i]["logprobs"][: n_comp[i]] for i in idx]
    return torch.tensor([lp + [0.0] * (T - len(lp)) for lp in rows], dtype=torch.float32, device=mask.device)


class Batch(NamedTuple):  # a step's B records as the update sees them, in the order they were popped
    seqs: list[list[int]]  # [B] prompt + completion token ids, cut at --max-seq-len
    n_prompt: list[int]  # [B] prompt tokens
    n_comp: list[int]  # [B] completion tokens kept (0 if the cut ate the completion)
    hit_limit: list[bool]  # [B] cut by the actor's --max-completion-tokens
    cut: list[bool]  # [B] cut by --max-seq-len
    zero_std: list[bool]  # [B] a record whose group's rewards were all equal (its advantage is exactly 0)
    masked: list[bool]  # [B] no gradient for this record's tokens (--mask-truncated-completions)
    fed: list[int]  # the records fed through the model: those that can change the gradient


def make_batch(records: list[dict], args: Args) -> Batch:
    """Which of the step's records the update sees, and which of their tokens get a gradient. A batch need not hold
    whole groups: a record carries its group's verdict in its advantage. A record whose advantage is exactly 0 adds 0
    to every token's loss, ppo's and tis's alike: it is not fed at all (most groups early and late in a run have equal
    rewards). The loss's divisor still counts it (update_policy), so the gradient is the one that feeding it would
    give."""
    seqs = [(rec["prompt_token_ids"] + rec["completion_token_ids"])[: args.max_seq_len] for rec in records]
    n_prompt = [len(rec["prompt_token_ids"]) for rec in records]
    n_comp = [max(0, len(seq) - n) for seq, n in zip(seqs, n_prompt, strict=True)]
    hit_limit = [rec.get("finish_reason") == "length" for rec in records]
    cut = [len(rec["prompt_token_ids"]) + len(rec["completion_token_ids"]) > args.max_seq_len for rec in records]
    zero_std = [rec["advantage"] == 0.0 for rec in records]
    masked = [args.mask_truncated_completions and (hit_limit[i] or cut[i]) for i in range(len(records))]
    fed = [i for i in range(len(records)) if n_comp[i] and not masked[i] and not zero_std[i]]
    return Batch(seqs, n_prompt, n_comp, hit_limit, cut, zero_std, masked, fed)


def update_policy(model, optimizer, batch: Batch, records, args: Args, pad_id: int, version: int, check, bf16):
    """One optimizer step over the micro-batches of the records fed (none fed: one, its loss times 0, for the check and
    the entropy). The mismatch is measured on the tokens sampled by `version`, the weights this learner holds;
    `check(mismatch)` runs on it before the update (None: those weights are not the servers'). `bf16`: bfloat16
    autocast, fp32 master weights. Returns the step's statistics and whether the weights were updated (finite)."""
    import torch

    device = next(model.parameters()).device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    advantages = torch.tensor([rec["advantage"] for rec in records], dtype=torch.float32)  # [B]
    rows = batch.fed or [i for i in range(len(batch.seqs)) if batch.n_comp[i]]  # none fed: see the docstring
    lengths = [len(batch.seqs[i]) for i in rows]
    micro = [[rows[j] for j in mb] for mb in pack_micro_batches(lengths, args.micro_token_budget)]
    micro = micro if batch.fed else micro[:1]
    divisor = len(batch.seqs)  # the step's records, fed or not: each micro-batch's loss is its exact share
    stats = {"loss": 0.0, "entropy_sum": 0.0, "tokens_fed": sum(batch.n_comp[i] for mb in micro for i in mb)}
    mismatch_sum = 0.0  # |our logprob - the sampler's| over the tokens sampled by the current version
    fresh_tokens = 0  # those tokens
    bad = False  # a non-finite loss: no update
    optimizer.zero_grad(set_to_none=True)
    for idx in micro:
        ids, attn, mask, at = micro_batch(batch.seqs, batch.n_prompt, idx, pad_id, device)
        train_mask = mask * torch.tensor([not batch.masked[i] for i in idx], device=device)[:, None]  # [b, T]
        with autocast:
            flat, entropy = token_logprobs(model, ids, attn, at, args.temperature)  # [N], [N]
            logprobs = as_rows(flat, mask)  # [b, T], under the sampler's policy
        stats["entropy_sum"] += entropy.sum().item()
        mu = sampler_logprobs(records, idx, batch.n_comp, mask)  # [b, T]: the sampling policy's logprobs
        sampled_now = torch.tensor([version == records[i]["version_min"] for i in idx], device=device)  # [b]
        fresh = sampled_now[:, None] * mask  # [b, T]: tokens sampled by the weights we hold
        mismatch_sum += ((logprobs.detach() - mu).abs() * fresh).sum().item()
        fresh_tokens += fresh.sum().item()
        loss = policy_loss(
            logprobs,
            mu,
            advantages[idx].to(device),
            train_mask,
            args.loss,
            args.clip_eps_low,
            args.clip_eps_high,
            args.tis_cap,
            divisor,
            stats=stats if batch.fed else {},
        ) * bool(batch.fed)
        if not torch.isfinite(loss):
            bad = True
            break
        loss.backward()
        stats["loss"] += loss.item()
    if not micro:  # nothing fed: the zero gradient that feeding the records gives (AdamW's momentum still steps)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
    stats["mismatch"] = mismatch_sum / fresh_tokens if fresh_tokens else float("nan")  # nan: no record of lag 0
    if check is not None and not bad:  # before the update: records sampled by weights we do not hold teach nothing
        check(stats["mismatch"])
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
    stats["grad_norm"] = grad_norm.item()
    updated = not bad and torch.isfinite(grad_norm).item()
    if updated:
        optimizer.step()
    return stats, updated


def main() -> None:
    args = parse_args()  # before the heavy imports: --help is instant
    run_args = asdict(args)  # saved with every checkpoint
    check_args(args)
    check_run_files(args, args.rollout_log)
    ckpts = checkpoint_steps(args.checkpoint_dir, say=True) if args.resume else []
    if ckpts and ckpts[-1] >= args.train_steps:
        print(f"nothing to do: the newest checkpoint, step_{ckpts[-1]}, has --train-steps {args.train_steps}")
        raise SystemExit(0)
    check_servers(args.vllm_urls)  # before anything heavy: no server stops the run here, saying how to start one

    import redis
    import torch
    from transformers import AutoTokenizer

    # TRY NOT TO MODIFY: device, Redis, logging (nothing here is random: no sampling, no shuffling, dropout off)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise SystemExit(
            f"{torch.cuda.get_device_name(device)} has no bfloat16 (Ampere or newer): this learner computes in bf16 "
            "autocast"
        )
    no_gpu = " (no CUDA GPU visible: a GPU needs torch built for CUDA and a CUDA 13 driver, see requirements.txt)"
    print(f"training on {device}" + ("" if device.type == "cuda" else no_gpu), flush=True)
    where = args.redis_url.rsplit("@", 1)[-1]  # never print a password
    r = redis.Redis.from_url(args.redis_url, socket_connect_timeout=5, socket_timeout=60)
    with_retries("PING", where, r.ping)
    loggers = set(args.logger.split(","))

    # model (fp32 master weights; bf16 autocast: see `bf16` below), optimizer, resume
    load_from = os.path.join(args.checkpoint_dir, f"step_{ckpts[-1]}") if ckpts else args.model
    tokenizer = AutoTokenizer.from_pretrained(load_from)
    model = load_model(load_from, device, args.activation_checkpointing)
    vocab_size = model.get_input_embeddings().num_embeddings
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    counters = {"step": 0, "version": 0, "counts": {}, "wandb_id": None}  # a new run's
    if load_from != args.model:
        counters = load_trainer_state(load_from, optimizer)  # the checkpoint's
    step = counters["step"]  # optimizer steps taken
    version = counters["version"]  # the policy version the servers hold (one per push)
    counts = Counter(counters["counts"])  # trained, dropped, rejected (and lost) records since the start of the run
    wandb_id = start_wandb(args, counters["wandb_id"]) if "wandb" in loggers else None  # --resume: the same W&B run

    # the servers' group, then our weights first: above every version the servers (and the queue) have seen
    print(f"loaded {load_from} on {device}; joining the workers of {len(args.vllm_urls)} server(s)", flush=True)
    sync = init_weight_sync(args.vllm_urls, device, args.sync_host)
    served = [requests.get(u + "/runtime_version", timeout=30, headers=auth_headers()).json() for u in args.vllm_urls]
    version = max([version, *(info["version"] for info in served)]) + 1
    push_weights(sync, model, version)
    if args.verify_sync:
        verify_weights(sync, model)
    print(f"pushed the weights of {load_from} to {len(args.vllm_urls)} server(s) as version {version}", flush=True)
    # update_policy's bf16 autocast: on a GPU, and on a CPU beside bf16 servers; the mismatch limit: both ends' dtypes
    bf16 = device.type == "cuda" or sync["dtype"] == "bfloat16"
    limit = logprob_mismatch_limit(args.max_logprob_mismatch, [sync["dtype"], "bfloat16" if bf16 else "float32"])
    current = True  # the learner holds the weights of its last push (`version`): records of that version are fresh

    start_time = time.time()
    first_step = step
    for signum in (signal.SIGTERM, signal.SIGUSR1):  # preemption, from here on: finish the step, save it, end
        signal.signal(signum, request_stop)
    while step < args.train_steps and not STOP_REQUESTS:
        t0 = time.time()
        # 1) wait for a batch: pop, decode, drop stale records (lag > max_lag)
        records, lags, t_wait, popped_log = pop_records(r, args, version, vocab_size, counts, where)
        if records is None:  # a stop came while the queue was dry: this step is given up (the last one saved below)
            break

        # 2) which records the update sees (those that can change the gradient), which of their tokens get one
        batch = make_batch(records, args)

        # 3) loss and update: one optimizer step over all micro-batches of the records fed; before it, the check that
        # the servers sample this policy (on the records of lag 0, if the servers hold the weights we hold)
        check = None
        if current:
            check = functools.partial(
                check_logprob_mismatch, limit=limit, step=step + 1, version=version, transport="collective"
            )
        stats, updated = update_policy(
            model, optimizer, batch, records, args, tokenizer.pad_token_id or 0, version, check, bf16
        )
        if not updated:  # no update (the push below still marks the step)
            print(f"WARNING: non-finite loss or gradient at step {step + 1}: update skipped", flush=True)
        step += 1

        # 4) push the weights to every server: a new version
        sync_s = 0.0
        if step % args.sync_every_steps == 0:
            version += 1
            sync_s = push_weights(sync, model, version)
            if args.verify_sync:
                verify_weights(sync, model)
            current = True
        elif updated:  # records of `version` now come from weights we no longer hold: lag 0 by number, stale in fact
            current = False

        # 5) log, checkpoint
        queue_len = with_retries("LLEN", where, lambda: r.llen(args.queue_key))
        totals = {
            "dropped": counts["dropped"],
            "rejected": counts["rejected"],
            "trained": counts["trained"],
            "max_lag": args.max_lag,
            "queue_len": queue_len,
            "version": version,
        }
        seconds = {"wait_s": t_wait, "sync_s": sync_s, "step_s": time.time() - t0}
        log_metrics(step_metrics(records, batch, stats, lags, totals, seconds), step, loggers)
        if args.rollout_log:
            write_rollouts(args.rollout_log, step, popped_log)
        if step % args.save_every == 0 or step == args.train_steps:
            path = os.path.join(args.checkpoint_dir, f"step_{step}")
            counters = {"step": step, "version": version, "counts": dict(counts), "wandb_id": wandb_id}
            save_checkpoint(path, model, tokenizer, optimizer, counters, run_args)
            prune_checkpoints(args.checkpoint_dir, args.keep_checkpoints)
    print(f"done: {step - first_step} steps in {time.time() - start_time:.1f}s; records: {dict(counts)}", flush=True)
    if STOP_REQUESTS and step < args.train_steps:  # the last step taken is saved (if it is not yet), then the run ends
        if step and step not in checkpoint_steps(args.checkpoint_dir):
            path = os.path.join(args.checkpoint_dir, f"step_{step}")
            counters = {"step": step, "version": version, "counts": dict(counts), "wandb_id": wandb_id}
            save_checkpoint(path, model, tokenizer, optimizer, counters, run_args)
            prune_checkpoints(args.checkpoint_dir, args.keep_checkpoints)
        print(f"stopped by {signal.Signals(STOP_REQUESTS[0]).name} after step {step}: --resume goes on from there")
        raise SystemExit(128 + STOP_REQUESTS[0])


# MACHINERY: what a reader can skip. The check that the servers sample this policy; the records' decoding and the
# queue; the client side of vllm_sync_server.py and the weight sync; the model's loading and refusals; preemption;
# logging, checkpoints and resume; the arguments' refusals.
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


# Records: decode and check everything the loss will index with, before anything touches the model
FIELDS = {
    "schema": int,
    "id": str,
    "group_id": str,
    "prompt_token_ids": list,
    "completion_token_ids": list,
    "logprobs": list,
    "reward": float,
    "advantage": float,
    "version_min": int,
    "version_max": int,
}


def decode_record(raw: bytes, vocab_size: int, temperature: float = 1.0) -> tuple[Optional[dict], Optional[str]]:
    """A queue entry -> (record, None), or (None, why it is rejected). JSON if it starts with '{', else msgpack.
    `temperature`: the learner's; a record's logprobs must be under the same one (1.0 when the record has none)."""
    import msgpack

    try:
        rec = json.loads(raw) if raw[:1] == b"{" else msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:  # pickle, garbage, a truncated write: all land here
        return None, f"neither JSON nor msgpack ({type(e).__name__}: {str(e)[:100]})"
    if not isinstance(rec, dict):
        return None, f"not a map but {type(rec).__name__}"
    for name, kind in FIELDS.items():
        value = rec.get(name)
        ok = isinstance(value, (int, float)) and math.isfinite(value) if kind is float else isinstance(value, kind)
        if not ok or isinstance(value, bool):
            return None, f"field {name!r} missing or not {kind.__name__} (got {type(value).__name__})"
    if rec["schema"] != 1:
        return None, f"schema {rec['schema']} (this learner reads 1)"
    for name in ("prompt_token_ids", "completion_token_ids"):
        if not rec[name] or not all(type(t) is int and 0 <= t < vocab_size for t in rec[name]):
            return None, f"{name} empty or not token ids in [0, {vocab_size})"
    lp = rec["logprobs"]
    if len(lp) != len(rec["completion_token_ids"]):
        return None, f"{len(lp)} logprobs for {len(rec['completion_token_ids'])} completion tokens"
    if not all(type(x) in (int, float) and math.isfinite(x) and x <= 1e-3 for x in lp):
        return None, "logprobs must be finite and <= 0"
    if not 0 <= rec["version_min"] <= rec["version_max"]:
        return None, f"versions {rec['version_min']}..{rec['version_max']}"
    sampled_at = rec.get("temperature", 1.0)  # absent: the record format's default
    if type(sampled_at) not in (int, float) or sampled_at != temperature:
        told = f"temperature {sampled_at!r}" if "temperature" in rec else "no temperature field (so 1.0)"
        why = f"{told}, but this learner trains at --temperature {temperature}: its logprobs are another policy's"
        return None, why
    return rec, None


def pop_records(r, args: Args, version: int, vocab_size: int, counts: Counter, where: str):
    """Pop records from the queue until --batch-size of them can be trained on: each is decoded and checked
    (decode_record), a record ahead of this learner's `version` is rejected, one whose lag is past --max-lag dropped.
    `counts` (trained, dropped, rejected) grows. Returns the records to train on, the lags popped (lag -> records),
    the seconds spent waiting for the queue, and one rollout-log line per record popped. After a stop (request_stop),
    5 s of an empty queue give the step up: the records are None, and those popped for it are lost (counted lost)."""
    records = []
    lags = Counter()
    t_wait = 0.0
    popped_log = []
    last_note = time.time()
    while len(records) < args.batch_size:
        tw = time.time()
        item = with_retries("BLPOP", where, lambda: r.blpop([args.queue_key], timeout=5))
        t_wait += time.time() - tw
        if item is None and STOP_REQUESTS:  # stopped, and the queue is dry: no batch will come
            print(f"the queue is dry: the step is given up, and the {len(records)} records popped for it are lost")
            counts.update(trained=-len(records), lost=len(records))
            return None, lags, t_wait, popped_log
        if item is None:  # nothing for 5 s: say so every 30 s
            if time.time() - last_note > 30:
                print(f"waiting for records in {args.queue_key}", flush=True)
                last_note = time.time()
            continue
        raws = [item[1]]
        more = args.batch_size - len(records) - 1
        if more:
            raws += with_retries("LPOP", where, lambda more=more: r.lpop(args.queue_key, more)) or []
        for raw in raws:
            rec, why = decode_record(raw, vocab_size, args.temperature)
            if rec is not None and rec["version_max"] > version:
                why = f"version {rec['version_max']} is ahead of this learner's {version}"
                rec = None
            if rec is None:
                counts["rejected"] += 1
                print(f"WARNING: rejected a record of {len(raw)} bytes: {why}", flush=True)
                popped_log.append({"status": "rejected", "reason": why, "bytes": len(raw)})
                continue
            lag = version - rec["version_max"]
            lags[lag] += 1
            status = "dropped" if lag > args.max_lag else "trained"
            counts[status] += 1
            logged = ("id", "version_min", "version_max", "reward", "advantage")
            popped_log.append({"status": status, "lag": lag} | {name: rec[name] for name in logged})
            if status == "trained":
                records.append(rec)
    return records, lags, t_wait, popped_log


# The client side of vllm_sync_server.py, for several servers in one group
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


def init_weight_sync(urls: list[str], device, sync_host: Optional[str] = None) -> dict:
    """One collective group with the workers of all servers, this learner as rank 0, outside torch.distributed's
    default group (NCCL on CUDA, gloo on CPU). Each server answers in two lines: "joining", then "ok"."""
    import torch.distributed as dist

    infos = [requests.get(url + "/runtime_version", timeout=30, headers=auth_headers()).json() for url in urls]
    dtypes = {info["dtype"] for info in infos}
    if len(dtypes) != 1:
        raise RuntimeError(f"the servers compute in different dtypes {dtypes}: start them with the same --dtype")
    # NCCL on one end and gloo on the other never meet: say so before joining
    for url, info in zip(urls, infos, strict=True):
        if info["device"] != device.type:
            raise RuntimeError(
                f"the server at {url} runs on {info['device']} and this learner on {device.type}: the "
                "weight sync needs both ends on GPUs (NCCL) or both on CPU (gloo)"
            )
    with socket.socket() as s:  # a free port for the group's TCPStore, which this process hosts
        s.bind(("", 0))
        port = s.getsockname()[1]
    host = sync_host or local_address(urls[0])  # where the servers' workers connect to our store
    timeout = datetime.timedelta(seconds=300)
    # rank 0 = this learner; server k's workers (its tensor-parallel size) take the next ranks, after those of servers
    # 0..k-1: rank_offset is where they start
    offsets = [1 + sum(info["workers"] for info in infos[:k]) for k in range(len(urls))]
    world_size = 1 + sum(info["workers"] for info in infos)
    connections = 8  # gloo (CPU): many broadcasts in flight at once hide each one's latency (bench/weight_sync.py)
    store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
    wait_s = 2 * max(info["sync_timeout_s"] for info in infos) + 180  # a 2nd line: after a collective and one before
    answers = []
    for url, offset in zip(urls, offsets, strict=True):
        body = {"host": host, "port": port, "world_size": world_size, "rank_offset": offset, "connections": connections}
        answers.append(lines(post(url, "/init_communicator", body, stream=True, timeout=wait_s)))
    for answer in answers:
        next(answer)  # "joining": the server's workers are connecting to our store now
    try:
        if device.type == "cuda":  # building our end completes the rendezvous of all ranks
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"  # a late peer must raise, not end the process
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(store, 0, world_size, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()  # the broadcasts spread over `connections` TCP connections
            opts._timeout, opts._threads = timeout, 2 * connections
            opts._devices = [dist.ProcessGroupGloo.create_default_device() for _ in range(connections)]
            pg = dist.ProcessGroupGloo(store, 0, world_size, opts)
    except Exception as e:  # some workers never joined: the servers' second lines say why
        why = [
            f"{url}: {next(a, {'error': 'no answer'}).get('error', 'joined')}"
            for url, a in zip(urls, answers, strict=True)
        ]
        raise RuntimeError(f"the servers' workers did not join this learner's group at {host}:{port}: {why}") from e
    dones = connect_nccl(pg, device, lambda: [next(answer) for answer in answers], wait_s)  # (NCCL: and connect)
    for url, done in zip(urls, dones, strict=True):
        if done["status"] != "ok":
            raise RuntimeError(f"{url}/init_communicator failed (this learner's group at {host}:{port}): {done}")
    return {"urls": urls, "pg": pg, "store": store, "dtype": dtypes.pop(), "device": device, "timeout_s": wait_s}


def push_weights(sync: dict, model, version: int) -> float:
    """Broadcast every parameter (cast to the servers' dtype) to all servers at once, one broadcast each, all in flight
    (up to 1 GiB of cast copies); they load them, pausing and resuming the generation in flight, and all take the same
    `version`. Returns the seconds taken."""
    import torch
    import torch.distributed as dist

    t0 = time.time()
    dtype = getattr(torch, sync["dtype"])
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    params = [{"name": n, "dtype": sync["dtype"], "shape": list(p.shape)} for n, p in named]
    body = {"params": params, "version": version}
    answers = [
        lines(post(url, "/update_param_batch", body, stream=True, timeout=sync["timeout_s"])) for url in sync["urls"]
    ]
    for answer in answers:
        next(answer)  # "receiving": the server checked the metadata and waits for the broadcasts
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    inflight = []  # (bytes, work) of the broadcasts not known to be done
    ahead = 0  # their bytes
    for _, p in named:  # one broadcast reaches every server
        buf = p.to(sync["device"], dtype).contiguous().view(-1).view(torch.uint8)  # bytes, as the servers receive them
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
            f"the weight push to {sync['urls']}",
        )
    try:
        for _, work in inflight:  # gloo: blocks, and raises at the group's timeout
            work.wait()
    except RuntimeError as e:  # or when a server's end of the group went away (killed mid-push): named, as post does
        raise RuntimeError(f"a vLLM server of {', '.join(sync['urls'])} broke off the weight push: {e}") from e
    for url, answer in zip(sync["urls"], answers, strict=True):
        done = next(answer)
        if done["status"] != "ok" or done["version"] != version:
            raise RuntimeError(f"weight push to {url} failed: {done}")
    return time.time() - t0


def verify_weights(sync: dict, model) -> None:
    """Compare every server's per-parameter sha256 (of the weights it computes with) with ours."""
    import torch

    dtype = getattr(torch, sync["dtype"])
    ours = {
        n: hashlib.sha256(p.detach().to(dtype).cpu().contiguous().view(torch.uint8).numpy()).hexdigest()
        for n, p in model.state_dict().items()
    }  # state_dict: a tied lm_head.weight too, as the servers report it
    for url in sync["urls"]:
        theirs = requests.get(url + "/weights_checksum", timeout=600, headers=auth_headers()).json()["checksums"]
        differ = sorted(n for n in ours.keys() | theirs.keys() if ours.get(n) != theirs.get(n))
        if differ:
            raise RuntimeError(f"{url}: weights differ after the push: {differ[:5]}")


def check_servers(urls: list[str]) -> None:
    """Before any work: a server must answer at each of `urls` (a bounded wait of a few seconds). One does not: one
    line naming its URL and how to start one, exit 1."""
    for url in urls:
        for attempt in range(3):
            try:
                requests.get(url + "/health", timeout=10, headers=auth_headers())
                break
            except requests.RequestException:
                time.sleep(attempt + 1)
        else:
            raise SystemExit(
                f"no server answers at {url}: start one (python vllm_sync_server.py --model MODEL --port PORT) and "
                "name it in --vllm-urls"
            )


def with_retries(what: str, where: str, fn):
    """Run a Redis call; while Redis is unreachable, say so and retry with exponential backoff (1 s .. 30 s)."""
    import redis

    delay = 1.0
    while True:
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError) as e:
            print(f"WARNING: Redis at {where} is not reachable ({what}: {e}); retrying in {delay:.0f}s", flush=True)
            time.sleep(delay)
            delay = min(2 * delay, 30.0)


# The model, and the refusals of one whose logprobs the learner would get wrong
def load_model(path: str, device, activation_checkpointing: bool):
    """The policy at `path` in fp32 on `device`, in training mode with every dropout off (disable_dropout), refused if
    its forward changes its logits after the lm_head (check_logits); activation checkpointing if asked."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).train()
    check_logits(model.config)  # token_logprobs's lm_head shortcut must compute the model's own logits
    disable_dropout(model)  # the policy's logprobs must be the sampler's: no random masks in training mode
    if activation_checkpointing:
        model.gradient_checkpointing_enable()  # keep one decoder layer's activations at a time; recompute in backward
    return model


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


# Logging and the run's files: its checkpoints, the arguments saved with them, its rollout log
TRAINER_STATE = "trainer_state.pt"  # a checkpoint's last file: a step_N folder without it is incomplete


def log_metrics(metrics: dict, step: int, loggers: set[str]) -> None:
    """The step's metrics, to each of `loggers`: one printed line, W&B (wandb.init ran in main; text metrics such as
    lag_hist are printed only)."""
    text = {k: f"{v:.4g}" if isinstance(v, float) else str(v) for k, v in metrics.items()}
    if "print" in loggers:
        print(f"step {step}: " + " ".join(f"{k}={v}" for k, v in text.items()), flush=True)
    if "wandb" in loggers:
        import wandb

        wandb.log({k: v for k, v in metrics.items() if not isinstance(v, str)}, step=step)


def start_wandb(args: Args, run_id: Optional[str]) -> str:
    """Start W&B logging (it reads WANDB_* variables; WANDB_MODE=offline writes to ./wandb only) and return the run's
    id, saved with each checkpoint: --resume continues that W&B run, not a new one."""
    import wandb

    return wandb.init(config=asdict(args), id=run_id, resume="allow").id


def step_metrics(records: list[dict], batch: Batch, stats: dict, lags: Counter, totals: dict, seconds: dict) -> dict:
    """The step's metrics (docs/pipeline.md, Logged metrics): from its records, its batch, the update's `stats`, the
    lags popped, the run's `totals` (dropped, rejected, trained, max_lag, queue_len, version) and `seconds` (wait_s,
    sync_s, step_s)."""
    B = len(records)
    fed = stats["tokens_fed"]  # completion tokens fed through the model (none fed: those update_micro_batches ran)
    tokens = max(1.0, stats.get("tokens", 0.0))  # completion tokens of the batch
    step_s = seconds["step_s"]
    return {
        "loss": stats["loss"],
        "grad_norm": stats["grad_norm"],
        "reward": sum(x["reward"] for x in records) / B,
        "avg_completion_length": sum(batch.n_comp) / B,
        "entropy": stats["entropy_sum"] / fed if fed else float("nan"),  # nan: no token was fed
        "completion_truncated_rate": sum(batch.hit_limit) / B,
        "seq_len_truncated_rate": sum(batch.cut) / B,
        "frac_reward_zero_std": sum(batch.zero_std) / B,
        "frac_samples_skipped": 1 - len(batch.fed) / B,  # no gradient to give: not fed (make_batch)
        "clip_frac": stats.get("clipped_tokens", 0.0) / tokens,
        "ratio": stats.get("ratio_sum", tokens) / tokens,
        "logprob_mismatch": stats["mismatch"],
        "lag_hist": ",".join(f"{k}:{v}" for k, v in sorted(lags.items())),
        "lag_mean": sum(k * v for k, v in lags.items()) / max(1, sum(lags.values())),
        "mixed_versions": sum(x["version_min"] != x["version_max"] for x in records),
        "dropped": sum(v for k, v in lags.items() if k > totals["max_lag"]),
        "dropped_total": totals["dropped"],
        "rejected_total": totals["rejected"],
        "trained_total": totals["trained"],
        "samples_per_s": B / step_s,
        "idle_frac": seconds["wait_s"] / step_s,
        "queue_len": totals["queue_len"],
        "version": totals["version"],
        "sync_s": seconds["sync_s"],
        "step_s": step_s,
    }


def write_rollouts(path: str, step: int, popped_log: list[dict]) -> None:
    """Append one line per record popped this step (trained, dropped or rejected, and why) to the JSONL file at
    `path`."""
    with open(path, "a") as rollout_log:
        for line in popped_log:
            rollout_log.write(json.dumps({"step": step, **line}) + "\n")


def save_checkpoint(path: str, model, tokenizer, optimizer, counters: dict, run_args: dict) -> None:
    """A checkpoint at `path`: the model in Hugging Face format (vLLM and transformers load it as it is), the
    tokenizer, the run's arguments (--resume reads them) and trainer_state.pt (the optimizer, `counters`, torch's
    random generator). Written whole in `path`.tmp, then published under `path` at once (publish_checkpoint)."""
    import torch

    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # a save of this step cut short before
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, "args.json"), "w") as f:
        json.dump(run_args, f, indent=1)
    state = {"optimizer": optimizer.state_dict(), **counters, "torch_rng": torch.get_rng_state()}
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
    """What save_checkpoint saved at `path` besides the model: trainer_state.pt into `optimizer` and torch's random
    generator. Returns the run's counters (step, version, counts, wandb_id)."""
    import torch

    state = torch.load(os.path.join(path, TRAINER_STATE), map_location="cpu", weights_only=True)  # any device's
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    print(f"resumed from {path} at step {state['step']}", flush=True)
    return {name: state.get(name) for name in ("step", "version", "counts", "wandb_id")}


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


COUNTS = ("batch_size", "micro_token_budget", "max_seq_len", "sync_every_steps", "save_every")  # each must be >= 1


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


def check_args(args: Args) -> None:
    """Settings refused before any work, naming the flag (the counts are parse_args's to check)."""
    if args.max_logprob_mismatch is not None and args.max_logprob_mismatch < 0:
        raise SystemExit(f"--max-logprob-mismatch must be >= 0 (0: no check), got {args.max_logprob_mismatch}")


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


if __name__ == "__main__":
    main()
