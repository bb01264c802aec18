"""`strata generate`: one prompt streamed to the terminal, or a JSONL file of prompts in a batch."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from strata import cli_options
from strata.demo.model import DEMO_SUMMARY
from strata.engine.args import EngineArgs
from strata.engine.llm import LLM
from strata.errors import StrataError
from strata.graph.fusion import PATTERNS, expected_counts
from strata.protocol.lora import LoRARequest
from strata.protocol.sampling_params import SamplingParams

NAME = "generate"
HELP = "generate text"

EPILOG = """examples:
  strata generate --prompt "Once upon a time"            # demo model, streams to the terminal
  strata generate --model ./Llama-3.2-1B --prompt "Hi" --temperature 0.7 --top-p 0.9 --seed 1
  strata generate --model ./qwen --input prompts.jsonl --output results.jsonl --max-tokens 128
    (prompts.jsonl: one JSON object per line with "prompt" (text) or "prompt_token_ids",
     optionally per-request sampling fields such as "max_tokens" or "temperature")
  strata generate --prompt "Shall I compare thee" --lora strata/demo/lora/sonnets   # with a LoRA adapter
"""


def add_arguments(g: argparse.ArgumentParser) -> None:
    g.add_argument("--prompt", default=None, help="one prompt; tokens stream to the terminal")
    g.add_argument("--input", default=None, help="JSONL file of prompts (batch mode, progress bar)")
    g.add_argument("--output", default=None, help="JSONL results file for --input (default: stdout)")
    g.add_argument("--lora", default=None, metavar="DIR",
                   help="generate with this PEFT LoRA adapter (a directory with adapter_config.json and "
                   "adapter_model.safetensors; implies --enable-lora)")
    g.add_argument("--print-fusions", action="store_true",
                   help="print how many of each FX fusion pattern were rewritten (turns on --fuse unless "
                   "--no-fuse)")
    EngineArgs.add_cli_args(g)
    EngineArgs.add_model_positional(g)  # `strata generate MODEL`, as `vllm serve MODEL`
    add_sampling_args(g)
    cli_options.enable_config(g)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate per completion")
    g.add_argument("--min-tokens", type=int, default=0, help="tokens to generate before EOS or a stop may end it")
    g.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: generation_config.json's, else greedy)")
    g.add_argument("--top-p", type=float, default=None, help="(default: generation_config.json's, else 1)")
    g.add_argument("--top-k", type=int, default=None, help="-1 = off (default: generation_config.json's)")
    g.add_argument("--min-p", type=float, default=None,
                   help="drop tokens below this share of the top token's probability (default: "
                   "generation_config.json's, else off)")
    g.add_argument("--repetition-penalty", type=float, default=None,
                   help="> 1 discourages repeating prompt and output tokens (default: generation_config.json's, "
                   "else 1)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="subtracted from tokens already generated")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted per occurrence of a token already generated")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: none, a fresh one per request)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    g.add_argument("-n", type=int, default=1, help="completions per prompt")


_SAMPLING_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos",
    "logprobs", "skip_special_tokens", "include_stop_str_in_output",
)


def sampling_from_args(args: argparse.Namespace, llm, overrides: dict | None = None):
    """Flags given explicitly, else the checkpoint's generation_config.json, else greedy."""
    kw = {f: getattr(args, f) for f in _SAMPLING_FIELDS if getattr(args, f, None) is not None}
    kw.update({k: v for k, v in (overrides or {}).items() if k in _SAMPLING_FIELDS})
    return SamplingParams(**{"temperature": 0.0, **llm.engine.generation_defaults, **kw})


