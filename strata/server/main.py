"""`strata serve`: start the engine process and tokenizer workers, serve HTTP, drain on SIGTERM.

Start-up binds the HTTP port first (a port in use is one line, exit 2, before any child exists;
uvicorn gets the bound socket, so the port cannot be lost later), removes the IPC directories of
dead servers, then starts the children. While serving, the engine and the tokenizer workers are
supervised (engine_client.py and tokenizer_pool.py say how): a dead child is restarted within a
budget, and when the budget is spent the server logs one line and exits 1. Signals: SIGTERM drains
and exits 0; SIGINT (Ctrl-C) does the same and exits 130; a second signal skips the drain. During
start-up either signal stops the children at once. Every path stops the children and removes the
IPC directory; the children also die on their own if this process is killed (procs.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import time
from pathlib import Path

import uvicorn

from strata import cli_options
from strata.config import EngineConfig
from strata.demo.model import demo_model_path
from strata.engine.args import EngineArgs
from strata.errors import ConfigError, StrataError
from strata.hardware.cores import server_layout
from strata.protocol.lora import LoRAError
from strata.protocol.tokenizer import Tokenizer
from strata.protocol.tokenizer_dir import tokenizer_dir
from strata.server import faults, procs, routes_ops
from strata.server.app import ServerOptions, ServerState, build_app
from strata.server.engine_client import EngineClient
from strata.server.lora import LoRARegistry, check_adapter_files, parse_lora_modules
from strata.server.metrics import Metrics
from strata.server.tokenizer_pool import InLoopTokenizer, TokenizerPool
from strata.settings import SETTINGS
from strata.text_table import fmt_bytes

logger = logging.getLogger("strata.server")

SERVE_EXAMPLES = """examples:
  strata serve                                        # the demo model on http://127.0.0.1:8000
  strata serve --model ./Qwen2-0.5B --served-model-name qwen --api-key secret
  strata serve Qwen/Qwen2.5-0.5B-Instruct             # from the HF cache, else downloaded
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0}'
  strata serve ./base --enable-lora --lora-modules sonnets=./adapters/sonnets   # "model": "sonnets" picks it
  strata serve ./base --enable-lora --enable-lora-updates --lora-dir ./adapters --api-key secret
