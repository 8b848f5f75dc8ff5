"""Tests of the paged-KV layouts: canonical views against vLLM's own K/V splits, gather/scatter, refused models."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvstore.connectors.vllm.layout import (
    KVFamily,
    PagedKV,
    PageFormat,
    UnsupportedModelError,
    canonical_view,
    check_kv_cache_config,
)
from tests.connectors.vllm.support import D, H, N, NUM_UNITS, page_format, random_cache


def test_cpu_view_matches_the_cpu_backends_own_k_and_v() -> None:
    """``cpu_attn.py`` views [B, H, N, 2D] as [B, H, 2N, D] and chunks dim 2: K rows, then V rows."""
    kv = random_cache(NUM_UNITS, H, N, 2 * D)
    view = canonical_view(kv, KVFamily.SPLIT_TOKENS, H, D, N)
    key_cache, value_cache = kv.view(NUM_UNITS, H, 2 * N, D).chunk(2, dim=2)
    assert view.shape == (NUM_UNITS, 2, H, N, D)
    assert torch.equal(view[:, 0], key_cache) and torch.equal(view[:, 1], value_cache)
    assert view.data_ptr() == kv.data_ptr()  # a view, no copy


@pytest.mark.parametrize("physical", ["HND", "NHD"])
def test_split_channel_view_matches_flash_attentions_k_and_v(physical: str) -> None:
    """FlashAttention splits ``kv_cache.transpose(1, 2)`` along the last dim: K is C[:D], V is C[D:]."""
    if physical == "HND":
        kv = random_cache(NUM_UNITS, H, N, 2 * D)
    else:  # LBNHC: tokens outside heads in memory, the same logical [B, H, N, C]
        kv = random_cache(NUM_UNITS, N, H, 2 * D).permute(0, 2, 1, 3)
    view = canonical_view(kv, KVFamily.SPLIT_CHANNELS, H, D, N)
    key_cache, value_cache = kv.transpose(1, 2).split(D, dim=-1)  # [B, N, H, D] each, as flash_attn.py
    assert torch.equal(view[:, 0], key_cache.transpose(1, 2)) and torch.equal(view[:, 1], value_cache.transpose(1, 2))


@pytest.mark.parametrize("shape", [(NUM_UNITS, N, 3 * D), (NUM_UNITS, 1, N, 3 * D)])
def test_latent_view(shape: tuple[int, ...]) -> None:
    kv = random_cache(*shape)
    view = canonical_view(kv, KVFamily.LATENT, 1, 3 * D, N)
    assert view.shape == (NUM_UNITS, 1, N, 3 * D) and torch.equal(view.reshape(kv.shape), kv)


def test_views_refuse_layouts_they_do_not_know() -> None:
    with pytest.raises(UnsupportedModelError, match="not"):
        canonical_view(random_cache(NUM_UNITS, H, N, 3 * D), KVFamily.SPLIT_TOKENS, H, D, N)
    nhd = random_cache(NUM_UNITS, N, H, 2 * D).permute(0, 2, 1, 3)
    with pytest.raises(UnsupportedModelError, match="head-major"):
        canonical_view(nhd, KVFamily.SPLIT_TOKENS, H, D, N)  # the CPU backend only reads LBHNC


@pytest.mark.parametrize("family", [KVFamily.SPLIT_TOKENS, KVFamily.SPLIT_CHANNELS, KVFamily.LATENT])
@pytest.mark.parametrize("units_per_block", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_gather_then_scatter_moves_exactly_the_blocks(family: KVFamily, units_per_block: int,
                                                      dtype: torch.dtype) -> None:
    """Blocks gathered from one cache and scattered into another land in the right units, nothing else changes."""
    head_size = 3 * D if family is KVFamily.LATENT else D
    heads = 1 if family is KVFamily.LATENT else H
    content = head_size if family is KVFamily.LATENT else 2 * D

    def caches() -> list[torch.Tensor]:
        return [random_cache(NUM_UNITS, heads, N, content, dtype=torch.float32).to(dtype) for _ in range(2)]

    source, target = caches(), caches()
    before = [t.clone() for t in target]
    fmt = page_format(family, dtype=str(dtype).removeprefix("torch."), heads=heads, head_size=head_size)
    make = lambda layers: PagedKV(fmt, [canonical_view(t, family, heads, head_size, N) for t in layers],  # noqa: E731
                                  units_per_block)
    src, dst = make(source), make(target)
    units_per_kv_block = 2 * units_per_block  # a kvstore block of two vLLM blocks
    blocks = src.gather(src.units_of([1, 4, 5, 2]), units_per_kv_block)  # two kvstore blocks
    assert blocks.shape == (2, *fmt.block_shape(units_per_kv_block * N)) and blocks.dtype == dtype
    # the first kvstore block's first vLLM block is "local" in the target: only its second is written
    skip = units_per_block
    dst.scatter(dst.units_of([3, 0, 5]), blocks, units_per_kv_block, first_units=[skip, 0])
    src_units = src.units_of([4, 5, 2])
    dst_units = dst.units_of([3, 0, 5])
    for layer in range(2):
        for s, d in zip(src_units, dst_units):
            assert torch.equal(source[layer][s].view(torch.uint8), target[layer][d].view(torch.uint8))
        untouched = [u for u in range(NUM_UNITS) if u not in dst_units]
        assert torch.equal(target[layer][untouched].view(torch.uint8), before[layer][untouched].view(torch.uint8))


def test_gathered_block_layout_is_layers_then_k_and_v() -> None:
    """A kvstore block is [L, 2, H, T, D]: K of layer 1, head 0, token t is what the CPU view holds there."""
    layers = [random_cache(NUM_UNITS, H, N, 2 * D) for _ in range(2)]
    fmt = page_format(KVFamily.SPLIT_TOKENS)
    paged = PagedKV(fmt, [canonical_view(t, KVFamily.SPLIT_TOKENS, H, D, N) for t in layers], 1)
    block = paged.gather([7, 3], 2)[0]  # one block of 2 units: tokens 0..31 from unit 7, 32..63 from unit 3
    key_cache = layers[1].view(NUM_UNITS, H, 2 * N, D)[:, :, :N]
    value_cache = layers[1].view(NUM_UNITS, H, 2 * N, D)[:, :, N:]
    assert torch.equal(block[1, 0, 0, :N], key_cache[7, 0]) and torch.equal(block[1, 0, 0, N:], key_cache[3, 0])
    assert torch.equal(block[1, 1, 1, N:], value_cache[3, 1])


def test_scatter_refuses_a_wrong_number_of_units() -> None:
    fmt = page_format(KVFamily.SPLIT_TOKENS)
    paged = PagedKV(fmt, [canonical_view(random_cache(NUM_UNITS, H, N, 2 * D), KVFamily.SPLIT_TOKENS, H, D, N)
                          for _ in range(2)], 1)
    blocks = paged.gather([0, 1], 2)
    with pytest.raises(ValueError, match="destination units"):
        paged.scatter([5], blocks, 2)


# ------------------------------------------------------------------ which models are served


def _full(**kwargs: object) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, **kwargs)


def _config(*groups: tuple[list[str], object]) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups])


LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def test_full_attention_and_mla_are_served() -> None:
    check_kv_cache_config(_config((LAYERS, _full())))
    check_kv_cache_config(_config((LAYERS, MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=576,
                                                            dtype=torch.bfloat16))))


@pytest.mark.parametrize(("groups", "match"), [
    ([(LAYERS[:2], _full()), (LAYERS[2:], SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=64,
                                                            dtype=torch.bfloat16, sliding_window=128))],
     r"2 KV-cache groups \(group 0 \(FullAttentionSpec.*group 1 \(SlidingWindowSpec"),
    ([(LAYERS, SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                                 sliding_window=128))], r"group 0 \(SlidingWindowSpec.*not full attention"),
    ([(LAYERS, _full(sliding_window=256))], "sliding-window layers"),
    ([(LAYERS, _full(attention_chunk_size=64))], "chunked local attention"),
    ([(LAYERS, ChunkedLocalAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                                         attention_chunk_size=64))], "not full attention"),
    ([(LAYERS[:2], _full()), (["model.layers.2.mixer"], MambaSpec(block_size=32, shapes=((4, 8),),
                                                                  dtypes=(torch.float32,)))],
     r"group 1 \(MambaSpec: model.layers.2.mixer\)"),
    ([(["model.layers.0.mixer"], MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(torch.float32,)))],
     r"MambaSpec.*not full attention"),
    ([], "attention-free"),
])
def test_models_the_connector_cannot_restore_are_refused_naming_the_group(groups: list, match: str) -> None:
    with pytest.raises(UnsupportedModelError, match=match):
        check_kv_cache_config(_config(*groups))


def test_cpu_view_splits_k_and_v_where_the_cpu_kernel_writes_them() -> None:
    """vLLM's own CPU cache writer puts K only into the view's K half and V only into its V half."""
    from vllm import _custom_ops as ops

    kv = torch.zeros(NUM_UNITS, H, N, 2 * 32, dtype=torch.bfloat16)  # head size 32: one the CPU kernels take
    view = canonical_view(kv, KVFamily.SPLIT_TOKENS, H, 32, N)
    key_cache, value_cache = kv.view(NUM_UNITS, H, 2 * N, 32).chunk(2, dim=2)
    slots = torch.tensor([3 * N + 5, 7 * N], dtype=torch.long)
    key = torch.randn(2, H, 32).to(torch.bfloat16)
    ops.cpu_attn_reshape_and_cache(key, torch.zeros_like(key), key_cache, value_cache, slots, "vec",
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    assert view[:, 0].count_nonzero() == key.count_nonzero() and view[:, 1].count_nonzero() == 0
    assert view[3, 0].count_nonzero() and view[7, 0].count_nonzero() and not view[4, 0].count_nonzero()
    kv.zero_()
    ops.cpu_attn_reshape_and_cache(torch.zeros_like(key), key, key_cache, value_cache, slots, "vec",
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    assert view[:, 1].count_nonzero() == key.count_nonzero() and view[:, 0].count_nonzero() == 0
    # V rows are [N, D] in token order: token 5 of unit 3 holds the first token's values
    assert torch.equal(view[3, 1, :, 5], key[0]) and torch.equal(view[7, 1, :, 0], key[1])
