"""Tests of namespaces and chained block hashes."""

from __future__ import annotations

import array
import dataclasses
import hashlib
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
import xxhash

from kvstore.errors import InvalidArgumentError
from kvstore.keys import (
    HashAlgorithm,
    KeySpan,
    Namespace,
    PackedHashes,
    block_key,
    block_keys,
    hash_blocks,
    span_extra_keys,
    split_key,
)

NS = Namespace(model="meta-llama/Llama-3.1-8B", revision="main", dtype="float16", layout="kv", block_size=4)

# Frozen vectors: changing the encoding or the chain breaks every stored cache.
XXH3_ROOT = "ad85ade15dcff64ef6efa34fb947f90f"
XXH3_CHAIN = ["a65996850ca81aa5bae83fe568ddf3cc", "85b57cb70a3a5da2dceb087261b48050"]
SHA256_ROOT = "4e77d640bdadbd86525fbd5e2ddaeed970b5d77d640b3caa52a26736e908e9bf"
SHA256_CHAIN = [
    "faefc97def6ca14c41afc040084f68fada001895c360b3f9cb6cd9ddf6333bd4",
    "91b30ce5981d4420c39e51b2eeea38c238b67383f33b2ae3980f0ec279a69cc6",
]


def test_frozen_vectors_xxh3() -> None:
    assert NS.root.hex() == XXH3_ROOT
    assert [h.hex() for h in hash_blocks(NS, list(range(10)))] == XXH3_CHAIN


def test_frozen_vectors_sha256() -> None:
    ns = dataclasses.replace(NS, hash_algorithm=HashAlgorithm.SHA256)
    assert ns.root.hex() == SHA256_ROOT
    assert [h.hex() for h in hash_blocks(ns, list(range(10)))] == SHA256_CHAIN


# Frozen vectors of per-block extra keys: an image (content key "sha256:abc") on tokens 2..6 of range(10).
IMAGE_SPAN = KeySpan(start=2, length=5, key="sha256:abc")
IMAGE_EXTRA = "0a0000007368613235363a61626302000000050000" "00"
XXH3_IMAGE_CHAIN = ["1e2cb3e018ba7c763dc44a8415e5dbe9", "c8b4d59816c666aff49793041625aef2"]
SHA256_IMAGE_CHAIN = [
    "a8d4b2e011274836ec585d8983ae73a8a0fd1c9bf3be432388ea2d010761c867",
    "48a7848d2d6624ec45512598da288bc9acb611f34fbbb11742040a4c3f4ec7ef",
]


def test_frozen_vectors_with_extra_keys() -> None:
    extra = span_extra_keys(10, NS.block_size, [IMAGE_SPAN])
    assert [e.hex() if e else None for e in extra] == [IMAGE_EXTRA, IMAGE_EXTRA, None]
    assert [h.hex() for h in hash_blocks(NS, list(range(10)), extra_keys=extra)] == XXH3_IMAGE_CHAIN
    ns = dataclasses.replace(NS, hash_algorithm=HashAlgorithm.SHA256)
    assert [h.hex() for h in hash_blocks(ns, list(range(10)), extra_keys=extra)] == SHA256_IMAGE_CHAIN


def test_extra_key_formula_is_the_documented_one() -> None:
    """h_i = H(h_{i-1} || token ids || uint32 len(e_i) || e_i); a block without an extra key hashes as before."""
    h0 = xxhash.xxh3_128_digest(NS.root + struct.pack("<4I", 0, 1, 2, 3))
    h1 = xxhash.xxh3_128_digest(h0 + struct.pack("<4I", 4, 5, 6, 7) + struct.pack("<I", 3) + b"img")
    assert hash_blocks(NS, range(8), extra_keys=[None, b"img"]) == [h0, h1]
    assert IMAGE_SPAN.encode() == struct.pack("<I", 10) + b"sha256:abc" + struct.pack("<II", 2, 5)


@pytest.mark.parametrize("no_extra", [None, [], [None, None, None], [b"", b""], [None, b"", None, None, None]])
def test_no_extra_keys_leave_every_hash_unchanged(no_extra: list | None) -> None:
    assert [h.hex() for h in hash_blocks(NS, list(range(10)), extra_keys=no_extra)] == XXH3_CHAIN


