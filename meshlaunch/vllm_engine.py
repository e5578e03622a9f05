"""A vLLM OpenAI server as the engine tests and bench_engines start it: KV events (PUB) and replay (ROUTER)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from meshlaunch.process import Proc

MODEL = "tiny"
"""The served model name of the tiny random Llama that scripts/engines/make_model.py writes."""
ENGINE_BLOCK = 32
"""vLLM's KV block size on CPU (16 is refused there); two mesh blocks of 16 each."""


@dataclass
class Engine:
    """One vLLM OpenAI server on 127.0.0.1 with KV events (PUB) and replay (ROUTER) on its own ports."""

    name: str
    port: int
    events: int
    replay: int
    proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def args(self, python: str, model_dir: Path) -> list[str]:
        kv = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events}",
            "replay_endpoint": f"tcp://*:{self.replay}",
        }
        return [
            python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", MODEL,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--block-size", str(ENGINE_BLOCK), "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--max-model-len", "2048", "--max-num-seqs", "16", "--enforce-eager",
            "--kv-events-config", json.dumps(kv),
        ]  # fmt: skip

    def get(self, path: str, timeout: float = 5.0) -> bytes:
        """GET `path` on this server; its body."""
        with urllib.request.urlopen(self.url + path, timeout=timeout) as resp:
            body: bytes = resp.read()
        return body

    def healthy(self) -> bool:
        try:
            return self.get("/health", 2.0) is not None
        except (OSError, urllib.error.URLError):
            return False

    def metric(self, name: str) -> float:
        total = 0.0
        for line in self.get("/metrics").decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def complete(self, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
        """Greedy completion asked of this server directly: (token ids, finish reason)."""
        body = json.dumps(
            {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "return_token_ids": True,
            }
        ).encode()
        req = urllib.request.Request(self.url + "/v1/completions", body, {"Content-Type": "application/json"})
        choice = json.loads(urllib.request.urlopen(req, timeout=120).read())["choices"][0]
        return list(choice["token_ids"]), choice["finish_reason"]
