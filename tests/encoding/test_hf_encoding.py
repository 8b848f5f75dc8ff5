"""The HF connector with ``kv_encoding``: saves store the encoded blocks, loads hit and hand the model its dtype."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kvstore import StoreConfig, open_store
from kvstore.blocks.tensors import decode_header
from kvstore.config import MemoryTierConfig
from kvstore.connectors.hf import HFConnector
from tests.support.hf import MAX_NEW_TOKENS, prompt, tiny_model

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("encoding", ["int8", "int4", "int8_v2", "int4_v2"])
def test_an_encoded_connector_saves_smaller_blocks_and_hits(encoding: str) -> None:
    model = tiny_model("llama", kv_heads=2)
    ids = prompt(40)
    with open_store(StoreConfig(memory=MemoryTierConfig(capacity_bytes=32 << 20))) as store:
        with HFConnector(model, store, block_size=8, model_id="tiny", kv_encoding=encoding) as conn:
            miss = conn.generate(ids, MAX_NEW_TOKENS)
            conn.flush()
            hit = conn.generate(ids, MAX_NEW_TOKENS)
            hashes = conn.block_hashes(ids)
            stored = store.get(conn.namespace, hashes)
            blocks = store.get_tensors(conn.namespace, hashes)
        with HFConnector(model, store, block_size=8, model_id="tiny") as exact:
            assert exact.namespace.root != conn.namespace.root
            assert store.lookup(exact.namespace, exact.block_hashes(ids)).num_blocks == 0
    assert conn.namespace.kv_encoding == encoding
    assert miss.num_cached_tokens == 0 and hit.num_cached_tokens == 32
    assert len(hit.token_ids) == len(miss.token_ids) == MAX_NEW_TOKENS
    assert [decode_header(b).encoding for b in stored] == [encoding] * 5
    logical = sum(b.numel() * b.element_size() for b in blocks)  # float32 KV
    # headers weigh in tiny blocks; layout 2 spends an 8-bit step per key channel over these blocks of 8 tokens
    bound = {"int8": 0.3, "int4": 0.26, "int8_v2": 0.32, "int4_v2": 0.26}[encoding]
    assert sum(len(b) for b in stored) < bound * logical
    cache = conn.new_cache()
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    for i, block in enumerate(blocks):
        assert block.dtype == torch.float32
        exact_keys = cache.layers[0].keys[0, :, i * 8:(i + 1) * 8]
        relative = ((block[0, 0] - exact_keys).norm() / exact_keys.norm()).item()
        assert 0 < relative < (0.01 if encoding.startswith("int8") else 0.15)  # docs/encodings.md
