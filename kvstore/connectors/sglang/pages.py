"""SGLang's HiCache pages as kvstore blocks: each page's view of the host pool, its namespace, its block hash.

A page of SGLang's host pool (``sglang.srt.mem_cache.pool_host``) is stored as
one kvstore block, in the host pool's own byte order, so that a read copies the
stored bytes straight into the pool (``get_into`` a view of the page) and a write
encodes straight from it: one copy each way. The page's bytes, in SGLang
0.5.23's ``init_kv_buffer`` order (``P`` tokens per page, ``L`` layers, ``H`` KV
heads of ``D`` dims, ``K`` the MLA latent width), and the block shape they are
viewed as (kvstore's layouts keep the block's tokens at dim 3 for ``kv``,
``[L, 2, H, B, D]``, and dim 2 for ``mla``, ``[L, 1, B, K]``, which the store checks):

=====================  ========================================  ==================================
``--hicache-mem-layout``  MHA page bytes -> ``kv`` block             MLA page bytes -> ``mla`` block
=====================  ========================================  ==================================
``layer_first``        ``[2, L, P, H, D]`` -> ``[2, L, 1, P, H*D]``  ``[L, P, 1, K]`` -> ``[L, 1, P, K]``
``page_first``         ``[2, P, L, H, D]`` -> ``[1, 2, 1, P, L*H*D]``  ``[P, L, 1, K]`` -> ``[1, 1, P, L*K]``
``page_first_direct``  ``[2, L, P, H, D]`` -> ``[2, L, 1, P, H*D]``  ``[L, P, 1, K]`` -> ``[L, 1, P, K]``
=====================  ========================================  ==================================

With ``page_first`` an MHA page is two contiguous runs (K, then V at the pool's
V offset) and an MLA page one; ``page_first_direct`` likewise; ``layer_first``
pages are strided (one run per layer and K/V).

``layer_first`` and ``page_first_direct`` pages have the same bytes, so engines
with those two layouts share pages; ``page_first`` pages differ and live in a
namespace of their own. Any other pool or layout (``page_head``,
``page_unified``, DCP-sharded MLA) is stored through the pool's flat data page
(``get_data_page`` / ``set_from_flat_data_page``: one more copy), under a
namespace named after its layout.

Namespaces (``kvstore.keys.Namespace``): the model tag is
``"<model>|sglang|<mha|mla>|order=<byte order>=<dims>|block=<shape>|pp=<rank>/<size>|cp=<rank>/<size>|dcp=..|fmt=<tag>"``,
the dtype is the pool's, ``block_size`` its page size, the ranks are the
writer's tensor-parallel rank and size (``tp_size=1`` for MLA, whose latent is
the same on every rank, as SGLang's file and Mooncake backends share MLA pages),
``cache_salt`` the tenant, and the hash is SHA-256 (SGLang's own page keys).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Sequence

from kvstore.blocks.tensors import dtype_name
from kvstore.keys import BlockHash, HashAlgorithm, Namespace

NATIVE_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
"""Host-pool layouts whose pages the backend views in place."""

_HEX_KEY = re.compile(r"^[0-9a-f]{64}$")
_KEY_DOMAIN = b"kvstore/sglang/key\x00"


@dataclass(frozen=True, slots=True)
class PageFormat:
    """What one stored page holds: its kvstore layout, dtype, shape and byte order.

    Attributes:
        layout: ``kv`` (MHA: K and V) or ``mla`` (one latent per token).
        dtype: codec dtype name of the pool, e.g. ``bfloat16``.
        shape: the block's shape (module docstring), 5 dims for ``kv``, 4 for ``mla``.
        order: the page's byte order and dims in the namespace, e.g. ``2.P.L.H.D=16x8x4x128``, or ``flat:<layout>``.
        page_size: tokens per page.
        native: pages are views of the pool (one copy); else the pool's flat data pages.
    """

    layout: str
    dtype: str
    shape: tuple[int, ...]
    order: str
    page_size: int
    native: bool

    @property
    def page_bytes(self) -> int:
        """Bytes of one page's payload."""
        count = 1
        for dim in self.shape:
            count *= dim
        return count * _itemsize(self.dtype)


def _itemsize(dtype: str) -> int:
    from kvstore.blocks.tensors import DTYPES

    return DTYPES[dtype][1]


