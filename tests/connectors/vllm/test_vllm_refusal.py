"""A model the connector cannot restore exactly is refused when the engine starts, with an error naming the group.

A sliding-window model is started for real; the other refusals (several
KV-cache groups, Mamba state, chunked local attention, cross-layer sharing, an
unknown backend) are checked on vLLM's own spec objects in ``test_layout.py``.
"""

from __future__ import annotations

import pytest

from tests.connectors.vllm.harness import Engine, EngineError, write_sliding_qwen2

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def test_a_sliding_window_model_is_refused_at_start_up(tmp_path_factory: pytest.TempPathFactory) -> None:
    model = write_sliding_qwen2(tmp_path_factory.mktemp("sliding") / "model")
    with pytest.raises(EngineError) as info:
        Engine(model, extra={}).start()
    message = str(info.value)
    assert "UnsupportedModelError" in message and "KV-cache group 0" in message
    assert "sliding-window" in message or "SlidingWindowSpec" in message
