"""Build a tiny Qwen2 model and tokenizer on disk, with no hub access.

The tests (and the benchmarks) use it instead of a real checkpoint: random weights, head_dim 32 (vLLM's
CPU attention does not support 16), a byte-level BPE trained here with `tokenizers`, a ChatML chat
template, everything saved with `save_pretrained` so that vLLM, transformers and the scripts load it as
they would load Qwen2.5.

The tokenizer makes each of `\\boxed{0}` ... `\\boxed{9}` a single ordinary token (it decodes to the
literal text), so a random policy sometimes writes a gradable answer in a single step; that is what
lets a learning test on CPU finish in a minute (see ../shared/FIELD_NOTES.md).
"""

from __future__ import annotations

import json
import os

BOXED_TOKENS = [f"\\boxed{{{d}}}" for d in range(10)]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# A small GSM8K-like corpus for the BPE merges.
CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
    "First, think step by step. Then put your final answer inside \\boxed{...}.",
    "The answer is \\boxed{72}. So the total is 48 + 24 = 72 clips.",
    "<think>Let me add the numbers: 3 + 4 = 7.</think> The final answer is \\boxed{7}.",
    "Solve for x: 2x + 3 = 17. Then x = 7. What is the value of 1/2 + 1/3?",
    "A train travels 60 miles per hour for 3 hours. How far does it travel? 180 miles.",
    "Betty has 100 dollars, she needs 200 dollars. Her parents give her 15 dollars.",
    "James writes a 3-page letter to 2 different friends twice a week. How many pages a year?",
] * 4


def build_tokenizer(path: str, vocab_size: int, byte_alphabet: bool = True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    n_base = vocab_size - len(SPECIAL) - len(BOXED_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=n_base,
        special_tokens=SPECIAL,
        # all 256 bytes, or (for a very small vocabulary) only the characters of the corpus
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if byte_alphabet else [],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    hf.add_tokens(BOXED_TOKENS)  # ordinary (non-special) tokens: decoding gives the literal text
    hf.chat_template = CHAT_TEMPLATE
    assert len(hf) <= vocab_size, (len(hf), vocab_size)
    hf.save_pretrained(path)
    return hf


def build_tiny_model(
    path: str,
    vocab_size: int = 384,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    tie_word_embeddings: bool = True,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    init_std: float = 0.02,
    byte_alphabet: bool = True,
) -> str:
    """Write a random Qwen2 model + tokenizer to `path` (skipped if it is already there)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    os.makedirs(path, exist_ok=True)
    tok = build_tokenizer(path, vocab_size, byte_alphabet)
    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=hidden_size // num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=init_std,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():  # non-trivial biases and norms, so a wrong load of any tensor shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id).save_pretrained(path)
    with open(os.path.join(path, "tiny_model.json"), "w") as f:
        json.dump({"boxed_token_ids": tok.convert_tokens_to_ids(BOXED_TOKENS)}, f)
    return path


if __name__ == "__main__":
    import sys

    # python tests/tiny_model.py [PATH] [--toy]: --toy is the learnable toy model of the learning tests and the CPU
    # demo (a 128-token vocabulary in which each `\boxed{d}` is one token)
    toy = "--toy" in sys.argv
    paths = [a for a in sys.argv[1:] if a != "--toy"]
    path = paths[0] if paths else "/tmp/tiny-qwen2"
    print(build_tiny_model(path, vocab_size=128, byte_alphabet=False) if toy else build_tiny_model(path))
