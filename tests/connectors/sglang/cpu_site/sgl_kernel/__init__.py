"""A pure-torch stand-in for ``sgl_kernel`` (``sglang-kernel``): just the ops SGLang 0.5.23 imports on a CPU.

CPU test scaffolding (``kvstore_sglang_cpu.py`` says where it applies): PyPI's
``sglang-kernel`` is a CUDA build, and SGLang's CPU engine
(``SGLANG_USE_CPU_ENGINE=1``) imports these names at start-up. The stand-in
registers no ``torch.ops.sgl_kernel`` ops, so SGLang finds no Intel AMX backend
(it looks for ``torch.ops.sgl_kernel.convert_weight_packed``), on any CPU, runs
its ``torch_native`` attention and calls only the first two ops below,
whose semantics are those of the Triton kernels SGLang runs on GPUs
(``assign_req_to_token_pool`` in ``sglang/srt/mem_cache/allocation.py``,
``copy_all_layer_kv_cache_tiled`` in ``sglang/kernels/ops/kvcache/cache_move.py``).
The speculative-decoding ops are imported with their modules but not called
without a draft model; here they raise :class:`NotImplementedError`. An import
of any other name fails, so a newer SGLang that needs more is noticed.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable

import torch

from kvstore_sglang_cpu import report

report("sgl_kernel", True, "SGLang imported sgl_kernel; the pure-torch stand-in answered")


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
                                 pool_len: int) -> None:
    """Write each request's new KV slots into its row of the request-to-token table.

    Request ``i`` gets ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]``
    from ``out_cache_loc``, whose slots lie request after request (request
    ``i``'s start where request ``i - 1``'s end). ``pool_len`` is the table's
    row length (the kernel's pointer stride; the tensor knows it here).
    """
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        req_to_token[row, start:end] = out_cache_loc[offset:offset + end - start]
        offset += end - start


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """Copy KV rows ``src_loc`` to rows ``tgt_loc`` in every buffer of the device pool (a move within the pool).

    Buffer ``b`` starts at address ``data_ptrs[b]`` and holds rows of
    ``strides[b]`` bytes. All sources are read before any target is written, as
    the kernel does per tile, so overlapping moves are safe.
    """
    if tgt_loc.numel() == 0:
        return
    rows = int(torch.maximum(tgt_loc.max(), src_loc.max())) + 1
    targets, sources = tgt_loc.long(), src_loc.long()
    for address, stride in zip(data_ptrs.tolist(), strides.tolist()):
        memory = (ctypes.c_uint8 * (rows * int(stride))).from_address(int(address))
        view = torch.frombuffer(memory, dtype=torch.uint8).view(rows, int(stride))
        view[targets] = view[sources]


def _not_in_stand_in(name: str) -> Callable[..., Any]:
    def op(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"sgl_kernel.{name}: speculative decoding is not in the kvstore tests' CPU stand-in")

    op.__name__ = op.__qualname__ = name
    return op


build_tree_kernel_efficient_cpu = _not_in_stand_in("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _not_in_stand_in("verify_tree_greedy_cpu")
assign_draft_cache_locs_contiguous_cpu = _not_in_stand_in("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _not_in_stand_in("assign_extend_cache_locs_cpu")
fill_accept_out_cache_loc_cpu = _not_in_stand_in("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _not_in_stand_in("fill_bonus_tokens_cpu")
