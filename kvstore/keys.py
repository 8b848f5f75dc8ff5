"""Namespaces and chained token-prefix block hashes: the keys of every tier.

A block hash commits to the whole prefix before it, as in vLLM's prefix caching
(``vllm/v1/core/kv_cache_utils.py``) and LMCache's chunk hashes, but computed with
a documented, seed-free hash over a canonical byte encoding so that every
process, language and restart agrees:

    h_{-1} = H(canonical encoding of the namespace)        (the namespace root)
    h_i    = H(h_{i-1} || token ids of block i as little-endian uint32)
    h_i    = H(h_{i-1} || token ids of block i || uint32 len(e_i) || e_i)   (with extra key e_i)

A block may carry an optional **extra key** ``e_i``: bytes that the KV of the
block depends on beyond its token ids, such as the content hash of an image or
audio clip whose placeholder tokens lie in the block (vLLM's
``generate_block_hash_extra_keys`` does the same for multimodal inputs). The
token part of a block has a fixed length, so the length-prefixed extra key is
unambiguous, and a block without one hashes exactly as before.
:func:`span_extra_keys` builds ``e_i`` from spans of content keys in the canonical
form documented there.

``H`` is xxh3-128 by default and SHA-256 where clients are not trusted (xxh3
collisions can be forced on purpose, SHA-256 collisions cannot).
"""

from __future__ import annotations

import enum
import hashlib
import struct
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, NewType, Sequence, cast, overload

import numpy as np
import xxhash

from kvstore.blocks.format import DTYPES, Layout, dtype_name, encoding_of
from kvstore.errors import InvalidArgumentError, UnknownDtypeError

BlockHash = NewType("BlockHash", bytes)
"""The chained hash of one full block: 16 bytes (xxh3-128) or 32 bytes (SHA-256)."""

BlockKey = NewType("BlockKey", bytes)
"""A tier key: the 8-byte namespace tag followed by the block hash (24 or 40 bytes)."""

NAMESPACE_TAG_BYTES = 8

NAMESPACE_FIELD_MAX_BYTES: dict[str, int] = {
    "model": 512,
    "revision": 128,
    "dtype": 32,
    "layout": 16,
    "adapter": 256,
    "cache_salt": 256,
    "hash_algorithm": 16,
    "kv_encoding": 16,
}
"""The longest each text field of a :class:`Namespace` may be, in UTF-8 bytes (``docs/security.md``).

A Hugging Face model id is at most 96 + 1 + 96 characters and a git revision
40; the limits leave room for local paths and long tags, and bound what one
request's namespace can make a node hold (the node caches namespaces it has
seen). Past a limit, the namespace is refused with :class:`InvalidArgumentError`.
"""
_NAMESPACE_MAGIC = b"kvstore/namespace/v1\x00"
_ENCODABLE_DTYPES = ("float16", "bfloat16", "float32")
_MAX_TOKEN_ID = 2**32 - 1


