"""Random-weight checkpoints to GGUF through convert_gguf.py, each checked by llama-bench."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from .figures import parse_llama_bench
from .runner import Ctx, StepError
from .settings import HERE, OUTTYPES, QUANTIZED


def converter_env(ctx: Ctx) -> dict[str, str]:
    """PYTHONPATH for the converter: sentencepiece in $PEERS/pydeps when this Python lacks it.

    The Llama converter imports sentencepiece before it looks for tokenizer.model (and only an
    absent file, not an absent module, sends it to the tokenizer.json path); the other imports
    (numpy, torch, transformers, pyyaml, tqdm) come from Strata's venv, gguf from the tree.
    """
    probe = subprocess.run([ctx.python, "-c", "import sentencepiece"], capture_output=True)
    if probe.returncode == 0:
        return {}
    deps = ctx.cache / "pydeps"
    if not (deps / "sentencepiece").is_dir():
        ctx.run("prepare", "pip-sentencepiece", [ctx.python, "-m", "pip", "install", "--no-deps", "--target",
                                                 deps, "sentencepiece"], timeout=1800)
    return {"PYTHONPATH": str(deps)}


def convert(ctx: Ctx, llama: Path, shapes: list[str]) -> dict[str, dict[str, Path]]:
    """GGUF files per shape and outtype under $PEERS/gguf/<sdist version>/, converted once."""
    from strata.demo.random_models import random_model_path

    env = None
    out: dict[str, dict[str, Path]] = {}
    gdir = ctx.cache / "gguf" / ctx.args.llama_cpp_python
    gdir.mkdir(parents=True, exist_ok=True)
    for shape in shapes:
        model = random_model_path(shape)
        out[shape] = {}
        for t in OUTTYPES:
            dst = gdir / f"{shape}-{t}.gguf"
            if not dst.is_file():
                if env is None:
                    env = converter_env(ctx)
                tmp = dst.with_suffix(".tmp.gguf")
                ctx.run("prepare", f"convert-{shape}-{t}",
                        [ctx.python, HERE / "convert_gguf.py", llama, model, "--outtype", t, "--outfile", tmp],
                        timeout=3600, env=env)
                tmp.rename(dst)
            out[shape][t] = dst
        for t, src in QUANTIZED.items():
            dst = gdir / f"{shape}-{t}.gguf"
            if not dst.is_file():
                tmp = dst.with_suffix(".tmp.gguf")
                ctx.run("prepare", f"quantize-{shape}-{t}",
                        [ctx.bin_dir / "llama-quantize", out[shape][src], tmp, t, str(ctx.args.threads)],
                        timeout=3600)
                tmp.rename(dst)
            out[shape][t] = dst
    return out


def verify_gguf(ctx: Ctx, ggufs: dict[str, dict[str, Path]]) -> None:
    """A tiny llama-bench run per file: the GGUF loads and runs (once per file and build; stamped
    with the build directory's name, so a later run with the native build verifies again, and
    falls back to the no-AMX build again, rather than trusting a stamp of the other build)."""
    build = ctx.bin_dir.parent.name
    for shape, files in ggufs.items():
        for t, path in files.items():
            ok = path.parent / f"{path.name}.verified-{build}"
            if ok.is_file():
                continue
            out = ctx.run("prepare", f"verify-{shape}-{t}",
                          [ctx.bin_dir / "llama-bench", "-m", path, "-p", "16", "-n", "4", "-r", "1", "-t",
                           str(ctx.args.threads), "-o", "json"], timeout=900, capture=True)
            rows = parse_llama_bench(out)
            if not rows or any(not r["avg_ts"] > 0 for r in rows):
                raise StepError(f"llama-bench on {path} gave no rates")
            ok.write_text(json.dumps(rows) + "\n")
