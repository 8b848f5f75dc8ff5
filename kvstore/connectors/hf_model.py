"""What the HF connector reads from a model and a prompt: the KV block shape, the namespace, the adapter, the
forward's cache keyword and the token ids."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from kvstore.blocks.tensors import dtype_name
from kvstore.errors import InvalidArgumentError
from kvstore.keys import HashAlgorithm, Namespace

try:  # transformers is the optional ``hf`` extra
    from transformers import DynamicCache
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("kvstore.connectors.hf needs transformers: pip install transformers "
                      "(or, in a checkout, pip install -e '.[hf]'; docs/install.md)") from exc

DEFAULT_BLOCK_SIZE = 256
"""Tokens per block when the caller names none (a 4 MiB float32 block for the demo model)."""

TokenIds = Sequence[int] | np.ndarray | torch.Tensor
"""Prompt token ids: ``[num_tokens]`` or ``[1, num_tokens]`` (batch size 1)."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The KV-relevant shape of a causal LM, read from its config.

    Attributes:
        model_type: ``config.model_type``, e.g. ``llama``.
        num_layers: decoder layers (``num_hidden_layers``).
        num_kv_heads: key/value heads per layer (``num_key_value_heads``; equals
            ``num_attention_heads`` without GQA).
        head_dim: channels per head (``head_dim``, else ``hidden_size // num_attention_heads``).
        sliding_window: tokens a sliding-window layer keeps, or ``None`` when
            every layer attends to the whole sequence.
    """

    model_type: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None


def model_shape(config: Any) -> ModelShape:
    """Read the :class:`ModelShape` of a transformers config (the decoder's, for multimodal configs).

    Raises:
        InvalidArgumentError: if the config lacks the layer or head counts.
    """
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    try:
        num_layers = int(text.num_hidden_layers)
        num_heads = int(text.num_attention_heads)
    except (AttributeError, TypeError) as exc:
        raise InvalidArgumentError(f"config of type {type(config).__name__} lacks layer/head counts: {exc}") from None
    num_kv_heads = int(getattr(text, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // num_heads)
    sliding: int | None = None
    probe = DynamicCache(config=config)
    windows = [int(getattr(layer, "sliding_window")) for layer in probe.layers if getattr(layer, "is_sliding", False)]
    if windows:
        sliding = min(windows)
    return ModelShape(str(getattr(text, "model_type", "") or ""), num_layers, num_kv_heads, head_dim, sliding)


def model_namespace(
    model: Any,
    *,
    block_size: int,
    model_id: str | None = None,
    revision: str | None = None,
    dtype: torch.dtype | str | None = None,
    cache_salt: str = "",
    hash_algorithm: HashAlgorithm | str = HashAlgorithm.XXH3_128,
    adapter: str | tuple[str, str] | None = None,
    kv_encoding: str = "",
) -> Namespace:
    """The namespace of a model's KV blocks: any difference in weights or KV shape changes it.

    ``Namespace.model`` is ``"<model id>|<model_type>|L<layers>|KV<kv heads>|D<head dim>"``,
    so the layer count, KV-head count and head size each change the root even
    when two models share a name; ``revision``, ``dtype``, ``cache_salt`` and the
    LoRA ``adapter`` go into their own namespace fields. A LoRA adapter changes
    the keys and values of every layer it adapts, so blocks of an adapted model
    are never shared with its base model or with another adapter (vLLM keys its
    prefix cache by LoRA id the same way).

    Args:
        model: a transformers ``PreTrainedModel`` (its ``config`` and ``dtype`` are read).
        block_size: tokens per block.
        model_id: name or path of the weights; defaults to ``config._name_or_path``.
            Models built from a config with random weights have none, and must
            pass one that names the weights (e.g. including the seed).
        revision: weights revision; defaults to ``config._commit_hash`` or ``""``.
        dtype: KV dtype; defaults to ``model.dtype``.
        cache_salt: per-tenant salt; different salts never share blocks.
        hash_algorithm: ``H`` of the block-hash chain (``sha256`` for untrusted clients).
        adapter: the LoRA adapter applied to the model: its name (or path), or ``(name, version)``
            (stored as ``name@version``; give the version, or a content hash, whenever the same name can
            hold other weights). ``""`` for the base model. ``None`` (the default) reads the model: a model
            with PEFT adapters loaded (``model.peft_config``) must be given one explicitly.
        kv_encoding: lossy KV encoding of the stored blocks (``int8``, ``fp8_e4m3``, ``int4``, ``int2``;
            ``docs/encodings.md``), ``""`` for exact blocks.

    Raises:
        InvalidArgumentError: if no model id is known, block_size is not positive, the adapter is
            malformed, or ``adapter`` is ``None`` for a model with PEFT adapters loaded.
        UnknownDtypeError: if the KV dtype has no codec code.
    """
    config = model.config
    name = model_id or getattr(config, "_name_or_path", "") or ""
    if not name:
        raise InvalidArgumentError(
            "the model has no name or path (config._name_or_path is empty, e.g. random weights "
            "built from a config); pass model_id= naming its weights"
        )
    shape = model_shape(config)
    kv_dtype = dtype_name(dtype if dtype is not None else model.dtype)
    tag = f"{name}|{shape.model_type}|L{shape.num_layers}|KV{shape.num_kv_heads}|D{shape.head_dim}"
    return Namespace(
        model=tag,
        revision=revision if revision is not None else (getattr(config, "_commit_hash", None) or ""),
        dtype=kv_dtype,
        layout="kv",
        block_size=block_size,
        adapter=adapter_id(model, adapter),
        cache_salt=cache_salt,
        hash_algorithm=HashAlgorithm(hash_algorithm),
        kv_encoding=kv_encoding,
    )


def adapter_id(model: Any, adapter: str | tuple[str, str] | None) -> str:
    """``Namespace.adapter`` of a model: ``name``, ``name@version``, or ``""`` for the base model.

    Args:
        model: the model (read only when ``adapter`` is ``None``, for PEFT adapters it holds).
        adapter: as :func:`model_namespace` takes it.

    Raises:
        InvalidArgumentError: on an empty name with a version, a name or version that is not a
            string, or ``None`` for a model with PEFT adapters loaded.
    """
    if adapter is None:
        loaded = getattr(model, "peft_config", None)
        if loaded:
            names = ", ".join(map(str, loaded))
            raise InvalidArgumentError(
                f"the model has LoRA adapters loaded ({names}); pass adapter='name' or adapter=('name', 'version') "
                "so that its blocks are not shared with the base model's (adapter='' if they are disabled)")
        return ""
    if isinstance(adapter, str):
        return adapter.strip()
    if (isinstance(adapter, tuple) and len(adapter) == 2 and all(isinstance(part, str) for part in adapter)
            and adapter[0].strip()):
        name, version = adapter[0].strip(), adapter[1].strip()
        return f"{name}@{version}" if version else name
    raise InvalidArgumentError(f"adapter must be a name or a (name, version) pair of strings, got {adapter!r}")


def token_list(token_ids: TokenIds) -> list[int]:
    """Token ids as a flat list, batch size 1.

    Raises:
        InvalidArgumentError: for a batch of more than one prompt, more than 2
            dims, or an empty prompt.
    """
    if isinstance(token_ids, torch.Tensor):
        array = token_ids.detach().to("cpu").numpy()
    else:
        array = np.asarray(token_ids)
    if array.ndim == 2:
        if array.shape[0] != 1:
            raise InvalidArgumentError(
                f"batch size {array.shape[0]} is not supported: the HF connector takes one prompt "
                "per call ([num_tokens] or [1, num_tokens]); call it once per prompt"
            )
        array = array[0]
    if array.ndim != 1:
        raise InvalidArgumentError(f"token ids must be [num_tokens] or [1, num_tokens], got shape {array.shape}")
    if array.size == 0:
        raise InvalidArgumentError("the prompt must hold at least one token")
    if array.dtype.kind not in "iu":
        raise InvalidArgumentError(f"token ids must be integers, got {array.dtype}")
    return [int(t) for t in array.tolist()]


def cache_keyword(model: Any) -> str:
    """The forward keyword that takes the KV cache: ``cache`` (5.24) or ``past_key_values`` (earlier 5.x)."""
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise InvalidArgumentError(
        f"{type(model).__name__}.forward takes neither cache= nor past_key_values=; not a cached causal LM"
    )