class HashAlgorithm(str, enum.Enum):
    """The hash ``H`` of the block-hash chain."""

    XXH3_128 = "xxh3_128"
    SHA256 = "sha256"

    def digest(self, data: bytes | memoryview) -> bytes:
        """Return ``H(data)``."""
        if self is HashAlgorithm.XXH3_128:
            return xxhash.xxh3_128_digest(data)
        return hashlib.sha256(data).digest()


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that makes KV bytes of one model incompatible with another's.

    Two namespaces that differ in any field have different roots, so no block
    hash is ever shared between them (``tests/test_keys.py`` checks every field).

    Attributes:
        model: model name or path, e.g. ``meta-llama/Llama-3.1-8B``.
        revision: model revision (commit or tag).
        dtype: KV dtype name, e.g. ``float16`` (see ``kvstore.blocks.tensors.DTYPES``).
        layout: layout tag of the block bytes, e.g. ``kv`` or ``mla``
            (see ``kvstore.blocks.tensors.Layout``).
        block_size: tokens per block.
        tp_size: tensor-parallel world size of the writer.
        tp_rank: tensor-parallel rank of the writer, ``0 <= tp_rank < tp_size``.
        adapter: LoRA adapter id, empty for the base model.
        cache_salt: per-tenant salt; tenants with different salts never share
            blocks and cannot probe each other's prefixes through timing.
        hash_algorithm: ``H`` of the chain.
        kv_encoding: the lossy KV encoding of the blocks (``fp8_e4m3``, ``int8``, ``int4``, ``int2``;
            ``kvstore.blocks.encoding``), or ``""`` for exact blocks. It enters the root only when set, so an exact
            namespace's keys are what they were before encodings existed, and exact and lossy blocks never
            share a key (``docs/encodings.md``).

    Raises:
        InvalidArgumentError: on an empty model, a text field over its limit in
            :data:`NAMESPACE_FIELD_MAX_BYTES`, a non-positive block size, an
            out-of-range rank, or a layout that is not ``kv`` or ``mla``; a ``kv_encoding`` with a dtype
            other than float16, bfloat16 or float32 (:class:`~kvstore.errors.UnknownEncodingError`, a
            ``CodecError``, on an unknown encoding).
        UnknownDtypeError: (an ``InvalidArgumentError``) on a dtype that is not a
            codec dtype name, naming the valid ones (``torch.float16`` and a
            ``torch.dtype`` are taken as ``float16``).
    """

    model: str
    revision: str = ""
    dtype: str = "float16"
    layout: str = "kv"
    block_size: int = 16
    tp_size: int = 1
    tp_rank: int = 0
    adapter: str = ""
    cache_salt: str = ""
    hash_algorithm: HashAlgorithm = HashAlgorithm.XXH3_128
    kv_encoding: str = ""
    root: BlockHash = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.model:
            raise InvalidArgumentError("namespace.model must not be empty")
        for name, max_bytes in NAMESPACE_FIELD_MAX_BYTES.items():
            text = getattr(self, name)
            if not isinstance(text, str):
                continue  # the hash algorithm as an enum: checked below
            if len(text) > max_bytes or len(text.encode("utf-8")) > max_bytes:  # the first test is cheap
                raise InvalidArgumentError(
                    f"namespace.{name} is {len(text.encode('utf-8'))} bytes, over its limit of {max_bytes}")
        if not 0 < self.block_size <= 1 << 20:
            raise InvalidArgumentError(f"namespace.block_size must be in [1, 2^20], got {self.block_size}")
        if not 0 < self.tp_size <= 1 << 16 or not 0 <= self.tp_rank < self.tp_size:
            raise InvalidArgumentError(
                f"namespace tp_rank={self.tp_rank} must be in [0, tp_size={self.tp_size})"
            )
        object.__setattr__(self, "dtype", namespace_dtype(self.dtype))
        object.__setattr__(self, "layout", namespace_layout(self.layout))
        object.__setattr__(self, "hash_algorithm", HashAlgorithm(self.hash_algorithm))
        encoding = encoding_of(self.kv_encoding)
        object.__setattr__(self, "kv_encoding", "" if encoding is None else encoding.value)
        if encoding is not None and self.dtype not in _ENCODABLE_DTYPES:
            raise InvalidArgumentError(f"namespace.kv_encoding {encoding.value!r} encodes float16, bfloat16 or "
                                       f"float32 KV, not {self.dtype}")
        object.__setattr__(self, "root", BlockHash(self.hash_algorithm.digest(self.encode())))

    def encode(self) -> bytes:
        """Canonical bytes of the namespace: a magic, then each field in declaration order.

        Strings are UTF-8 behind a little-endian uint32 length; integers are
        little-endian uint32. The encoding is stable across processes and
        languages; changing it changes every hash (bump the magic). The
        ``kv_encoding`` is appended only when set, so that exact namespaces
        encode (and hash) as before it existed.
        """
        parts = [_NAMESPACE_MAGIC]
        for text in (self.model, self.revision, self.dtype, self.layout):
            _put_str(parts, text)
        parts.append(struct.pack("<III", self.block_size, self.tp_size, self.tp_rank))
        for text in (self.adapter, self.cache_salt, self.hash_algorithm.value):
            _put_str(parts, text)
        if self.kv_encoding:
            _put_str(parts, self.kv_encoding)
        return b"".join(parts)

    @property
    def tag(self) -> bytes:
        """The first 8 bytes of the root: the namespace part of every :data:`BlockKey`."""
        return self.root[:NAMESPACE_TAG_BYTES]

    @property
    def hash_bytes(self) -> int:
        """Length of one block hash in this namespace (16 or 32 bytes): the root's, a hash of the same ``H``."""
        return len(self.root)