def test_an_extra_key_changes_its_block_and_every_later_one_only() -> None:
    tokens = list(range(16))
    plain = hash_blocks(NS, tokens)
    keyed = hash_blocks(NS, tokens, extra_keys=[None, b"a"])
    assert keyed[0] == plain[0] and not set(keyed[1:]) & set(plain)
    other = hash_blocks(NS, tokens, extra_keys=[None, b"b"])
    assert other[0] == plain[0] and not set(other[1:]) & set(keyed[1:])
    # the extra key is length-prefixed: moving bytes between the tokens and the key cannot collide
    assert hash_blocks(NS, tokens, extra_keys=[None, bytearray(b"a")]) == keyed
    assert hash_blocks(NS, tokens, extra_keys=[None, memoryview(b"a")]) == keyed


def test_same_placeholders_different_images_get_different_keys() -> None:
    """The bug behind extra keys: equal placeholder tokens for two images must not share blocks."""
    placeholder = [7] * 8
    prompt = [1, 2, 3, 4] + placeholder + [5, 6, 7, 8]
    cat = hash_blocks(NS, prompt, extra_keys=span_extra_keys(len(prompt), 4, [KeySpan(4, 8, "cat")]))
    dog = hash_blocks(NS, prompt, extra_keys=span_extra_keys(len(prompt), 4, [KeySpan(4, 8, "dog")]))
    assert cat[0] == dog[0] == hash_blocks(NS, prompt)[0]  # the text before the image still matches
    assert not set(cat[1:]) & set(dog[1:])
    moved = hash_blocks(NS, prompt, extra_keys=span_extra_keys(len(prompt), 4, [KeySpan(5, 7, "cat")]))
    assert moved[1:] != cat[1:]  # where the content lies is part of the key
    two = span_extra_keys(len(prompt), 4, [KeySpan(4, 4, "cat"), KeySpan(8, 4, "cat")])
    assert hash_blocks(NS, prompt, extra_keys=two)[1:] != cat[1:]  # so is how it splits into spans


def test_span_extra_keys_cover_the_blocks_a_span_touches() -> None:
    spans = [KeySpan(3, 2, b"a"), KeySpan(4, 9, b"b")]
    keys = span_extra_keys(14, 4, spans)
    assert len(keys) == 4
    assert keys[0] == spans[0].encode()
    assert keys[1] == spans[0].encode() + spans[1].encode()
    assert keys[2] == keys[3] == spans[1].encode()
    assert span_extra_keys(8, 4, []) == [None, None]
    assert span_extra_keys(8, 4, [KeySpan(20, 4, b"past the end")]) == [None, None]
    assert len(span_extra_keys(0, 4, [])) == 0


@pytest.mark.parametrize("bad", [{"start": -1, "length": 2, "key": b"k"}, {"start": 0, "length": 0, "key": b"k"},
                                 {"start": 0, "length": 1, "key": 3}])
def test_bad_key_spans(bad: dict) -> None:
    with pytest.raises(InvalidArgumentError):
        KeySpan(**bad)


def test_bad_extra_keys() -> None:
    with pytest.raises(InvalidArgumentError, match="extra key of block 1 must be bytes"):
        hash_blocks(NS, range(8), extra_keys=[None, "text"])
    with pytest.raises(InvalidArgumentError):
        span_extra_keys(8, 0, [])


def test_chain_formula_is_the_documented_one() -> None:
    """h_i = H(h_{i-1} || token ids as little-endian uint32), h_{-1} = H(namespace encoding)."""
    root = xxhash.xxh3_128_digest(NS.encode())
    h0 = xxhash.xxh3_128_digest(root + struct.pack("<4I", 0, 1, 2, 3))
    h1 = xxhash.xxh3_128_digest(h0 + struct.pack("<4I", 4, 5, 6, 7))
    assert hash_blocks(NS, range(8)) == [h0, h1]
    ns = dataclasses.replace(NS, hash_algorithm="sha256")
    assert ns.root == hashlib.sha256(ns.encode()).digest()


