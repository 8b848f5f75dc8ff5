"""Helpers of the HF connector tests: tiny random-weight causal LMs (nothing downloaded), prompts, reference output."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB = 256
MAX_NEW_TOKENS = 12


def tiny_model(family: str = "llama", *, layers: int = 2, kv_heads: int = 2, dtype: torch.dtype = torch.float32,
               seed: int = 0, device: str = "cpu"):
    """A random-weight causal LM (hidden 64, 4 query heads, vocab 256), seeded, in eval mode."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=512)
    config = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[family](**common)
    cls = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "mistral": MistralForCausalLM}[family]
    torch.manual_seed(seed)
    return cls(config).to(device=device, dtype=dtype).eval()


def prompt(num_tokens: int, seed: int = 1) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (num_tokens,), generator=generator).tolist()


def reference(model, ids: list[int]) -> tuple[int, ...]:
    """Greedy tokens from ``model.generate`` with no kvstore involved."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids], device=model.device), max_new_tokens=MAX_NEW_TOKENS,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return tuple(out[0, len(ids):].tolist())
