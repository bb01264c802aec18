"""`strata serve`: start the engine process and tokenizer workers, serve HTTP, drain on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import time

import uvicorn

from strata.config import EngineConfig
from strata.engine.args import EngineArgs
from strata.errors import StrataError
from strata.server import procs
from strata.server.app import ServerOptions, ServerState, build_app
from strata.server.metrics import Metrics

logger = logging.getLogger("strata.server")

SERVE_EXAMPLES = """examples:
  strata serve                                        # the demo model on http://127.0.0.1:8000
  strata serve --model ./Qwen2-0.5B --served-model-name qwen --api-key secret
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0}'
"""


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None, help="model id clients use (default: the model dir's name)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set STRATA_API_KEY)")
    g.add_argument("--tokenizer-workers", type=int, default=None,
                   help="tokenizer processes; 0 = tokenise in the event loop (default: from spare cores, >= 1)")
    g.add_argument("--max-request-bytes", default="1MiB", help="largest request body (default: 1MiB)")
    g.add_argument("--max-queue", type=int, default=256,
                   help="requests allowed to wait for a first token before new ones get 429 (default: 256)")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM/SIGINT (default: 30)")
    g.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for the model to load")


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: shutdown is ours (drain first)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def cmd_serve(args: argparse.Namespace) -> int:
    from strata.hardware.placement import server_layout

    engine_args = EngineArgs.from_cli_args(args)
    model = engine_args.model_path()
    kwargs = {"model": model, **engine_args.config_kwargs()}
    EngineConfig(**kwargs)  # validate every flag here, before starting any process
    opts = ServerOptions(
        served_model_name=args.served_model_name or "", api_key=args.api_key or os.environ.get("STRATA_API_KEY") or None,
        max_request_bytes=args.max_request_bytes, max_queue=args.max_queue, drain_timeout=args.drain_timeout,
        tokenizer_workers=args.tokenizer_workers, startup_timeout=args.startup_timeout,
    )
    layout = server_layout(args.tokenizer_workers, args.num_threads)
    kwargs["num_threads"] = layout.compute_threads
    if model is None:
        from strata.demo.model import demo_model_path

        model_path = str(demo_model_path())
    else:
        model_path = str(model)
    if not os.path.isfile(os.path.join(model_path, "tokenizer.json")):
        raise StrataError(f"{model_path} has no tokenizer.json; the server needs one to read and write text "
                          "(copy the model's tokenizer files into that directory)")
    opts.served_model_name = (opts.served_model_name or args.random_model
                              or os.path.basename(os.path.normpath(model_path)))
    logger.info("layout: %s", layout.describe())
    return asyncio.run(_serve(args, kwargs, model_path, opts, layout))


async def _serve(args, kwargs: dict, model_path: str, opts: ServerOptions, layout) -> int:
    from strata.engine.tokenizer import Tokenizer
    from strata.server.engine_client import EngineClient
    from strata.server.tokenizer_pool import InLoopTokenizer, TokenizerPool

    state = ServerState(options=opts, metrics=Metrics())
    state.tokenizer = Tokenizer.from_dir(model_path)
    server = _Server(uvicorn.Config(build_app(state), host=args.host, port=args.port, log_level="warning",
                                    access_log=False, lifespan="off", timeout_keep_alive=5))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ipc = procs.IpcDir()
    http = asyncio.create_task(server.serve())  # /health answers while the model loads
    code = 0
    try:
        t0 = time.perf_counter()
        state.engine = EngineClient(kwargs, ipc, layout.compute_cpus)
        state.engine.on_stats = state.metrics.on_engine_stats
        state.engine.on_done = state.metrics.on_engine_done
        if layout.tokenizer_workers > 0:
            state.tokenizers = TokenizerPool(model_path, layout.tokenizer_workers, ipc, layout.tokenizer_cpus)
        else:
            state.tokenizers = InLoopTokenizer(state.tokenizer)
        await _until(stop, asyncio.gather(state.engine.start(opts.startup_timeout),
                                          state.tokenizers.start(opts.startup_timeout)))
        if not stop.is_set():
            state.info = state.engine.info
            state.ready = True
            logger.warning("serving %s as %r on http://%s:%d (ready in %.1fs; %s)", model_path,
                           opts.served_model_name, args.host, args.port, time.perf_counter() - t0, layout.describe())
            await stop.wait()
        await _drain(state)
    except StrataError as e:
        logger.error("%s", e)
        code = 1
    finally:
        state.draining = True
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(http, 10)
        if state.engine is not None:
            await state.engine.close()
        if state.tokenizers is not None:
            state.tokenizers.close()
        ipc.cleanup()
    return code


async def _until(stop: asyncio.Event, work) -> None:
    """Await `work` unless a stop signal comes first (then cancel it)."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return
    task.result()


async def _drain(state: ServerState) -> None:
    """Refuse new work (503), let in-flight requests finish for up to drain_timeout, abort the rest."""
    state.draining = True
    deadline = time.monotonic() + state.options.drain_timeout
    logger.warning("draining: %d requests in flight, up to %.0fs", len(state.in_flight), state.options.drain_timeout)
    while (state.in_flight or state.waiting) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if state.in_flight or state.waiting:
        n = state.engine.abort_all("server shut down before this request finished (drain timeout)")
        logger.warning("drain timeout: aborted %d requests", n)
        for _ in range(100):  # let their responses go out
            if not state.in_flight:
                break
            await asyncio.sleep(0.05)
    logger.warning("drained; exiting")
