"""Tests of the keys of a vLLM engine's blocks: every part of the namespace, LoRA, tenants, multimodal content."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch
from transformers import LlamaConfig
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.request import Request

from kvstore.connectors.vllm.layout import PageFormat
from kvstore.connectors.vllm.namespaces import (
    ModelIdentity,
    RankInfo,
    RequestKeys,
    model_identity,
    request_adapter,
    request_spans,
    storage_namespace,
)
from kvstore.keys import HashAlgorithm, KeySpan, hash_blocks, span_extra_keys

FORMAT = PageFormat(backend="CPU_ATTN", family="split_tokens", interior="cpu_attn:isa=vec", num_layers=2,
                    num_kv_heads=2, head_size=32, unit_tokens=32, dtype="bfloat16", cache_dtype="auto")
IDENTITY = ModelIdentity(model_id="org/model", revision="main", config_digest="abc", act_dtype="bfloat16",
                         quantization="", tp_size=2, pp_size=1)


def _namespace(identity: ModelIdentity = IDENTITY, fmt: PageFormat = FORMAT, pp: int = 0, tp: int = 0,
               **kwargs: object):
    return storage_namespace(identity, RankInfo(pp, tp, fmt), block_size=64, hash_algorithm=HashAlgorithm.XXH3_128,
                             **kwargs)


def _config(**overrides: object) -> SimpleNamespace:
    hf = LlamaConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                     **overrides.pop("hf", {}))
    model = SimpleNamespace(model="/models/llama", revision=None, hf_config=hf, dtype=torch.bfloat16,
                            quantization=None)
    parallel = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1)
    return SimpleNamespace(model_config=model, parallel_config=parallel)


def test_model_identity_reads_vllms_config() -> None:
    identity = model_identity(_config())
    assert identity.model_id == "/models/llama" and identity.act_dtype == "bfloat16" and identity.tp_size == 1
    assert model_identity(_config(), model_id="org/llama").model_id == "org/llama"
    assert model_identity(_config(hf={"rope_theta": 1e6})).config_digest != identity.config_digest


def test_every_part_of_the_namespace_changes_it() -> None:
    base = _namespace()
    variants = [
        _namespace(dataclasses.replace(IDENTITY, model_id="org/other")),
        _namespace(dataclasses.replace(IDENTITY, revision="v2")),
        _namespace(dataclasses.replace(IDENTITY, config_digest="def")),
        _namespace(dataclasses.replace(IDENTITY, act_dtype="float16")),
        _namespace(dataclasses.replace(IDENTITY, quantization="awq")),
        _namespace(fmt=dataclasses.replace(FORMAT, backend="FLASH_ATTN", family="split_channels", interior="canonical")),
        _namespace(fmt=dataclasses.replace(FORMAT, interior="cpu_attn:isa=amx")),
        _namespace(fmt=dataclasses.replace(FORMAT, num_kv_heads=1)),
        _namespace(fmt=dataclasses.replace(FORMAT, cache_dtype="fp8_e4m3", dtype="float8_e4m3fn", scales="01")),
        _namespace(fmt=dataclasses.replace(FORMAT, unit_tokens=16)),
        _namespace(pp=1),
        _namespace(tp=1),
        _namespace(cache_salt="tenant-b"),
        _namespace(adapter="x#1"),
    ]
    roots = {base.root, *(v.root for v in variants)}
    assert len(roots) == len(variants) + 1


def test_mla_blocks_are_shared_by_every_tp_rank() -> None:
    mla = dataclasses.replace(FORMAT, family="latent", num_kv_heads=1, head_size=576)
    assert _namespace(fmt=mla, tp=0) == _namespace(fmt=mla, tp=1)
    assert _namespace(fmt=mla).tp_size == 1 and _namespace(fmt=mla).layout == "mla"


def test_a_lora_request_is_keyed_by_name_and_id() -> None:
    def request(lora: LoRARequest | None) -> Request:
        return Request("r", [1, 2, 3], SamplingParams(max_tokens=1), None, lora_request=lora)

    assert request_adapter(request(None)) == ""
    names = {request_adapter(request(LoRARequest(name, i, "/a"))) for name, i in [("x", 1), ("x", 2), ("y", 1)]}
    assert names == {"x#1", "x#2", "y#1"}


def _image(identifier: str, offset: int, length: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


def test_multimodal_features_become_content_spans() -> None:
    request = Request("r", [7] * 100, SamplingParams(max_tokens=1), None,
                      mm_features=[_image("sha-cat", 10, 40), _image("sha-dog", 60, 20)])
    assert request_spans(request) == [KeySpan(10, 40, "image:sha-cat"), KeySpan(60, 20, "image:sha-dog")]


def test_same_placeholders_different_images_get_different_block_hashes() -> None:
    namespaces = [_namespace(), _namespace(tp=1)]
    tokens = [5] * 64 + [7] * 64 + [9] * 64  # text, 64 image placeholders, text: 3 blocks of 64
    cat = RequestKeys(namespaces, [KeySpan(64, 64, "image:cat")]).hashes(tokens, 3)
    dog = RequestKeys(namespaces, [KeySpan(64, 64, "image:dog")]).hashes(tokens, 3)
    text = RequestKeys(namespaces).hashes(tokens, 3)
    for rank in range(2):
        assert cat[rank][0] == dog[rank][0] == text[rank][0]  # the text before the image still hits
        assert not set(cat[rank][1:]) & set(dog[rank][1:]) and not set(cat[rank][1:]) & set(text[rank][1:])
    assert cat[0] != cat[1]  # every rank has its own chain


def test_request_keys_match_hash_blocks_and_grow_with_the_tokens() -> None:
    namespace = _namespace()
    spans = [KeySpan(70, 10, "audio:clip")]
    tokens = list(range(1, 400))
    keys = RequestKeys([namespace], spans)
    first = keys.hashes(tokens, 2)[0]
    grown = keys.hashes(tokens, 6)[0]
    expected = hash_blocks(namespace, tokens[: 6 * 64], extra_keys=span_extra_keys(80, 64, spans))
    assert grown == expected and first == expected[:2]
    plain = hash_blocks(namespace, tokens[: 6 * 64])
    assert grown[0] == plain[0] and not set(grown[1:]) & set(plain)  # the audio clip lies in block 1
