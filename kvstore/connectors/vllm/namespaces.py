"""The keys of a vLLM engine's blocks: its namespaces (model, layout, ranks) and each request's hash chains.

A block's namespace (``kvstore.keys.Namespace``) holds everything that makes its
bytes differ from another engine's:

* ``model``: ``"<model id>|vllm|cfg=<digest>|act=<dtype>|q=<quantization>|<page format>|pp=<rank>/<size>"``:
  the weights' name (``--model`` or the ``model_id`` setting), a digest of the
  model's config (layers, heads, RoPE scaling, ...: any override changes it),
  the activation dtype, the weight quantization, the worker's page format
  (attention backend, in-block order, layers, KV heads, head size, kernel block
  size, KV-cache dtype such as ``fp8_e4m3`` and its scales, see
  :class:`~kvstore.connectors.vllm.layout.PageFormat`) and the pipeline stage;
* ``revision``: vLLM's ``--revision``; ``dtype``: the KV-cache dtype;
  ``layout``: ``kv`` or ``mla``; ``block_size``: kvstore's block size;
* ``tp_size`` / ``tp_rank``: each tensor-parallel rank stores its own heads
  under its own namespace (an MLA latent is the same on every rank, so MLA
  blocks use ``tp_size=1`` and are written by rank 0 only);
* ``cache_salt``: the request's ``cache_salt`` (the tenant);
* ``adapter``: ``"<lora_name>#<lora_int_id>"`` of a LoRA request, so two
  adapters that share a name (or an id) never share blocks; empty for the base model.

Every rank's chain is rooted in its own namespace. A multimodal request's
blocks carry the content keys of the images or audio whose placeholders they
cover (``kvstore.keys.span_extra_keys`` over the request's ``mm_features``:
identifier, offset and length), so equal placeholder tokens with different
images never share blocks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

import xxhash

from kvstore.blocks.tensors import dtype_name
from kvstore.keys import BlockHash, HashAlgorithm, KeySpan, Namespace, hash_blocks, span_extra_keys
from kvstore.connectors.vllm.layout import PageFormat


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """What, beside the page format, makes one engine's KV differ from another's.

    Attributes:
        model_id: the weights' name or path.
        revision: the weights' revision, ``""`` when unknown.
        config_digest: xxh3-64 hex of the model config (``hf_config``), without paths and versions.
        act_dtype: the model's activation dtype, e.g. ``bfloat16``.
        quantization: vLLM's weight quantization method, ``""`` for none.
        tp_size: tensor-parallel size.
        pp_size: pipeline-parallel size.
    """

    model_id: str
    revision: str
    config_digest: str
    act_dtype: str
    quantization: str
    tp_size: int
    pp_size: int


def model_identity(vllm_config: Any, model_id: str | None = None) -> ModelIdentity:
    """Read the :class:`ModelIdentity` of a vLLM engine from its ``VllmConfig``.

    Args:
        vllm_config: vLLM's ``VllmConfig``.
        model_id: overrides ``model_config.model`` (see the ``model_id`` setting).
    """
    model = vllm_config.model_config
    config = model.hf_config.to_dict() if hasattr(model.hf_config, "to_dict") else dict(vars(model.hf_config))
    kept = {k: v for k, v in config.items() if not k.startswith("_") and k not in ("transformers_version",
                                                                                  "name_or_path")}
    digest = xxhash.xxh3_64_hexdigest(json.dumps(kept, sort_keys=True, default=str).encode())
    parallel = vllm_config.parallel_config
    return ModelIdentity(
        model_id=model_id or str(model.model), revision=str(model.revision or ""), config_digest=digest,
        act_dtype=dtype_name(model.dtype), quantization=str(model.quantization or ""),
        tp_size=int(parallel.tensor_parallel_size), pp_size=int(parallel.pipeline_parallel_size),
    )


@dataclass(frozen=True, slots=True)
class RankInfo:
    """One worker as the scheduler sees it (from the worker's handshake).

    Attributes:
        pp_rank: pipeline stage.
        tp_rank: tensor-parallel rank.
        page_format: what its blocks hold.
        lookup_target: ``host:port`` of its embedded store's lookup endpoint, or
            ``None`` when the workers use ``kvstore serve`` nodes.
        lookup_token: the bearer token of that endpoint.
    """

    pp_rank: int
    tp_rank: int
    page_format: PageFormat
    lookup_target: str | None = None
    lookup_token: str | None = None


def storage_namespace(identity: ModelIdentity, rank: RankInfo, *, block_size: int, hash_algorithm: HashAlgorithm,
                      cache_salt: str = "", adapter: str = "", kv_encoding: str = "") -> Namespace:
    """The namespace one rank's blocks of one tenant and adapter are stored under (module docstring).

    Raises:
        InvalidArgumentError: on a block size or rank the namespace refuses, or a ``kv_encoding`` of a KV
            cache dtype it cannot encode (e.g. an fp8 cache).
    """
    fmt = rank.page_format
    tag = (f"{identity.model_id}|vllm|cfg={identity.config_digest}|act={identity.act_dtype}"
           f"|q={identity.quantization}|{fmt.descriptor}|pp={rank.pp_rank}/{identity.pp_size}")
    replicated = fmt.layout.value == "mla"
    return Namespace(
        model=tag, revision=identity.revision, dtype=fmt.dtype, layout=fmt.layout.value, block_size=block_size,
        tp_size=1 if replicated else identity.tp_size, tp_rank=0 if replicated else rank.tp_rank,
        adapter=adapter, cache_salt=cache_salt, hash_algorithm=hash_algorithm, kv_encoding=kv_encoding,
    )


def request_adapter(request: Any) -> str:
    """``"<lora_name>#<lora_int_id>"`` of a request's LoRA adapter, ``""`` without one."""
    lora = getattr(request, "lora_request", None)
    return f"{lora.lora_name}#{lora.lora_int_id}" if lora is not None else ""


def request_spans(request: Any) -> list[KeySpan]:
    """The content spans of a multimodal request: per ``mm_features`` item, its placeholder range and content key.

    The key is ``"<modality>:<identifier>"`` (vLLM's identifier hashes the item's
    bytes and processor settings, with the LoRA prefix where one applies).
    """
    spans = []
    for feature in getattr(request, "mm_features", None) or ():
        position = feature.mm_position
        spans.append(KeySpan(int(position.offset), int(position.length), f"{feature.modality}:{feature.identifier}"))
    return spans


@dataclass(slots=True)
class RequestKeys:
    """The block hashes of one request under every rank's namespace, extended as its tokens grow.

    Args:
        namespaces: one per rank (scheduler order).
        spans: the request's content spans (multimodal), positions from its first token.
    """

    namespaces: Sequence[Namespace]
    spans: Sequence[KeySpan] = ()
    _chains: list[list[BlockHash]] = field(default_factory=list)
    _extra: list[bytes | None] | None = None

    def hashes(self, token_ids: Sequence[int], num_blocks: int) -> list[list[BlockHash]]:
        """Per rank, the hashes of blocks ``[0, num_blocks)`` of ``token_ids`` (which must hold that many full blocks).

        The chains are computed once and extended; ``token_ids`` must be the
        same sequence (grown at its end) on every call.
        """
        if not self._chains:
            self._chains = [[] for _ in self.namespaces]
        block_size = self.namespaces[0].block_size
        have = len(self._chains[0])
        if num_blocks > have:
            if self.spans and self._extra is None:
                last = max(s.start + s.length for s in self.spans)
                self._extra = span_extra_keys(last, block_size, self.spans)
            extra = self._extra[have:num_blocks] if self._extra else None
            tokens = list(token_ids[have * block_size: num_blocks * block_size])
            for chain, namespace in zip(self._chains, self.namespaces):
                chain.extend(hash_blocks(namespace, tokens, parent=chain[-1] if chain else None, extra_keys=extra))
        return [chain[:num_blocks] for chain in self._chains]