def page_format(pool: Any, is_mla: bool) -> PageFormat:
    """The :class:`PageFormat` of an SGLang host pool (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost`` or alike).

    Reads ``layout``, ``page_size``, ``dtype`` and ``kv_buffer`` (its shape per ``init_kv_buffer``).

    Raises:
        UnknownDtypeError: if the pool's dtype has no kvstore codec code.
        ValueError: if the pool has no KV buffer (an allocator-only pool; nothing to store).
    """
    dtype = dtype_name(pool.dtype)
    page_size = int(pool.page_size)
    buffer = getattr(pool, "kv_buffer", None)
    if buffer is None or not hasattr(buffer, "shape"):
        raise ValueError(f"{type(pool).__name__} has no kv_buffer tensor; the kvstore backend stores KV pages only")
    layout = str(pool.layout)
    dims = tuple(int(d) for d in buffer.shape)
    native = layout in NATIVE_LAYOUTS and int(getattr(pool, "dcp_size", 1)) == 1
    if native and not is_mla and len(dims) == (6 if layout == "page_first_direct" else 5) and dims[0] == 2:
        heads, head_dim = dims[-2], dims[-1]
        layers = dims[1] if layout == "layer_first" else dims[2]
        if layout == "page_first":
            return PageFormat("kv", dtype, (1, 2, 1, page_size, layers * heads * head_dim), f"2.P.L.H.D={page_size}x{layers}x{heads}x{head_dim}",
                              page_size, True)
        return PageFormat("kv", dtype, (2, layers, 1, page_size, heads * head_dim),
                          f"2.L.P.H.D={layers}x{page_size}x{heads}x{head_dim}", page_size, True)
    if native and is_mla and len(dims) == (5 if layout == "page_first_direct" else 4):
        latent = dims[-1]
        layers = dims[0] if layout == "layer_first" else dims[1]
        if layout == "page_first":
            return PageFormat("mla", dtype, (1, 1, page_size, layers * latent),
                              f"P.L.1.K={page_size}x{layers}x1x{latent}", page_size, True)
        return PageFormat("mla", dtype, (layers, 1, page_size, latent),
                          f"L.P.1.K={layers}x{page_size}x1x{latent}", page_size, True)
    numel = int(pool.get_dummy_flat_data_page().numel())
    if numel % page_size:
        raise ValueError(f"a {layout} page of {type(pool).__name__} has {numel} elements, "
                         f"not a multiple of its {page_size} tokens")
    shape = (1, 1, page_size, numel // page_size) if is_mla else (1, 1, 1, page_size, numel // page_size)
    return PageFormat("mla" if is_mla else "kv", dtype, shape, f"flat:{layout}", page_size, False)


def page_view(pool: Any, fmt: PageFormat, index: int) -> Any:
    """The page of ``pool`` starting at token slot ``index``, viewed as ``fmt.shape`` (native formats only; no copy).

    Args:
        pool: the host pool.
        fmt: its :func:`page_format` (``native``).
        index: first token slot of the page (``host_indices[i * page_size]``), a multiple of the page size.
    """
    size, buffer, layout = fmt.page_size, pool.kv_buffer, pool.layout
    if fmt.layout == "kv":
        if layout == "layer_first":
            page = buffer[:, :, index:index + size]
        elif layout == "page_first":
            page = buffer[:, index:index + size]
        else:
            page = buffer[:, index // size]
    elif layout == "layer_first":
        page = buffer[:, index:index + size]
    elif layout == "page_first":
        page = buffer[index:index + size]
    else:
        page = buffer[index // size]
    return page.view(fmt.shape)


def storage_namespace(fmt: PageFormat, storage_config: Any, *, model_id: str | None = None,
                      tenant: str = "", format_tag: str | None = None) -> Namespace:
    """The namespace of one rank's pages (module docstring).

    Args:
        fmt: the pool's page format.
        storage_config: SGLang's ``HiCacheStorageConfig`` (ranks, ``is_mla_model``, ``model_name``).
        model_id: overrides ``storage_config.model_name``.
        tenant: the ``cache_salt``.
        format_tag: the pool's ``storage_format_tag`` (its own page byte format), if any.

    Raises:
        ValueError: if there is no model name.
        InvalidArgumentError: on a field the namespace refuses (a name over 512 bytes).
    """
    model = model_id or storage_config.model_name
    if not model:
        raise ValueError("SGLang gave no model_name; set model_id in the extra config")
    shape = "x".join(str(d) for d in fmt.shape)
    tag = (f"{model}|sglang|{'mla' if fmt.layout == 'mla' else 'mha'}|order={fmt.order}|block={shape}"
           f"|pp={storage_config.pp_rank}/{storage_config.pp_size}"
           f"|cp={storage_config.attn_cp_rank}/{storage_config.attn_cp_size}")
    dcp_size = int(getattr(storage_config, "dcp_size", 1) or 1)
    if dcp_size > 1:
        tag += f"|dcp={storage_config.dcp_rank}/{dcp_size}|tp={storage_config.tp_size}"
    if format_tag:
        tag += f"|fmt={format_tag}"
    replicated = bool(storage_config.is_mla_model)
    return Namespace(
        model=tag, dtype=fmt.dtype, layout=fmt.layout, block_size=fmt.page_size,
        tp_size=1 if replicated else int(storage_config.tp_size),
        tp_rank=0 if replicated else int(storage_config.tp_rank),
        cache_salt=tenant, hash_algorithm=HashAlgorithm.SHA256,
    )


def block_hash(key: str) -> BlockHash:
    """kvstore's 32-byte block hash of one SGLang page key.

    SGLang's page keys are SHA-256 hex digests chained over the token ids
    (``sglang.srt.mem_cache.hicache_key_scheme``): such a key is used as its bytes.
    Any other key (a suffixed one, another scheme) is hashed: SHA-256 of a domain
    prefix and its UTF-8 bytes, so it can never equal a hex key's bytes by accident.
    """
    if len(key) == 64 and _HEX_KEY.match(key):
        return BlockHash(bytes.fromhex(key))
    return BlockHash(hashlib.sha256(_KEY_DOMAIN + key.encode("utf-8")).digest())


def block_hashes(keys: Sequence[str]) -> list[BlockHash]:
    """:func:`block_hash` of each key, in order."""
    return [block_hash(k) for k in keys]
