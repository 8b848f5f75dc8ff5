"""What the HF connector reports: one load, one generation, and its running totals."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

@dataclass(frozen=True, slots=True)
class LoadResult:
    """What :meth:`HFConnector.load` found for a prompt.

    Attributes:
        cache: a ``DynamicCache`` holding the first ``num_cached_tokens`` tokens'
            KV on the model's device and dtype (empty on a miss); the caller may
            extend it in place.
        num_cached_tokens: prompt tokens covered by the cache, a multiple of the
            block size and always ``< len(prompt)``.
        load_s: seconds spent fetching and building the cache.
        fell_back: the store failed or timed out, so the cache is empty.
    """

    cache: Any
    num_cached_tokens: int
    load_s: float
    fell_back: bool = False


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """One :meth:`HFConnector.generate` call.

    Attributes:
        token_ids: generated token ids (the prompt excluded), ``len <= max_new_tokens``.
        num_prompt_tokens: prompt length, tokens.
        num_cached_tokens: prompt tokens whose KV came from the store.
        ttft_s: seconds from the call to the first generated token: load, prefill
            of the uncached suffix, and the first token's argmax.
        load_s: seconds of the load (part of ``ttft_s``).
        prefill_s: seconds of the suffix prefill (part of ``ttft_s``).
        total_s: seconds of the whole call, decoding included (background save excluded).
        fell_back: the store failed or timed out and the whole prompt was prefilled.
        first_logits: ``[vocab_size]`` float32 CPU logits of the last prompt position
            (what the first token came from), to compare runs more finely than by tokens.
    """

    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_cached_tokens: int
    ttft_s: float
    load_s: float
    prefill_s: float
    total_s: float
    fell_back: bool = False
    first_logits: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def hit_ratio(self) -> float:
        """Fraction of prompt tokens served from the store, in ``[0, 1)``."""
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    @property
    def num_computed_tokens(self) -> int:
        """Prompt tokens prefilled by the model (``num_prompt_tokens - num_cached_tokens``)."""
        return self.num_prompt_tokens - self.num_cached_tokens


@dataclass(slots=True)
class ConnectorStats:
    """Counts since the connector was made (a snapshot; see :meth:`HFConnector.stats`).

    Attributes:
        num_requests: prompts loaded through the store.
        num_prompt_tokens: their tokens.
        num_cached_tokens: of those, tokens served from the store.
        num_load_failures: loads that raised or timed out and fell back to a full prefill.
        num_rejected_blocks: fetched blocks dropped for a wrong shape or dtype.
        num_saves: background saves finished.
        num_blocks_saved: blocks newly stored by them.
        num_save_failures: saves that raised (logged; the request was unaffected).
        num_saves_skipped: saves skipped because the cache no longer held every token
            (a sliding-window layer past its window).
    """

    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_load_failures: int = 0
    num_rejected_blocks: int = 0
    num_saves: int = 0
    num_blocks_saved: int = 0
    num_save_failures: int = 0
    num_saves_skipped: int = 0

    @property
    def hit_ratio(self) -> float:
        """Fraction of loaded prompt tokens served from the store."""
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0
