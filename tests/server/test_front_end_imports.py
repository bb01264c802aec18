"""The server's front end runs without torch: it shares only strata.protocol with the engine.

A fresh interpreter builds the front end as server/main.py's `_serve` does (ServerState, the
checkpoint's tokenizer, build_app, routes_ops.install, the in-loop tokenizer, an EngineClient),
then serves a completion, a structured chat completion and a refused request through the app with
an engine stand-in answering in-process; torch must not be in sys.modules afterwards. The
import-linter contract "The server's front end imports no torch" (pyproject.toml) keeps the same
statically.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

import strata
from tests.server.serverproc import free_port

DEMO_DIR = Path(strata.__file__).parent / "demo"  # the demo checkpoint's tokenizer files

FRONT_END = r"""
import asyncio, json, sys

from fastapi.testclient import TestClient

from strata.protocol.tokenizer import Tokenizer
from strata.server import routes_ops
from strata.server.app import ServerOptions, ServerState, build_app
from strata.server.engine_client import EngineClient
from strata.server.metrics import Metrics
from strata.server.procs import IpcDir
from strata.server.tokenizer_pool import InLoopTokenizer, TokenizerPool  # noqa: F401

model_dir = sys.argv[1]


class Engine:
    # answers each request with one token and finish "length", as the engine process would
    outage = None
    alive = True

    async def add(self, rid, prompt_ids, params, q):
        q.put_nowait(("delta", {"id": rid, "index": 0, "tokens": [prompt_ids[-1]], "logprobs": None,
                                "finish": "length", "stop_reason": None}))

    async def abort(self, rids):
        pass

    async def finish_seq(self, rid, index, stop):
        pass

    def release(self, rid):
        pass


opts = ServerOptions(served_model_name="demo")
state = ServerState(options=opts, metrics=Metrics(opts.served_model_name))
state.tokenizer = Tokenizer.from_dir(model_dir)
app = build_app(state)
routes_ops.install(app, state)
state.tokenizers = InLoopTokenizer(state.tokenizer)
ipc = IpcDir()
try:
    EngineClient({"model": model_dir}, ipc, None)  # the real client is built (its process not started)
finally:
    ipc.cleanup()
state.engine = Engine()
state.info = {"vocab_size": state.tokenizer.vocab_size, "max_model_len": 64, "generation_defaults": {}}
state.ready = True
client = TestClient(app)
statuses = [
    client.post("/v1/completions", json={"model": "demo", "prompt": "Once upon", "max_tokens": 1}).status_code,
    client.post("/v1/chat/completions", json={"model": "demo", "messages": [{"role": "user", "content": "Hi"}],
                                              "max_tokens": 1, "response_format": {"type": "json_object"}}).status_code,
    client.post("/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": 1, "top_p": 2}).status_code,
]
print(json.dumps({"statuses": statuses, "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))}))
"""


def test_front_end_runs_without_torch():
    out = subprocess.run([sys.executable, "-c", FRONT_END, str(DEMO_DIR)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["statuses"] == [200, 200, 400], result
    assert result["torch"] == [], f"the front end imported torch: {result['torch'][:10]}"


def test_strata_serve_front_end_process_never_imports_torch(tmp_path):
    """The real thing: `strata serve` (the demo model) under `python -X importtime`, which logs every
    module the front-end process imports (the engine process is a child without the flag); it
    starts, serves a completion and stops without torch among them."""
    port = free_port()
    log = tmp_path / "imports.log"
    cmd = [sys.executable, "-X", "importtime", "-m", "strata", "serve", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "128", "--kv-cache-memory", "4MiB", "--tokenizer-workers", "0"]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stderr=err, stdout=subprocess.DEVNULL, env={**os.environ})
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 180
            while True:
                assert proc.poll() is None, log.read_text()[-3000:]
                try:
                    if httpx.get(url + "/ready", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "server not ready in time"
                time.sleep(0.2)
            r = httpx.post(url + "/v1/completions", json={"prompt": "To be", "max_tokens": 4, "temperature": 0},
                           timeout=60)
            assert r.status_code == 200, r.text
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    imported = [line.rsplit("|", 1)[-1].strip() for line in log.read_text().splitlines()
                if line.startswith("import time:") and "|" in line]
    assert "strata.server.app" in imported  # the log is this process's imports
    assert [m for m in imported if m == "torch" or m.startswith("torch.")] == []
