"""Real vLLM engines for tests: tiny models with seeded random weights on disk, each engine in its own process.

Nothing is downloaded: :func:`write_llama` and :func:`write_qwen2` save a
transformers model built from a config (``safetensors``), :func:`write_lora`
a PEFT LoRA adapter of random weights. :class:`Engine` starts
``tests/connectors/vllm/engine.py`` as a child process (killed with the test
process) and talks to it over a ``multiprocessing.connection`` socket, so a test
can run prompts, read the connector's Prometheus counters, wait for its saves,
and kill or restart the kvstore node under a running engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import random
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any, Callable, Sequence

from tests.support.process import forget, spawn

REPO_ROOT = Path(__file__).resolve().parents[3]
BLOCK_SIZE = 32
"""vLLM's block size in these tests (the CPU backend needs a multiple of 32)."""
VOCAB_SIZE = 512
START_TIMEOUT_S = 600.0
"""Seconds an engine may take to start (about a minute on 2 busy cores)."""
CALL_TIMEOUT_S = 600.0

CONNECTOR = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.connectors.vllm"}


def write_llama(path: Path, *, seed: int = 0, num_kv_heads: int = 2) -> Path:
    """A 2-layer Llama (GQA: 4 query heads, ``num_kv_heads`` KV heads of 32 channels) in bf16, random weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=num_kv_heads,
                         intermediate_size=256, vocab_size=VOCAB_SIZE, max_position_embeddings=4096,
                         initializer_range=0.2, torch_dtype="bfloat16", tie_word_embeddings=False)
    return _save(LlamaForCausalLM, config, path, seed, torch)


def write_qwen2(path: Path, *, seed: int = 1) -> Path:
    """A 2-layer Qwen2 (QKV biases, GQA 4/2 heads of 32 channels) in bf16, random weights."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=256, vocab_size=VOCAB_SIZE, max_position_embeddings=4096,
                         initializer_range=0.2, torch_dtype="bfloat16", tie_word_embeddings=False,
                         use_sliding_window=False)
    return _save(Qwen2ForCausalLM, config, path, seed, torch)


def write_sliding_qwen2(path: Path, *, seed: int = 2) -> Path:
    """A Qwen2 whose layers all use a 64-token sliding window (a model the connector must refuse)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=256, vocab_size=VOCAB_SIZE, max_position_embeddings=4096,
                         initializer_range=0.2, torch_dtype="bfloat16", use_sliding_window=True, sliding_window=64,
                         max_window_layers=0, layer_types=["sliding_attention", "sliding_attention"])
    return _save(Qwen2ForCausalLM, config, path, seed, torch)


def _save(model_cls: Any, config: Any, path: Path, seed: int, torch: Any) -> Path:
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def write_lora(path: Path, *, seed: int, hidden_size: int = 128, kv_size: int = 64, num_layers: int = 2) -> Path:
    """A rank-8 PEFT LoRA adapter on ``k_proj`` and ``v_proj`` with random weights (it changes the KV)."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["k_proj", "v_proj"], "bias": "none",
        "task_type": "CAUSAL_LM", "lora_dropout": 0.0, "fan_in_fan_out": False, "modules_to_save": None,
    }))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for proj in ("k_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(8, hidden_size, generator=generator) * 0.5).bfloat16()
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(kv_size, 8, generator=generator) * 0.5).bfloat16()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def tokens(num_tokens: int, seed: int) -> list[int]:
    """``num_tokens`` random token ids from a seeded generator (never 0)."""
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB_SIZE) for _ in range(num_tokens)]


class EngineError(RuntimeError):
    """The engine process failed: at start-up (the message holds vLLM's traceback) or on a command."""