_DTYPE_ALIASES = {
    "fp16": "float16", "half": "float16", "f16": "float16", "bf16": "bfloat16", "fp32": "float32",
    "float": "float32", "f32": "float32", "fp64": "float64", "double": "float64", "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn", "e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "e5m2": "float8_e5m2",
}
"""Short dtype names that engines use (vLLM's ``--kv-cache-dtype``, numpy's), and the codec name each means."""


def namespace_dtype(dtype: object) -> str:
    """The codec name of a namespace's KV dtype: ``float16`` for ``"float16"``, ``"torch.float16"`` or ``torch.float16``.

    Raises:
        UnknownDtypeError: if it is not a codec dtype, naming the valid names (and the one meant, for
            an engine's short name such as ``fp16``).
    """
    try:
        return dtype_name(dtype)
    except UnknownDtypeError:
        pass
    except (AttributeError, TypeError):
        raise UnknownDtypeError(f"namespace.dtype must be a dtype name such as 'float16', "
                                f"got {type(dtype).__name__} {dtype!r}") from None
    text = str(dtype).removeprefix("torch.")
    meant = _DTYPE_ALIASES.get(text.lower())
    hint = f" (did you mean {meant!r}?)" if meant else ""
    raise UnknownDtypeError(f"namespace.dtype {dtype!r} is not a kvstore dtype{hint}; valid: {', '.join(DTYPES)}")


def namespace_layout(layout: object) -> str:
    """The layout tag of a namespace: ``kv`` or ``mla`` (a :class:`~kvstore.blocks.tensors.Layout` or its value).

    Raises:
        InvalidArgumentError: on any other value, naming the valid ones.
    """
    try:
        return Layout(layout).value
    except ValueError:
        raise InvalidArgumentError(f"namespace.layout must be one of {[v.value for v in Layout]}, "
                                   f"got {layout!r}") from None


def _put_str(parts: list[bytes], text: str) -> None:
    data = text.encode("utf-8")
    parts.append(struct.pack("<I", len(data)))
    parts.append(data)


