"""LoRA adapters in `strata serve`: the request's `model` picks the adapter (tokens equal offline
LLM(enable_lora=True)'s), /v1/models lists them, runtime load/unload (API key, --lora-dir, every
refusal), a load does not hold up other requests, an unload while requests hold the adapter loses
none, per-adapter metrics and vLLM's lora_requests_info gauge, and a restarted engine gets every
adapter back. One server for the module (a tiny Llama with a tokenizer); planted gates
(STRATA_TEST_FAULTS lora_load_gate / engine_step_gate) hold a load or the engine's steps
deterministically, with no timing."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from strata.cli.registry import build_parser
from strata.engine.args import EngineArgs
from strata.errors import ConfigError
from strata.protocol.lora import LoRARequest
from strata.protocol.stats import EngineStats
from strata.server import routes_ops
from strata.server.app import build_app
from strata.server.lora import LoRARegistry, parse_lora_modules
from strata.server.main import lora_registry
from strata.server.metrics import Metrics
from strata.server.state import ServerOptions, ServerState
from tests.lora_adapters import make_adapter
from tests.server.serverproc import child, kill_tree, start_server, wait_status

KEY = "lora-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [5, 6, 7, 8, 9, 10]  # token ids: the same prompt for the server and the offline engine
MAX_TOKENS = 12
BASE_FLAGS = ("--served-model-name", "base", "--max-model-len", "96", "--kv-cache-memory", "1MiB")


# --- adapters on disk --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def files(text_model, tmp_path_factory):
    """Adapters for the text model: `a` given at start, the rest under the --lora-dir `runtime`,
    bad ones for each refusal, and one outside it."""
    import safetensors.torch

    root = tmp_path_factory.mktemp("lora-serve")
    runtime, outside = root / "runtime", root / "outside"
    runtime.mkdir()
    outside.mkdir()
    make_adapter(text_model.hf, root / "a", seed=1)
    make_adapter(text_model.hf, runtime / "b", seed=2, r=4, alpha=8)
    make_adapter(text_model.hf, runtime / "rank32", seed=3, r=32, alpha=32)
    make_adapter(text_model.hf, outside / "c", seed=4)
    shutil.copytree(root / "a", runtime / "a_copy")
    shutil.copytree(runtime / "b", runtime / "shape")  # lora_A of one projection one column short
    weights = runtime / "shape" / "adapter_model.safetensors"
    tensors = safetensors.torch.load_file(str(weights))
    first = sorted(k for k in tensors if "lora_A" in k)[0]
    tensors[first] = tensors[first][:, :-1].contiguous()
    safetensors.torch.save_file(tensors, str(weights))
    (runtime / "pickle").mkdir()  # a .bin adapter (never opened: refused on sight)
    shutil.copy(runtime / "b" / "adapter_config.json", runtime / "pickle")
    (runtime / "pickle" / "adapter_model.bin").write_bytes(b"not read")
    shutil.copytree(runtime / "b", runtime / "dora")
    cfg = json.loads((runtime / "dora" / "adapter_config.json").read_text())
    (runtime / "dora" / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    os.symlink(outside / "c", runtime / "escape")  # a directory link out of --lora-dir
    (runtime / "filelink").mkdir()  # a file link out of it
    shutil.copy(outside / "c" / "adapter_config.json", runtime / "filelink")
    os.symlink(outside / "c" / "adapter_model.safetensors", runtime / "filelink" / "adapter_model.safetensors")
    (root / "chat.jinja").write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                     "assistant:")
    return SimpleNamespace(root=root, a=root / "a", runtime=runtime, outside=outside,
                           load_gate=root / "load-gate", step_gate=root / "step-gate")


@pytest.fixture(scope="module")
def offline(text_model, files):
    """Greedy text of PROMPT offline: the base, adapter a and adapter b (the server's reference)."""
    from conftest import make_llm

    from strata import SamplingParams

    llm = make_llm(text_model, enable_lora=True, max_loras=2)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        loras = [None, LoRARequest("a", 1, str(files.a)), LoRARequest("b", 2, str(files.runtime / "b"))]
        outs = llm.generate([PROMPT] * 3, params, use_tqdm=False, lora_request=loras)
        return dict(zip(("base", "a", "b"), (o.outputs[0].text for o in outs)))
    finally:
        llm.close()


@pytest.fixture(scope="module")
def served(text_model, files):
    faults = f"lora_load_gate={files.load_gate},engine_step_gate={files.step_gate}"
    s = start_server("--model", str(text_model.path), *BASE_FLAGS, "--enable-lora", "--max-loras", "2",
                     "--max-cpu-loras", "8", "--lora-modules", f"a={files.a}", "--enable-lora-updates", "--lora-dir", str(files.runtime),
                     "--api-key", KEY, "--chat-template", str(files.root / "chat.jinja"),
                     env={"STRATA_TEST_FAULTS": faults})
    try:
        yield s
    finally:
        try:
            assert s.stop() == 0
        finally:
            kill_tree(s.proc)


def post(s, path: str, body: dict, headers: dict | None = AUTH) -> httpx.Response:
    return s.post(path, json=body, headers=headers)


def complete(s, model: str, **kw) -> httpx.Response:
    return post(s, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                       "temperature": 0, "ignore_eos": True, **kw})


