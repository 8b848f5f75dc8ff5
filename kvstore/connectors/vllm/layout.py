"""vLLM's paged KV tensors seen as kvstore blocks: which models are served, and gather/scatter of whole blocks.

vLLM 0.32 hands a connector one tensor per attention layer (``register_kv_caches``)
whose logical shape is ``[num_blocks, H, N, C]`` (RFC #42082, ``vllm/v1/kv_cache_layout.py``):
``H`` KV heads, ``N`` tokens per kernel block, ``C`` the content of one (head, token)
cell; the physical order comes from the group's ``KVCacheLayout`` and shows in the
strides. What ``C`` holds depends on the attention backend, so the family is read
from the backend's name (``layer.attn_backend.get_name()``), never guessed from shapes:

* ``split_tokens`` (``CPU_ATTN``, ``vllm/v1/attention/backends/cpu_attn.py``):
  each head's page is ``[2N, D]``, K in the first ``N`` rows and V in the last
  ``N``. The order inside those rows is the CPU kernel's own and depends on the
  ISA it picked (``layer.isa``: the VEC kernels store K as ``[D, N]``), so the
  namespace records the ISA and only an engine with the same one reads the blocks.
* ``split_channels`` (``FLASH_ATTN``, ``FLASHINFER``, ``TRITON_ATTN``): ``C`` is
  ``K || V``, ``D`` channels each, for every (head, token): K and V are exact,
  backend-neutral tensors, in NHD (``LBNHC``) or HND (``LBHNC``) order alike.
* ``latent`` (any MLA backend, ``attn_backend.is_mla()``): ``H == 1`` and ``C``
  is the compressed latent plus the RoPE part (DeepSeek-V2), replicated over TP ranks.

Every family is turned into one strided *canonical view* per layer, with no copy:
``[num_units, 2, H, N, D]`` (``kv`` layout) or ``[num_units, 1, N, C]`` (``mla``),
where a *unit* is one kernel block. A kvstore block of ``T`` tokens is ``T / N``
consecutive units of every layer, stacked as ``[num_layers, 2, H, T, D]`` (codec
layout ``kv``) or ``[num_layers, 1, T, C]`` (``mla``). On CUDA, gathering blocks is
one ``index_select`` per layer, loading them one ``index_copy_`` per layer, into
exactly the units vLLM allocated, so nothing outside them is ever written. On a
CPU, loads are numpy copies (:meth:`PagedKV.scatter_arrays`): one strided copy per
layer for a batch of blocks (one assignment per layer, by unit index), else one per
unit and layer, straight from the fetched or leased bytes. Numpy copies in the
calling thread, with the GIL released and no OpenMP: no copy waits at a barrier for
a core that another process holds (torch's parallel copy would), and a load on a
worker thread runs beside the engine's step. Gathers (saves) are numpy copies too.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
import xxhash

from kvstore.blocks.tensors import Layout, dtype_name, torch_dtype
from kvstore.connectors.kit.spec import BlockSpec
from kvstore.connectors.kit.leased import item_type
from kvstore.errors import InvalidArgumentError


class UnsupportedModelError(InvalidArgumentError):
    """The model's KV cache has a part the connector cannot restore exactly; it is refused at start-up."""


class KVFamily(str, enum.Enum):
    """How a backend lays out one (head, token) cell of its page; see the module docstring."""

    SPLIT_TOKENS = "split_tokens"
    SPLIT_CHANNELS = "split_channels"
    LATENT = "latent"


BACKEND_FAMILIES: dict[str, KVFamily] = {
    "CPU_ATTN": KVFamily.SPLIT_TOKENS,
    "FLASH_ATTN": KVFamily.SPLIT_CHANNELS,
    "FLASHINFER": KVFamily.SPLIT_CHANNELS,
    "TRITON_ATTN": KVFamily.SPLIT_CHANNELS,
}
"""Non-MLA attention backends whose page layout the connector knows (vLLM 0.32), by ``get_name()``."""