class Engine:
    """One vLLM engine (``LLM``) in a child process; see the module docstring.

    Args:
        model: the model directory.
        kv_role: ``kv_producer``, ``kv_consumer`` or ``kv_both``; ``None`` for no connector.
        extra: ``kv_connector_extra_config``.
        connector: ``kv_connector`` (and ``kv_connector_module_path``) of another connector than kvstore's,
            e.g. ``{"kv_connector": "ExampleConnector"}``.
        prefix_caching: vLLM's own (local) prefix caching.
        workdir: where the engine's log goes.
        engine_core_process: run vLLM's engine core (the scheduler) in a process of its own, as
            ``vllm serve`` does; by default it runs in the engine's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
            which starts faster. The worker runs in its own process either way.
        kv_events: vLLM's ``KVEventsConfig`` fields (``--kv-events-config``), e.g. ``{"enable_kv_cache_events":
            True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557"}``; ``None``: events off.
        llm_args: more ``LLM`` arguments (``max_num_batched_tokens``, ``kv_cache_dtype``, ``enable_lora``, ...).
    """

    def __init__(self, model: Path, *, kv_role: str | None = "kv_both", extra: dict[str, Any] | None = None,
                 prefix_caching: bool = False, workdir: Path | None = None, engine_core_process: bool = False,
                 connector: dict[str, Any] | None = None, kv_events: dict[str, Any] | None = None,
                 **llm_args: Any) -> None:
        self.settings: dict[str, Any] = {
            "llm": {"model": str(model), "skip_tokenizer_init": True, "enforce_eager": True, "block_size": BLOCK_SIZE,
                    "max_model_len": 2048, "enable_prefix_caching": prefix_caching,
                    "kv_cache_memory_bytes": 128 << 20, "disable_log_stats": False, "seed": 0, **llm_args},
            "kv_transfer": {**(connector or CONNECTOR), "kv_role": kv_role,
                            "kv_connector_extra_config": dict(extra or {})}
            if kv_role else None,
            "kv_events": kv_events,
        }
        self.engine_core_process = engine_core_process
        self.workdir = Path(tempfile.mkdtemp(prefix="vllm-engine-")) if workdir is None else workdir
        self.log_path = self.workdir / "engine.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Engine:
        """Start the engine and wait until its ``LLM`` is built.

        Raises:
            EngineError: with vLLM's traceback, if the engine does not start.
        """
        address = str(self.workdir / "engine.sock")
        authkey = secrets.token_bytes(16)
        listener = Listener(address, family="AF_UNIX", authkey=authkey)
        accepted: list[Connection] = []
        acceptor = threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True)
        acceptor.start()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
               # collective_rpc of a function (kvstore.connectors.vllm.on_worker) between the test's own processes
               "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
               # the engine core (scheduler) in the engine's process, the worker in its own: one start-up less
               "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if self.engine_core_process else "0"}
        with open(self.log_path, "ab") as log:
            self._proc = spawn([sys.executable, "-m", "tests.connectors.vllm.engine", address, authkey.hex()],
                               stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=str(REPO_ROOT),
                               env=env, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while acceptor.is_alive():
            acceptor.join(0.2)
            if self._proc.poll() is not None or time.monotonic() > deadline:
                listener.close()
                self.kill()
                raise EngineError(f"the engine process did not connect:\n{self.log_tail()}")
        listener.close()
        self._conn = accepted[0]
        self._conn.send(self.settings)
        reply = self._receive(deadline)
        if "error" in reply:
            self.close()
            causes = [line for line in self.log_tail(400).splitlines() if "Error" in line and "Traceback" not in line]
            raise EngineError(reply["error"] + "\nroot causes in the engine log:\n" + "\n".join(causes[-10:]))
        return self

    def _receive(self, deadline: float) -> dict[str, Any]:
        assert self._conn is not None and self._proc is not None
        while not self._conn.poll(0.2):
            if self._proc.poll() is not None:
                raise EngineError(f"the engine process exited ({self._proc.returncode}):\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise EngineError(f"the engine did not answer in time:\n{self.log_tail()}")
        return self._conn.recv()

    def call(self, op: str, **args: Any) -> Any:
        """Run one command in the engine process and return its result.

        Raises:
            EngineError: with the engine's traceback, if the command failed.
        """
        assert self._conn is not None, "the engine is not started"
        self._conn.send({"op": op, **args})
        reply = self._receive(time.monotonic() + CALL_TIMEOUT_S)
        if "error" in reply:
            raise EngineError(reply["error"])
        return reply["result"]

    def close(self) -> None:
        """Stop the engine (and its vLLM processes)."""
        if self._conn is not None and self._proc is not None and self._proc.poll() is None:
            try:
                self._conn.send({"op": "quit"})
                self._receive(time.monotonic() + 60.0)
                self._proc.wait(60.0)
            except (EngineError, OSError, EOFError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def kill(self) -> None:
        """Kill the engine and every vLLM process it started (its process group) at once."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)  # the engine leads its own session (start_new_session)
            self._proc.wait(30.0)
            forget(self._proc)

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log_tail(self, num_lines: int = 60) -> str:
        """The last lines of the engine's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return "(no log)"

    # ------------------------------------------------------------------ commands

    def generate(self, prompts: Sequence[dict[str, Any] | list[int]], max_tokens: int = 16, **options: Any
                 ) -> list[list[int]]:
        """Greedy outputs of prompts run together (a batch); a prompt is token ids or a dict (see ``engine.py``)."""
        given = [p if isinstance(p, dict) else {"tokens": list(p)} for p in prompts]
        return self.call("generate", prompts=[{**p, **options} for p in given], max_tokens=max_tokens)

    def generate_pausing(self, prompts: Sequence[list[int]], pause_after: int, on_pause: Callable[[], None],
                         max_tokens: int = 16) -> list[list[int]]:
        """Like :meth:`generate`, but the engine stops stepping once ``pause_after`` requests finished, runs ``on_pause`` here, then goes on."""
        assert self._conn is not None
        self._conn.send({"op": "generate", "prompts": [{"tokens": list(p)} for p in prompts],
                         "max_tokens": max_tokens, "pause_after": pause_after})
        reply = self._receive(time.monotonic() + CALL_TIMEOUT_S)
        if "paused" not in reply:
            raise EngineError(reply.get("error", f"the engine did not pause: {reply}"))
        try:
            on_pause()
        finally:
            self._conn.send({"op": "go"})
        reply = self._receive(time.monotonic() + CALL_TIMEOUT_S)
        if "error" in reply:
            raise EngineError(reply["error"])
        return reply["result"]

    def generate_holding_loads(self, prompts: Sequence[dict[str, Any] | list[int]], *,
                               on_loads: Callable[[], None] = lambda: None,
                               on_loading: Callable[[], dict[str, Any] | None] = lambda: None,
                               max_tokens: int = 16) -> list[list[int] | None]:
        """Like :meth:`generate`, pausing the engine at the first step that loads (``hold_loads`` in ``engine.py``).

        ``on_loads`` runs once the scheduler planned the step's loads, before any
        worker starts them; ``on_loading`` after that step, while they are in
        flight. Both may call this engine's commands (:meth:`metrics`,
        :meth:`state`, ...); ``on_loading`` may return ``{"abort": True}`` to abort
        the requests being loaded (their outputs are ``None``). The engine core
        must run in the engine's process (``engine_core_process=False``).

        Raises:
            EngineError: if the engine failed, or no step loaded anything.
        """
        assert self._conn is not None
        given = [p if isinstance(p, dict) else {"tokens": list(p)} for p in prompts]
        self._conn.send({"op": "generate", "prompts": given, "max_tokens": max_tokens, "hold_loads": True})
        for pause, action in (("loads", on_loads), ("loading", on_loading)):
            reply = self._receive(time.monotonic() + CALL_TIMEOUT_S)
            if reply.get("paused") != pause:
                raise EngineError(reply.get("error", f"the engine did not pause at {pause!r}: {reply}"))
            go: dict[str, Any] = {"op": "go"}
            try:
                result = action()
                if pause == "loading" and result:
                    go.update(result)
            finally:
                self._conn.send(go)
        reply = self._receive(time.monotonic() + CALL_TIMEOUT_S)
        if "error" in reply:
            raise EngineError(reply["error"])
        return reply["result"]

    def state(self) -> dict[str, Any]:
        """What the engine holds for requests: ``free_blocks`` (vLLM's free KV blocks), ``requests`` (vLLM's),
        ``connector_requests`` and ``finish_saves`` (the connector scheduler's), and ``workers`` (each worker's
        ``WorkerSide.in_flight()``). Needs the engine core in the engine's process."""
        return self.call("state")

    def settle(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """Step the engine until vLLM holds no request (an aborted one is kept until its load ends); then :meth:`state`."""
        return self.call("settle", timeout_s=timeout_s)

    def ttft(self, prompt: list[int], tag: str) -> dict[str, Any]:
        """Seconds from submitting ``prompt`` to its first token (``ttft_s``), and that ``token``."""
        return self.call("ttft", tokens=list(prompt), tag=tag)

    def metrics(self) -> dict[str, float]:
        """The connector's counters (``kvstore_*_total``) and vLLM's prefix-cache counters, from vLLM's Prometheus registry."""
        return self.call("metrics")

    def namespace(self, salt: str = "", adapter: str = "") -> Any:
        """The namespace the engine's (first) worker stores a tenant's blocks under."""
        return self.call("namespace", salt=salt, adapter=adapter)

    def drain(self) -> None:
        """Wait until the workers' queued saves reached the store."""
        assert self.call("drain"), "saves did not finish"


def counter(metrics: dict[str, float], name: str, prefix: str = "kvstore_") -> float:
    """A counter from :meth:`Engine.metrics`: the connector's ``name``, or vLLM's with ``prefix=""`` (0 before it counted)."""
    return metrics.get(f"{prefix}{name}_total", metrics.get(f"{prefix}{name}", 0.0))


def deltas(before: dict[str, float], after: dict[str, float], *names: str) -> dict[str, float]:
    """How much each connector counter grew between two :meth:`Engine.metrics` snapshots."""
    return {name: counter(after, name) - counter(before, name) for name in names}
