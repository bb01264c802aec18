"""Random-weight checkpoints to GGUF through convert_gguf.py, each checked by llama-bench."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from .figures import parse_llama_bench
from .runner import Ctx, StepError
from .settings import HERE, gguf_plan, gguf_types


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
    """GGUF files per shape and type under $PEERS/gguf/<sdist version>/, each made once (settings.
    gguf_plan: the converter's outtypes, then llama-quantize's types from one of them; a big shape's
    intermediate bf16 GGUF is deleted once its quantised files exist, and not made again while they
    do). Returns the files the benchmark rows read (settings.gguf_types)."""
    from strata.demo.random_models import random_model_path

    envs: list[dict[str, str]] = []  # the converter's environment, probed once
    out: dict[str, dict[str, Path]] = {}
    gdir = ctx.cache / "gguf" / ctx.args.llama_cpp_python
    gdir.mkdir(parents=True, exist_ok=True)
    for shape in shapes:
        model = random_model_path(shape)
        outtypes, quantized, drop = gguf_plan(shape)
        keep = gguf_types(shape)
        path = {t: gdir / f"{shape}-{t}.gguf" for t in (*outtypes, *quantized)}
        for t in outtypes:
            if t in keep:
                _converted(ctx, llama, model, shape, t, path[t], envs)
        for t, src in quantized.items():
            dst = path[t]
            if not dst.is_file():
                tmp = dst.with_suffix(".tmp.gguf")
                ctx.run("prepare", f"quantize-{shape}-{t}",
                        [ctx.bin_dir / "llama-quantize", _converted(ctx, llama, model, shape, src, path[src], envs),
                         tmp, t, str(ctx.args.threads)], timeout=3600)
                tmp.rename(dst)
        for t in drop:  # intermediates: every file made from them exists by now
            if path[t].is_file():
                print(f"deleting {path[t]} (only the quantised files made from it are benchmarked)", flush=True)
                path[t].unlink()
            for stamp in gdir.glob(f"{path[t].name}.verified-*"):
                stamp.unlink()
        out[shape] = {t: path[t] for t in keep}
    return out


def _converted(ctx: Ctx, llama: Path, model: Path, shape: str, t: str, dst: Path,
               envs: list[dict[str, str]]) -> Path:
    """dst, the GGUF of outtype t written by the converter unless it exists."""
    if not dst.is_file():
        if not envs:
            envs.append(converter_env(ctx))
        tmp = dst.with_suffix(".tmp.gguf")
        ctx.run("prepare", f"convert-{shape}-{t}",
                [ctx.python, HERE / "convert_gguf.py", llama, model, "--outtype", t, "--outfile", tmp],
                timeout=3600, env=envs[0])
        tmp.rename(dst)
    return dst


def long_context_model(ctx: Ctx, shape: str, n_ctx: int) -> Path:
    """$PEERS/models/<shape>-ctx<n>/: the random checkpoint of `shape` (its files symlinked, the same
    weights and tokenizer) with config.json's max_position_embeddings raised to n_ctx, so that
    Strata accepts a max_model_len up to n_ctx (settings.DEPTH_CONTEXT says why)."""
    from strata.demo.random_models import random_model_path

    src = random_model_path(shape)
    dst = ctx.cache / "models" / f"{shape}-ctx{n_ctx}"
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("max_position_embeddings", 0) < n_ctx:
        cfg["max_position_embeddings"] = n_ctx
    for f in src.iterdir():
        if f.name == "config.json" or not f.is_file():
            continue
        link = dst / f.name
        if not (link.is_symlink() and link.resolve() == f.resolve()):
            link.unlink(missing_ok=True)
            link.symlink_to(f.resolve())
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return dst


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
