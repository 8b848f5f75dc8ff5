"""The HF transformers connector: exact greedy output with cache hits, isolation, failures, layout."""

from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("transformers")

from kvstore import StoreConfig, open_store
from kvstore.config import MemoryTierConfig
from kvstore.connectors.hf import HFConnector, model_namespace
from kvstore.errors import InvalidArgumentError
from tests.support.hf import MAX_NEW_TOKENS, VOCAB, prompt, reference, tiny_model
from transformers import MistralForCausalLM  # noqa: E402

pytestmark = pytest.mark.slow  # starts processes or servers: outside `make test-fast`

SMALL_STORE = StoreConfig(memory=MemoryTierConfig(capacity_bytes=32 << 20))  # opens in milliseconds


@pytest.fixture
def store():
    with open_store(SMALL_STORE) as s:
        yield s


@pytest.mark.parametrize(
    ("family", "kv_heads", "num_tokens", "block_size"),
    [
        ("llama", 2, 45, 8),    # ends mid-block
        ("llama", 4, 64, 16),   # MHA, block-aligned
        ("qwen2", 1, 37, 4),    # GQA down to MQA, ends mid-block
        ("qwen2", 2, 50, 16),   # GQA
        ("mistral", 2, 33, 8),  # sliding-window layers (window larger than the prompt)
    ],
)
def test_hit_gives_identical_greedy_output(store, family, kv_heads, num_tokens, block_size):
    model = tiny_model(family, kv_heads=kv_heads)
    ids = prompt(num_tokens)
    expected = reference(model, ids)
    with HFConnector(model, store, block_size=block_size, model_id=f"tiny-{family}") as conn:
        miss = conn.generate(ids, MAX_NEW_TOKENS)
        conn.flush()
        hit = conn.generate(ids, MAX_NEW_TOKENS)
        conn.flush()
    full_blocks = num_tokens // block_size
    assert miss.num_cached_tokens == 0
    assert hit.num_cached_tokens == min(full_blocks, (num_tokens - 1) // block_size) * block_size > 0
    assert miss.token_ids == expected
    assert hit.token_ids == expected
    assert conn.stats().num_blocks_saved == full_blocks


def test_fully_cached_prompt_leaves_one_token_to_compute(store):
    model = tiny_model()
    long_ids = prompt(40)
    with HFConnector(model, store, block_size=8, model_id="tiny") as conn:
        conn.generate(long_ids, MAX_NEW_TOKENS)
        conn.flush()
        for length in (32, 40, 9, 8):  # every block cached; 8 is one block exactly
            ids = long_ids[:length]
            hit = conn.generate(ids, MAX_NEW_TOKENS, save=False)
            assert hit.num_cached_tokens == (length - 1) // 8 * 8
            assert hit.token_ids == reference(model, ids)


def test_conversation_turns_hit_previous_turns(store):
    model = tiny_model("qwen2", kv_heads=1)
    block_size = 8
    history = prompt(21, seed=2)
    with HFConnector(model, store, block_size=block_size, model_id="tiny-chat") as conn:
        previous_len = 0
        for turn in range(4):
            result = conn.generate(history, MAX_NEW_TOKENS, save_generated=True)
            conn.flush()
            assert result.token_ids == reference(model, history)
            if turn:
                # Every full block of the previous prompt plus its answer was stored.
                assert result.num_cached_tokens >= min(previous_len, len(history) - 1) // block_size * block_size
                assert result.num_cached_tokens > 0
            previous_len = len(history) + len(result.token_ids) - 1
            history = history + list(result.token_ids) + prompt(13, seed=10 + turn)


def test_saved_blocks_hold_the_models_kv_in_codec_layout(store):
    model = tiny_model("qwen2", kv_heads=2)
    ids = prompt(27)
    with HFConnector(model, store, block_size=8, model_id="tiny") as conn:
        conn.generate(ids, 2)
        conn.flush()
        blocks = store.get_tensors(conn.namespace, conn.block_hashes(ids))
    cache = conn.new_cache()
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    assert len(blocks) == 3
    for i, block in enumerate(blocks):
        assert block.shape == (2, 2, 2, 8, 16)  # [layers, K/V, kv heads, block, head dim]
        for layer in range(2):
            torch.testing.assert_close(block[layer, 0], cache.layers[layer].keys[0, :, i * 8 : (i + 1) * 8], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(block[layer, 1], cache.layers[layer].values[0, :, i * 8 : (i + 1) * 8], rtol=1e-5, atol=1e-5)


def test_generation_never_writes_into_fetched_blocks(store):
    model = tiny_model()
    ids = prompt(33)
    with HFConnector(model, store, block_size=8, model_id="tiny") as conn:
        conn.generate(ids, 2)
        conn.flush()
        hashes = conn.block_hashes(ids)
        before = [bytes(b) for b in store.get(conn.namespace, hashes)]
        loaded = conn.load(ids)
        for layer in loaded.cache.layers:  # an in-place write into the cache must not reach the store
            layer.keys.fill_(7.0)
        conn.generate(ids, MAX_NEW_TOKENS)
        conn.flush()
        after = [bytes(b) for b in store.get(conn.namespace, hashes)]
    assert loaded.num_cached_tokens == 32
    assert before == after


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_hit_is_exact_on_gpu(store):
    model = tiny_model(dtype=torch.bfloat16, device="cuda")
    ids = prompt(70)
    expected = reference(model, ids)
    with HFConnector(model, store, block_size=16, model_id="tiny") as conn:
        assert conn.namespace.dtype == "bfloat16"
        conn.generate(ids, MAX_NEW_TOKENS)
        conn.flush()
        hit = conn.generate(ids, MAX_NEW_TOKENS)
    assert hit.num_cached_tokens == 64
    assert hit.token_ids == expected


@pytest.mark.parametrize(
    "other",
    [
        dict(layers=3),                   # another config
        dict(kv_heads=4),                 # another KV-head count
        dict(dtype=torch.float64),        # another dtype
        dict(cache_salt="tenant-b"),      # another tenant
        dict(model_id="tiny-other"),      # other weights
        dict(revision="v2"),              # another revision
        dict(adapter="lora-a"),           # a LoRA adapter on the same base weights
    ],
)
def test_no_hit_across_models_dtypes_or_salts(store, other):
    ids = prompt(40)
    with HFConnector(tiny_model(), store, block_size=8, model_id="tiny") as writer:
        writer.generate(ids, 2)
        writer.flush()
        assert writer.generate(ids, 2, save=False).num_cached_tokens == 32
    model = tiny_model(layers=other.get("layers", 2), kv_heads=other.get("kv_heads", 2),
                       dtype=other.get("dtype", torch.float32))
    with HFConnector(model, store, block_size=8, model_id=other.get("model_id", "tiny"),
                     revision=other.get("revision"), cache_salt=other.get("cache_salt", ""),
                     adapter=other.get("adapter")) as reader:
        assert reader.namespace.root != writer.namespace.root
        result = reader.generate(ids, MAX_NEW_TOKENS, save=False)
    assert result.num_cached_tokens == 0
    assert result.token_ids == reference(model, ids)


def test_namespace_fields_follow_the_model():
    base = model_namespace(tiny_model(), block_size=8, model_id="m")
    assert base.dtype == "float32" and base.layout == "kv" and base.block_size == 8
    assert "L2" in base.model and "KV2" in base.model and "D16" in base.model
    assert model_namespace(tiny_model(), block_size=16, model_id="m").root != base.root
    with pytest.raises(InvalidArgumentError, match="model_id"):
        model_namespace(tiny_model(), block_size=8)  # random weights have no name


def test_the_adapter_and_its_version_key_the_namespace():
    model = tiny_model()
    base = model_namespace(model, block_size=8, model_id="m")
    named = model_namespace(model, block_size=8, model_id="m", adapter="sql-lora")
    v1 = model_namespace(model, block_size=8, model_id="m", adapter=("sql-lora", "v1"))
    v2 = model_namespace(model, block_size=8, model_id="m", adapter=("sql-lora", "v2"))
    assert (base.adapter, named.adapter, v1.adapter, v2.adapter) == ("", "sql-lora", "sql-lora@v1", "sql-lora@v2")
    assert len({base.root, named.root, v1.root, v2.root}) == 4
    assert model_namespace(model, block_size=8, model_id="m", adapter=("sql-lora", "")).root == named.root
    with pytest.raises(InvalidArgumentError, match="adapter must be a name or a \\(name, version\\) pair"):
        model_namespace(model, block_size=8, model_id="m", adapter=("", "v1"))


def test_a_model_with_peft_adapters_loaded_must_name_its_adapter(store):
    model = tiny_model()
    model.peft_config = {"sql-lora": object()}  # what transformers' PeftAdapterMixin.load_adapter sets
    with pytest.raises(InvalidArgumentError, match="LoRA adapters loaded \\(sql-lora\\); pass adapter="):
        HFConnector(model, store, block_size=8, model_id="m")
    with HFConnector(model, store, block_size=8, model_id="m", adapter=("sql-lora", "v3")) as conn:
        assert conn.namespace.adapter == "sql-lora@v3"
    assert model_namespace(model, block_size=8, model_id="m", adapter="").adapter == ""  # adapters disabled


def test_wrong_kv_under_the_right_hashes_changes_the_output(store):
    """Negative control: the equality tests can fail, because the connector really uses the fetched KV."""
    model = tiny_model()
    ids = prompt(45)
    expected = reference(model, ids)
    with HFConnector(model, store, block_size=8, model_id="tiny") as conn:
        hashes = conn.block_hashes(ids)
        generator = torch.Generator().manual_seed(3)
        wrong = [torch.randn(2, 2, 2, 8, 16, generator=generator) * 4 for _ in hashes]
        assert store.put(conn.namespace, hashes, wrong) == len(hashes)
        result = conn.generate(ids, MAX_NEW_TOKENS, save=False)
    assert result.num_cached_tokens == 40
    assert result.token_ids != expected


def test_blocks_of_the_wrong_shape_are_rejected(store):
    model = tiny_model()
    ids = prompt(45)
    with HFConnector(model, store, block_size=8, model_id="tiny") as conn:
        hashes = conn.block_hashes(ids)
        store.put(conn.namespace, hashes, [torch.zeros(2, 2, 1, 8, 16) for _ in hashes])  # 1 KV head, not 2
        result = conn.generate(ids, MAX_NEW_TOKENS, save=False)
        assert conn.stats().num_rejected_blocks == len(hashes)
    assert result.num_cached_tokens == 0
    assert result.token_ids == reference(model, ids)


def test_closed_store_falls_back_to_full_prefill(caplog):
    model = tiny_model()
    ids = prompt(45)
    store = open_store(SMALL_STORE)
    store.close()
    with HFConnector(model, store, block_size=8, model_id="tiny") as conn:
        result = conn.generate(ids, MAX_NEW_TOKENS)
        conn.flush()
        stats = conn.stats()
    assert result.fell_back and result.num_cached_tokens == 0
    assert result.token_ids == reference(model, ids)
    assert stats.num_load_failures == 1 and stats.num_save_failures == 1
    assert "kvstore load failed" in caplog.text


def test_stalled_store_times_out_and_falls_back(store):
    model = tiny_model()
    ids = prompt(45)
    with HFConnector(model, store, block_size=8, model_id="tiny", load_timeout_s=0.2) as conn:
        conn.generate(ids, 2)
        conn.flush()

        stalling, released = threading.Event(), threading.Event()

        async def stall() -> None:
            stalling.set()
            released.wait(30)  # blocks the store's event loop until the test lets go: every call waits behind it

        staller = threading.Thread(target=store.run, args=(stall(),))
        staller.start()
        assert stalling.wait(30)
        try:
            result = conn.generate(ids, MAX_NEW_TOKENS, save=False)  # its load gives up after load_timeout_s
        finally:
            released.set()
        staller.join()
        assert conn.stats().num_load_failures == 1
    assert result.fell_back and result.num_cached_tokens == 0
    assert result.token_ids == reference(model, ids)


def test_batches_of_several_prompts_are_refused(store):
    with HFConnector(tiny_model(), store, block_size=8, model_id="tiny") as conn:
        with pytest.raises(InvalidArgumentError, match="batch size 2 is not supported"):
            conn.generate(torch.zeros(2, 10, dtype=torch.long), 2)
        batch_of_one = conn.generate(torch.tensor([prompt(20)]), 2)
    assert len(batch_of_one.token_ids) == 2


def test_prompt_shorter_than_a_block_works_and_stores_nothing(store):
    model = tiny_model()
    ids = prompt(5)
    with HFConnector(model, store, block_size=8, model_id="tiny") as conn:
        result = conn.generate(ids, MAX_NEW_TOKENS)
        conn.flush()
        assert conn.stats().num_blocks_saved == 0
    assert result.token_ids == reference(model, ids)


def test_cache_keyword_follows_the_installed_transformers():
    from kvstore.connectors.hf_model import cache_keyword

    class EarlierFiveX:  # transformers 5.0 spelled the keyword past_key_values
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            return None

    class NoCache:
        def forward(self, input_ids=None):
            return None

    assert cache_keyword(tiny_model()) == "cache"  # 5.24: cache=, past_key_values= deprecated
    assert cache_keyword(EarlierFiveX()) == "past_key_values"
    with pytest.raises(InvalidArgumentError, match="neither"):
        cache_keyword(NoCache())


def test_sliding_window_past_the_window_still_matches(store):
    config = tiny_model("mistral").config
    config.sliding_window = 20  # the cache keeps 19 tokens per layer
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    ids = prompt(45)
    with HFConnector(model, store, block_size=8, model_id="tiny-window") as conn:
        conn.generate(ids, MAX_NEW_TOKENS)
        conn.flush()
        result = conn.generate(ids, MAX_NEW_TOKENS)
        stats = conn.stats()
    assert stats.num_saves_skipped >= 1  # the layers no longer hold the whole prompt: nothing saved
    assert result.num_cached_tokens == 0
    assert result.token_ids == reference(model, ids)
