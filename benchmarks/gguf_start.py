"""Start to first token and peak RSS of Strata and llama-server on one GGUF file.

usage: python benchmarks/gguf_start.py FILE.gguf --llama-server PATH [--runs 2]

Strata: `strata generate --model FILE --max-tokens 1` as a fresh process (imports, load,
prefill, one token); llama-server: started, /health polled, one /completion of one token. Each
is timed from process start to the first token and its peak RSS read from wait4's rusage
(getrusage of the child: ru_maxrss). Prints one line per run and the file size beside.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PORT = 18090
PROMPT = "Hello there, how are you"


def _wait_rss(proc: subprocess.Popen) -> int:
    _, _, usage = os.wait4(proc.pid, 0)
    proc.returncode = 0
    return usage.ru_maxrss * 1024


def strata_run(model: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "strata", "generate", "--model", model, "--prompt", PROMPT,
                             "--max-tokens", "1", "--max-model-len", "2048"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rss = _wait_rss(proc)
    return time.perf_counter() - t0, rss


def llama_run(model: str, server: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    proc = subprocess.Popen([server, "-m", model, "--port", str(PORT), "--host", "127.0.0.1", "-t", "2",
                             "-c", "2048", "-np", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None:
                    raise SystemExit(f"llama-server exited with {proc.returncode}") from None
                time.sleep(0.05)
        req = urllib.request.Request(f"http://127.0.0.1:{PORT}/completion",
                                     data=json.dumps({"prompt": PROMPT, "n_predict": 1}).encode(),
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=300).read()
        elapsed = time.perf_counter() - t0
    finally:
        proc.terminate()
    return elapsed, _wait_rss(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    size = Path(args.model).stat().st_size
    print(f"{Path(args.model).name}: {size / 1e9:.3f} GB")
    for name, run in (("strata", lambda: strata_run(args.model)), ("llama-server", lambda: llama_run(args.model, args.llama_server))):
        for k in range(args.runs):
            seconds, rss = run()
            print(f"{name:<13} run {k + 1}: start to first token {seconds:.2f} s, peak RSS {rss / 1e9:.2f} GB "
                  f"({rss / size:.2f}x the file)")


if __name__ == "__main__":
    main()
