"""Small Llama models with seeded random weights, built offline from a config for the demo and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvstore.tools.demo.tokenizer import VOCAB_SIZE


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shape of a demo Llama.

    Attributes:
        num_layers: decoder layers.
        hidden_size: model width.
        num_heads: query heads.
        num_kv_heads: key/value heads (GQA when fewer than ``num_heads``).
        intermediate_size: MLP width.
        vocab_size: vocabulary (256: the byte tokenizer).
        max_positions: longest sequence, tokens.
        seed: ``torch.manual_seed`` of the random weights.
        dtype: parameter and KV dtype name (``float32``, ``bfloat16``, ``float16``).
    """

    num_layers: int = 8
    hidden_size: int = 1024
    num_heads: int = 16
    num_kv_heads: int = 4
    intermediate_size: int = 5120
    vocab_size: int = VOCAB_SIZE
    max_positions: int = 8192
    seed: int = 0
    dtype: str = "float32"

    @property
    def head_dim(self) -> int:
        """Channels per head: ``hidden_size // num_heads``."""
        return self.hidden_size // self.num_heads

    @property
    def model_id(self) -> str:
        """A name for the weights: every field that changes them, the seed included."""
        return (
            f"kvstore-demo/llama-L{self.num_layers}-H{self.hidden_size}-A{self.num_heads}-KV{self.num_kv_heads}"
            f"-F{self.intermediate_size}-V{self.vocab_size}-seed{self.seed}"
        )

    def num_params(self) -> int:
        """Parameters of the model (untied embeddings and LM head)."""
        h, f, kv = self.hidden_size, self.intermediate_size, self.num_kv_heads * self.head_dim
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
        return self.num_layers * per_layer + 2 * self.vocab_size * h + h

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token takes over all layers."""
        itemsize = torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


PRESETS: dict[str, ModelSpec] = {
    "default": ModelSpec(),  # ~147M parameters
    "small": ModelSpec(num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=2, intermediate_size=1536),
    "tiny": ModelSpec(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256),
}
"""Named model shapes: ``default`` (~147M parameters), ``small`` (~13M) and ``tiny`` (for tests)."""


def spec_from(preset: str = "default", **overrides: int | str | None) -> ModelSpec:
    """A preset with some fields replaced; ``None`` overrides are ignored.

    Raises:
        ValueError: on an unknown preset, or heads that do not divide the hidden size.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; known: {sorted(PRESETS)}")
    spec = replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})
    if spec.hidden_size % spec.num_heads or spec.num_heads % spec.num_kv_heads:
        raise ValueError(
            f"hidden {spec.hidden_size}, heads {spec.num_heads} and KV heads {spec.num_kv_heads} must divide evenly"
        )
    return spec


def build_model(spec: ModelSpec, device: str = "cpu"):
    """Build a ``LlamaForCausalLM`` with seeded random weights, in eval mode; no download.

    The same spec gives the same weights in every process (``torch.manual_seed(spec.seed)``
    before construction, on the CPU, then a move to ``device``).

    Raises:
        ImportError: without transformers (the ``hf`` extra).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_positions,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    return model.to(device=device, dtype=getattr(torch, spec.dtype)).eval()