def _stream(llm, prompt: str, params, lora=None) -> None:
    """Print tokens as they are produced (n = 1), then a timing line on stderr."""
    engine = llm.engine
    ids = engine.encode(prompt)
    engine.validate(0, ids, params, lora_request=lora)
    rid = "cli-0"
    engine.add_request(rid, prompt, ids, params, lora_request=lora)
    shown = 0
    print(prompt, end="", flush=True)
    out = None
    try:
        while engine.has_unfinished():
            for out in engine.step():
                text = out.outputs[0].text
                print(text[shown:], end="", flush=True)
                shown = len(text)
    finally:
        print(flush=True)  # end the streamed line, also when interrupted: messages start on their own line
    if out is not None and out.first_token_time:
        n = len(out.outputs[0].token_ids)
        ttft = out.first_token_time - out.arrival_time
        dt = out.finished_time - out.first_token_time
        rate = (n - 1) / dt if n > 1 and dt > 0 else float("nan")
        print(
            f"[{n} tokens, finish={out.outputs[0].finish_reason}, TTFT {ttft * 1000:.0f} ms, "
            f"decode {rate:.1f} tok/s]", file=sys.stderr,
        )


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise StrataError(f"--input {path}: cannot read ({e})") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise StrataError(f"--input {path}:{i}: not valid JSON ({e})") from None
        if not isinstance(row, dict) or not ("prompt" in row or "prompt_token_ids" in row):
            raise StrataError(f"--input {path}:{i}: expected an object with 'prompt' or 'prompt_token_ids'")
        rows.append(row)
    return rows


def _print_fusions(llm) -> None:
    """The FX fusion report: patterns rewritten, and what the model's structure implies."""
    fused = llm.engine.fusion
    if fused is None:
        print("fusions: off (--no-fuse)", file=sys.stderr)
        return
    layers = llm.engine.model_config.num_layers
    want = expected_counts(layers)
    print(f"fusions ({layers} layers):", file=sys.stderr)
    for name in PATTERNS:
        got = fused.counts.get(name, 0)
        note = "" if got == want[name] else f"  (structure implies {want[name]})"
        print(f"  {name:<13} {got:>4}{note}", file=sys.stderr)


REAL_MODEL_HINT = "for a real model: strata generate Qwen/Qwen2.5-0.5B-Instruct --prompt ... (or --model PATH)"


def _model_note(engine_args: EngineArgs) -> str | None:
    """One line (stderr) saying what the built-in and random models are, so nobody mistakes them
    for a real model's quality; None for a model the user named."""
    if engine_args.random_model is not None:
        return (f"note: --random-model {engine_args.random_model} has random weights: its text is noise (for "
                f"benchmarks); {REAL_MODEL_HINT}")
    if engine_args.model is None:
        return f"note: the built-in demo model ({DEMO_SUMMARY}); {REAL_MODEL_HINT}"
    return None


def run(args: argparse.Namespace) -> int:
    if (args.prompt is None) == (args.input is None):
        raise StrataError("give exactly one of --prompt TEXT or --input prompts.jsonl")
    engine_args = EngineArgs.from_cli_args(args)
    kwargs = engine_args.config_kwargs()
    if args.print_fusions and kwargs.get("fuse") is None:
        kwargs["fuse"] = True
    lora = None
    if args.lora is not None:
        kwargs["enable_lora"] = True
        lora = LoRARequest(Path(args.lora).name or "adapter", 1, args.lora)
    note = _model_note(engine_args)
    if note:
        print(note, file=sys.stderr)
    llm = LLM(engine_args.model_path(), **kwargs)
    if args.print_fusions:
        _print_fusions(llm)
    if args.prompt is not None:
        params = sampling_from_args(args, llm)
        if params.n != 1:
            outs = llm.generate([args.prompt], params, use_tqdm=False, lora_request=lora)
            for c in outs[0].outputs:
                print(f"--- completion {c.index} ({c.finish_reason})\n{args.prompt}{c.text}")
        else:
            _stream(llm, args.prompt, params, lora)
        return 0
    rows = _read_jsonl(Path(args.input))
    prompts = [{k: r[k] for k in ("prompt", "prompt_token_ids") if k in r} for r in rows]
    params = [sampling_from_args(args, llm, r) for r in rows]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=lora)
    elapsed = time.perf_counter() - t0
    sink = open(args.output, "w") if args.output else sys.stdout  # noqa: SIM115
    try:
        for o in outs:
            record = {
                "request_id": o.request_id, "prompt": o.prompt,
                "outputs": [
                    {"index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                    for c in o.outputs
                ],
            }
            sink.write(json.dumps(record, ensure_ascii=False) + "\n")
    finally:
        if sink is not sys.stdout:
            sink.close()
    generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
    print(f"{len(outs)} requests, {generated} tokens in {elapsed:.1f}s ({generated / elapsed:.1f} tok/s)", file=sys.stderr)
    return 0