_BYTE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""KV dtypes that are copied as ``uint8`` (``index_copy_`` has no float8 kernels on every device)."""


@dataclass(frozen=True, slots=True)
class PageFormat:
    """What the bytes of one worker's kvstore blocks mean: part of their namespace, sent to the scheduler.

    Attributes:
        backend: the attention backend, e.g. ``CPU_ATTN``.
        family: how the backend lays out K and V (:class:`KVFamily` value).
        interior: ``canonical`` when K and V are exact tensors, else the backend's
            own in-block order (``cpu_attn:isa=vec``).
        num_layers: attention layers this worker holds (its pipeline stage's).
        num_kv_heads: KV heads per layer on this worker (after the TP split); 1 for MLA.
        head_size: channels of K (and of V), or of the latent for MLA.
        unit_tokens: tokens per kernel block (vLLM's attention block size).
        dtype: codec dtype name of the cache, e.g. ``bfloat16`` or ``float8_e4m3fn``.
        cache_dtype: vLLM's ``--kv-cache-dtype``, e.g. ``auto`` or ``fp8_e4m3``.
        scales: digest of the per-layer K/V scales of a quantized cache, else empty.
    """

    backend: str
    family: str
    interior: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    unit_tokens: int
    dtype: str
    cache_dtype: str
    scales: str = ""

    @property
    def layout(self) -> Layout:
        """The codec layout of the blocks: ``mla`` for a latent cache, else ``kv``."""
        return Layout.MLA if self.family == KVFamily.LATENT.value else Layout.KV

    @property
    def descriptor(self) -> str:
        """A stable string naming every field, for the namespace's model tag."""
        return (f"{self.backend}/{self.family}/{self.interior}/L{self.num_layers}/H{self.num_kv_heads}"
                f"/D{self.head_size}/N{self.unit_tokens}/{self.dtype}/kv={self.cache_dtype}"
                + (f"/scales={self.scales}" if self.scales else ""))

    def block_spec(self, block_tokens: int) -> BlockSpec:
        """What one kvstore block of ``block_tokens`` tokens holds: this format's dtype, layout and block shape."""
        return BlockSpec(self.dtype, self.layout, self.block_shape(block_tokens))

    def block_shape(self, block_tokens: int) -> tuple[int, ...]:
        """Shape of one kvstore block of ``block_tokens`` tokens: ``[L, 2, H, T, D]`` or ``[L, 1, T, C]``."""
        if self.layout is Layout.MLA:
            return (self.num_layers, 1, block_tokens, self.head_size)
        return (self.num_layers, 2, self.num_kv_heads, block_tokens, self.head_size)


# --------------------------------------------------------------------------- which models are served


def check_kv_cache_config(kv_cache_config: Any) -> None:
    """Refuse KV-cache groups whose state the connector cannot restore exactly.

    The connector restores one group of full-attention (or MLA) layers by token
    blocks. It refuses, naming the group: several groups (hybrid models: sliding
    window beside full attention, Mamba or linear-attention state), a group of
    sliding-window, chunked-local, cross, encoder-only, sink or Mamba layers, a
    sliding window or attention chunk recorded on a full-attention group (the
    hybrid allocator turned off), per-token quantization scales and packed pages.
    LMCache's hits on hybrid models without their recurrent state garbled about
    40% of outputs (LMCache issue #2845); a refusal at start-up is the safe answer.

    Args:
        kv_cache_config: vLLM's ``KVCacheConfig``.

    Raises:
        UnsupportedModelError: naming the first group it cannot serve and why.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, MLAAttentionSpec

    groups = list(kv_cache_config.kv_cache_groups)
    if not groups:
        raise UnsupportedModelError("the model has no KV cache (attention-free); the kvstore connector has nothing to do")
    if len(groups) > 1:
        names = ", ".join(f"group {i} ({type(g.kv_cache_spec).__name__}: {_layers(g.layer_names)})"
                          for i, g in enumerate(groups))
        raise UnsupportedModelError(
            f"the model has {len(groups)} KV-cache groups ({names}); the kvstore connector restores only models "
            "whose attention layers form one full-attention group (hybrid sliding-window, Mamba and "
            "linear-attention models would get KV without their other state)")
    group = groups[0]
    spec = group.kv_cache_spec
    where = f"KV-cache group 0 ({type(spec).__name__}: {_layers(group.layer_names)})"
    if type(spec) not in (FullAttentionSpec, MLAAttentionSpec):
        raise UnsupportedModelError(
            f"{where} is not full attention; the kvstore connector serves FullAttentionSpec and MLAAttentionSpec groups")
    if spec.sliding_window is not None:
        raise UnsupportedModelError(f"{where} has sliding-window layers (window {spec.sliding_window})")
    if spec.attention_chunk_size is not None:
        raise UnsupportedModelError(f"{where} uses chunked local attention (chunk {spec.attention_chunk_size})")
    if spec.kv_quant_mode not in (KVQuantMode.NONE, KVQuantMode.FP8_PER_TENSOR):
        raise UnsupportedModelError(f"{where} quantizes KV with per-token scales ({spec.kv_quant_mode.name}), "
                                    "which live outside the pages")
    if spec.num_head_slots is not None or spec.state_content_bytes is not None or spec.tokens_per_state != 1:
        raise UnsupportedModelError(f"{where} packs its pages (heads, content or tokens per state)")
    if not isinstance(spec, MLAAttentionSpec) and spec.head_size_v != spec.head_size:
        raise UnsupportedModelError(f"{where} has V heads of {spec.head_size_v} channels and K heads of "
                                    f"{spec.head_size}")


def _layers(names: Sequence[str]) -> str:
    names = list(names)
    return ", ".join(names) if len(names) <= 3 else f"{names[0]} ... {names[-1]}, {len(names)} layers"


# --------------------------------------------------------------------------- the worker's paged KV


class PagedKV:
    """One worker's paged KV caches as kvstore blocks: the canonical view of every layer.

    Args:
        page_format: what the blocks hold.
        views: per layer, in order, the canonical view ``[num_units, 2, H, N, D]``
            (``kv``) or ``[num_units, 1, N, C]`` (``mla``), a strided view of vLLM's tensor.
        units_per_block: kernel blocks per vLLM (manager) block.
    """

    def __init__(self, page_format: PageFormat, views: Sequence[torch.Tensor], units_per_block: int) -> None:
        self.page_format = page_format
        self.views = list(views)
        self.units_per_block = units_per_block
        self.device = self.views[0].device
        self._copy_dtype = self.views[0].dtype  # uint8 for float8 caches
        self._block_dtype = torch_dtype(page_format.dtype)
        self._arrays: list[np.ndarray] | None = None

    def units_of(self, block_ids: Sequence[int]) -> list[int]:
        """The kernel-block ids of vLLM blocks, in token order (``units_per_block`` per block)."""
        per_block = self.units_per_block
        return [block_id * per_block + r for block_id in block_ids for r in range(per_block)]

    def gather(self, unit_ids: Sequence[int], units_per_kv_block: int) -> torch.Tensor:
        """Copy whole kvstore blocks out of the paged caches.

        Args:
            unit_ids: kernel-block ids, ``units_per_kv_block`` per kvstore block, blocks in order.
            units_per_kv_block: kernel blocks per kvstore block.

        Returns:
            ``[num_blocks, L, 2, H, T, D]`` (``kv``) or ``[num_blocks, L, 1, T, C]``
            (``mla``) on the caches' device, in the cache dtype; a fresh tensor.
        """
        num_blocks = len(unit_ids) // units_per_kv_block
        fmt = self.page_format
        shape = (num_blocks, *fmt.block_shape(units_per_kv_block * fmt.unit_tokens))
        out = torch.empty(shape, dtype=self._copy_dtype, device=self.device)
        if self.device.type == "cpu":
            # numpy copies: one pass over the bytes with the GIL released and no OpenMP barrier to wait at
            # for cores other processes hold; one strided copy per layer for a run of whole blocks
            layers = self._layer_arrays()
            target = out.view(torch_dtype_of(item_type(self._copy_dtype.itemsize))).numpy()
            first = unit_ids[0] if unit_ids else 0
            if units_per_kv_block == 1 and all(unit_ids[i] == first + i for i in range(num_blocks)):
                for layer, source in enumerate(layers):
                    target[:, layer] = source[first:first + num_blocks]
            else:
                tokens = fmt.unit_tokens
                for block in range(num_blocks):
                    for k in range(units_per_kv_block):
                        unit = unit_ids[block * units_per_kv_block + k]
                        for layer, source in enumerate(layers):
                            target[block, layer][..., k * tokens:(k + 1) * tokens, :] = source[unit]
        else:
            index = torch.as_tensor(unit_ids, dtype=torch.long, device=self.device)
            for layer, view in enumerate(self.views):  # one gather per layer (kernel launches, not units)
                out[:, layer] = self._from_units(view.index_select(0, index), num_blocks, units_per_kv_block)
        return out if out.dtype == self._block_dtype else out.view(self._block_dtype)

    def scatter(self, unit_ids: Sequence[int], blocks: Sequence[torch.Tensor] | torch.Tensor,
                units_per_kv_block: int, first_units: Sequence[int] | None = None) -> None:
        """Write kvstore blocks into kernel blocks of the paged caches.

        Args:
            unit_ids: destination kernel-block ids, one per unit written, in token order.
            blocks: the kvstore blocks, each ``[L, ...]`` as one of :meth:`gather`'s
                (a list, or a tensor with the blocks along dim 0), on any device,
                in the cache dtype. On CUDA they are stacked and copied to the
                device once; on the CPU every unit is copied straight from them.
            units_per_kv_block: kernel blocks per kvstore block.
            first_units: per kvstore block, its first unit to write (a block partly
                covered by vLLM's local prefix cache is written only past it);
                ``None`` when every unit is written. Block ``i`` then supplies its
                units ``first_units[i]`` to ``units_per_kv_block - 1``, block after
                block, to ``unit_ids`` in order.

        Raises:
            InvalidArgumentError: if ``unit_ids`` does not hold one id per unit written.
        """
        num_blocks = len(blocks)
        firsts = list(first_units) if first_units is not None else [0] * num_blocks
        written = [(b, k) for b in range(num_blocks) for k in range(firsts[b], units_per_kv_block)]
        if len(unit_ids) != len(written):
            raise InvalidArgumentError(f"{len(unit_ids)} destination units for {len(written)} units written")
        if self.device.type == "cpu":
            item = item_type(self._copy_dtype.itemsize)
            if isinstance(blocks, torch.Tensor):
                arrays: Any = blocks.view(self._copy_dtype).view(torch_dtype_of(item)).numpy()
            else:
                arrays = [block.view(self._copy_dtype).view(torch_dtype_of(item)).numpy() for block in blocks]
            self.scatter_arrays(unit_ids, arrays, units_per_kv_block, first_units)
            return
        stacked = blocks if isinstance(blocks, torch.Tensor) else torch.stack(list(blocks))
        source = stacked.to(self.device, non_blocking=False)
        if source.dtype != self._copy_dtype:
            source = source.view(self._copy_dtype)
        select = torch.as_tensor([b * units_per_kv_block + k for b, k in written], dtype=torch.long,
                                 device=self.device)
        index = torch.as_tensor(unit_ids, dtype=torch.long, device=self.device)
        for layer, view in enumerate(self.views):  # one copy per layer (kernel launches, not units)
            units = self._to_units(source[:, layer], num_blocks, units_per_kv_block)
            view.index_copy_(0, index, units.index_select(0, select))

    def scatter_arrays(self, unit_ids: Sequence[int], arrays: np.ndarray | Sequence[np.ndarray],
                       units_per_kv_block: int, first_units: Sequence[int] | None = None) -> None:
        """:meth:`scatter` from numpy arrays, on a CPU: one strided copy per layer where the batch allows it.

        Args:
            unit_ids: as :meth:`scatter`.
            arrays: the kvstore blocks, ``[num_blocks, *block_shape]`` (one array, any strides: a view of a
                leased segment) or one ``block_shape`` array per block, of the integer type of the cache
                dtype's item size (``item_type``): bits are moved, not values.
            units_per_kv_block: as :meth:`scatter`.
            first_units: as :meth:`scatter`.

        Raises:
            InvalidArgumentError: if ``unit_ids`` does not hold one id per unit written, or the caches are
                not on the CPU.
        """
        if self.device.type != "cpu":
            raise InvalidArgumentError(f"scatter_arrays writes CPU caches; these are on {self.device}")
        num_blocks = len(arrays)
        firsts = list(first_units) if first_units is not None else [0] * num_blocks
        written = [(b, k) for b in range(num_blocks) for k in range(firsts[b], units_per_kv_block)]
        if len(unit_ids) != len(written):
            raise InvalidArgumentError(f"{len(unit_ids)} destination units for {len(written)} units written")
        layers = self._layer_arrays()
        if units_per_kv_block == 1 and isinstance(arrays, np.ndarray) and num_blocks:
            first = unit_ids[0]
            runs = all(unit_ids[i] == first + i for i in range(num_blocks))
            where: Any = slice(first, first + num_blocks) if runs else np.asarray(unit_ids, dtype=np.intp)
            for layer, target in enumerate(layers):  # one strided copy per layer, the GIL released
                target[where] = arrays[:, layer]
            return
        tokens = self.page_format.unit_tokens
        for unit, (b, k) in zip(unit_ids, written):
            block = arrays[b]
            for layer, target in enumerate(layers):
                target[unit] = block[layer][..., k * tokens:(k + 1) * tokens, :]

    def _layer_arrays(self) -> list[np.ndarray]:
        """Each layer's canonical view as a numpy array over the cache's memory (the integer type of its item
        size), made once."""
        if self._arrays is None:
            as_type = torch_dtype_of(item_type(self._copy_dtype.itemsize))
            self._arrays = [view.view(as_type).numpy() for view in self.views]
        return self._arrays

    def _tokens(self, block_layer: torch.Tensor, k: int) -> torch.Tensor:
        """Unit ``k`` of one layer of one block: ``[2, H, N, D]`` or ``[1, N, C]``, a view."""
        tokens = self.page_format.unit_tokens
        return block_layer.narrow(-2, k * tokens, tokens)

    def _from_units(self, pages: torch.Tensor, num_blocks: int, units_per_kv_block: int) -> torch.Tensor:
        """``[n * u, 2, H, N, D]`` units (or MLA's ``[n * u, 1, N, C]``) as ``n`` blocks of one layer."""
        fmt = self.page_format
        tokens = units_per_kv_block * fmt.unit_tokens
        if fmt.layout is Layout.MLA:
            return pages.view(num_blocks, units_per_kv_block, 1, fmt.unit_tokens, fmt.head_size) \
                .permute(0, 2, 1, 3, 4).reshape(num_blocks, 1, tokens, fmt.head_size)
        return pages.view(num_blocks, units_per_kv_block, 2, fmt.num_kv_heads, fmt.unit_tokens, fmt.head_size) \
            .permute(0, 2, 3, 1, 4, 5).reshape(num_blocks, 2, fmt.num_kv_heads, tokens, fmt.head_size)

    def _to_units(self, layer_blocks: torch.Tensor, num_blocks: int, units_per_kv_block: int) -> torch.Tensor:
        """The inverse of :meth:`_from_units`: ``n`` blocks of one layer as ``n * u`` units."""
        fmt = self.page_format
        if fmt.layout is Layout.MLA:
            return layer_blocks.reshape(num_blocks, 1, units_per_kv_block, fmt.unit_tokens, fmt.head_size) \
                .permute(0, 2, 1, 3, 4).reshape(num_blocks * units_per_kv_block, 1, fmt.unit_tokens, fmt.head_size)
        return layer_blocks.reshape(num_blocks, 2, fmt.num_kv_heads, units_per_kv_block, fmt.unit_tokens,
                                    fmt.head_size) \
            .permute(0, 3, 1, 2, 4, 5).reshape(num_blocks * units_per_kv_block, 2, fmt.num_kv_heads,
                                               fmt.unit_tokens, fmt.head_size)


_TORCH_OF_NUMPY = {np.uint8: torch.uint8, np.int16: torch.int16, np.int32: torch.int32, np.int64: torch.int64}


def torch_dtype_of(item: type[np.generic]) -> torch.dtype:
    """The torch dtype of a numpy integer type (to view a tensor as that type before ``.numpy()``)."""
    return _TORCH_OF_NUMPY[item]


def canonical_view(kv_cache: torch.Tensor, family: KVFamily, num_kv_heads: int, head_size: int,
                   unit_tokens: int) -> torch.Tensor:
    """The canonical view of one layer's cache (module docstring), as a strided view with no copy.

    Args:
        kv_cache: the layer's tensor from ``register_kv_caches``: logical
            ``[num_units, H, N, C]`` (``[num_units, N, C]`` also taken for MLA), any strides.
        family: the backend's :class:`KVFamily`.
        num_kv_heads: ``H`` (1 for MLA).
        head_size: ``D`` (the latent width ``C`` for MLA).
        unit_tokens: ``N``.

    Raises:
        UnsupportedModelError: if the tensor's shape or strides do not match the
            family (a backend that changed its layout must not be read wrongly).
    """
    tensor = kv_cache.view(torch.uint8) if kv_cache.dtype in _BYTE_DTYPES else kv_cache
    if family is KVFamily.LATENT:
        if tensor.dim() == 3:
            tensor = tensor.unsqueeze(1)
        _expect(tensor, (1, unit_tokens, head_size), "MLA [num_blocks, 1, N, C]")
        if tensor.stride(-1) != 1:
            raise UnsupportedModelError(f"MLA cache with strides {tensor.stride()} is not contiguous in C")
        return tensor
    _expect(tensor, (num_kv_heads, unit_tokens, 2 * head_size), "[num_blocks, H, N, 2 * D]")
    s_block, s_head, s_token, s_chan = tensor.stride()
    if s_chan != 1:
        raise UnsupportedModelError(f"KV cache strides {tensor.stride()} are not contiguous in the content dim")
    num_units = tensor.shape[0]
    if family is KVFamily.SPLIT_TOKENS:
        # The CPU backend views each head's [N, 2D] page as [2N, D] and chunks it: K rows, then V rows.
        if s_token != 2 * head_size or s_head != unit_tokens * 2 * head_size:
            raise UnsupportedModelError(f"CPU KV cache strides {tensor.stride()} are not head-major (LBHNC)")
        view = tensor.as_strided((num_units, num_kv_heads, 2, unit_tokens, head_size),
                                 (s_block, s_head, unit_tokens * head_size, head_size, 1), tensor.storage_offset())
        return view.permute(0, 2, 1, 3, 4)
    # FlashAttention, FlashInfer, Triton: C is K || V, head_size channels each, in NHD or HND order.
    view = tensor.as_strided((num_units, num_kv_heads, unit_tokens, 2, head_size),
                             (s_block, s_head, s_token, head_size, 1), tensor.storage_offset())
    return view.permute(0, 3, 1, 2, 4)


def _expect(tensor: torch.Tensor, tail: tuple[int, ...], what: str) -> None:
    if tuple(tensor.shape[1:]) != tail:
        raise UnsupportedModelError(f"KV cache of shape {list(tensor.shape)} is not {what} with "
                                    f"{list(tail)} after the block dim")


def _scales_digest(layers: Sequence[Any]) -> str:
    """xxh3-64 of every layer's K and V scale, for quantized caches (blocks of other scales decode wrongly)."""
    values = [[float(getattr(layer, "_k_scale_float", 1.0)), float(getattr(layer, "_v_scale_float", 1.0))]
              for layer in layers]
    return xxhash.xxh3_64_hexdigest(json.dumps(values).encode())


def paged_kv(vllm_config: Any, kv_cache_config: Any, kv_caches: dict[str, Any]) -> PagedKV:
    """Read the layout of a worker's paged KV from vLLM and build its :class:`PagedKV`.

    Args:
        vllm_config: vLLM's ``VllmConfig``.
        kv_cache_config: vLLM's ``KVCacheConfig`` (checked by :func:`check_kv_cache_config`).
        kv_caches: ``register_kv_caches``' argument: layer name to tensor.

    Raises:
        UnsupportedModelError: naming the layer, for cross-layer KV sharing, an
            attention backend whose layout the connector does not know, layers of
            different backends, or a tensor that does not match its backend's layout.
    """
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    check_kv_cache_config(kv_cache_config)
    group = kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    all_layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)
    for name, layer in all_layers.items():
        target = getattr(layer, "kv_sharing_target_layer_name", None)
        if target is not None:
            raise UnsupportedModelError(f"layer {name} shares the KV cache of layer {target} (cross-layer KV "
                                        "sharing); the kvstore connector does not serve such models")
    names = [n for n in group.layer_names if n in kv_caches]
    if not names:
        raise UnsupportedModelError("no KV cache tensor was registered for the attention layers of group 0")
    layers = [all_layers[n] for n in names]
    backends = {n: layer.attn_backend.get_name() for n, layer in zip(names, layers)}
    backend = backends[names[0]]
    if len(set(backends.values())) > 1:
        raise UnsupportedModelError(f"layers use different attention backends {sorted(set(backends.values()))}")
    is_mla = bool(layers[0].attn_backend.is_mla())
    if is_mla:
        family = KVFamily.LATENT
    elif backend in BACKEND_FAMILIES:
        family = BACKEND_FAMILIES[backend]
    else:
        raise UnsupportedModelError(
            f"attention backend {backend} (layer {names[0]}): the kvstore connector does not know how it lays out "
            f"K and V; it supports {sorted(BACKEND_FAMILIES)} and MLA backends")
    first = kv_caches[names[0]]
    num_blocks = kv_cache_config.num_blocks
    if first.shape[0] % num_blocks:
        raise UnsupportedModelError(f"{first.shape[0]} kernel blocks are not a multiple of {num_blocks} blocks")
    units_per_block = first.shape[0] // num_blocks
    if spec.block_size % units_per_block:
        raise UnsupportedModelError(f"block size {spec.block_size} is not {units_per_block} kernel blocks")
    unit_tokens = spec.block_size // units_per_block
    num_kv_heads = 1 if is_mla else spec.num_kv_heads
    head_size = first.shape[-1] if is_mla else spec.head_size
    views = [canonical_view(kv_caches[n], family, num_kv_heads, head_size, unit_tokens) for n in names]
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    interior = "canonical"
    if family is KVFamily.SPLIT_TOKENS:
        interior = f"cpu_attn:isa={getattr(layers[0], 'isa', 'unknown')}"
    fmt = PageFormat(
        backend=backend, family=family.value, interior=interior, num_layers=len(names), num_kv_heads=num_kv_heads,
        head_size=head_size, unit_tokens=unit_tokens, dtype=dtype_name(first.dtype), cache_dtype=cache_dtype,
        scales=_scales_digest(layers) if cache_dtype != "auto" else "",
    )
    return PagedKV(fmt, views, units_per_block)
