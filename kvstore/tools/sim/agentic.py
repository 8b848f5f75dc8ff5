"""Synthetic agentic-coding sessions: a seeded generator of prefix-block traces shaped like coding agents' traffic.

Real agentic traces (e.g. the kv-cache-tester sessions read by
``kvstore.tools.trace``) have a shape Mooncake's chat traces lack, and an eviction
policy must not be tuned to either. This generator makes that shape at any
size, from a seed, with the knobs in :class:`AgenticConfig`:

* **Shared system and tool prefixes.** Each session runs one of a few agent
  types; every session of a type starts with the same system prompt and tool
  definitions (``prefix_tokens`` each), so their first blocks are shared across
  sessions.
* **Growing histories.** A session is a sequence of requests; each request is
  the whole history so far (prefix, every earlier input and output) plus new
  input (a user message or a tool result, log-normal in size with a heavy
  tail). Think time between requests is log-normal; now and then the user is
  away for minutes.
* **Subagents that fork a prefix.** A request may spawn 1..``max_subagents``
  subagents at once. A subagent's requests start with the parent's history up
  to the fork point (or only its system prefix, with probability
  ``subagent_fresh_prob``) and grow their own histories; they run
  concurrently, and the parent resumes when the last one is done. Subagents
  spawn none of their own (as in Claude Code).
* **Compaction.** A history over ``max_context_tokens`` is compacted: the next
  request is the system prefix plus a fresh summary, so a new chain begins.
* **Sessions and TTLs.** Each request names its session (``s<n>``, and
  ``s<n>.<k>`` for its ``k``-th subagent), as a client passes ``session_id``,
  and carries ``ttl_s`` when one is set (``docs/agentic.md``).

Blocks are ``block_tokens`` tokens (64 by default, as the kv-cache-tester
traces), and a request names only its full blocks (``floor(tokens /
block_tokens)``), as vLLM hashes only full blocks. Block ids are chained
prefix ids: a block's id is decided by its parent's id and its own content, so
equal ids at equal positions mean equal prefixes (see ``kvstore.tools.trace``).

All randomness comes from one ``random.Random(seed)``, so a config and a seed
give the same trace in every process.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field
from typing import Iterator

from kvstore.errors import InvalidArgumentError
from kvstore.tools.trace import TraceRequest

AGENTIC_BLOCK_TOKENS = 64
"""Tokens per block of the generated traces (kv-cache-tester's chunk size)."""


@dataclass(frozen=True, slots=True)
class AgenticConfig:
    """The shape of a synthetic agentic workload. Times are seconds, sizes tokens.

    Attributes:
        num_sessions: sessions to generate.
        duration_s: sessions start uniformly at random in ``[0, duration_s)``.
        num_agent_types: distinct system and tool prefixes.
        prefix_tokens: ``(low, high)`` tokens of a type's shared prefix.
        turns: ``(low, high)`` requests of a top-level session (log-uniform).
        first_input_tokens: median tokens of a session's first message.
        input_tokens: median tokens of later inputs (tool results, messages); log-normal.
        input_sigma: log-normal sigma of input sizes (the heavy tail of file reads).
        output_tokens: median tokens of a model output, appended to the history.
        think_s: median seconds between a reply and the next request.
        away_prob: chance that the gap before a request is an away time instead.
        away_s: median seconds of an away time.
        subagent_prob: chance that a request spawns subagents.
        max_subagents: most subagents spawned at once.
        subagent_turns: ``(low, high)`` requests of a subagent.
        subagent_fresh_prob: chance that a subagent starts from the system prefix
            only, not from the parent's history.
        max_context_tokens: a history longer than this is compacted.
        summary_tokens: tokens of the summary a compaction leaves.
        block_tokens: tokens per block.
        seed: the seed of every random choice.
        ttl_s: the cache-control TTL every request carries, seconds (0.0: none; Anthropic's prompt cache keeps
            5 minutes, 300.0); ``subagent_ttl_s`` for a subagent's requests.
        subagent_ttl_s: a subagent's TTL (``None``: ``ttl_s``).
    """

    num_sessions: int = 60
    duration_s: float = 1800.0
    num_agent_types: int = 3
    prefix_tokens: tuple[int, int] = (12_000, 20_000)
    turns: tuple[int, int] = (5, 120)
    first_input_tokens: int = 3_000
    input_tokens: int = 1_200
    input_sigma: float = 1.3
    output_tokens: int = 300
    think_s: float = 8.0
    away_prob: float = 0.05
    away_s: float = 300.0
    subagent_prob: float = 0.03
    max_subagents: int = 4
    subagent_turns: tuple[int, int] = (3, 25)
    subagent_fresh_prob: float = 0.3
    max_context_tokens: int = 160_000
    summary_tokens: int = 6_000
    block_tokens: int = AGENTIC_BLOCK_TOKENS
    seed: int = 0
    ttl_s: float = 0.0
    subagent_ttl_s: float | None = None

    def __post_init__(self) -> None:
        checks = (
            (self.num_sessions >= 0, "num_sessions must be >= 0"),
            (self.duration_s > 0, "duration_s must be > 0"),
            (self.num_agent_types >= 1, "num_agent_types must be >= 1"),
            (0 < self.prefix_tokens[0] <= self.prefix_tokens[1], "prefix_tokens must be 0 < low <= high"),
            (1 <= self.turns[0] <= self.turns[1], "turns must be 1 <= low <= high"),
            (1 <= self.subagent_turns[0] <= self.subagent_turns[1], "subagent_turns must be 1 <= low <= high"),
            (min(self.first_input_tokens, self.input_tokens, self.output_tokens) > 0, "token sizes must be > 0"),
            (0 <= self.away_prob <= 1 and 0 <= self.subagent_prob <= 1 and 0 <= self.subagent_fresh_prob <= 1,
             "probabilities must be in [0, 1]"),
            (self.max_subagents >= 1, "max_subagents must be >= 1"),
            (self.max_context_tokens > self.prefix_tokens[1] + self.summary_tokens,
             "max_context_tokens must exceed the largest prefix plus summary_tokens"),
            (self.block_tokens >= 1, "block_tokens must be >= 1"),
            (0 <= self.ttl_s < math.inf and (self.subagent_ttl_s is None or 0 <= self.subagent_ttl_s < math.inf),
             "ttl_s and subagent_ttl_s must be finite numbers of seconds >= 0"),
        )
        for ok, message in checks:
            if not ok:
                raise InvalidArgumentError(message)


class _BlockIds:
    """Chained prefix-block ids: one id per (parent id, block content) pair, assigned in order of first use."""

    __slots__ = ("_ids",)

    def __init__(self) -> None:
        self._ids: dict[tuple[int, tuple[int, ...]], int] = {}

    def child(self, parent: int, content: tuple[int, ...]) -> int:
        key = (parent, content)
        found = self._ids.get(key)
        if found is None:
            found = self._ids[key] = len(self._ids) + 1
        return found


@dataclass(slots=True)
class _Walk:
    """How far the block ids of a history were computed: segments and tokens done, ids, the open block's pieces."""

    segments: int = 0
    tokens: int = 0
    parent: int = 0
    ids: list[int] = field(default_factory=list)
    pieces: list[int] = field(default_factory=list)

    def copy(self) -> _Walk:
        return _Walk(self.segments, self.tokens, self.parent, list(self.ids), list(self.pieces))


@dataclass(slots=True)
class _Agent:
    """One session or subagent: its history as segments of (content id, tokens), and what it does next."""

    history: list[tuple[int, int]]
    turns_left: int
    prefix: list[tuple[int, int]]
    parent: _Agent | None = None
    waiting_for: int = 0  # subagents still running
    resume_at: float = 0.0
    walk: _Walk = field(default_factory=_Walk)
    session: str = ""
    subagents: int = 0  # subagents spawned so far, to name the next one's session


class AgenticGenerator:
    """Generates the requests of one :class:`AgenticConfig`, in arrival order.

    Args:
        config: the workload's shape and seed.
    """

    def __init__(self, config: AgenticConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)
        self._ids = _BlockIds()
        self._next_content = 0
        rng, c = self._rng, config
        self._prefixes = [[(self._content(), rng.randint(*c.prefix_tokens))] for _ in range(c.num_agent_types)]

    def _content(self) -> int:
        self._next_content += 1
        return self._next_content

    def _lognormal(self, median: float, sigma: float) -> float:
        return median * math.exp(self._rng.gauss(0.0, sigma))

    def _log_uniform_int(self, low: int, high: int) -> int:
        return int(round(math.exp(self._rng.uniform(math.log(low), math.log(high)))))

    def _gap_s(self) -> float:
        c = self.config
        if self._rng.random() < c.away_prob:
            return self._lognormal(c.away_s, 0.8)
        return self._lognormal(c.think_s, 0.9)

    def _input(self, median: int) -> tuple[int, int]:
        tokens = max(1, int(self._lognormal(median, self.config.input_sigma)))
        return self._content(), min(tokens, self.config.max_context_tokens // 4)

    def _blocks(self, agent: _Agent) -> tuple[int, tuple[int, ...]]:
        """The prompt length and the chained full-block ids of ``agent``'s history, extending its cached walk."""
        bt = self.config.block_tokens
        walk = agent.walk
        history = agent.history
        for content, tokens in history[walk.segments:]:
            offset = 0
            while offset < tokens:
                take = min(tokens - offset, bt - (walk.tokens % bt))
                walk.pieces.append(content * 1_000_003 + offset)
                offset += take
                walk.tokens += take
                if walk.tokens % bt == 0:  # a block is full: its id chains on its parent's
                    walk.parent = self._ids.child(walk.parent, tuple(walk.pieces))
                    walk.ids.append(walk.parent)
                    walk.pieces = []
        walk.segments = len(history)
        return walk.tokens, tuple(walk.ids)

    def _compact_if_needed(self, agent: _Agent) -> None:
        c = self.config
        if sum(tokens for _, tokens in agent.history) > c.max_context_tokens:
            agent.history = [*agent.prefix, (self._content(), c.summary_tokens)]
            agent.walk = _Walk()

    def __iter__(self) -> Iterator[TraceRequest]:
        c, rng = self.config, self._rng
        events: list[tuple[float, int, _Agent]] = []  # (time, sequence, agent) of each agent's next request
        sequence = 0
        for _ in range(c.num_sessions):
            prefix = self._prefixes[rng.randrange(c.num_agent_types)]
            agent = _Agent([*prefix, self._input(c.first_input_tokens)], self._log_uniform_int(*c.turns), prefix,
                           session=f"s{len(events)}")
            sequence += 1
            heapq.heappush(events, (rng.uniform(0.0, c.duration_s), sequence, agent))
        while events:
            now, _, agent = heapq.heappop(events)
            self._compact_if_needed(agent)
            tokens, ids = self._blocks(agent)
            output = max(1, int(self._lognormal(c.output_tokens, 0.7)))
            ttl = c.ttl_s if agent.parent is None or c.subagent_ttl_s is None else c.subagent_ttl_s
            yield TraceRequest(now, tokens, output, ids, agent.session, ttl)
            agent.history.append((self._content(), output))
            agent.turns_left -= 1
            if agent.turns_left > 0 and agent.parent is None and rng.random() < c.subagent_prob:
                count = rng.randint(1, c.max_subagents)
                agent.waiting_for = count
                for _ in range(count):
                    fresh = rng.random() < c.subagent_fresh_prob
                    base = list(agent.prefix if fresh else agent.history)
                    agent.subagents += 1
                    child = _Agent([*base, self._input(c.first_input_tokens)],
                                   self._log_uniform_int(*c.subagent_turns), agent.prefix, parent=agent,
                                   walk=_Walk() if fresh else agent.walk.copy(),
                                   session=f"{agent.session}.{agent.subagents}")
                    sequence += 1
                    heapq.heappush(events, (now + self._lognormal(1.0, 0.5), sequence, child))
                continue
            if agent.turns_left > 0:
                agent.history.append(self._input(c.input_tokens))
                sequence += 1
                heapq.heappush(events, (now + self._gap_s(), sequence, agent))
                continue
            parent = agent.parent
            if parent is not None:
                parent.waiting_for -= 1
                parent.resume_at = max(parent.resume_at, now)
                if parent.waiting_for == 0:
                    parent.history.append(self._input(c.input_tokens))  # the subagents' reports
                    sequence += 1
                    heapq.heappush(events, (parent.resume_at + self._gap_s(), sequence, parent))


def generate_agentic(config: AgenticConfig | None = None) -> list[TraceRequest]:
    """The requests of a synthetic agentic workload, in arrival order; see :class:`AgenticConfig`.

    Raises:
        InvalidArgumentError: on a config value out of range (from :class:`AgenticConfig`).
    """
    return list(AgenticGenerator(config or AgenticConfig()))
