"""The client's call layer as pure logic (``kvstore.client.plan``, ``kvstore.client.calls``): no node, no I/O."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from kvstore.client import AsyncKVStoreClient, KVStoreClient
from kvstore.client.calls import AS_BYTES, AS_LEASE, AS_TENSORS, IntoTensors, first, total
from kvstore.blocks.tensors import encode_block
from kvstore.client.plan import RETURNED, SLOT, Attempt, Outcome, Pause, Plan, RequestStream, Rpc, Slot, Step, Transport
from kvstore.client.stats import merge_health
from kvstore.errors import InvalidArgumentError, ResourceExhaustedError, UnavailableError
from tests.support.server import kv_blocks, namespace


def _drive(step: Step[Any], answers: dict[type, Any]) -> tuple[Any, list[Any]]:
    """A transport with no I/O: answers each operation from ``answers`` (an exception is thrown in)."""
    outcome, asked = Outcome(), []
    while (op := outcome.send_into(step)) is not RETURNED:
        asked.append(op)
        answer = answers[type(op)]
        if isinstance(answer, BaseException):
            outcome.error = answer
        else:
            outcome.value = answer
    return outcome.value, asked


def test_a_step_is_driven_by_sending_back_each_operations_outcome() -> None:
    rpc = Rpc(0, lambda channel: None, b"", lambda reply: reply)

    def step() -> Step[int]:
        release = yield SLOT
        result = yield Attempt(0, rpc, 1.0)
        release()
        return int(result) + 1

    released: list[bool] = []
    result, asked = _drive(step(), {Slot: lambda: released.append(True), Attempt: 41})
    assert result == 42 and released == [True]
    assert asked == [SLOT, Attempt(0, rpc, 1.0)]


def test_an_operations_error_is_thrown_into_the_step_which_decides() -> None:
    def step() -> Step[str]:
        try:
            yield Pause(0.5)
        except UnavailableError:
            return "recovered"
        return "not reached"

    assert _drive(step(), {Pause: UnavailableError("down")})[0] == "recovered"
    with pytest.raises(ResourceExhaustedError):
        _drive(step(), {Pause: ResourceExhaustedError("full")})


def test_a_request_streams_error_comes_back_typed() -> None:
    def failing() -> Iterator[bytes]:
        yield b"a"
        raise ValueError("cannot serialize")

    stream = RequestStream(failing())
    assert next(stream) == b"a"
    with pytest.raises(ValueError):
        next(stream)
    with pytest.raises(InvalidArgumentError, match="Put request"):
        stream.raise_error()

    def kvstore_error() -> Iterator[bytes]:
        raise ResourceExhaustedError("too big")
        yield b""

    stream = RequestStream(kvstore_error())
    with pytest.raises(ResourceExhaustedError):
        next(stream)
    with pytest.raises(ResourceExhaustedError, match="too big"):
        stream.raise_error()
    RequestStream(iter([b"x"])).raise_error()  # no error: nothing raised


def test_merges() -> None:
    plan = Plan({0: Rpc(0, lambda channel: None, b"", lambda reply: reply)}, first)
    assert plan.merge(["only"]) == "only"
    assert total([3, None, 4]) == 7
    assert merge_health([None, "NOT_SERVING", "SERVING"]) == "SERVING"
    assert merge_health(["NOT_SERVING", None, "SERVICE_UNKNOWN"]) == "NOT_SERVING"
    with pytest.raises(UnavailableError):
        merge_health([None, None])


def test_both_clients_are_transports() -> None:
    transports: list[type[Transport]] = [KVStoreClient, AsyncKVStoreClient]  # checked by mypy, called here
    for client_type in transports:
        assert callable(client_type.execute)


def test_each_delivery_makes_its_result_of_received_blocks() -> None:
    import torch

    ns = namespace()
    _, tensors = kv_blocks(ns, 2)
    blocks: list[bytes | memoryview] = [encode_block(t) for t in tensors]
    assert AS_BYTES.received(blocks) is blocks  # the assembler's list itself
    decoded = AS_TENSORS.received(blocks)
    assert all(torch.equal(a, b) for a, b in zip(decoded, tensors))
    lease = AS_LEASE.received(blocks)
    with lease as held:
        assert held is blocks and lease.expires_at == float("inf") and not lease.checked
    destinations = [torch.zeros_like(t) for t in tensors]
    copied = IntoTensors(destinations, True, False, ns.layout).received(blocks)
    assert copied.num_copied == 2 and all(torch.equal(a, b) for a, b in zip(destinations, tensors))