def token_bytes(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Return token ids as a contiguous little-endian uint32 array of shape ``[num_tokens]``.

    Accepts a list, a NumPy array or a CPU torch tensor.

    Raises:
        InvalidArgumentError: if the ids are not 1-D or an id is outside ``[0, 2^32)``.
    """
    array = np.asarray(token_ids)
    if array.ndim != 1:
        raise InvalidArgumentError(f"token ids must be 1-D, got shape {array.shape}")
    if array.size and array.dtype != np.dtype("<u4"):
        if array.dtype.kind not in "iu":
            raise InvalidArgumentError(f"token ids must be integers, got {array.dtype}")
        if int(array.min()) < 0 or int(array.max()) > _MAX_TOKEN_ID:
            raise InvalidArgumentError("token ids must lie in [0, 2^32)")
    return np.ascontiguousarray(array, dtype="<u4")


def hash_blocks(
    namespace: Namespace,
    token_ids: Sequence[int] | np.ndarray,
    *,
    parent: BlockHash | None = None,
    extra_keys: Sequence[bytes | None] | None = None,
) -> list[BlockHash]:
    """Chained hashes of the full blocks of ``token_ids``; a partial last block is not hashed.

    Args:
        namespace: supplies ``H``, the block size and the root ``h_{-1}``.
        token_ids: ``[num_tokens]`` token ids, each in ``[0, 2^32)``.
        parent: hash of the block just before ``token_ids[0]``, to extend a
            chain; the namespace root when ``None``.
        extra_keys: per block of ``token_ids`` (block 0 starts at ``token_ids[0]``),
            the block's extra key ``e_i`` (see the module docstring), or ``None``
            or ``b""`` for none. Entries past the last full block are ignored (a
            partial block is not hashed), missing ones mean none; ``None`` for
            no extra keys at all, which gives the same hashes as before extra keys existed.

    Returns:
        ``num_tokens // block_size`` block hashes, in order.

    Raises:
        InvalidArgumentError: on malformed token ids, a parent of the wrong
            length, or an extra key that is not bytes-like or is 2^32 bytes or longer.
    """
    ids = token_bytes(token_ids)
    previous: bytes = namespace.root if parent is None else parent
    if len(previous) != namespace.hash_bytes:
        raise InvalidArgumentError(f"parent hash must be {namespace.hash_bytes} bytes, got {len(previous)}")
    block_nbytes = namespace.block_size * 4
    data = ids.tobytes()
    digest = (
        xxhash.xxh3_128_digest
        if namespace.hash_algorithm is HashAlgorithm.XXH3_128
        else lambda b: hashlib.sha256(b).digest()
    )
    num_blocks = len(ids) // namespace.block_size
    extras = _extra_suffixes(extra_keys, num_blocks)
    hashes: list[BlockHash] = []
    for i, start in enumerate(range(0, num_blocks * block_nbytes, block_nbytes)):
        previous = digest(previous + data[start : start + block_nbytes] + extras[i])
        hashes.append(BlockHash(previous))
    return hashes


def _extra_suffixes(extra_keys: Sequence[bytes | None] | None, num_blocks: int) -> list[bytes]:
    """Per full block, the bytes hashed after its token ids: ``b""``, or ``uint32 len(e) || e``.

    Raises:
        InvalidArgumentError: on an extra key that is not bytes-like or is too long.
    """
    suffixes = [b""] * num_blocks
    if extra_keys is None:
        return suffixes
    for i, extra in enumerate(list(extra_keys)[:num_blocks]):
        if extra is None:
            continue
        try:
            raw = memoryview(extra).tobytes()
        except TypeError:
            raise InvalidArgumentError(
                f"extra key of block {i} must be bytes, got {type(extra).__name__}"
            ) from None
        if len(raw) > _MAX_TOKEN_ID:
            raise InvalidArgumentError(f"extra key of block {i} is {len(raw)} bytes; the limit is 2^32 - 1")
        if raw:
            suffixes[i] = struct.pack("<I", len(raw)) + raw
    return suffixes


@dataclass(frozen=True, slots=True)
class KeySpan:
    """Content that a run of tokens stands for, identified by a key: e.g. an image behind its placeholders.

    Attributes:
        start: position of the span's first token in the sequence (0-based).
        length: tokens in the span, > 0.
        key: the content's identifier, e.g. vLLM's ``MultiModalFeatureSpec.identifier``
            (a hash of the image bytes and processor settings); a ``str`` is taken as its UTF-8 bytes.

    Raises:
        InvalidArgumentError: on a negative start, a non-positive length, or a
            start, length or key that does not fit a uint32.
    """

    start: int
    length: int
    key: bytes | str

    def __post_init__(self) -> None:
        if not 0 <= self.start <= _MAX_TOKEN_ID or not 0 < self.length <= _MAX_TOKEN_ID:
            raise InvalidArgumentError(f"a key span needs 0 <= start and 0 < length < 2^32, got {self.start}, "
                                       f"{self.length}")
        key = self.key
        try:
            key = key.encode("utf-8") if isinstance(key, str) else memoryview(key).tobytes()
        except TypeError:
            raise InvalidArgumentError(f"a key span's key must be bytes or str, got {type(key).__name__}") from None
        object.__setattr__(self, "key", key)
        if len(key) > _MAX_TOKEN_ID:
            raise InvalidArgumentError("a key span's key must be shorter than 2^32 bytes")

    def encode(self) -> bytes:
        """Canonical bytes: ``uint32 len(key) || key || uint32 start || uint32 length``, little-endian."""
        key = self.key if isinstance(self.key, bytes) else self.key.encode("utf-8")
        return struct.pack("<I", len(key)) + key + struct.pack("<II", self.start, self.length)


def span_extra_keys(num_tokens: int, block_size: int, spans: Iterable[KeySpan]) -> list[bytes | None]:
    """The extra key of each block of a sequence from the spans of content that overlap it.

    Block ``i`` covers tokens ``[i * block_size, (i + 1) * block_size)``; its
    extra key is the concatenation, in the order given, of :meth:`KeySpan.encode`
    of every span that overlaps it, or ``None`` when none does. Absolute
    positions are encoded, so the same content placed elsewhere, or split into
    spans differently, gives different keys. Pass the result to
    :func:`hash_blocks` as ``extra_keys``; two prompts whose placeholder tokens
    are equal but whose images differ then get different block hashes from the
    first block an image touches on.

    Args:
        num_tokens: tokens in the sequence (the last block may be partial).
        block_size: tokens per block, > 0.
        spans: the content spans, positions relative to the sequence's first token.

    Returns:
        ``ceil(num_tokens / block_size)`` entries.

    Raises:
        InvalidArgumentError: on a non-positive block size or a negative token count.
    """
    if block_size <= 0 or num_tokens < 0:
        raise InvalidArgumentError(f"need block_size > 0 and num_tokens >= 0, got {block_size}, {num_tokens}")
    num_blocks = -(-num_tokens // block_size)
    parts: list[list[bytes]] = [[] for _ in range(num_blocks)]
    for span in spans:
        first = span.start // block_size
        last = min((span.start + span.length - 1) // block_size, num_blocks - 1)
        encoded = span.encode()
        for i in range(first, last + 1):
            parts[i].append(encoded)
    return [b"".join(p) if p else None for p in parts]


def block_key(namespace: Namespace, block_hash: bytes) -> BlockKey:
    """The tier key of ``block_hash`` in ``namespace``: ``namespace.tag || block_hash``.

    Any bytes-like hash is taken by its bytes (a typed buffer, e.g. an
    ``array('I')``, by its ``nbytes``, not its item count).

    Raises:
        InvalidArgumentError: if the hash length does not match the namespace's
            algorithm, or the hash is not bytes-like.
    """
    if type(block_hash) is not bytes:
        block_hash = _as_bytes(block_hash)
    if len(block_hash) != namespace.hash_bytes:
        raise InvalidArgumentError(
            f"block hash must be {namespace.hash_bytes} bytes for {namespace.hash_algorithm.value}, "
            f"got {len(block_hash)}"
        )
    return BlockKey(namespace.tag + block_hash)


def _as_bytes(block_hash: Any) -> bytes:
    """The bytes of a bytes-like hash.

    Raises:
        InvalidArgumentError: if it is not bytes-like.
    """
    try:
        return memoryview(block_hash).tobytes()
    except TypeError:
        raise InvalidArgumentError(f"a block hash must be bytes, got {type(block_hash).__name__}"
                                   " (hashes come from kvstore.hash_blocks)") from None


_ONE_HASH_TYPES = (bytes, bytearray, memoryview, str)
"""What a caller passes by mistake for a list of hashes: one hash, or a string."""


def check_hash_list(namespace: object, block_hashes: object) -> None:
    """Check, in constant time, that a call got a :class:`Namespace` and a sequence of hashes, not one hash.

    What the block API (``lookup``, ``get``, ``put``, ``delete``) of the store and
    the clients checks first; :func:`check_block_hashes` checks every hash too.

    Raises:
        InvalidArgumentError: if ``namespace`` is not a :class:`Namespace`, or ``block_hashes`` is
            ``bytes``, ``bytearray``, ``memoryview`` or ``str`` (one hash, not a list of them).
    """
    if type(namespace) is not Namespace and not isinstance(namespace, Namespace):
        raise InvalidArgumentError(f"namespace must be a kvstore Namespace, got {type(namespace).__name__}")
    if isinstance(block_hashes, _ONE_HASH_TYPES):
        raise InvalidArgumentError(
            f"expected a sequence of block hashes, got {type(block_hashes).__name__}"
            + (" (a hex string? use [bytes.fromhex(h) for h in hashes])" if isinstance(block_hashes, str)
               else " (one hash? pass [block_hash])"))


def check_block_hashes(namespace: Namespace, block_hashes: Sequence[bytes]) -> None:
    """Check a call's hashes: a sequence (:func:`check_hash_list`) of bytes-like hashes of the namespace's length.

    The usual case is checked by one C call (joining the hashes: 1,024 in about
    10 µs), which checks the total length; only a list that fails it is
    diagnosed hash by hash. Where lengths that differ add up to the right total,
    the store (and a node) still refuses the hash of the wrong length.

    Raises:
        InvalidArgumentError: as :func:`check_hash_list`; if ``block_hashes`` has no length (a
            generator); or naming the index of the first hash that is not bytes-like (a ``str`` is
            told to use ``bytes.fromhex``) or not ``namespace.hash_bytes`` long.
    """
    check_hash_list(namespace, block_hashes)
    try:
        num_hashes = len(block_hashes)
    except TypeError:
        raise InvalidArgumentError(
            f"expected a sequence of block hashes, got {type(block_hashes).__name__}") from None
    try:
        total_bytes = len(b"".join(block_hashes))
    except TypeError:  # a hash that is not bytes-like
        total_bytes = -1
    if total_bytes != num_hashes * namespace.hash_bytes:
        _check_each_hash(namespace, block_hashes)


def _check_each_hash(namespace: Namespace, block_hashes: Iterable[object]) -> None:
    """Raise :class:`InvalidArgumentError` naming the first hash that is not bytes-like of the namespace's length."""
    for index, block_hash in enumerate(block_hashes):
        _check_one_hash(namespace, index, block_hash)


def _check_one_hash(namespace: Namespace, index: int, block_hash: Any) -> None:
    """Raise :class:`InvalidArgumentError` naming hash ``index`` if it is not bytes-like of the namespace's length."""
    if isinstance(block_hash, str):
        raise InvalidArgumentError(f"block hash {index}: expected bytes, got str (a hex string? "
                                   f"use bytes.fromhex({block_hash[:12]!r}...))")
    try:
        nbytes = memoryview(block_hash).nbytes
    except TypeError:
        raise InvalidArgumentError(f"block hash {index}: expected bytes, got {type(block_hash).__name__}"
                                   " (hashes come from kvstore.hash_blocks)") from None
    if nbytes != namespace.hash_bytes:
        raise InvalidArgumentError(f"block hash {index}: must be {namespace.hash_bytes} bytes for "
                                   f"{namespace.hash_algorithm.value}, got {nbytes}")


def block_keys(namespace: Namespace, block_hashes: Iterable[bytes]) -> list[BlockKey]:
    """:func:`block_key` over a sequence of hashes (one length check each, no per-key call).

    From :data:`_PACKED_MIN_HASHES` hashes of the namespace's length on, the
    keys are cut out of one joined buffer by numpy, in C: for 1,024 hashes that
    takes about a quarter less time than a Python loop (the Lookup of
    ``benchmarks/bench_service.py``).

    Raises:
        InvalidArgumentError: as :func:`check_block_hashes`: one hash instead of a sequence, a hash
            that is not bytes-like, or a length that does not match the namespace's algorithm.
    """
    check_hash_list(namespace, block_hashes)
    width = namespace.hash_bytes
    tag = namespace.tag
    if type(block_hashes) is list and len(block_hashes) < _PACKED_MIN_HASHES:  # a Get's few hashes: the hot path
        keys = [tag + h for h in block_hashes if type(h) is bytes and len(h) == width]
        if len(keys) == len(block_hashes):
            return cast(list[BlockKey], keys)  # keys by construction; BlockKey(k) each would cost a call per key
    if isinstance(block_hashes, PackedHashes):
        if block_hashes.width != width and len(block_hashes):
            block_key(namespace, block_hashes[0])  # raises, naming the lengths
        return _keys_of_packed(tag, block_hashes.data, width)
    hashes = block_hashes if isinstance(block_hashes, (list, tuple)) else list(block_hashes)
    if set(map(type, hashes)) - {bytes}:  # bytearray, memoryview, typed buffers: by their bytes
        if any(isinstance(h, str) for h in hashes):
            _check_each_hash(namespace, hashes)  # raises, naming the first and the fix
        hashes = [h if type(h) is bytes else _as_bytes(h) for h in hashes]
    if len(hashes) >= _PACKED_MIN_HASHES and set(map(len, hashes)) == {width}:
        packed = tag + tag.join(hashes)  # tag h0 tag h1 ...: the keys, end to end
        packed_keys: list[BlockKey] = np.frombuffer(packed, dtype=f"V{len(tag) + width}").tolist()
        return packed_keys
    if set(map(len, hashes)) - {width}:
        _check_each_hash(namespace, hashes)  # raises, naming the first hash of the wrong length
    return cast(list[BlockKey], [tag + h for h in hashes])


_PACKED_MIN_HASHES = 16
"""Fewest hashes for which :func:`block_keys` cuts keys out of one buffer; below it a Python loop is faster."""


def _keys_of_packed(tag: bytes, data: bytes, width: int) -> list[BlockKey]:
    """The keys of hashes of ``width`` bytes end to end in ``data``: each one ``tag`` followed by its hash."""
    keys = np.empty((len(data) // width, len(tag) + width), dtype=np.uint8)
    keys[:, : len(tag)] = np.frombuffer(tag, dtype=np.uint8)
    keys[:, len(tag):] = np.frombuffer(data, dtype=np.uint8).reshape(-1, width)
    result: list[BlockKey] = keys.view(f"V{len(tag) + width}").ravel().tolist()
    return result


class PackedHashes(Sequence[bytes]):
    """Block hashes of one length, end to end in one ``bytes``: a list of hashes without an object per hash.

    What the server reads out of a request (``kvstore.wire.decode_hash_request``):
    :func:`block_keys` makes keys from it in C, with no length check per hash
    (all are ``width`` bytes by construction). Indexing and iteration give
    ``bytes``; a slice is another :class:`PackedHashes`.

    Args:
        data: the hashes, ``len(data)`` a multiple of ``width``.
        width: bytes per hash, > 0.

    Raises:
        ValueError: if ``width <= 0`` or ``len(data)`` is not a multiple of it.
    """

    __slots__ = ("data", "width")

    def __init__(self, data: bytes, width: int) -> None:
        if width <= 0 or len(data) % width:
            raise ValueError(f"{len(data)} bytes are not whole hashes of {width} bytes")
        self.data = data
        self.width = width

    def __len__(self) -> int:
        return len(self.data) // self.width

    @overload
    def __getitem__(self, index: int) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> PackedHashes: ...

    def __getitem__(self, index: int | slice) -> bytes | PackedHashes:
        """Hash ``index`` (``bytes``), or a slice of them (another :class:`PackedHashes`)."""
        width = self.width
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:
                return PackedHashes(self.data[start * width: max(start, stop) * width], width)
            return PackedHashes(b"".join(self[i] for i in range(start, stop, step)), width)
        position = range(len(self))[index]  # IndexError past either end, negative indices count from the end
        return self.data[position * width: (position + 1) * width]

    def __iter__(self) -> Iterator[bytes]:
        data, width = self.data, self.width
        return (data[i: i + width] for i in range(0, len(data), width))

    def __repr__(self) -> str:
        return f"PackedHashes({len(self)} hashes of {self.width} bytes)"


def split_key(key: BlockKey) -> tuple[bytes, BlockHash]:
    """Split a tier key into its namespace tag and block hash."""
    return key[:NAMESPACE_TAG_BYTES], BlockHash(key[NAMESPACE_TAG_BYTES:])
