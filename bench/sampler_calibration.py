"""Benchmark: does vllm_sync_server.py sample from the distribution whose logprobs it reports? vLLM on the CPU against
transformers' own sampling, on the real model.

GRPO's gradient assumes each completion is drawn from the policy softmax(logits / T) whose logprobs the trainer
computes. The trainers check the logprobs the server reports (--max-logprob-mismatch), not the draw itself: vLLM's CPU
sampler is a kernel of its own (a Gumbel-max argmax with hashed noise,
vllm/v1/sample/ops/topk_topp_sampler.py, forward_cpu), and one of its versions could not reach half of a large
vocabulary. At every sampled position two averages must agree for an unbiased sampler, each against its expectation
under the trainer's distribution p (an independent float32 forward pass of transformers):
  - how often the sampled token is p's most likely one, against the mean of p's largest probability;
  - the mean -log p(sampled token), against the mean entropy of p.
Each gap is printed as z, over its standard error: given the tokens before it, each position's term has mean 0 under
an unbiased sampler, so the terms are uncorrelated and z is about standard normal (|z| > 3: a biased sampler).
Sources: transformers' generate (multinomial; the reference), and the server seeded as the trainers seed it, and
unseeded. The task's first --prompts training prompts (bench/arithmetic.py's), --n completions each.

Run: python bench/sampler_calibration.py [--dtype float32] [--temperature 0.6] [--prompts 24] [--n 8] [--tokens 48]
"""

import argparse
import json
import os
import signal
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
TRAIN = os.path.join(ROOT, "tests", "fixtures", "arithmetic_one_digit_gsm8k", "train.jsonl")


def calibration(model, prompt_ids: list[int], completions: list[list[int]], temperature: float) -> dict:
    """Sums over the completions' positions: top-1 picks, p's top-1 probability (and its Bernoulli variance),
    -log p(sampled), p's entropy (the mean of -log p under p) and the variance of -log p under p."""
    import torch

    sums = {"positions": 0, "top1_picked": 0.0, "top1_p": 0.0, "top1_var": 0.0, "neg_logp": 0.0, "entropy": 0.0}
    sums["neg_logp_var"] = 0.0
    for tokens in completions:
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + tokens])).logits[0, len(prompt_ids) - 1 : -1]  # [T, V]
        logp = (logits.float() / temperature).log_softmax(-1)  # [T, V]
        sampled = torch.tensor(tokens)  # [T]
        sums["positions"] += len(tokens)
        sums["top1_picked"] += (logp.argmax(-1) == sampled).sum().item()
        top1 = logp.max(-1).values.exp()  # [T]
        entropy = -(logp.exp() * logp).sum(-1)  # [T]
        sums["top1_p"] += top1.sum().item()
        sums["top1_var"] += (top1 * (1 - top1)).sum().item()
        sums["neg_logp"] += -logp.gather(1, sampled[:, None]).sum().item()
        sums["entropy"] += entropy.sum().item()
        sums["neg_logp_var"] += ((logp.exp() * logp.square()).sum(-1) - entropy.square()).sum().item()
    return sums


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the server's dtype")
    parser.add_argument("--temperature", type=float, default=0.6, help="sampling temperature")
    parser.add_argument("--prompts", type=int, default=24, help="training prompts")
    parser.add_argument("--n", type=int, default=8, help="completions per prompt")
    parser.add_argument("--tokens", type=int, default=48, help="completion tokens at most")
    args = parser.parse_args()

    import requests
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl_grpo import free_port, start_server

    from real_model import real_model_dir

    path = real_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = tokenizer.eos_token_id
    with open(TRAIN) as f:
        questions = [json.loads(line)["question"] for line in f][: args.prompts]
    chats = [[{"role": "user", "content": q}] for q in questions]
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in texts]  # as the trainers' prompt_ids
    port = free_port()
    server = start_server(path, port, os.path.join(tempfile.gettempdir(), "bench_sampler.log"), True, args.dtype)
    results = {}
    try:
        for source in ("transformers generate", "server, seeded", "server, unseeded"):
            total = {}
            for i, ids in enumerate(prompts):
                if source == "transformers generate":
                    torch.manual_seed(i)
                    out = model.generate(
                        torch.tensor([ids]),
                        do_sample=True,
                        temperature=args.temperature,
                        top_k=0,
                        top_p=1.0,
                        max_new_tokens=args.tokens,
                        num_return_sequences=args.n,
                        pad_token_id=eos,
                    )[:, len(ids) :].tolist()
                    completions = [row[: row.index(eos) + 1] if eos in row else row for row in out]
                else:
                    body = {"prompts": [ids], "n": args.n, "temperature": args.temperature, "max_tokens": args.tokens}
                    if source == "server, seeded":
                        body["seed"] = 1000 * i + 7
                    answer = requests.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=600).json()
                    completions = [c["token_ids"] for c in answer["results"][0]["completions"]]
                for key, value in calibration(model, ids, completions, args.temperature).items():
                    total[key] = total.get(key, 0) + value
            results[source] = total
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    print(
        f"\nSmolLM2-135M-Instruct, T {args.temperature}, server in {args.dtype}, {args.prompts} x {args.n} completions"
    )
    print(f"{'source':<24}{'positions':>10}{'top-1 picked':>13}{'mean top-1 p':>13}{'z':>6}", end="")
    print(f"{'-log p':>8}{'entropy':>8}{'z':>6}")
    for source, s in results.items():
        n = s["positions"]
        z_top1 = (s["top1_picked"] - s["top1_p"]) / s["top1_var"] ** 0.5
        z_logp = (s["neg_logp"] - s["entropy"]) / s["neg_logp_var"] ** 0.5
        print(f"{source:<24}{n:>10}{s['top1_picked'] / n:>13.4f}{s['top1_p'] / n:>13.4f}{z_top1:>6.1f}", end="")
        print(f"{s['neg_logp'] / n:>8.4f}{s['entropy'] / n:>8.4f}{z_logp:>6.1f}")


if __name__ == "__main__":
    main()
