"""A real vLLM engine in its own process, driven by a test over a ``multiprocessing.connection`` (``harness.Engine``).

Run as ``python -m tests.connectors.vllm.engine ADDRESS AUTHKEY_HEX``. The
first message is the engine's settings; the process answers ``{"ready": ...}``
once the ``LLM`` is built (or ``{"error": traceback}``), then serves commands
until ``quit``. Only the test's own objects cross the connection (plain dicts,
lists and kvstore namespaces).
"""

from __future__ import annotations

import sys
import time
import traceback
from multiprocessing.connection import Client
from typing import Any


def _generate(llm: Any, conn: Any, cmd: dict[str, Any]) -> list[list[int]]:
    """Run prompts to completion through the engine's step loop; optionally pause after some finish.

    ``cmd["prompts"]``: dicts with ``tokens`` and optional ``salt``, ``lora``
    (``[name, id, path]``), ``load``, ``save``, ``session_id``, ``ttl_s`` (the last four go in
    ``kv_transfer_params["kvstore"]``), ``max_tokens``. With
    ``pause_after=k``, the loop stops stepping once ``k`` requests have
    finished, sends ``{"paused": k}`` and waits for any message before going on.

    With ``hold_loads`` (the engine core in this process), it pauses twice at
    the first step whose connector metadata holds loads: ``{"paused":
    "loads"}`` once the scheduler planned them (looked up, blocks allocated),
    before any worker starts them, and ``{"paused": "loading"}`` after that
    step, while they are in flight (asynchronous loads). Each pause serves
    commands (``metrics``, ``state``, ...) until ``{"op": "go"}``; the second
    one's ``go`` may carry ``"abort": true``, which aborts those requests.
    An aborted request's output is ``None``.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    engine = llm.llm_engine
    ids = []
    for i, prompt in enumerate(cmd["prompts"]):
        options = {k: prompt[k] for k in ("load", "save", "session_id", "ttl_s") if k in prompt}
        extra = {"kv_transfer_params": {"kvstore": options}} if options else None
        params = SamplingParams(max_tokens=prompt.get("max_tokens", cmd.get("max_tokens", 16)), temperature=0.0,
                                ignore_eos=True, extra_args=extra)
        tokens = TokensPrompt(prompt_token_ids=list(prompt["tokens"]))
        if prompt.get("salt"):
            tokens["cache_salt"] = prompt["salt"]
        lora = LoRARequest(*prompt["lora"]) if prompt.get("lora") else None
        request_id = f"{cmd.get('tag', 'r')}-{i}"
        engine.add_request(request_id, tokens, params, lora_request=lora)
        ids.append(request_id)
    outputs: dict[str, list[int]] = {}
    pause_after = cmd.get("pause_after")
    held = _HeldLoads(llm, conn) if cmd.get("hold_loads") else None
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished and output.request_id in ids:
                    outputs[output.request_id] = list(output.outputs[0].token_ids)
            if pause_after is not None and len(outputs) >= pause_after:
                conn.send({"paused": len(outputs)})
                conn.recv()
                pause_after = None
            if held is not None and held.loads and not held.resumed:
                held.resumed = True
                if _pause(llm, conn, "loading").get("abort"):
                    engine.abort_request(held.loads, internal=True)
    finally:
        if held is not None:
            held.restore()
    return [outputs.get(i) for i in ids]


class _HeldLoads:
    """The scheduler connector's ``build_connector_meta`` wrapped to pause at the first metadata with loads."""

    def __init__(self, llm: Any, conn: Any) -> None:
        self.connector = _scheduler(llm).connector
        self.build = self.connector.build_connector_meta
        self.loads: list[str] = []  # vLLM's (internal) ids of the requests whose loads were held
        self.resumed = False

        def build(scheduler_output: Any) -> Any:
            meta = self.build(scheduler_output)
            if not self.loads and meta.loads:
                self.loads = [job.req_id for job in meta.loads]
                _pause(llm, conn, "loads")
            return meta

        self.connector.build_connector_meta = build

    def restore(self) -> None:
        del self.connector.build_connector_meta  # the class's method again


def _pause(llm: Any, conn: Any, what: str) -> dict[str, Any]:
    """Tell the test ``{"paused": what}``, serve its commands until ``{"op": "go"}``, and return that message."""
    conn.send({"paused": what})
    while (cmd := conn.recv())["op"] != "go":
        try:
            conn.send({"result": HANDLERS[cmd["op"]](llm, cmd)})
        except Exception:  # noqa: BLE001 - reported to the test, which fails with it
            conn.send({"error": traceback.format_exc()})
    return cmd