def test_only_full_blocks_are_hashed() -> None:
    assert len(hash_blocks(NS, range(3))) == 0
    assert len(hash_blocks(NS, range(11))) == 2
    assert hash_blocks(NS, range(11)) == hash_blocks(NS, range(8))


def test_prefix_property_and_parent_extension() -> None:
    tokens = list(range(100, 120))
    full = hash_blocks(NS, tokens)
    assert hash_blocks(NS, tokens[:8]) == full[:2]
    assert hash_blocks(NS, tokens[8:], parent=full[1]) == full[2:]
    changed = tokens.copy()
    changed[1] += 1
    assert all(a != b for a, b in zip(hash_blocks(NS, changed), full))  # a change poisons the whole tail


def test_input_types_agree() -> None:
    tokens = [5, 70000, 2**32 - 1, 0, 9, 9, 9, 9]
    expected = hash_blocks(NS, tokens)
    assert hash_blocks(NS, np.array(tokens, dtype=np.int64)) == expected
    assert hash_blocks(NS, torch.tensor(tokens, dtype=torch.int64)) == expected
    assert hash_blocks(NS, np.array(tokens, dtype=np.uint32)) == expected


@pytest.mark.parametrize("bad", [[-1, 0, 0, 0], [2**32, 0, 0, 0], [[1, 2], [3, 4]], [0.5, 1, 2, 3]])
def test_bad_token_ids(bad: object) -> None:
    with pytest.raises(InvalidArgumentError):
        hash_blocks(NS, bad)


def test_every_namespace_field_changes_every_hash() -> None:
    tokens = list(range(64))
    base = hash_blocks(NS, tokens)
    variants = {
        "model": "meta-llama/Llama-3.1-70B", "revision": "v2", "dtype": "bfloat16", "layout": "mla",
        "tp_size": 2, "tp_rank": 1, "adapter": "lora-a", "cache_salt": "tenant-b",
        "hash_algorithm": HashAlgorithm.SHA256, "kv_encoding": "int8",
    }
    fields = {f.name for f in dataclasses.fields(Namespace) if f.init}
    assert fields - {"block_size"} == set(variants), "a new namespace field needs a test here"
    for name, value in variants.items():
        if name == "tp_rank":
            other = dataclasses.replace(NS, tp_size=2, tp_rank=1)
            reference = hash_blocks(dataclasses.replace(NS, tp_size=2), tokens)
        else:
            other = dataclasses.replace(NS, **{name: value})
            reference = base
        hashes = hash_blocks(other, tokens)
        assert other.root != NS.root, name
        assert not set(hashes) & set(reference), name
    bigger = dataclasses.replace(NS, block_size=8)
    assert not set(hash_blocks(bigger, tokens)) & set(base)


def test_encoding_is_unambiguous() -> None:
    a = Namespace(model="ab", revision="c")
    b = Namespace(model="a", revision="bc")
    assert a.encode() != b.encode() and a.root != b.root


@pytest.mark.slow
def test_hashes_agree_across_processes_with_different_hash_seeds() -> None:
    code = "from kvstore.keys import Namespace, hash_blocks; ns = Namespace(model='m', block_size=4, cache_salt='s');" \
           "print(','.join(h.hex() for h in hash_blocks(ns, list(range(32)))))"
    outputs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outputs.add(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                   capture_output=True, text=True).stdout.strip())
    assert len(outputs) == 1 and outputs.pop().count(",") == 7


def test_block_key_layout_and_validation() -> None:
    h = hash_blocks(NS, range(4))[0]
    key = block_key(NS, h)
    assert split_key(key) == (NS.tag, h) and len(key) == 24
    with pytest.raises(InvalidArgumentError):
        block_key(NS, h[:15])
    with pytest.raises(InvalidArgumentError):
        block_key(dataclasses.replace(NS, hash_algorithm="sha256"), h)


@pytest.mark.parametrize("kwargs", [{"model": ""}, {"model": "m", "block_size": 0},
                                    {"model": "m", "tp_size": 2, "tp_rank": 2}, {"model": "m", "hash_algorithm": "md5"}])