"""

# the `strata serve` command (strata/cli/registry.py lists it)
NAME = "serve"
HELP = "OpenAI-compatible HTTP server"
EPILOG = SERVE_EXAMPLES


def add_arguments(p: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(p)
    EngineArgs.add_model_positional(p)  # `strata serve MODEL`, as `vllm serve MODEL`
    add_serve_args(p)
    cli_options.enable_config(p)
    cli_options.enable_env(p)  # STRATA_<FLAG> for every serve flag


def run(args: argparse.Namespace) -> int:
    return cmd_serve(args)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    g.add_argument("--port", type=int, default=8000, help="TCP port to listen on (0 = any free port)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model ids clients may use, as vLLM takes them: the first is the one responses carry "
                   "(default: the model dir's name)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set STRATA_API_KEY)")
    g.add_argument("--tokenizer-workers", type=int, default=None,
                   help="tokenizer processes; 0 = tokenise in the event loop (default: from spare cores, >= 1)")
    g.add_argument("--max-request-bytes", default="1MiB", help="largest request body (default: 1MiB)")
    g.add_argument("--max-queue", type=int, default=256,
                   help="requests allowed to wait for a first token before new ones get 429 (default: 256)")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM/SIGINT (default: 30)")
    g.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for the model to load")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="no access log line per request (method, path, status, latency, tokens, request id)")
    g = p.add_argument_group("LoRA adapters (with --enable-lora)")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="adapters to serve from the start, each NAME=PATH (a PEFT adapter directory) or vLLM's "
                   "JSON form '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; a request picks one by "
                   "sending its NAME as `model` (put MODEL before this flag: it takes every word after it)")
    g.add_argument("--enable-lora-updates", action="store_true",
                   help="answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes; vLLM's "
                   "switch is VLLM_ALLOW_RUNTIME_LORA_UPDATING); needs --lora-dir; behind --api-key when set")
    g.add_argument("--lora-dir", default=None, metavar="DIR",
                   help="the only directory runtime loading reads adapters from: a lora_path that resolves "
                   "outside it (symlinks followed) is refused; a relative lora_path is taken inside it")


GIVE_UP_GRACE = 1.0  # seconds /health answers 503 after the server gave up, before it exits


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: shutdown is ours (drain first)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class _BindError(logging.Filter):
    """Keeps the OSError uvicorn logs (then exits) when it cannot bind: we report it in one line."""

    def __init__(self) -> None:
        super().__init__()
        self.error: OSError | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, OSError):
            self.error = record.msg
            return False
        return True


def cmd_serve(args: argparse.Namespace) -> int:
    engine_args = EngineArgs.from_cli_args(args)
    model = engine_args.model_path()
    kwargs = {"model": model, **engine_args.config_kwargs()}
    EngineConfig(**kwargs)  # validate every flag here, before starting any process
    opts = ServerOptions(
        served_model_name=(args.served_model_name or [""])[0], aliases=tuple(args.served_model_name or ())[1:],
        log_requests=not args.disable_log_requests,
        api_key=args.api_key or SETTINGS.api_key,
        max_request_bytes=args.max_request_bytes, max_queue=args.max_queue, drain_timeout=args.drain_timeout,
        tokenizer_workers=args.tokenizer_workers, startup_timeout=args.startup_timeout,
    )
    layout = server_layout(args.tokenizer_workers, args.num_threads)
    kwargs["num_threads"] = layout.compute_threads
    if model is None:
        model_path = str(demo_model_path())
    else:
        model_path = str(model)
    if kwargs.get("tokenizer"):  # --tokenizer DIR: the front end's and the workers' tokenizer too
        vocab = json.loads(Path(model_path, "config.json").read_text())["vocab_size"]
        model_path_for_text = str(tokenizer_dir(Path(model_path), kwargs["tokenizer"], vocab))
    else:
        model_path_for_text = model_path
    if not os.path.isfile(os.path.join(model_path_for_text, "tokenizer.json")):
        raise StrataError(f"{model_path} has no tokenizer.json; the server needs one to read and write text "
                          "(copy the model's tokenizer files into that directory, or pass --tokenizer DIR)")
    opts.served_model_name = (opts.served_model_name or args.random_model or engine_args.hub_id()
                              or os.path.basename(os.path.normpath(model_path)))
    loras = lora_registry(args, engine_args, opts.model_names)
    sock = None if faults.skip_port_check() else procs.listen_socket(args.host, args.port)
    ipc = None
    try:
        for d in procs.IpcDir.clean_stale():
            logger.info("removed %s (its server is gone)", d)
        ipc = procs.IpcDir()
        logger.info("layout: %s", layout.describe())
        return asyncio.run(_serve(args, kwargs, model_path, opts, layout, sock, ipc, model_path_for_text, loras))
    finally:
        if sock is not None:
            sock.close()
        if ipc is not None:
            ipc.cleanup()


async def _http(server: _Server, sock: socket.socket | None, host: str, port: int) -> None:
    """uvicorn, with its exit on a failed bind (SystemExit) turned into our one-line error."""
    bind = _BindError()
    uv_log = logging.getLogger("uvicorn.error")
    uv_log.addFilter(bind)
    try:
        await server.serve(sockets=[sock] if sock is not None else None)
    except SystemExit:
        if bind.error is not None:
            raise procs.port_error(host, port, bind.error) from None
        raise StrataError("the HTTP server failed to start (see the log above)") from None
    finally:
        uv_log.removeFilter(bind)


async def _first(**aws) -> str:
    """Wait for the first of the named awaitables to finish; cancel the others (not tasks given in)."""
    futs = {name: asyncio.ensure_future(a) for name, a in aws.items()}
    done, _ = await asyncio.wait(futs.values(), return_when=asyncio.FIRST_COMPLETED)
    first = next(name for name, f in futs.items() if f in done)
    for name, f in futs.items():
        if name != first and f is not aws[name]:
            f.cancel()
            with contextlib.suppress(BaseException):
                await f
    return first


async def _serve(args, kwargs: dict, model_path: str, opts: ServerOptions, layout, sock, ipc: procs.IpcDir,
                 tokenizer_path: str, loras: LoRARegistry) -> int:

    loop = asyncio.get_running_loop()
    stop, force, signals = asyncio.Event(), asyncio.Event(), []

    def on_signal(sig: int) -> None:
        signals.append(sig)
        (force if stop.is_set() else stop).set()  # a second signal skips the drain

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    state = ServerState(options=opts, metrics=Metrics(opts.served_model_name), loras=loras)
    state.tokenizer = Tokenizer.from_dir(tokenizer_path, chat_template=kwargs.get("chat_template"))
    app = build_app(state)
    routes_ops.install(app, state)
    gpus = gpu_device_checks(kwargs, state.metrics)  # before the engine starts: kernel image, PCIe link
    # log_config=None: uvicorn's lines go through our handler (timestamps, levels); its access log is
    # off because app.Guard writes one line per request with tokens and the request id
    server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", log_config=None,
                                    access_log=False, lifespan="off", timeout_keep_alive=5))
    http = asyncio.create_task(_http(server, sock, args.host, args.port))  # /health answers while loading
    watchers: list[asyncio.Task] = []
    starts: list[asyncio.Task] = []
    startup = None
    code = 0
    try:
        t0 = time.perf_counter()
        state.engine = EngineClient(kwargs, ipc, layout.compute_cpus, loras=loras, call_timeout=opts.startup_timeout)
        state.engine.on_stats = state.metrics.on_engine_stats
        state.engine.on_done = state.metrics.on_engine_done
        if layout.tokenizer_workers > 0:
            state.tokenizers = TokenizerPool(tokenizer_path, layout.tokenizer_workers, ipc, layout.tokenizer_cpus,
                                             chat_template=kwargs.get("chat_template"))
        else:
            state.tokenizers = InLoopTokenizer(state.tokenizer)
        starts = [asyncio.create_task(state.engine.start(opts.startup_timeout)),
                  asyncio.create_task(state.tokenizers.start(opts.startup_timeout))]
        startup = asyncio.gather(*starts)
        first = await _first(stop=stop.wait(), http=http, work=startup)
        if first == "http":
            http.result()  # raises why it stopped (port lost)
            raise StrataError("the HTTP server stopped during start-up")
        if first == "stop":
            logger.warning("%s during start-up: stopping", signal.Signals(signals[0]).name)
            return _signal_code(signals)
        startup.result()
        state.info = state.engine.info
        gpu_tf32_checks(gpus, state.info, state.metrics)
        state.ready = True
        port = sock.getsockname()[1] if sock is not None else args.port  # the real one for --port 0
        for line in startup_summary(state.info, kwargs, opts, layout, model_path) + lora_summary(loras, kwargs):
            logger.info("%s", line)
        logger.info("serving on http://%s:%d (ready in %.1fs)", args.host, port, time.perf_counter() - t0)
        watchers.append(asyncio.create_task(state.engine.supervise(opts.startup_timeout)))
        if isinstance(state.tokenizers, TokenizerPool):
            watchers.append(asyncio.create_task(state.tokenizers.supervise()))
        gave_up = asyncio.wait(watchers, return_when=asyncio.FIRST_COMPLETED)
        first = await _first(stop=stop.wait(), http=http, gave_up=gave_up)
        if first == "stop":
            for w in watchers:  # no restarts while shutting down
                w.cancel()
            await _drain(state, force)
            return _signal_code(signals)
        if first == "http":
            http.result()
            raise StrataError("the HTTP server stopped unexpectedly")
        w = next(w for w in watchers if w.done())
        why = w.result() if w.exception() is None else f"supervision failed: {w.exception()!r}"
        state.failed = why  # /health and /ready answer 503 from now on
        logger.error("%s: exiting with code 1 so that a supervisor restarts the server", why)
        state.engine.abort_all(f"server shutting down: {why}")
        await asyncio.sleep(GIVE_UP_GRACE)  # let probes see the 503 and aborted requests get their answer
        code = 1
    except StrataError as e:
        if http.done() and not http.cancelled() and http.exception() is e:
            raise  # the port: one line from the CLI, as when it is in use at start
        logger.error("%s", e)
        code = 1
    finally:
        state.draining = True
        server.should_exit = True
        if startup is not None:
            startup.cancel()  # cancels the start tasks too
            with contextlib.suppress(BaseException):
                await startup  # retrieved: nothing logged about it at exit
        for t in starts + watchers:
            t.cancel()
            with contextlib.suppress(BaseException):
                await t
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(http, 10)
        if state.engine is not None:
            await state.engine.close()
        if state.tokenizers is not None:
            state.tokenizers.close()
        ipc.cleanup()
    return code


def startup_summary(info: dict, kwargs: dict, opts: ServerOptions, layout, model_path: str) -> list[str]:
    """The start-up lines at INFO: model, dtype and why, KV budget, threads and placement."""
    names = ", ".join(map(repr, opts.model_names))
    quant = kwargs.get("quantization") or info.get("quantization")
    if kwargs.get("dtype", "auto") != "auto":
        why = f"--dtype {kwargs['dtype']}"
    else:
        why = "--dtype auto: the fastest measured on this device (strata hw; -v on generate shows the figures)"
    weights = f", weights {quant}" if quant else ""
    return [
        f"model {model_path} ({info.get('architecture', '?')}, max_model_len {info.get('max_model_len')}) "
        f"served as {names}",
        f"dtype {str(info.get('dtype', '?')).removeprefix('torch.')}{weights} ({why})",
        _kv_summary(info, kwargs),
        f"threads: {info.get('threads', '?')} compute; {layout.describe()}",
    ]


def lora_registry(args: argparse.Namespace, engine_args: EngineArgs, base_names: tuple[str, ...]) -> LoRARegistry:
    """The LoRA flags checked together (each refusal names the flag and the fix) and the adapters of
    --lora-modules registered, their files checked before any process starts."""
    given = [flag for flag, on in (
        ("--lora-modules", bool(args.lora_modules)), ("--lora-dir", args.lora_dir is not None),
        ("--enable-lora-updates", args.enable_lora_updates), ("--max-loras", "max_loras" in engine_args.overrides),
        ("--max-lora-rank", "max_lora_rank" in engine_args.overrides),
        ("--max-cpu-loras", "max_cpu_loras" in engine_args.overrides)) if on]
    if not engine_args.get("enable_lora"):
        if given:
            raise ConfigError(f"{given[0]} needs --enable-lora (LoRA adapters are off without it)")
        return LoRARegistry()
    if args.enable_lora_updates and args.lora_dir is None:
        raise ConfigError("--enable-lora-updates needs --lora-dir DIR: runtime loading reads adapters from inside "
                          "that directory only")
    if args.lora_dir is not None:
        if not args.enable_lora_updates:
            raise ConfigError("--lora-dir is where runtime loading reads adapters from; it needs "
                              "--enable-lora-updates (adapters given at start are named by --lora-modules)")
        if not os.path.isdir(args.lora_dir):
            raise ConfigError(f"--lora-dir {args.lora_dir}: not a directory")
    reg = LoRARegistry(enabled=True, updates=args.enable_lora_updates,
                       lora_dir=os.path.realpath(args.lora_dir) if args.lora_dir else None)
    for name, path, base in parse_lora_modules(args.lora_modules):
        if name in base_names:
            raise ConfigError(f"--lora-modules: {name!r} is the base model's served name; give the adapter another")
        try:
            lora = reg.new(name, os.path.abspath(os.path.expanduser(path)), base)
            check_adapter_files(lora)
        except LoRAError as e:
            raise ConfigError(f"--lora-modules: {e}") from None
        reg.add(lora)
    return reg


def lora_summary(loras: LoRARegistry, kwargs: dict) -> list[str]:
    """The start-up line about adapters, when LoRA is on."""
    if not loras.enabled:
        return []
    names = ", ".join(f"{lr.lora_name} ({lr.path})" for lr in loras.adapters.values()) or "none yet"
    runtime = f"; runtime loading from {loras.lora_dir}" if loras.updates else ""
    return [f"LoRA adapters: {names}; max_loras {kwargs.get('max_loras', 1)}, max_lora_rank "
            f"{kwargs.get('max_lora_rank', 16)}{runtime}"]


def gpu_device_checks(kwargs: dict, metrics: Metrics) -> list:
    """On CUDA only: the start-up checks that need no model (hardware/startup_checks.py), logged as
    warnings with the fix and exported as gauges; returns the GPUs' facts for the TF32 check."""
    if not str(kwargs.get("device") or "cpu").startswith("cuda"):
        return []  # (before importing torch: a CPU server's front end runs without it)
    import torch  # reason: only a CUDA server's front end loads torch, for these checks

    if not torch.cuda.is_available():
        return []
    from strata.hardware import startup_checks  # reason: imports torch; CUDA servers only

    try:
        facts = startup_checks.gather_facts()
    except Exception as e:  # a check must never stop the server
        logger.warning("GPU start-up checks skipped: cannot read the GPUs' facts (%s)", e)
        return []
    checks = startup_checks.device_checks(facts, list(torch.cuda.get_arch_list()))
    startup_checks.report(checks)
    metrics.gpu_checks(checks)
    return facts


