"""Real SGLang servers on CPU for tests and benchmarks: a tiny model written from a config, one server per process group.

Nothing is downloaded: :func:`write_qwen2` saves a 2-layer Qwen2 with seeded
random weights (transformers, ``safetensors``) and a byte-level BPE tokenizer
trained here on generated text. :class:`SGLangServer` starts ``python -m
sglang.launch_server`` with the launch line of ``docs/sglang.md`` (HiCache with
kvstore's backend, or SGLang's own ``file`` backend, or no HiCache) on a free
loopback port, and talks to it over HTTP (``/generate`` with token ids, greedy;
``/flush_cache``).

SGLang 0.5.23 needs CPU test scaffolding to run on a CPU torch; it lives in
``cpu_site/`` (``kvstore_sglang_cpu.py`` says what and why) and reaches only the
server's processes: ``cpu_site`` and the harness's torchvision copy go first on
the server's ``PYTHONPATH``, and nowhere else. A GPU runs SGLang unmodified.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import pkgutil
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Sequence

from tests.support.process import OwnedProcess, forget, free_port, spawn

REPO_ROOT = Path(__file__).resolve().parents[3]
CPU_SITE = Path(__file__).resolve().parent / "cpu_site"
"""Put first on the server's ``PYTHONPATH`` only: the CPU scaffolding (``kvstore_sglang_cpu.py``)."""
TORCHVISION_DIR = "cpu-harness-torchvision"
"""Folder of the venv (``sys.prefix``) holding torchvision 0.28.0 for the server's path (``make setup-sglang``)."""
PAGE_SIZE = 16
"""SGLang's page size in these servers (``--page-size``): tokens per HiCache page, one kvstore block each."""
VOCAB_SIZE = 512


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The size of a Qwen2 that :func:`write_qwen2` writes (vocab :data:`VOCAB_SIZE`, bf16)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int

    @property
    def head_dim(self) -> int:
        """Channels per head, ``hidden_size / num_heads``."""
        return self.hidden_size // self.num_heads


TINY = ModelShape(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)
"""The tests' model: 2 layers, 4 query heads and 2 KV heads of 32 channels (a 16-token page is 8 KiB)."""
SMALL = ModelShape(num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=2, intermediate_size=1408)
"""A model whose prefill costs something on a CPU (11M parameters besides the embeddings; a page is 32 KiB), for
benchmarks."""
START_TIMEOUT_S = 600.0
"""Seconds a server may take to start (20 s on an idle 2-core machine; minutes on a busy shared one)."""
REQUEST_TIMEOUT_S = 300.0
"""Seconds one HTTP request may take before the test calls it a hang."""


