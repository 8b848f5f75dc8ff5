"""The second layout beside the first: blocks of the first still decode as they did, namespaces of the two never
share a key or a block, the numba kernels give torch's bytes and values bit for bit, and tiny rows survive."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvstore.blocks.tensors import decode_block, decode_header, verify_block
from kvstore.config import MemoryTierConfig, StoreConfig
from kvstore.embedded import EmbeddedStore
from kvstore.blocks.encoding import Encoding, encode_lossy
from kvstore.blocks.encoding import dispatch
from kvstore.blocks.encoding.blocks import decode_block_into
from kvstore.errors import InvalidArgumentError
from kvstore.keys import Namespace, block_key, hash_blocks
from tests.support.server import namespace

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("encoding", ["fp8_e4m3", "int8", "int4", "int2"])
def test_blocks_of_the_first_layout_written_before_still_decode(encoding: str) -> None:
    """Blocks written by the release before layout 2 (``data/v1_*.kvb``, bfloat16 ``[2, 2, 2, 16, 32]``) decode to
    what that release decoded, but for its bfloat16 rounding of the scale (fp8, int8), which this one does not
    make: within one bfloat16 step of it, and closer to the source where they differ."""
    block = (DATA / f"v1_{encoding}.kvb").read_bytes()
    header = verify_block(block)
    assert header.encoding == encoding and header.dtype == "bfloat16"
    before = torch.frombuffer(bytearray((DATA / f"v1_{encoding}.decoded.bf16").read_bytes()),
                              dtype=torch.bfloat16).view(header.shape)
    source = torch.frombuffer(bytearray((DATA / "v1_source.bf16").read_bytes()), dtype=torch.bfloat16).view(header.shape)
    now = decode_block(block)
    if encoding in ("int4", "int2"):
        assert torch.equal(now, before)
        return
    assert torch.allclose(now.float(), before.float(), rtol=2.0 ** -7, atol=0)
    assert (now.float() - source.float()).norm() <= (before.float() - source.float()).norm() * 1.001


def test_namespaces_of_the_two_layouts_never_share_a_key_or_a_block() -> None:
    roots = {Namespace(model="m", dtype="bfloat16", kv_encoding=e.value).root for e in Encoding}
    assert len(roots) == len(Encoding)
    old, new = (namespace(dtype="bfloat16", kv_encoding=e) for e in ("int8", "int8_v2"))
    tokens = list(range(32))
    assert not {block_key(old, h) for h in hash_blocks(old, tokens)} & {block_key(new, h) for h in hash_blocks(new, tokens)}
    x = torch.randn(2, 2, 2, 16, 64).to(torch.bfloat16)
    with EmbeddedStore(StoreConfig(memory=MemoryTierConfig(capacity_bytes=16 << 20))) as store:
        with pytest.raises(InvalidArgumentError, match="encoding 'int8' is not the namespace's 'int8_v2'"):
            store.put(new, hash_blocks(new, range(16)), [encode_lossy(x, "kv", "int8")])
        with pytest.raises(InvalidArgumentError, match="encoding 'int8_v2' is not the namespace's 'int8'"):
            store.put(old, hash_blocks(old, range(16)), [encode_lossy(x, "kv", "int8_v2")])
        assert store.put(old, hash_blocks(old, range(16)), [x]) == 1
        assert store.lookup(new, hash_blocks(new, range(16))).num_blocks == 0  # the old block is not the new's


SHAPES = [("kv", (2, 2, 3, 16, 64)), ("kv", (1, 2, 2, 48, 40)), ("kv", (2, 2, 2, 64, 128)), ("mla", (2, 1, 16, 96))]


def _kv_like(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    x[..., 3] *= 20.0
    x[..., 7] += 5.0
    x[0, 0, 0] *= 1e-3  # small rows: subnormal codes of e4m3, float16 subnormals out
    if dtype != torch.float16:
        x[-1, -1] *= 1e-30  # tiny rows: quantized as 2^64 times themselves (kernels.TINY_ROW)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("encoding", dispatch.FAST_ENCODINGS, ids=lambda e: e.value)
def test_the_cpu_kernels_give_torchs_bytes_and_values(encoding: Encoding, dtype: torch.dtype,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """fast.py (numba, one pass) and kernels*.py (torch: what GPUs run) encode to the same bytes and decode to the
    same values, bit for bit."""
    if dispatch.fast_kernels() is None:
        pytest.skip("numba is not installed")
    for index, (layout, shape) in enumerate(SHAPES):
        x = _kv_like(shape, dtype, seed=index)
        fast = encode_lossy(x, layout, encoding)
        fast_out = decode_block(fast)
        monkeypatch.setenv("KVSTORE_ENCODING_KERNELS", "torch")
        dispatch.fast_kernels.cache_clear()
        try:
            assert dispatch.fast_kernels() is None
            reference = encode_lossy(x, layout, encoding)
            reference_out = torch.empty_like(x)
            decode_block_into(fast, decode_header(fast), reference_out)
        finally:
            monkeypatch.delenv("KVSTORE_ENCODING_KERNELS")
            dispatch.fast_kernels.cache_clear()
        assert fast == reference, (layout, shape)
        assert torch.equal(fast_out, reference_out), (layout, shape)


def test_the_steps_table_scales_by_octaves_exactly() -> None:
    """fast.py finds a group's step from the ratio's exponent and 16 comparisons, which holds because each octave
    of the table is the first one halved, exactly: ``table[16 a + b] == 2^-a * table[b]``."""
    from kvstore.blocks.encoding.kernels_v2 import STEP_TABLE

    for q in range(256):
        assert float(STEP_TABLE[q]) == 2.0 ** -(q // 16) * float(STEP_TABLE[q % 16])


@pytest.mark.parametrize("encoding", ["fp8_e4m3", "int8", "int8_v2", "int4_v2"])
def test_a_tiny_row_does_not_decode_to_zeros(encoding: str) -> None:
    """A bfloat16 row whose largest value is 1e-37 (the scale is about 1e-39, below float32's normals) comes
    back within the encoding's error, not as zeros: the scale is applied in float32, never rounded to bfloat16."""
    x = torch.randn(2, 2, 2, 16, 64, generator=torch.Generator().manual_seed(9))
    x[0, 1] *= 1e-37 / float(x[0, 1].abs().max())
    x = x.to(torch.bfloat16)
    y = decode_block(encode_lossy(x, "kv", encoding))
    tiny, back = x[0, 1].double() * 1e37, y[0, 1].double() * 1e37
    assert bool(torch.isfinite(y).all())
    assert float((back - tiny).norm() / tiny.norm()) < (0.15 if encoding == "int4_v2" else 0.05)


def test_non_finite_values_are_refused_at_encode() -> None:
    for encoding in Encoding:
        for bad in (float("nan"), float("inf")):
            x = torch.randn(1, 2, 1, 16, 64)
            x[0, 0, 0, 3, 5] = bad
            with pytest.raises(InvalidArgumentError, match="not finite|float16's range"):
                encode_lossy(x.to(torch.float16), "kv", encoding)


def test_a_host_without_numba_encodes_with_torch() -> None:
    """numba is a dependency, but a host without it still encodes (torch kernels) and gets the same bytes."""
    code = ("import sys; sys.modules['numba'] = None\n"
            "import torch\nfrom kvstore.blocks.encoding import encode_lossy, dispatch\n"
            "x = torch.arange(2 * 2 * 2 * 16 * 64, dtype=torch.float32).reshape(2, 2, 2, 16, 64).sin()\n"
            "assert dispatch.fast_kernels() is None\n"
            "sys.stdout.buffer.write(bytes(encode_lossy(x.to(torch.bfloat16), 'kv', 'int8_v2')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}).stdout
    x = torch.arange(2 * 2 * 2 * 16 * 64, dtype=torch.float32).reshape(2, 2, 2, 16, 64).sin()
    assert out == bytes(encode_lossy(x.to(torch.bfloat16), "kv", "int8_v2"))
