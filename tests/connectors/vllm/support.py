"""Helpers the vLLM connector's tests share: page formats, paged caches, a CPU worker, scheduler inputs."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Sequence

import torch
from vllm import SamplingParams
from vllm.v1.request import Request

from kvstore.connectors.vllm.config import parse_config
from kvstore.connectors.vllm.layout import KVFamily, PagedKV, PageFormat, canonical_view
from kvstore.connectors.vllm.namespaces import ModelIdentity
from kvstore.connectors.vllm.worker import WorkerSide

NUM_UNITS, H, N, D = 12, 2, 32, 16
"""The layout tests' paged cache: units (kernel blocks), KV heads, tokens per unit, head size."""

WORKER_BLOCKS, WORKER_LAYERS, WORKER_HEAD_SIZE = 16, 2, 32
"""The worker tests' paged cache: vLLM blocks per layer, layers, head size (``H`` heads, ``N`` tokens a unit)."""

WORKER_FORMAT = PageFormat(backend="CPU_ATTN", family="split_tokens", interior="cpu_attn:isa=vec",
                           num_layers=WORKER_LAYERS, num_kv_heads=H, head_size=WORKER_HEAD_SIZE, unit_tokens=N,
                           dtype="bfloat16", cache_dtype="auto")
"""The page format of :func:`cpu_worker`'s caches."""

WORKER_IDENTITY = ModelIdentity(model_id="m", revision="", config_digest="c", act_dtype="bfloat16", quantization="",
                                tp_size=1, pp_size=1)
"""The model identity of :func:`cpu_worker`."""

WORKER_RANK = (0, 0)
"""``(pp_rank, tp_rank)`` of :func:`cpu_worker`."""


def page_format(family: KVFamily, dtype: str = "bfloat16", heads: int = H, head_size: int = D) -> PageFormat:
    """A test backend's page format of ``family``: 2 layers, ``N`` tokens a unit, canonical interior."""
    return PageFormat(backend="TEST", family=family.value, interior="canonical", num_layers=2, num_kv_heads=heads,
                      head_size=head_size, unit_tokens=N, dtype=dtype, cache_dtype="auto")


def random_cache(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A tensor of ``shape`` of normal random values, as ``dtype``."""
    return torch.randn(*shape).to(dtype)


def cpu_caches(seed: int) -> list[torch.Tensor]:
    """One ``CPU_ATTN`` layer cache ``[WORKER_BLOCKS, H, N, 2 * WORKER_HEAD_SIZE]`` per layer, random from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(WORKER_BLOCKS, H, N, 2 * WORKER_HEAD_SIZE, generator=generator).bfloat16()
            for _ in range(WORKER_LAYERS)]


def cpu_worker(client: Any, caches: list[torch.Tensor], **extra: Any) -> WorkerSide:
    """A worker over ``caches`` (:func:`cpu_caches`) and ``client``, with kvstore blocks of 2 vLLM blocks of 32.

    Args:
        client: the store (the worker closes it).
        caches: its layer caches.
        extra: further ``kv_connector_extra_config`` settings.
    """
    paged = PagedKV(WORKER_FORMAT, [canonical_view(c, KVFamily.SPLIT_TOKENS, H, WORKER_HEAD_SIZE, N) for c in caches],
                    1)
    config = parse_config({"block_size": 64, "timeout_s": 5, **extra})
    return WorkerSide(config, WORKER_IDENTITY, paged, WORKER_RANK, 32, client)


def vllm_request(req_id: str, tokens: list[int], **kwargs: Any) -> Request:
    """A vLLM ``Request`` of ``tokens`` (8 tokens to generate); ``extra_args`` go to its ``SamplingParams``."""
    params = SamplingParams(max_tokens=8, extra_args=kwargs.pop("extra_args", None))
    return Request(req_id, list(tokens), params, None, **kwargs)


def scheduler_output(new: Sequence[tuple[str, int, int]] = (),
                     cached: Sequence[tuple[str, int, int]] = ()) -> SimpleNamespace:
    """A ``SchedulerOutput`` with the fields the connector reads: ``(req_id, computed before, scheduled)``."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c) for r, c, _ in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _, _ in cached],
                                              num_computed_tokens=[c for _, c, _ in cached]),
        num_scheduled_tokens={r: n for r, _, n in [*new, *cached]},
    )