def text_of(s, model: str) -> str:
    r = complete(s, model)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    return r.json()["choices"][0]["text"]


def stream_text(s, path: str, body: dict) -> tuple[str, str]:
    """(the streamed text, the chunks' model) of a streaming request."""
    parts, model = [], None
    with httpx.stream("POST", s.url + path, json={**body, "stream": True}, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            model = chunk["model"]
            for c in chunk["choices"]:
                parts.append(c.get("text") or c.get("delta", {}).get("content") or "")
    return "".join(parts), model


def load(s, name: str, path: str, **kw) -> httpx.Response:
    return post(s, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path, **kw})


def unload(s, name: str) -> httpx.Response:
    return post(s, "/v1/unload_lora_adapter", {"lora_name": name})


def error_of(r: httpx.Response) -> dict:
    return r.json()["error"]


def lora_info(s) -> list[dict]:
    """The label sets of vllm:lora_requests_info (parsed as a scraper does)."""
    text = httpx.get(s.url + "/metrics", headers=AUTH, timeout=10).text
    return [smp.labels for fam in text_string_to_metric_families(text) for smp in fam.samples
            if smp.name == "vllm:lora_requests_info"]


def wait_for(check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


# --- flags (no server) ---------------------------------------------------------------------------
def _registry(*argv: str, names=("base",)) -> LoRARegistry:
    args = build_parser().parse_args(["serve", *argv])
    return lora_registry(args, EngineArgs.from_cli_args(args), names)


def test_lora_flags_need_enable_lora_and_each_other(files):
    for flags, named in ((["--lora-modules", f"a={files.a}"], "--lora-modules"),
                         (["--lora-dir", str(files.runtime)], "--lora-dir"),
                         (["--enable-lora-updates"], "--enable-lora-updates"),
                         (["--max-loras", "4"], "--max-loras"), (["--max-lora-rank", "64"], "--max-lora-rank"),
                         (["--max-cpu-loras", "8"], "--max-cpu-loras")):
        with pytest.raises(ConfigError, match=f"{named} needs --enable-lora"):
            _registry(*flags)
    with pytest.raises(ConfigError, match="--enable-lora-updates needs --lora-dir"):
        _registry("--enable-lora", "--enable-lora-updates")
    with pytest.raises(ConfigError, match="--lora-dir .* needs --enable-lora-updates"):
        _registry("--enable-lora", "--lora-dir", str(files.runtime))
    with pytest.raises(ConfigError, match="not a directory"):
        _registry("--enable-lora", "--enable-lora-updates", "--lora-dir", str(files.root / "missing"))
    with pytest.raises(ConfigError, match="'base' is the base model's served name"):
        _registry("--enable-lora", "--lora-modules", f"base={files.a}")
    with pytest.raises(ConfigError, match=r"--lora-modules: LoRA adapter p: .*adapter_model.bin \(a pickle"):
        _registry("--enable-lora", "--lora-modules", f"p={files.runtime / 'pickle'}")
    assert not _registry().enabled
    reg = _registry("--enable-lora", "--lora-modules", f"a={files.a}",
                    json.dumps({"name": "b", "path": str(files.runtime / "b"), "base_model_name": "base"}))
    assert [(lr.lora_name, lr.lora_int_id, lr.path, lr.base_model_name) for lr in reg.adapters.values()] == [
        ("a", 1, str(files.a), None), ("b", 2, str(files.runtime / "b"), "base")]


def test_lora_modules_forms_and_refusals():
    assert parse_lora_modules(["x=/p", '{"name": "y", "path": "/q", "base_model_name": "m"}']) == [
        ("x", "/p", None), ("y", "/q", "m")]
    for bad, why in (("x", "NAME=PATH"), ("=/p", "NAME=PATH"), ("x=", "NAME=PATH"), ("{oops", "not valid JSON"),
                     ('{"name": "x"}', "needs string fields"), ('{"name": "x", "path": "/p", "r": 8}', "unknown field 'r'")):
        with pytest.raises(ConfigError, match=why):
            parse_lora_modules([bad])
    with pytest.raises(ConfigError, match="given twice"):
        parse_lora_modules(["x=/p", "x=/q"])


def test_flag_without_enable_lora_is_one_line_exit_2(files):
    r = subprocess.run([sys.executable, "-m", "strata.cli", "serve", "--lora-dir", str(files.runtime)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "error: --lora-dir needs --enable-lora (LoRA adapters are off without it)"


def test_an_adapter_the_engine_refuses_fails_the_start_naming_it(text_model, files):
    """Rank 32 over --max-lora-rank 16 is found by the engine (not the front end's file checks):
    the server exits 1 before serving, and the log names the adapter and the fix."""
    cmd = [sys.executable, "-m", "strata.cli", "serve", "--model", str(text_model.path), "--port", "0",
           "--dtype", "float32", *BASE_FLAGS, "--enable-lora", "--lora-modules", f"big={files.runtime / 'rank32'}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "LoRA adapter big" in r.stderr and "rank 32" in r.stderr and "--max-lora-rank 32" in r.stderr, r.stderr


# --- metrics (no server) ---------------------------------------------------------------------------
def test_lora_info_gauge_keeps_one_series_of_the_current_adapters():
    m = Metrics("m")
    m.on_engine_stats(EngineStats())  # LoRA off: no series
    assert _info_series(m) == []
    m.on_engine_stats(EngineStats(lora_running=("a", "b"), lora_waiting=("c",), max_loras=2))
    [(labels, value)] = _info_series(m)
    assert labels == {"max_lora": "2", "running_lora_adapters": "a,b", "waiting_lora_adapters": "c"}
    assert abs(value - time.time()) < 60  # a timestamp, as vLLM's
    m.on_engine_stats(EngineStats(lora_running=["b"], lora_waiting=[], max_loras=2))  # lists, as msgpack sends
    assert [labels for labels, _ in _info_series(m)] == [
        {"max_lora": "2", "running_lora_adapters": "b", "waiting_lora_adapters": ""}]


def _info_series(m: Metrics) -> list[tuple[dict, float]]:
    return [(s.labels, s.value) for fam in text_string_to_metric_families(m.render().decode()) for s in fam.samples
            if s.name == "vllm:lora_requests_info"]


# --- the HTTP side alone (no processes) ------------------------------------------------------------
def _app(loras: LoRARegistry) -> TestClient:
    state = ServerState(options=ServerOptions(served_model_name="base"), metrics=Metrics("base"), ready=True,
                        loras=loras)
    app = build_app(state)
    routes_ops.install(app, state)
    return TestClient(app)


@pytest.mark.parametrize("enabled", [False, True])
def test_lora_routes_off_answer_404_naming_the_flags(enabled):
    client = _app(LoRARegistry(enabled=enabled))
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "x"}),
                       ("/v1/unload_lora_adapter", {"lora_name": "x"})):
        r = client.post(path, json=body)
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["code"] == "lora_updates_disabled"
        assert "--enable-lora --enable-lora-updates --lora-dir DIR" in err["message"]
    assert [c["id"] for c in client.get("/v1/models").json()["data"]] == ["base"]


def test_a_request_routed_before_an_unload_is_a_404_not_the_base(tmp_path):
    """The adapter was resolved, then unloaded before the request reached the engine: the client
    refuses to send it (the engine process would refuse it too) instead of running the base."""
    import asyncio

    from strata.server.engine_client import EngineClient
    from strata.server.procs import IpcDir

    reg = LoRARegistry(enabled=True)
    lora = reg.new("x", str(tmp_path))
    client = EngineClient({}, IpcDir(str(tmp_path)), None, loras=reg)
    q: asyncio.Queue = asyncio.Queue()
    asyncio.run(client.add("r1", [1, 2], {}, q, lora=lora))  # never registered: unloaded meanwhile
    kind, item = q.get_nowait()
    assert kind == "error" and item["status"] == 404 and "'x' was unloaded" in item["message"]


# --- the served model ------------------------------------------------------------------------------
def test_models_lists_the_base_and_each_adapter(served, files):
    cards = {c["id"]: c for c in served.get("/v1/models", headers=AUTH).json()["data"]}
    assert list(cards) == ["base", "a"]
    assert cards["base"]["parent"] is None
    assert cards["a"]["parent"] == "base" and cards["a"]["root"] == str(files.a)
    assert served.get("/v1/models/a", headers=AUTH).json()["root"] == str(files.a)
    assert served.get("/v1/models/nope", headers=AUTH).status_code == 404


def test_model_field_picks_the_adapter(served, offline):
    """Base and adapter differ; each equals the offline engine's greedy text; completions and chat,
    streaming and not; an unknown name is the 404 listing every served name."""
    assert offline["a"] != offline["base"]
    assert text_of(served, "base") == offline["base"]
    assert text_of(served, "a") == offline["a"]
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    assert stream_text(served, "/v1/completions", {**body, "model": "a"}) == (offline["a"], "a")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}
    answers = {}
    for model in ("base", "a"):
        r = post(served, "/v1/chat/completions", {**chat, "model": model})
        assert r.status_code == 200 and r.json()["model"] == model, r.text
        answers[model] = r.json()["choices"][0]["message"]["content"]
        assert stream_text(served, "/v1/chat/completions", {**chat, "model": model}) == (answers[model], model)
    assert answers["a"] != answers["base"]
    r = complete(served, "nope")
    assert r.status_code == 404
    assert error_of(r)["message"] == ("model 'nope' does not exist; this server serves 'base' or 'a' "
                                      "(GET /v1/models)")


