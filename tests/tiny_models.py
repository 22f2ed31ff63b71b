"""Tiny random-weight checkpoints of the supported families, saved as real HF directories."""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama", "qwen3", "gemma")


def tiny_config(family: str, vocab: int = 96, eos: int = 1, layers: int = 3):
    from transformers import GemmaConfig, LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=eos, bos_token_id=0, pad_token_id=0,
    )
    if family == "llama":
        return LlamaConfig(**common, head_dim=16, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=16, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if family == "gemma":
        return GemmaConfig(**common, head_dim=16, hidden_activation="gelu_pytorch_tanh")
    raise ValueError(family)


def tiny_model(family: str, seed: int = 0, **kwargs):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **kwargs), dtype=torch.float32)
    with torch.no_grad():
        # Larger-than-default weights give peaked next-token laws, so greedy decoding has clear
        # winners and speculative drafts are sometimes right.
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.25)
    return model.eval()


def save_tiny(family: str, directory: Path, seed: int = 0, **kwargs) -> Path:
    tiny_model(family, seed, **kwargs).save_pretrained(directory, safe_serialization=True)
    return directory


def save_tokenizer(directory: Path, vocab: int = 96) -> Path:
    """A real word-level tokenizer ("w0" … "w{vocab-1}", id = number) with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w0", eos_token="w1", unk_token="w2",
                                   pad_token="w0")
    fast.chat_template = "{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}"
    fast.save_pretrained(directory)
    return directory


def tiny_training_files(root: Path, conversations: int = 12, prompts: int = 4) -> tuple[Path, Path, Path]:
    """A tiny checkpoint with its tokenizer, ``conversations`` chats (JSONL) and ``prompts`` eval
    prompts (``{"turns": [...]}``) under ``root``: what ``specforge train``/``eval``/``run`` need."""
    import json

    model = save_tokenizer(save_tiny("llama", root / "model", vocab=96), vocab=96)
    chats = root / "chats.jsonl"
    chats.write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": " ".join(f"w{5 + (i + j) % 40}" for j in range(6))},
                                 {"role": "assistant", "content": "w9 w9"}]}) + "\n" for i in range(conversations)))
    evals = root / "prompts.jsonl"
    evals.write_text("".join(json.dumps({"turns": [" ".join(f"w{7 + (3 * i + j) % 30}" for j in range(5))]}) + "\n"
                             for i in range(prompts)))
    return model, chats, evals