def gpu_tf32_checks(facts: list, info: dict, metrics: Metrics) -> None:
    """Once the engine reported the dtype it runs: does an fp32 model use TF32."""
    if facts:
        from strata.hardware import startup_checks  # reason: imports torch; CUDA servers only

        checks = startup_checks.tf32_checks(facts, str(info.get("dtype", "")))
        startup_checks.report(checks)
        metrics.gpu_checks(checks)


def _kv_summary(info: dict, kwargs: dict) -> str:
    """The KV reservation and how it was sized, for the start-up line."""
    tokens = info.get("num_blocks", 0) * info.get("block_size", 0)
    how = ("--kv-cache-memory" if kwargs.get("kv_cache_memory") is not None
           else "max_num_seqs x max_model_len, capped at --memory-fraction of available memory")
    size = fmt_bytes(info["kv_cache_bytes"]) if "kv_cache_bytes" in info else "?"
    return f"KV cache {size} = {tokens} tokens, sized from {how}; resident only as used"


def _signal_code(signals: list[int]) -> int:
    """Exit status after a requested stop: 130 for SIGINT (Ctrl-C, as the shell reports), 0 for SIGTERM."""
    return 130 if signals and signals[0] == signal.SIGINT else 0


async def _drain(state: ServerState, force: asyncio.Event) -> None:
    """Refuse new work (503), let in-flight requests finish for up to drain_timeout, abort the rest."""
    state.draining = True
    deadline = time.monotonic() + state.options.drain_timeout
    logger.warning("draining: %d requests in flight, up to %.0fs", len(state.in_flight), state.options.drain_timeout)
    while (state.in_flight or state.waiting) and time.monotonic() < deadline and not force.is_set():
        await asyncio.sleep(0.05)
    if state.in_flight or state.waiting:
        n = state.engine.abort_all("server shut down before this request finished (drain timeout)")
        logger.warning("drain %s: aborted %d requests", "cut short" if force.is_set() else "timeout", n)
        for _ in range(100):  # let their responses go out
            if not state.in_flight:
                break
            await asyncio.sleep(0.05)
    logger.warning("drained; exiting")