def test_lora_routes_need_the_api_key(served):
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        r = post(served, path, {"lora_name": "b", "lora_path": "b"}, headers=None)
        assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"


def test_every_bad_load_and_unload_is_refused_by_name(served, files):
    cases = [  # (body, status, param, words the message holds)
        ({"lora_path": "b"}, 400, "lora_name", "lora_name"),
        ({"lora_name": "b"}, 400, "lora_path", "lora_path"),
        ({"lora_name": "b", "lora_path": "b", "rank": 4}, 400, "rank", "rank"),
        ({"lora_name": "a", "lora_path": "b"}, 400, "lora_name", "'a' has already been loaded"),
        ({"lora_name": "base", "lora_path": "b"}, 400, "lora_name", "base model's served name"),
        ({"lora_name": "", "lora_path": "b"}, 400, "lora_name", "lora_name is empty"),
        ({"lora_name": "bad name", "lora_path": "b"}, 400, "lora_name", "use letters, digits"),
        ({"lora_name": "c", "lora_path": str(files.outside / "c")}, 400, "lora_path", "outside --lora-dir"),
        ({"lora_name": "c", "lora_path": "../outside/c"}, 400, "lora_path", "outside --lora-dir"),
        ({"lora_name": "c", "lora_path": "escape"}, 400, "lora_path", "outside --lora-dir"),
        ({"lora_name": "c", "lora_path": "filelink"}, 400, "lora_path", "a link to outside --lora-dir"),
        ({"lora_name": "c", "lora_path": "missing"}, 400, "lora_path", "is not a directory"),
        ({"lora_name": "c", "lora_path": "pickle"}, 400, "lora_path", "adapter_model.bin (a pickle"),
        ({"lora_name": "c", "lora_path": "dora"}, 400, "lora_path", "DoRA"),
        ({"lora_name": "c", "lora_path": "rank32"}, 400, "lora_path", "rank 32"),  # the engine's checks
        ({"lora_name": "c", "lora_path": "shape"}, 400, "lora_path", "do not fit the base"),
    ]
    for body, status, param, words in cases:
        r = post(served, "/v1/load_lora_adapter", body)
        assert r.status_code == status, (body, r.text)
        err = error_of(r)
        assert err["param"] == param and words in err["message"], (body, err)
    r = unload(served, "nope")
    assert r.status_code == 404 and "'nope' is not loaded (loaded adapters: 'a')" in error_of(r)["message"]
    r = post(served, "/v1/unload_lora_adapter", {"lora_name": "a", "lora_int_id": 99})
    assert r.status_code == 400 and error_of(r)["param"] == "lora_int_id"
    names = [c["id"] for c in served.get("/v1/models", headers=AUTH).json()["data"]]
    assert names == ["base", "a"]  # nothing half-loaded
    assert text_of(served, "a")  # and the engine still serves


