"""A tokenizer worker process: `python -m strata.server.tokenizer_worker`.

Receives text or chat messages from the front end, returns token ids; msgpack over ZeroMQ. Several
run side by side so tokenising long prompts never stalls the HTTP event loop or the engine. Each is
a DEALER with its own identity on the pool's ROUTER socket, so the pool knows which jobs a worker
holds (and can hand them to another when it dies); it exits when the front end dies.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

import zmq

from strata.errors import StrataError
from strata.logs import setup_logging
from strata.protocol.tokenizer import Tokenizer
from strata.protocol.wire import decode, encode
from strata.server import faults, procs

logger = logging.getLogger("strata.server.tokenizer")


def tokenize(tokenizer, job: dict) -> list[int]:
    """The one tokenisation rule, shared by the workers and the in-loop fallback."""
    delay = faults.tokenize_delay()
    if delay:
        time.sleep(delay)
    if job["kind"] == "chat":
        text = tokenizer.apply_chat_template(job["messages"], add_generation_prompt=True, tools=job.get("tools"))
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(job["text"], add_special_tokens=job.get("add_special_tokens", True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True, help="directory with tokenizer.json")
    ap.add_argument("--address", required=True, help="ZeroMQ address of the pool's ROUTER socket")
    ap.add_argument("--identity", required=True, help="this worker's name on that socket")
    ap.add_argument("--cpus", default=None, help="comma-separated CPU ids to run on")
    ap.add_argument("--chat-template", default=None, help="the server's --chat-template (file or template)")
    args = ap.parse_args(argv)
    procs.die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when to stop
    setup_logging("info")
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one core per worker
    tokenizer = Tokenizer.from_dir(args.model, chat_template=args.chat_template)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, args.identity.encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(args.address)
    sock.send(encode({"job": -1, "hello": args.identity}))
    while True:
        job = decode(sock.recv())
        if faults.tokenizer_should_exit(job):
            logger.warning("planted fault: tokenizer worker %s exits (STRATA_TEST_FAULTS)", args.identity)
            os._exit(3)
        t0 = time.perf_counter()
        try:
            reply = {"job": job["job"], "ids": tokenize(tokenizer, job)}
        except StrataError as e:  # bad input (e.g. a template error) fails this job only
            reply = {"job": job["job"], "error": str(e)}
        except Exception as e:
            logger.exception("tokenizer job failed")
            reply = {"job": job["job"], "error": f"{type(e).__name__}: {e}", "internal": True}
        reply["seconds"] = time.perf_counter() - t0
        sock.send(encode(reply))


if __name__ == "__main__":
    sys.exit(main())
