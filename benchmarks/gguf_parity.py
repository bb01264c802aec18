"""Greedy tokens of Strata and llama-server on the same GGUF file: the match rate and where they part.

usage: python benchmarks/gguf_parity.py FILE.gguf --llama-server PATH [--prompts 20] [--tokens 64]
       [--text FILE --tokenizer DIR] [-- llama-server flags]
       python benchmarks/gguf_parity.py FILE.gguf --llama-server PATH --tokenize TEXT_FILE

--tokenize: no generation; every paragraph of TEXT_FILE encoded by the tokenizer Strata derives
from the GGUF's metadata and by llama-server's /tokenize (llama.cpp's own tokenizer, as
llama-tokenize runs it), with and without the BOS rule; prints the paragraphs equal and the first
that is not.

Prompts are token ids (random ids 300-4000, seeded), or with --text the first 300 characters of
every 7th paragraph of FILE, encoded by DIR's tokenizer.json; both engines get the same ids, 64
greedy tokens each (llama-server: top_k 1, no prompt cache, ignore_eos). Prints the number of
prompts equal over all tokens and the sorted first-divergence positions of the others. Why they
part: docs/design-notes.md "GGUF files".
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import time
import urllib.request
from pathlib import Path

PORT = 18089


def _prompts(args) -> list[list[int]]:
    if args.text:
        import tokenizers

        tok = tokenizers.Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json"))
        paras = [p for p in Path(args.text).read_text(encoding="utf-8").split("\n\n") if len(p) > 80]
        return [tok.encode(paras[(7 * i) % len(paras)][:300]).ids for i in range(args.prompts)]
    rng = random.Random(0)
    return [[rng.randrange(300, 4000) for _ in range(rng.randrange(4, 40))] for _ in range(args.prompts)]


def _llama_tokens(args, prompts: list[list[int]]) -> list[list[int]]:
    server = _server(args)
    try:
        out = []
        for ids in prompts:
            body = {"prompt": ids, "n_predict": args.tokens, "temperature": 0, "top_k": 1, "cache_prompt": False,
                    "return_tokens": True, "ignore_eos": True, "samplers": ["top_k"]}
            out.append(_post("/completion", body)["tokens"])
        return out
    finally:
        server.terminate()
        server.wait(10)


def _server(args):
    server = subprocess.Popen([args.llama_server, "-m", args.model, "--port", str(PORT), "--host", "127.0.0.1",
                               "-t", "2", "-c", "2048", "-np", "1", *args.server_args],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(120):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2)
            break
        except OSError:
            time.sleep(1)
    return server


def _post(path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=300))


def _tokenize(args) -> None:
    from strata.graph.hub import check_model_dir
    from strata.protocol.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(check_model_dir(args.model))
    paras = [p for p in Path(args.tokenize).read_text(encoding="utf-8").split("\n\n") if p.strip()]
    server = _server(args)
    try:
        for special in (False, True):
            same, first = 0, None
            for k, text in enumerate(paras):
                theirs = _post("/tokenize", {"content": text, "add_special": special})["tokens"]
                ours = tok.encode(text, add_special_tokens=special)
                if ours == theirs:
                    same += 1
                elif first is None:
                    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
                    first = f"paragraph {k}, token {at}: {ours[at:at + 3]} vs llama.cpp {theirs[at:at + 3]}"
            print(f"{Path(args.model).name} {'with' if special else 'without'} special tokens: {same}/{len(paras)} "
                  f"paragraphs of {Path(args.tokenize).name} encode as llama.cpp's" + (f"; first difference {first}" if first else ""))
    finally:
        server.terminate()
        server.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--text")
    ap.add_argument("--tokenizer")
    ap.add_argument("--tokenize", metavar="TEXT_FILE", help="compare tokenizations instead of generations")
    ap.add_argument("server_args", nargs="*")
    args = ap.parse_args()
    if args.tokenize:
        return _tokenize(args)
    if args.text and not args.tokenizer:
        ap.error("--text needs --tokenizer DIR (the directory holding tokenizer.json)")
    prompts = _prompts(args)
    ref = _llama_tokens(args, prompts)
    from strata import LLM, SamplingParams

    llm = LLM(model=args.model, max_model_len=max(map(len, prompts)) + args.tokens + 16, dtype="float32")
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], sp, use_tqdm=False)
    firsts = []
    for o, r in zip(outs, ref):
        got = list(o.outputs[0].token_ids)
        if got != r[: args.tokens]:
            firsts.append(next((i for i, (a, b) in enumerate(zip(got, r)) if a != b), min(len(got), len(r))))
    print(f"{Path(args.model).name}: {len(prompts) - len(firsts)}/{len(prompts)} prompts equal over {args.tokens} "
          f"tokens; first divergences at {sorted(firsts)}")


if __name__ == "__main__":
    main()
