"""Host pools on CPU (SGLang's page interface), SGLang's real storage config and page keys, for tests and the benchmark."""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.utils import get_hash_str

LAYOUTS = ("layer_first", "page_first", "page_first_direct")


class HostPool:
    """A host KV pool with the interface SGLang's storage backends use, for CPU tests (why: ``docs/sglang.md``).

    SGLang's own ``MHATokenToKVPoolHost`` and ``MLATokenToKVPoolHost`` cannot be
    imported in ``.venv-sglang``: their package imports SGLang's model configs,
    which import torchvision, and PyPI's torchvision builds need CUDA torch
    (``RuntimeError: operator torchvision::nms does not exist`` on the CPU torch).
    This pool has their attributes (``kv_buffer``, ``layout``, ``page_size``,
    ``dtype``, ``page_num``, ``size``) with ``kv_buffer`` shaped as their
    ``init_kv_buffer`` shapes it in SGLang 0.5.23, and their documented page
    methods (``get_data_page``, ``get_dummy_flat_data_page``,
    ``set_from_flat_data_page``) with the same slicing per layout.

    Args:
        layout: ``layer_first``, ``page_first`` or ``page_first_direct``.
        dtype: the KV dtype.
        page_size: tokens per page.
        num_pages: pages of the pool (SGLang adds one padding page; so does this).
        mla: an MLA pool (one latent of ``head_dim`` per token and layer) instead of MHA.
    """

    def __init__(self, layout: str, dtype: torch.dtype, *, page_size: int, num_layers: int, num_heads: int,
                 head_dim: int, num_pages: int, mla: bool) -> None:
        self.layout, self.dtype, self.page_size, self.mla = layout, dtype, page_size, mla
        self.layer_num, self.head_num, self.head_dim = num_layers, num_heads, head_dim
        self.page_num = num_pages + 1
        self.size = self.page_num * page_size
        self.device = "cpu"
        dims = {
            (False, "layer_first"): (2, num_layers, self.size, num_heads, head_dim),
            (False, "page_first"): (2, self.size, num_layers, num_heads, head_dim),
            (False, "page_first_direct"): (2, self.page_num, num_layers, page_size, num_heads, head_dim),
            (True, "layer_first"): (num_layers, self.size, 1, head_dim),
            (True, "page_first"): (self.size, num_layers, 1, head_dim),
            (True, "page_first_direct"): (self.page_num, num_layers, page_size, 1, head_dim),
        }[(mla, layout)]
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def _page(self, index: int) -> torch.Tensor:
        end = index + self.page_size
        if self.mla:
            return {"layer_first": lambda: self.kv_buffer[:, index:end],
                    "page_first": lambda: self.kv_buffer[index:end],
                    "page_first_direct": lambda: self.kv_buffer[index // self.page_size:index // self.page_size + 1],
                    }[self.layout]()
        return {"layer_first": lambda: self.kv_buffer[:, :, index:end],
                "page_first": lambda: self.kv_buffer[:, index:end],
                "page_first_direct": lambda: self.kv_buffer[:, index // self.page_size:index // self.page_size + 1],
                }[self.layout]()

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        """The page from token slot ``index``: flattened (a copy when strided) or the view."""
        page = self._page(int(index))
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        """A zeroed flat page, to read a stored page into."""
        return torch.zeros(self._page(0).numel(), dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        """Write a flat page into the page from token slot ``index``."""
        page = self._page(int(index))
        page.copy_(data_page.reshape(page.shape))


def mha_pool(layout: str, dtype: torch.dtype = torch.float16, *, page_size: int = 4, num_layers: int = 2,
             num_heads: int = 2, head_dim: int = 8, device_pages: int = 8) -> HostPool:
    """An MHA host pool (``MHATokenToKVPoolHost``'s buffer and page methods) of twice ``device_pages`` pages."""
    return HostPool(layout, dtype, page_size=page_size, num_layers=num_layers, num_heads=num_heads,
                    head_dim=head_dim, num_pages=2 * device_pages, mla=False)


def mla_pool(layout: str, dtype: torch.dtype = torch.bfloat16, *, page_size: int = 4, num_layers: int = 2,
             kv_lora_rank: int = 16, rope_dim: int = 8, device_pages: int = 8) -> HostPool:
    """An MLA host pool (``MLATokenToKVPoolHost``'s), latent width ``kv_lora_rank + rope_dim``."""
    return HostPool(layout, dtype, page_size=page_size, num_layers=num_layers, num_heads=1,
                    head_dim=kv_lora_rank + rope_dim, num_pages=2 * device_pages, mla=True)


def storage_config(extra: dict[str, Any] | None = None, *, tp_rank: int = 0, tp_size: int = 1,
                   is_mla: bool = False, model: str = "test/model", page_first: bool = False,
                   metrics: bool = False) -> HiCacheStorageConfig:
    """SGLang's ``HiCacheStorageConfig`` of one rank, with the dynamic loader's keys in ``extra_config``."""
    extra_config = {"backend_name": "kvstore", "module_path": "kvstore.connectors.sglang",
                    "class_name": "KVStoreHiCacheStorage", "interface_v1": 1, **(extra or {})}
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=is_mla, enable_storage_metrics=metrics, is_page_first_layout=page_first, model_name=model,
        extra_config=extra_config)


def page_keys(num_pages: int, page_size: int, first_token: int = 0) -> list[str]:
    """SGLang's own chained SHA-256 page keys (``get_hash_str``) of ``num_pages`` pages of token ids."""
    keys: list[str] = []
    prior = None
    for page in range(num_pages):
        start = first_token + page * page_size
        prior = get_hash_str(list(range(start, start + page_size)), prior)
        keys.append(prior)
    return keys


def fill_random(pool: Any, seed: int) -> None:
    """Random bytes in the whole host buffer of ``pool``."""
    generator = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=generator).to(pool.kv_buffer.dtype))


def host_indices(first_page: int, num_pages: int, page_size: int) -> torch.Tensor:
    """The token slots of ``num_pages`` pages from page ``first_page`` (as SGLang's allocator hands them out)."""
    return torch.arange(first_page * page_size, (first_page + num_pages) * page_size, dtype=torch.int64)


def pages_of(pool: Any, indices: torch.Tensor, num_pages: int) -> list[torch.Tensor]:
    """The pool's flat data pages (``get_data_page``, SGLang's own accessor) at ``indices``, copied."""
    size = pool.page_size
    return [pool.get_data_page(int(indices[i * size]), flat=True).clone() for i in range(num_pages)]
