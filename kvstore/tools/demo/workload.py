"""The demo's real-text workload from tinyshakespeare: questions about one passage, and a growing conversation."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

DATA_FILE = "tinyshakespeare.txt"

QUESTIONS = (
    "Who speaks first in this passage, and what do they ask for?",
    "Why are the citizens angry with Caius Marcius?",
    "What does the Second Citizen say in Marcius's defence?",
    "What is the mood of the crowd at the end of the passage?",
    "Which lines mention corn or bread?",
    "Summarise the passage in one sentence.",
    "What do the citizens decide to do?",
    "Who is called chief enemy to the people?",
)
"""Questions asked about the shared passage, in order."""

CONVERSATION_OFFSET = 100_000
"""Character offset in the corpus where the conversation's speeches start."""


@dataclass(frozen=True, slots=True)
class Request:
    """One prompt of the workload.

    Attributes:
        name: short label, e.g. ``question 2`` or ``turn 3``.
        kind: ``passage`` (a question about the shared passage) or ``conversation``.
        text: the whole prompt.
    """

    name: str
    kind: str
    text: str


def load_corpus() -> str:
    """The bundled tinyshakespeare text (public domain; see ``kvstore/data/README.md``)."""
    return (resources.files("kvstore") / "data" / DATA_FILE).read_text("utf-8")


def _speeches(text: str) -> list[str]:
    return [s.strip() for s in text.split("\n\n") if s.strip()]


def passage(corpus: str, num_chars: int) -> str:
    """The first whole speeches of the corpus, at most ``num_chars`` characters (at least one speech)."""
    out: list[str] = []
    size = 0
    for speech in _speeches(corpus):
        if out and size + len(speech) + 2 > num_chars:
            break
        out.append(speech)
        size += len(speech) + 2
    return "\n\n".join(out)


def passage_questions(corpus: str, passage_chars: int, num_questions: int) -> list[Request]:
    """Requests ``passage + question``: every prompt shares the passage as its prefix.

    Args:
        corpus: the text.
        passage_chars: passage length, characters (one byte token each for ASCII).
        num_questions: requests, at most ``len(QUESTIONS)``.

    Raises:
        ValueError: if more questions are asked for than exist.
    """
    if not 0 <= num_questions <= len(QUESTIONS):
        raise ValueError(f"num_questions must be in [0, {len(QUESTIONS)}], got {num_questions}")
    shared = f"Read the passage and answer the question.\n\n{passage(corpus, passage_chars)}\n\n"
    return [
        Request(f"question {i + 1}", "passage", f"{shared}Question: {q}\nAnswer:")
        for i, q in enumerate(QUESTIONS[:num_questions])
    ]


def conversation(corpus: str, num_turns: int, turn_chars: int) -> list[Request]:
    """A scripted multi-turn chat: each prompt is the previous prompt plus a reply and a new message.

    Messages are consecutive speeches from the play (the "assistant" replies are
    scripted too, so the history does not depend on the model's output), each
    about ``turn_chars / 2`` characters, so every prompt strictly extends the one
    before it and can hit all of its full blocks.

    Args:
        corpus: the text.
        num_turns: requests.
        turn_chars: characters each turn adds (user message plus reply), roughly.
    """
    speeches = iter(_speeches(corpus[CONVERSATION_OFFSET:]))

    def message() -> str:
        parts: list[str] = []
        while sum(len(p) + 1 for p in parts) < turn_chars // 2:
            parts.append(next(speeches))
        return "\n".join(parts)

    history = "A conversation about the play.\n\n"
    requests = []
    for turn in range(num_turns):
        history += f"User: {message()}\nAssistant:"
        requests.append(Request(f"turn {turn + 1}", "conversation", history))
        history += f" {message()}\n\n"
    return requests