def write_qwen2(path: Path, *, seed: int = 1, shape: ModelShape = TINY) -> Path:
    """A Qwen2 of ``shape`` (:data:`TINY`: 2 layers, 4 query heads, 2 KV heads of 32 dims) in bf16 with random
    weights, vocab 512, and a tokenizer.

    The tokenizer is a byte-level BPE of 512 ids trained on generated words
    (SGLang's server loads one; the tests send token ids). Written once: a
    directory that holds a ``config.json`` is returned as it is.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    if (path / "config.json").exists():
        return path
    config = Qwen2Config(num_hidden_layers=shape.num_layers, hidden_size=shape.hidden_size,
                         num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                         intermediate_size=shape.intermediate_size, vocab_size=VOCAB_SIZE, max_position_embeddings=4096,
                         initializer_range=0.2, torch_dtype="bfloat16", tie_word_embeddings=False,
                         use_sliding_window=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((f"block {i} of prefix {i * 7 % 97} in the cache tier {i % 13}" for i in range(2000)),
                                  trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)
    return path


def prompt(num_tokens: int, seed: int) -> list[int]:
    """``num_tokens`` token ids from a seeded generator, none of them special (ids 3 and up)."""
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(num_tokens)]


def page_keys(token_ids: Sequence[int]) -> list[str]:
    """SGLang's storage keys (``get_hash_str``, chained SHA-256 hex) of the full pages of ``token_ids``.

    The keys of a request without ``extra_key`` or ``cache_salt`` (SGLang seeds
    its chain with those; ``sglang.srt.mem_cache.utils.get_storage_hash_str``).
    """
    from sglang.srt.mem_cache.utils import get_hash_str

    full = len(token_ids) // PAGE_SIZE * PAGE_SIZE
    return list(get_hash_str(list(token_ids[:full]), None, page_size=PAGE_SIZE)) if full else []


PAGE_HASH_CODE = f"from sglang.srt.mem_cache.utils import get_hash_str; get_hash_str([3] * {PAGE_SIZE}, None)"
"""Python that makes SGLang build (or load) its native page-hash extension."""


def extensions_dir() -> Path:
    """``TORCH_EXTENSIONS_DIR`` of the servers: one per venv path, so checkouts sharing a machine do not rebuild each
    other's copy (torch's JIT loader rebuilds when the include paths in its build file change)."""
    digest = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"kvstore-sglang-torch-extensions-{digest}"


def warm_page_hash() -> None:
    """Build SGLang's native page-hash extension for the servers, before any starts.

    SGLang 0.5.23 compiles it (``hicache_hash_cpp``, torch's JIT loader, into
    ``TORCH_EXTENSIONS_DIR``) on first use, in the server's storage threads; a
    ``/flush_cache`` waits 10 s for those threads, and when the compile outlasts
    that (a busy machine) SGLang's scheduler exits (``Failed to stop HiCache
    storage threads cleanly``). Built here, in a process with the servers'
    :func:`extensions_dir`, it is loaded, not compiled, by the servers.

    Raises:
        subprocess.CalledProcessError: if the build fails (it needs a C++ compiler, ninja and OpenSSL's headers).
    """
    subprocess.run([sys.executable, "-c", PAGE_HASH_CODE], check=True, timeout=START_TIMEOUT_S,
                   env={**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions_dir())})


def other_model_modules() -> list[str]:
    """SGLang's model modules other than ``qwen2``: its ``SGLANG_DISABLED_MODEL_ARCHS`` skips importing them.

    SGLang's model registry imports every module of ``sglang.srt.models`` (over
    250) in each server process that loads it; the servers here need one. Found
    without importing SGLang.
    """
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, "SGLang is not installed"
    models = [str(Path(p) / "srt" / "models") for p in spec.submodule_search_locations]
    return sorted(name for _, name, is_package in pkgutil.iter_modules(models) if not is_package and name != "qwen2")


def kvstore_config(target: str = "", **settings: Any) -> dict[str, Any]:
    """The ``--hicache-storage-backend-extra-config`` of ``docs/sglang.md``: SGLang's loader keys and kvstore's settings."""
    config: dict[str, Any] = {"backend_name": "kvstore", "module_path": "kvstore.connectors.sglang",
                              "class_name": "KVStoreHiCacheStorage", "interface_v1": 1}
    if target:
        config["target"] = target
    return config | settings


def _page_format(layout: str, shape: ModelShape) -> Any:
    import torch

    from kvstore.connectors.sglang.pages import page_format
    from tests.connectors.sglang.harness import mha_pool

    pool = mha_pool(layout, torch.bfloat16, page_size=PAGE_SIZE, num_layers=shape.num_layers,
                    num_heads=shape.num_kv_heads, head_dim=shape.head_dim)
    return page_format(pool, False)


def kvstore_namespace(model: Path, layout: str = "page_first", tenant: str = "", shape: ModelShape = TINY) -> Any:
    """The namespace kvstore's backend stores a :class:`SGLangServer`'s pages under (``docs/sglang.md``).

    Computed with the backend's own functions (``kvstore.connectors.sglang.pages``)
    from a host pool of the server's shape (``harness.mha_pool``) and SGLang's
    model name, which is the ``--model-path`` as given.
    """
    from kvstore.connectors.sglang.pages import storage_namespace
    from tests.connectors.sglang.harness import storage_config

    return storage_namespace(_page_format(layout, shape), storage_config(model=str(model)), tenant=tenant)


def kvstore_page_shape(layout: str = "page_first", shape: ModelShape = TINY) -> tuple[int, ...]:
    """The kvstore block shape of one of a :class:`SGLangServer`'s pages (``pages.py``'s table)."""
    return tuple(_page_format(layout, shape).shape)


def stored_pages(target: str, namespace: Any, token_ids: Sequence[int]) -> int:
    """How many of the full pages of ``token_ids`` the node at ``target`` holds under ``namespace`` (a lookup)."""
    from kvstore.client import KVStoreClient
    from kvstore.connectors.sglang.pages import block_hashes

    with KVStoreClient(target, timeout_s=10.0) as client:
        return client.lookup(namespace, block_hashes(page_keys(token_ids))).num_blocks


def wait_stored(target: str, namespace: Any, token_ids: Sequence[int], timeout_s: float = 120.0) -> None:
    """Wait until every full page of ``token_ids`` is in the node under ``namespace``.

    SGLang's HiCache writes through to storage on its backup thread, after the
    request returned; ``timeout_s`` bounds the wait, it is not a timing check.

    Raises:
        AssertionError: if the pages are not all there within ``timeout_s``.
    """
    from tests.support.waiting import wait_until

    pages = len(page_keys(token_ids))
    wait_until(lambda: stored_pages(target, namespace, token_ids) == pages, timeout_s,
               f"{pages} pages reach the node under {namespace.model!r}, salt {namespace.cache_salt!r}", pause_s=0.2)


@dataclasses.dataclass(frozen=True)
class Generation:
    """One ``/generate`` answer.

    Attributes:
        output_ids: the generated token ids (greedy).
        cached_tokens: prompt tokens SGLang did not compute (its ``meta_info.cached_tokens``).
        device, host, storage: where they came from (``meta_info.cached_tokens_details``; 0 when absent).
        storage_backend: the storage backend's class name SGLang reports, or ``""``.
    """

    output_ids: list[int]
    cached_tokens: int
    device: int
    host: int
    storage: int
    storage_backend: str


class ServerError(RuntimeError):
    """The SGLang server did not start, exited, or answered an error; the message holds its log tail."""


class SGLangServer(OwnedProcess):
    """One SGLang server (``python -m sglang.launch_server``) on CPU, in a process group of its own.

    Args:
        model: the model directory (:func:`write_qwen2`).
        storage: ``None`` (no HiCache), ``"file"`` (SGLang's ``HiCacheFile`` in ``workdir/hicache``) or
            kvstore's extra config (:func:`kvstore_config`: ``--hicache-storage-backend dynamic``).
        layout: ``--hicache-mem-layout`` (``page_first`` or ``layer_first``).
        extra_args: more ``launch_server`` arguments.
        workdir: where the log and the scaffolding report go; a new temporary folder when ``None``.
    """

    def __init__(self, model: Path, *, storage: str | dict[str, Any] | None = None, layout: str = "page_first",
                 extra_args: Sequence[str] = (), workdir: Path | None = None) -> None:
        self.model = Path(model)
        self.storage = storage
        self.layout = layout
        self.extra_args = list(extra_args)
        self._own_dir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="sglang-server-")) if workdir is None else Path(workdir)
        self.log_path = self.workdir / "server.log"
        self.report_path = self.workdir / "cpu-scaffolding.jsonl"
        self.call_log_path = self.workdir / "storage-calls.jsonl"
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    def command_line(self) -> list[str]:
        """The ``launch_server`` argument vector (``docs/sglang.md``'s launch line, sized for a small CPU).

        ``--sleep-on-idle``: an idle SGLang scheduler otherwise polls without
        pause and holds a core, one per server, which on two cores starves the
        rest (another server starting, the node, the test).
        """
        argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.model), "--device", "cpu",
                "--host", "127.0.0.1", "--port", str(self.port), "--page-size", str(PAGE_SIZE),
                "--max-total-tokens", "4096", "--context-length", "2048", "--max-running-requests", "8",
                "--skip-server-warmup", "--sleep-on-idle"]
        if self.storage is not None:
            argv += ["--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-mem-layout", self.layout]
            if self.storage == "file":
                argv += ["--hicache-storage-backend", "file"]
            else:
                argv += ["--hicache-storage-backend", "dynamic",
                         "--hicache-storage-backend-extra-config", json.dumps(self.storage)]
        return argv + self.extra_args

    def environment(self) -> dict[str, str]:
        """The server's environment: this one, with the CPU scaffolding and this checkout on ``PYTHONPATH``.

        Raises:
            ServerError: if ``make setup-sglang`` did not install the harness's torchvision.
        """
        torchvision = Path(sys.prefix) / TORCHVISION_DIR
        if not (torchvision / "torchvision").is_dir():
            raise ServerError(f"{torchvision} holds no torchvision: run `make setup-sglang` (the Makefile's "
                              "$(SGLANG_VENV)/.installed step installs it there)")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "PYTEST_"))}
        path = [str(CPU_SITE), str(torchvision), str(REPO_ROOT)]
        env |= {"PYTHONPATH": os.pathsep.join(path), "SGLANG_USE_CPU_ENGINE": "1",
                "SGLANG_DISABLED_MODEL_ARCHS": ",".join(other_model_modules()),
                "TORCH_EXTENSIONS_DIR": str(extensions_dir()),
                "KVSTORE_SGLANG_CPU_REPORT": str(self.report_path),
                "KVSTORE_SGLANG_CALL_LOG": str(self.call_log_path),
                "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(self.workdir / "hicache"),
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        return env

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> SGLangServer:
        """Start the server and wait until ``/health`` answers 200 (SGLang's status is up).

        Raises:
            ServerError: with the log tail, if it exits or is not up within :data:`START_TIMEOUT_S`.
        """
        if self._proc is not None and self._proc.poll() is None:
            return self
        self.port = free_port()
        env = self.environment()
        with open(self.log_path, "ab") as log:
            self._proc = spawn(self.command_line(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               cwd=str(self.workdir), env=env, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._healthy():
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self.kill()
                raise ServerError(f"the SGLang server exited ({code}) while starting:\n{self.log_tail(80)}")
            if time.monotonic() > deadline:
                self.kill()
                raise ServerError(f"the SGLang server was not up within {START_TIMEOUT_S} s:\n{self.log_tail(80)}")
            time.sleep(0.25)  # polling an HTTP endpoint: SGLang offers nothing to wait on
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as reply:
                return reply.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def kill(self) -> None:
        """Kill the server and every process SGLang started (its process group) at once."""
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)  # the server leads its own session (start_new_session)
        self._proc.wait(30.0)
        forget(self._proc)
        self._proc = None

    # ------------------------------------------------------------------ requests

    def _post(self, route: str, body: dict[str, Any] | None = None) -> tuple[int, bytes]:
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(self.url + route, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
                return reply.status, reply.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()
        except OSError as error:
            raise ServerError(f"{route}: {error}\n{self.log_tail()}") from error

    def generate(self, token_ids: Sequence[int], max_new_tokens: int = 8, **fields: Any) -> Generation:
        """Run one prompt (token ids), greedy; ``fields`` are more ``/generate`` fields (``cache_salt``, ...).

        Raises:
            ServerError: on an HTTP error, or no answer within :data:`REQUEST_TIMEOUT_S`.
        """
        status, body = self._post("/generate", {"input_ids": list(token_ids), **fields, "sampling_params": {
            "max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}})
        if status != 200:
            raise ServerError(f"/generate answered {status}: {body[:2000]!r}\n{self.log_tail()}")
        answer = json.loads(body)
        meta = answer["meta_info"]
        details = meta.get("cached_tokens_details") or {}
        return Generation(output_ids=list(answer["output_ids"]), cached_tokens=int(meta.get("cached_tokens", 0)),
                          device=int(details.get("device", 0)), host=int(details.get("host", 0)),
                          storage=int(details.get("storage") or 0),
                          storage_backend=str(details.get("storage_backend") or ""))

    def flush_cache(self, timeout_s: float = 120.0) -> None:
        """Empty SGLang's device and host caches (``/flush_cache``); its storage tier keeps its pages.

        SGLang refuses (400) while a request is still in its scheduler, which it
        can be for a moment after the request's answer came back: the flush is
        sent again until it is done, within ``timeout_s`` (a bound, not a timing check).

        Raises:
            ServerError: if SGLang still refused after ``timeout_s``, or failed.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            status, body = self._post("/flush_cache")
            if status == 200:
                return
            if status != 400 or time.monotonic() > deadline:
                raise ServerError(f"/flush_cache answered {status}: {body[:500]!r}\n{self.log_tail()}")
            time.sleep(0.05)  # SGLang offers nothing to wait on until its scheduler is idle

    def storage_calls(self) -> list[dict[str, Any]]:
        """Every storage call of kvstore's backend in the server so far, as it started and ended (``kvstore_sglang_probe``)."""
        if not self.call_log_path.exists():
            return []
        return [json.loads(line) for line in self.call_log_path.read_text().splitlines() if line.strip()]

    def scaffolding_report(self) -> list[dict[str, Any]]:
        """The CPU scaffolding's check outcomes from the server's processes (``kvstore_sglang_cpu.report``)."""
        if not self.report_path.exists():
            return []
        return [json.loads(line) for line in self.report_path.read_text().splitlines() if line.strip()]


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m tests.connectors.sglang.server DIR``: write the tiny model to ``DIR`` and build SGLang's page hash.

    For ``docs/sglang.md``'s CPU quick start: the model of the tests, and the
    native extension SGLang would otherwise compile inside the server on first use
    (:func:`warm_page_hash` says why that is best done ahead), here in the default
    ``TORCH_EXTENSIONS_DIR``, where a server started by hand looks.
    """
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__.split("\n")[0] if main.__doc__ else None)
    parser.add_argument("model_dir", type=Path)
    args = parser.parse_args(argv)
    write_qwen2(args.model_dir)
    page_keys([3] * PAGE_SIZE)  # SGLang's get_hash_str: builds the extension, or loads it
    print(args.model_dir)


if __name__ == "__main__":
    main()