def test_bad_namespaces(kwargs: dict) -> None:
    with pytest.raises((InvalidArgumentError, ValueError)):
        Namespace(**kwargs)


@pytest.mark.parametrize("num_hashes", [0, 1, 15, 16, 17, 1024])
@pytest.mark.parametrize("algorithm", list(HashAlgorithm))
def test_block_keys_match_block_key_for_short_and_long_lists(num_hashes: int, algorithm: HashAlgorithm) -> None:
    """Long lists are cut from one joined buffer, short ones built one by one: the same keys, as bytes."""
    namespace = Namespace("m", hash_algorithm=algorithm)
    hashes = [os.urandom(namespace.hash_bytes) for _ in range(num_hashes)]
    kinds = [bytes, bytearray, memoryview]
    mixed = [kinds[i % 3](h) for i, h in enumerate(hashes)]
    keys = block_keys(namespace, iter(mixed))
    assert keys == [block_key(namespace, h) for h in hashes] and all(type(k) is bytes for k in keys)


@pytest.mark.parametrize("num_hashes", [3, 40])
def test_block_keys_refuse_one_hash_of_the_wrong_length(num_hashes: int) -> None:
    namespace = Namespace("m")
    hashes = [os.urandom(16) for _ in range(num_hashes)]
    hashes[-1] = hashes[-1][:15] + hashes[-2][:1] + b"x"  # as many bytes in all, spread unevenly
    hashes[-2] = hashes[-2][:15]
    with pytest.raises(InvalidArgumentError, match="must be 16 bytes"):
        block_keys(namespace, hashes)


@pytest.mark.parametrize("num_hashes", [1, 40])
def test_a_typed_buffer_hash_counts_its_bytes_not_its_items(num_hashes: int) -> None:
    """An ``array('I')`` of 16 items is 64 bytes: the wrong length for a 16-byte hash, however len() reads."""
    namespace = Namespace("m")
    wide = array.array("I", range(16))
    with pytest.raises(InvalidArgumentError, match="must be 16 bytes for xxh3_128, got 64"):
        block_key(namespace, wide)
    with pytest.raises(InvalidArgumentError, match="got 64"):
        block_keys(namespace, [os.urandom(16) for _ in range(num_hashes - 1)] + [wide])
    right = array.array("I", range(4))  # 4 items, 16 bytes: a valid hash
    assert block_keys(namespace, [right] * num_hashes) == [block_key(namespace, right.tobytes())] * num_hashes
    with pytest.raises(InvalidArgumentError, match="expected bytes, got str"):
        block_keys(namespace, ["0123456789abcdef"])


@pytest.mark.parametrize("num_hashes", [0, 1, 40])
def test_packed_hashes_are_a_sequence_of_bytes_with_the_same_keys(num_hashes: int) -> None:
    namespace = Namespace("m")
    hashes = [os.urandom(16) for _ in range(num_hashes)]
    packed = PackedHashes(b"".join(hashes), 16)
    assert len(packed) == num_hashes and list(packed) == hashes
    assert block_keys(namespace, packed) == block_keys(namespace, hashes)
    assert all(type(k) is bytes for k in block_keys(namespace, packed))
    if num_hashes:
        assert packed[0] == hashes[0] and packed[-1] == hashes[-1]
        assert list(packed[1:3]) == hashes[1:3] and list(packed[::-2]) == hashes[::-2]
        assert list(packed[5:2]) == [] and isinstance(packed[1:], PackedHashes)
        with pytest.raises(IndexError):
            packed[num_hashes]


def test_packed_hashes_of_the_wrong_width_or_shape_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="must be 16 bytes for xxh3_128, got 32"):
        block_keys(Namespace("m"), PackedHashes(os.urandom(64), 32))
    assert block_keys(Namespace("m"), PackedHashes(b"", 32)) == []  # no hash, nothing of the wrong length
    for data, width in ((b"x" * 17, 16), (b"", 0)):
        with pytest.raises(ValueError, match="not whole hashes"):
            PackedHashes(data, width)
