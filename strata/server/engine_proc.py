"""The engine's busy loop, in its own process: `python -m strata.server.engine_proc`.

It receives requests as token ids from the front end, steps the engine whenever there is work,
and sends back the new token ids of every sequence it advanced (no text: detokenisation happens
in the front end, off this loop). Requests, outputs and statistics are msgpack over ZeroMQ.
It exits when the front end dies (procs.die_with_parent); the front end restarts it when it dies.

LoRA adapters: a request's "add" message may name one (a LoRARequest's fields); "load_lora" and
"unload_lora" are calls answered with a "reply" carrying their token. An adapter is read on the
engine's worker thread (LLMEngine.add_lora(wait=False)) and the loop keeps stepping; the reply goes
out once the read is done.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import time
import traceback

import zmq

from strata.engine.parallel import RankDied
from strata.errors import RequestError
from strata.logs import setup_logging
from strata.protocol.lora import LoRARequest
from strata.protocol.wire import decode, encode, params_from_dict
from strata.server import faults, procs

logger = logging.getLogger("strata.server.engine")

IDLE_POLL_MS = 100  # how long an idle loop waits for a message before sending fresh stats
LOAD_POLL_MS = 5  # the same while an adapter is being read


class EngineLoop:
    def __init__(self, engine, pull: zmq.Socket, push: zmq.Socket) -> None:
        self.engine = engine
        self.pull, self.push = pull, push
        self.sent: dict[tuple[str, int], int] = {}  # (request, completion index) -> tokens sent
        self.running = True
        self.failed = False  # the engine cannot go on (a tensor-parallel rank died)
        self._last_stats = 0.0
        self.loads: list[tuple[int, LoRARequest, object]] = []  # (call token, adapter, its read or None)

    # --- inbound ---------------------------------------------------------------------------
    def handle(self, msg: dict, errors: list) -> None:
        op = msg.get("op")
        eng = self.engine
        if op == "add":
            rid = msg["id"]
            try:
                params = params_from_dict(msg["params"])
                lora = self._lora_of(msg.get("lora"))
                eng.validate(0, msg["prompt_ids"], params, lora)
                eng.add_request(rid, None, msg["prompt_ids"], params, lora)
            except Exception as e:  # a bad request fails alone
                logger.warning("request %s rejected: %s", rid, e)
                errors.append({"id": rid, "message": str(e), "status": 400})
        elif op in ("load_lora", "unload_lora"):
            try:
                if op == "load_lora":
                    lora = LoRARequest(**msg["lora"])
                    self.loads.append((msg["token"], lora, None))
                    self.poll_loads()
                else:
                    self.reply(msg["token"], result=eng.remove_lora(msg["id"]))
            except RequestError as e:  # every call gets its reply, or the front end would wait for it
                self.reply(msg["token"], error=str(e))
            except Exception:
                logger.error("%s failed:\n%s", op, traceback.format_exc())
                self.reply(msg["token"], error=f"internal error in {op} (see the server log)", status=500)
        elif op == "abort":
            for rid in msg["ids"]:
                eng.abort(rid)
                self._forget(rid)
        elif op == "finish_seq":
            eng.finish_sequence(msg["id"], msg["index"], "stop", msg.get("stop"))
        elif op == "shutdown":
            self.running = False
        else:
            logger.error("unknown message op %r ignored", op)

    def _lora_of(self, wire: dict | None) -> LoRARequest | None:
        """The request's adapter, which must be one the engine holds: validate would read an
        unknown one, and the server routes only to loaded adapters (an unload may have raced)."""
        if wire is None:
            return None
        lora = LoRARequest(**wire)
        if lora not in self.engine.list_loras():
            raise RequestError(f"LoRA adapter {lora.lora_name!r} is not loaded in the engine (it was unloaded); "
                               "GET /v1/models lists the served names")
        return lora

    def reply(self, token: int, result=None, error: str | None = None, status: int = 400) -> None:
        self.push.send(encode({"op": "reply", "token": token, "result": result, "error": error, "status": status}))

    def poll_loads(self) -> None:
        """Start the adapter reads that are due, answer the ones that finished."""
        left = []
        for token, lora, fut in self.loads:
            try:
                if fut is None:
                    if faults.lora_load_held():
                        left.append((token, lora, None))
                        continue
                    fut = self.engine.add_lora(lora, wait=False)
                if not fut.done():
                    left.append((token, lora, fut))
                    continue
                fut.result()
            except RequestError as e:  # LoRAError: the adapter's problem, named
                logger.warning("LoRA adapter %s not loaded: %s", lora.lora_name, e)
                self.reply(token, error=str(e))
            except Exception:
                logger.error("reading LoRA adapter %s failed:\n%s", lora.lora_name, traceback.format_exc())
                self.reply(token, error=f"internal error while reading LoRA adapter {lora.lora_name} (see the "
                           "server log)", status=500)
            else:
                self.reply(token)
        self.loads = left

    def _forget(self, rid: str) -> None:
        for key in [k for k in self.sent if k[0] == rid]:
            del self.sent[key]

    def drain_inbox(self, timeout_ms: int, errors: list) -> None:
        if not self.pull.poll(timeout_ms):
            return
        while True:
            try:
                data = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self.handle(decode(data), errors)
            except Exception:
                logger.error("bad message from the front end:\n%s", traceback.format_exc())

    # --- outbound --------------------------------------------------------------------------
    def deltas(self, outputs) -> tuple[list, list]:
        deltas, done = [], []
        for out in outputs:
            for c in out.outputs:
                key = (out.request_id, c.index)
                start = self.sent.get(key, 0)
                new = c.token_ids[start:]
                if not new and c.finish_reason is None:
                    continue
                self.sent[key] = len(c.token_ids)
                lps = None
                if c.logprobs is not None:
                    lps = [[[t, lp] for t, lp in d.items()] for d in c.logprobs[start:]]
                delta = {
                    "id": out.request_id, "index": c.index, "tokens": new, "logprobs": lps,
                    "finish": c.finish_reason,
                    "stop_reason": c.stop_reason if isinstance(c.stop_reason, int | str) else None,
                }
                if start == 0 and out.prompt_logprobs is not None:  # with the first delta of each choice
                    delta["prompt_logprobs"] = [None if d is None else [[t, lp] for t, lp in d.items()]
                                                for d in out.prompt_logprobs]
                deltas.append(delta)
            if out.finished:
                self._forget(out.request_id)
                req_tl = {"arrival": out.arrival_time, "first_scheduled": out.first_scheduled_time,
                          "first_token": out.first_token_time, "finished": out.finished_time}
                done.append({"id": out.request_id, "timeline": req_tl, "preemptions": out.num_preemptions})
        return deltas, done

    def stats(self) -> dict:
        return dataclasses.asdict(self.engine.stats())  # protocol/stats.EngineStats, as a msgpack map

    def run(self) -> None:
        eng = self.engine
        while self.running:
            errors: list = []
            idle_ms = LOAD_POLL_MS if self.loads else IDLE_POLL_MS  # a load's reply goes out soon after its read
            held = faults.engine_step_held()
            self.drain_inbox(LOAD_POLL_MS if held else 0 if eng.has_unfinished() else idle_ms, errors)
            if self.loads:
                self.poll_loads()
            outputs = []
            if eng.has_unfinished() and not faults.engine_step_held():  # looked at again: it may be new
                try:
                    outputs = eng.step()
                except RankDied as e:  # tensor parallelism lost a rank: this engine is done
                    logger.error("%s; exiting, so that the server restarts the engine", e)
                    self.failed, self.running = True, False
                    break
                except Exception:
                    errors += self._fail_batch(traceback.format_exc())
            deltas, done = self.deltas(outputs)
            now = time.monotonic()
            if deltas or done or errors or now - self._last_stats > 1.0:
                self._last_stats = now
                self.push.send(encode({"op": "step", "deltas": deltas, "done": done,
                                       "errors": errors, "stats": self.stats()}))

    def _fail_batch(self, tb: str) -> list:
        """A step raised: fail the requests it was running (500), keep serving the rest."""
        logger.error("engine step failed; failing its running requests:\n%s", tb)
        eng = self.engine
        ids = sorted({s.request.request_id for s in eng.scheduler.running})
        for rid in ids:
            eng.abort(rid)
            self._forget(rid)
        return [{"id": rid, "message": "internal error while running this request (see server log)",
                 "status": 500} for rid in ids]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--inbox", required=True, help="ZeroMQ address to receive requests from")
    ap.add_argument("--outbox", required=True, help="ZeroMQ address to send outputs to")
    ap.add_argument("--config", required=True, help="EngineConfig fields as JSON")
    ap.add_argument("--cpus", default=None, help="comma-separated CPU ids to run on")
    ap.add_argument("--log-level", default="INFO")
    ap.add_argument("--start-number", type=int, default=0, help="0 for the first start, k for the k-th restart")
    args = ap.parse_args(argv)
    procs.die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when to stop (drain)
    setup_logging(args.log_level)
    if faults.engine_should_exit(args.start_number):
        logger.warning("planted fault: engine start %d exits before loading (STRATA_TEST_FAULTS)", args.start_number)
        return 3
    if faults.engine_start_delay():
        time.sleep(faults.engine_start_delay())
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(args.inbox)
    push = ctx.socket(zmq.PUSH)
    push.connect(args.outbox)
    try:
        # reason (both): inside the try, so a failed import is reported to the front end as a failed start
        from strata.config import EngineConfig
        from strata.engine.llm_engine import LLMEngine

        # serving: the platform's policy tunes the prefill cap from the steps after the warm-up's
        engine = LLMEngine(EngineConfig(**json.loads(args.config)), detokenize=False, workload="serving")
        warm = engine.warm_up()
    except Exception as e:
        logger.error("engine failed to start:\n%s", traceback.format_exc())
        push.send(encode({"op": "fatal", "message": f"{type(e).__name__}: {e}"}))
        push.close(linger=2000)
        return 1
    cfg = engine.model_config
    info = {
        "model_path": str(engine.model_path), "architecture": cfg.architecture, "dtype": str(engine.dtype),
        "quantization": engine.config.quantization,  # bf16 here when dtype auto chose bf16 weights
        "max_model_len": engine.max_model_len, "vocab_size": cfg.vocab_size,
        "eos_token_ids": engine.eos_token_ids, "generation_defaults": engine.generation_defaults,
        "num_blocks": engine.plan.num_blocks, "block_size": engine.config.block_size,
        "kv_cache_bytes": engine.plan.kv_cache_bytes,
        "threads": engine.threads, "warmup_seconds": warm,
    }
    logger.info("engine ready (warm-up %.2fs)", warm)
    push.send(encode({"op": "ready", "info": info}))
    loop = EngineLoop(engine, pull, push)
    try:
        loop.run()
    except KeyboardInterrupt:
        pass
    finally:
        engine.close()  # with tensor parallelism: the other ranks stop too
    push.close(linger=1000)
    pull.close(linger=0)
    ctx.term()
    return 1 if loop.failed else 0


if __name__ == "__main__":
    sys.exit(main())