def _scheduler(llm: Any) -> Any:
    """vLLM's scheduler; only while the engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise RuntimeError("the engine core runs in a process of its own: start the engine with engine_core_process=False")
    return core.scheduler


def _state(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    """What the engine holds for requests: vLLM's free KV blocks and requests, the connector's per-request state and
    each worker's loads not yet reported (:meth:`WorkerSide.in_flight`)."""
    scheduler = _scheduler(llm)
    side = scheduler.connector.scheduler_side
    return {"free_blocks": scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
            "requests": len(scheduler.requests), "connector_requests": len(side._requests),
            "finish_saves": len(side._finish_saves),
            "workers": _on_workers(llm, lambda worker: worker.in_flight())}


def _settle(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    """Step the engine until vLLM holds no request (an aborted one waits for its load to end), then :func:`_state`.

    Raises:
        TimeoutError: if requests remain after ``timeout_s`` (default 120) seconds.
    """
    scheduler = _scheduler(llm)
    deadline = time.monotonic() + float(cmd.get("timeout_s", 120.0))
    while scheduler.has_requests():
        if time.monotonic() > deadline:
            raise TimeoutError(f"vLLM still holds {len(scheduler.requests)} requests")
        llm.llm_engine.step()
    return _state(llm, cmd)


def _decode_with_hits(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    """Decode throughput of running requests with and without hits loading, one ``engine.step()`` at a time.

    ``cmd``: ``running`` (prompts, token ids) decode greedily with ``max_tokens``;
    once every one has its first token, each of ``trials`` rounds steps
    ``baseline_steps`` times with nothing else in the engine (the baseline
    window), then adds the ``hits`` prompts (one token each) and steps until
    every hit has its first token, then ``settle_steps``
    more and until the hits are gone. No request saves (``kv_transfer_params``).
    Times are ``time.perf_counter()`` around ``step()``; a step's tokens are the
    running requests' new output tokens. Needs the engine core in this process
    (``Engine(engine_core_process=False)``) to read which loads are in flight.

    Returns:
        ``{"trials": [{"baseline": {"steps", "tokens", "seconds"}, "steps": [{"seconds", "tokens",
        "loading"}, ...], "hit_ttft_s": [...]}]}``: ``steps`` are the load window's, ``loading`` the
        number of hits whose load was in flight when the step began (not yet looked up, or in
        ``WAITING_FOR_REMOTE_KVS`` and not reported received); ``hit_ttft_s`` the seconds from
        ``add_request`` to the end of the step that returned each hit's first token.

    Raises:
        RuntimeError: a running request finished before the last window ended (``max_tokens`` too small).
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.request import RequestStatus

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    no_save = {"kv_transfer_params": {"kvstore": {"save": False}}}
    lengths: dict[str, int] = {}

    def add(request_id: str, tokens: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=no_save)
        engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(tokens)), params)
        lengths[request_id] = 0

    def step(running: set[str]) -> tuple[int, set[str]]:
        """One step: (new tokens of ``running``, requests with their first token now)."""
        num_tokens, first = 0, set()
        for output in engine.step():
            rid, count = output.request_id, len(output.outputs[0].token_ids) if output.outputs else 0
            if rid in running:
                num_tokens += count - lengths[rid]
                if output.finished:
                    raise RuntimeError("a running request finished before the last window: raise max_tokens")
            if count and not lengths[rid]:
                first.add(rid)
            lengths[rid] = count
        return num_tokens, first

    def loading(hits: set[str]) -> int:
        count = 0
        for rid, request in scheduler.requests.items():  # vLLM's ids: ours plus "-" and 8 random characters
            if rid.rsplit("-", 1)[0] not in hits:
                continue
            if request.status == RequestStatus.WAITING and request.num_computed_tokens == 0:
                count += 1  # not scheduled yet: its lookup (and, synchronously, its load) is in the next step
            elif (request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                  and rid not in scheduler.finished_recving_kv_req_ids):
                count += 1
        return count

    running = {f"run-{i}" for i in range(len(cmd["running"]))}
    for i, tokens in enumerate(cmd["running"]):
        add(f"run-{i}", tokens, cmd["max_tokens"])
    started: set[str] = set()
    while started != running:
        started |= step(running)[1]
    trials = []
    for trial in range(cmd["trials"]):
        begin, num_tokens = time.perf_counter(), 0
        for _ in range(cmd["baseline_steps"]):
            num_tokens += step(running)[0]
        baseline = {"steps": cmd["baseline_steps"], "tokens": num_tokens, "seconds": time.perf_counter() - begin}
        hits = {f"hit-{trial}-{i}" for i in range(len(cmd["hits"]))}
        steps, ttft_s = [], {}
        begin = time.perf_counter()
        for i, tokens in enumerate(cmd["hits"]):
            add(f"hit-{trial}-{i}", tokens, 1)
        while len(ttft_s) < len(hits):
            in_flight, step_begin = loading(hits), time.perf_counter()
            got, first = step(running)
            now = time.perf_counter()
            steps.append({"seconds": now - step_begin, "tokens": got, "loading": in_flight})
            ttft_s.update({rid: now - begin for rid in first & hits})
        for _ in range(cmd["settle_steps"]):
            step(running)
        while engine.get_num_unfinished_requests() > len(running):  # hits still finishing
            step(running)
        trials.append({"baseline": baseline, "steps": steps, "hit_ttft_s": [ttft_s[h] for h in sorted(hits)]})
    engine.abort_request(sorted(running))
    while engine.has_unfinished_requests():
        engine.step()
    return {"trials": trials}

def _ttft(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    """Seconds from submitting one prompt to its first token (greedy, one token), and the token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    engine.add_request(cmd["tag"], TokensPrompt(prompt_token_ids=list(cmd["tokens"])), params)
    ttft_s, token = None, None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if ttft_s is None and output.outputs and output.outputs[0].token_ids:
                ttft_s, token = time.perf_counter() - started, output.outputs[0].token_ids[0]
    return {"ttft_s": ttft_s, "token": token}


def _metrics(llm: Any, cmd: dict[str, Any]) -> dict[str, float]:
    """The ``vllm:kvstore_*`` metrics (and vLLM's own prefix-cache counters) from the engine's Prometheus registry.

    A histogram gives ``<name>_sum`` (seconds) and ``<name>_count``.
    """
    values: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith(("vllm:kvstore_", "vllm:prefix_cache", "vllm:external_prefix_cache")):
            name = metric.name.removeprefix("vllm:")
            if hasattr(metric, "sum") and hasattr(metric, "count"):
                values[f"{name}_sum"], values[f"{name}_count"] = float(metric.sum), float(metric.count)
            else:
                values[name] = float(getattr(metric, "value", 0) or 0)
    return values


def _on_workers(llm: Any, fn: Any) -> list[Any]:
    from kvstore.connectors.vllm import on_worker

    return llm.collective_rpc(on_worker(fn))


def _namespace(llm: Any, cmd: dict[str, Any]) -> Any:
    from kvstore.connectors.vllm.jobs import TenantKey

    tenant = TenantKey(cmd.get("salt", ""), cmd.get("adapter", ""))
    return _on_workers(llm, lambda side: side.namespace(tenant))[0]


def _drain(llm: Any, cmd: dict[str, Any]) -> bool:
    timeout_s = float(cmd.get("timeout_s", 60.0))
    return all(_on_workers(llm, lambda side: side.drain(timeout_s)))


HANDLERS: dict[str, Any] = {"metrics": _metrics, "ttft": _ttft, "namespace": _namespace, "drain": _drain,
                            "state": _state, "settle": _settle, "decode_with_hits": _decode_with_hits,
                            "reset_prefix_cache": lambda llm, cmd: llm.reset_prefix_cache()}
"""The engine's commands besides ``generate`` and ``quit``: ``op`` -> ``handler(llm, cmd)``."""


def main(address: str, authkey_hex: str) -> None:
    conn = Client(address, authkey=bytes.fromhex(authkey_hex))
    settings: dict[str, Any] = conn.recv()
    try:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        kv = settings.get("kv_transfer")
        transfer = KVTransferConfig(**kv) if kv else None
        extra_configs: dict[str, Any] = {}
        if settings.get("kv_events"):
            from vllm.config import KVEventsConfig

            extra_configs["kv_events_config"] = KVEventsConfig(**settings["kv_events"])
        llm = LLM(**settings["llm"], kv_transfer_config=transfer, **extra_configs)
    except BaseException:  # noqa: BLE001 - the test reads the start-up error
        conn.send({"error": traceback.format_exc()})
        return
    conn.send({"ready": True})
    while True:
        cmd = conn.recv()
        if cmd["op"] == "quit":
            conn.send({"result": None})
            break
        try:
            if cmd["op"] == "generate":
                result = _generate(llm, conn, cmd)
            else:
                result = HANDLERS[cmd["op"]](llm, cmd)
            conn.send({"result": result})
        except Exception:  # noqa: BLE001 - reported to the test, which fails with it
            conn.send({"error": traceback.format_exc()})
    del llm


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