def test_a_held_load_does_not_stall_other_requests(served, files, offline):
    """While the engine holds b's load (planted gate), requests with the base and with a complete;
    once the gate opens the load answers and b serves its own tokens."""
    files.load_gate.touch()
    with cf.ThreadPoolExecutor(1) as pool:
        try:
            pending = pool.submit(load, served, "b", "b")
            time.sleep(0.3)  # let the load reach the engine (it cannot finish while the gate is there)
            assert text_of(served, "base") == offline["base"]
            assert stream_text(served, "/v1/completions", {"model": "a", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                           "temperature": 0, "ignore_eos": True})[0] == offline["a"]
            r = load(served, "b", "b")  # the same name while its load is under way
            assert r.status_code == 400 and "being loaded" in error_of(r)["message"]
            assert complete(served, "b").status_code == 404  # not served before the engine said yes
            assert not pending.done()
        finally:
            files.load_gate.unlink()
        r = pending.result(timeout=60)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'b' added successfully.", r.text
    assert text_of(served, "b") == offline["b"]
    cards = {c["id"]: c for c in served.get("/v1/models", headers=AUTH).json()["data"]}
    assert list(cards) == ["base", "a", "b"] and cards["b"]["root"] == str(files.runtime / "b")


def test_unload_while_requests_hold_the_adapter_loses_none(served, files, offline):
    """Requests queued in the engine with b2 (its steps held by a planted gate, so they are there for
    sure) when b2 is unloaded all finish with b2's tokens; new requests for b2 get a 404. The held
    requests show in vllm:lora_requests_info as waiting."""
    assert load(served, "b2", "b").status_code == 200  # the same weights as b, under another name
    files.step_gate.touch()
    body = {"model": "b2", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    with cf.ThreadPoolExecutor(4) as pool:
        try:
            streams = [pool.submit(stream_text, served, "/v1/completions", body) for _ in range(2)]
            plain = [pool.submit(complete, served, "b2") for _ in range(2)]
            wait_for(lambda: any(s["waiting_lora_adapters"] == "b2" and s["max_lora"] == "2"
                                 for s in lora_info(served)))
            wait_for(lambda: served.metric("strata_num_requests_waiting", AUTH) == 4)
            r = unload(served, "b2")
            assert r.status_code == 200 and r.text == "Success: LoRA adapter 'b2' removed successfully."
            r = complete(served, "b2")
            assert r.status_code == 404 and error_of(r)["code"] == "model_not_found"
            assert not any(f.done() for f in streams + plain)
        finally:
            files.step_gate.unlink()
        for f in streams:
            assert f.result(timeout=60) == (offline["b"], "b2")
        for f in plain:
            r = f.result(timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == offline["b"], r.text
    assert "b2" not in [c["id"] for c in served.get("/v1/models", headers=AUTH).json()["data"]]
    wait_for(lambda: {s["waiting_lora_adapters"] for s in lora_info(served)} == {""})


def test_unload_then_load_again_serves_the_new_weights(served, files, offline):
    """What replaces vLLM's load_inplace (refused by name): unload, then load under the same name."""
    assert load(served, "swap", "b").status_code == 200
    assert text_of(served, "swap") == offline["b"]
    r = load(served, "swap", "a_copy", load_inplace=True)
    assert r.status_code == 400 and error_of(r)["param"] == "load_inplace", r.text
    assert unload(served, "swap").status_code == 200
    assert load(served, "swap", "a_copy").status_code == 200
    assert text_of(served, "swap") == offline["a"]
    assert served.get("/v1/models/swap", headers=AUTH).json()["root"] == str(files.runtime / "a_copy")
    assert unload(served, "swap").status_code == 200


def test_per_adapter_metrics(served):
    """strata_lora_* counters per adapter (lora_name beside model_name), parsed as a scraper does."""
    before = _lora_counts(served)
    assert complete(served, "a").status_code == 200
    after = _lora_counts(served)
    assert after[("strata_lora_requests_total", "a")] == before.get(("strata_lora_requests_total", "a"), 0) + 1
    assert (after[("strata_lora_generation_tokens_total", "a")]
            == before.get(("strata_lora_generation_tokens_total", "a"), 0) + MAX_TOKENS)
    assert (after[("strata_lora_prompt_tokens_total", "a")]
            == before.get(("strata_lora_prompt_tokens_total", "a"), 0) + len(PROMPT))
    assert after[("strata_lora_generation_tokens_total", "b2")] == 4 * MAX_TOKENS  # the unload test's requests
    assert not any(name == "base" for _, name in after)  # the base is not an adapter
    text = served.get("/metrics", headers=AUTH).text
    assert 'strata_requests_total{endpoint="/v1/load_lora_adapter",model_name="base",status="200"}' in text


def _lora_counts(s) -> dict[tuple[str, str], float]:
    out = {}
    for fam in text_string_to_metric_families(s.get("/metrics", headers=AUTH).text):
        for smp in fam.samples:
            if smp.name.startswith("strata_lora_"):
                assert smp.labels["model_name"] == "base"
                out[(smp.name, smp.labels["lora_name"])] = smp.value
    return out


def test_a_restarted_engine_gets_every_adapter_back(served, offline):
    """Last: SIGKILL the engine process; after the supervisor's restart the adapters given at start
    and loaded at run time serve the same tokens."""
    engine = child(served.proc, "engine_proc")
    engine.send_signal(signal.SIGKILL)
    assert wait_status(served, "/ready", lambda c: c == 503, timeout=10) == 503
    assert wait_status(served, "/ready", lambda c: c == 200, timeout=120) == 200
    assert child(served.proc, "engine_proc").pid != engine.pid
    assert [c["id"] for c in served.get("/v1/models", headers=AUTH).json()["data"]] == ["base", "a", "b"]
    assert text_of(served, "a") == offline["a"]
    assert text_of(served, "b") == offline["b"]
    assert text_of(served, "base") == offline["base"]
