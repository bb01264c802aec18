"""The prepare step: the llama-cpp-python sdist and its vendored llama.cpp, built with cmake and
cached by a stamp; then convert.py's GGUF conversion and checks."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from .convert import convert, verify_gguf
from .runner import Ctx, StepError, read_json
from .settings import BUILD_TARGETS, CMAKE_FLAGS, EXTRA_TARGETS, NO_AMX_FLAGS


def sdist_path(ctx: Ctx) -> Path:
    """The llama-cpp-python sdist in $PEERS/src, downloaded from PyPI with pip when absent."""
    ver = ctx.args.llama_cpp_python
    src = ctx.cache / "src"
    src.mkdir(parents=True, exist_ok=True)
    dst = src / f"llama_cpp_python-{ver}.tar.gz"
    if dst.is_file():
        print(f"sdist: {dst} (cached)")
        return dst
    if ctx.args.sdist:
        shutil.copyfile(ctx.args.sdist, dst)
        print(f"sdist: copied {ctx.args.sdist}")
        return dst
    with tempfile.TemporaryDirectory(dir=src) as tmp:
        ctx.run("prepare", "pip-download", [ctx.python, "-m", "pip", "download", f"llama-cpp-python=={ver}",
                                            "--no-deps", "--no-binary", ":all:", "-d", tmp], timeout=1800)
        got = sorted(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if not got:
            raise StepError(f"pip download left no llama_cpp_python-*.tar.gz in {tmp}")
        got[0].rename(dst)
    return dst


def extract(ctx: Ctx, sdist: Path) -> Path:
    """Unpack the sdist once; returns its vendor/llama.cpp directory."""
    ver = ctx.args.llama_cpp_python
    root = ctx.cache / "src" / f"llama_cpp_python-{ver}"
    stamp = ctx.cache / "src" / f".extracted-{ver}"
    if not stamp.is_file():
        shutil.rmtree(root, ignore_errors=True)
        print(f"extracting {sdist.name} ...", flush=True)
        with tarfile.open(sdist) as tf:
            kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tf.extractall(ctx.cache / "src", **kw)
        stamp.write_text(ver + "\n")
    llama = root / "vendor" / "llama.cpp"
    if not (llama / "CMakeLists.txt").is_file():
        raise StepError(f"{llama} has no CMakeLists.txt: not the expected sdist layout")
    return llama


def llama_commit(llama: Path) -> dict:
    """Commit of the vendored llama.cpp: from git when it works, else the submodule's HEAD file."""
    info: dict[str, Any] = {}
    try:
        out = subprocess.run(["git", "-C", str(llama), "log", "-1", "--format=%H%n%cI%n%s"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode == 0:
            h, date, subj = (out.stdout.splitlines() + ["", "", ""])[:3]
            info = {"commit": h, "commit_date": date, "commit_subject": subj}
    except (OSError, subprocess.SubprocessError):
        pass
    if not info.get("commit"):
        head = llama.parents[1] / ".git" / "modules" / "vendor" / "llama.cpp" / "HEAD"
        if head.is_file():
            info["commit"] = head.read_text().strip()
    return info


def cpu_key() -> str:
    """CPU model + flags: GGML_NATIVE binaries are only valid on a CPU like the one that built them."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor()]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12]


def build_llama(ctx: Ctx, llama: Path, flags: tuple[str, ...] = CMAKE_FLAGS) -> Path:
    """cmake configure + build of BUILD_TARGETS, skipped when the stamp matches (EXTRA_TARGETS
    are added to a cached tree incrementally); returns bin/."""
    bins = _build_llama(ctx, llama, flags)
    missing = [t for t in EXTRA_TARGETS if not (bins / t).is_file()]
    if missing:
        ctx.run("prepare", "cmake-build-extra", ["cmake", "--build", bins.parent, "--config", "Release", "-j",
                                                 str(ctx.args.jobs or os.cpu_count() or 2), "--target", *missing],
                timeout=3600)
    return bins


def _build_llama(ctx: Ctx, llama: Path, flags: tuple[str, ...]) -> Path:
    ver = ctx.args.llama_cpp_python
    key = {"sdist_version": ver, "cmake_flags": list(flags), "targets": list(BUILD_TARGETS),
           "cpu": cpu_key()}
    key_hash = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    bdir = ctx.cache / "build" / f"llama.cpp-{ver}-{key_hash}"
    stamp = bdir / "strata-peers.stamp.json"
    bins = bdir / "bin"
    if stamp.is_file() and all((bins / t).is_file() for t in BUILD_TARGETS):
        st = read_json(stamp)
        if st.get("key") == key:
            print(f"llama.cpp build: cached in {bdir} (built {st.get('built_at')}, "
                  f"{st.get('build_s', 0):.0f} s); skipping the build", flush=True)
            ctx.results["build"] = {"status": "reused from cache", "dir": ctx.display([str(bdir)]),
                                    "built_at": st.get("built_at"), "build_s": st.get("build_s"),
                                    "jobs": st.get("jobs")}
            return bins
    if ctx.args.no_build:
        raise StepError(f"no cached llama.cpp build in {bdir} and --no-build was given")
    jobs = ctx.args.jobs or os.cpu_count() or 2
    bdir.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    t0 = time.perf_counter()
    ctx.run("prepare", "cmake-configure", ["cmake", "-S", llama, "-B", bdir, *flags], timeout=1800)
    ctx.run("prepare", "cmake-build", ["cmake", "--build", bdir, "--config", "Release", "-j", str(jobs),
                                       "--target", *BUILD_TARGETS], timeout=7200)
    build_s = time.perf_counter() - t0
    stamp.write_text(json.dumps({"key": key, "built_at": dt.datetime.now().isoformat(timespec="seconds"),
                                 "build_s": build_s, "jobs": jobs}, indent=2) + "\n")
    ctx.results["build"] = {"status": "built in this run", "dir": ctx.display([str(bdir)]), "build_s": build_s,
                            "jobs": jobs}
    print(f"llama.cpp build: {build_s:.0f} s", flush=True)
    return bins


_CRASH_SIGNALS = {4: "SIGILL", 7: "SIGBUS", 11: "SIGSEGV"}


def _crash_signal(message: str) -> str | None:
    """The signal a failed step died of, when its message names a crash (rc -N from Python,
    128 + N from a shell; "Illegal instruction" from a shell's report), else None."""
    for num, name in _CRASH_SIGNALS.items():
        if f"rc -{num})" in message or f"rc {128 + num})" in message:
            return name
    return "SIGILL" if "Illegal instruction" in message else None


def prepare(ctx: Ctx, shapes: list[str]) -> dict[str, dict[str, Path]]:
    sdist = sdist_path(ctx)
    llama = extract(ctx, sdist)
    ctx.llama_dir = llama
    info = llama_commit(llama)
    info["sdist_version"] = ctx.args.llama_cpp_python
    info["cmake_flags"] = list(CMAKE_FLAGS)
    info["targets"] = list(BUILD_TARGETS)
    gp = llama / "gguf-py" / "pyproject.toml"
    if gp.is_file():
        for line in gp.read_text().splitlines():
            if line.startswith("version"):
                info["gguf_py_version"] = line.split("=", 1)[1].strip().strip('"')
                break
    ctx.results["versions"]["llama_cpp"] = info
    ctx.bin_dir = build_llama(ctx, llama)
    ggufs = convert(ctx, llama, shapes)
    info["variant"] = "native (GGML_NATIVE=ON)"
    try:
        verify_gguf(ctx, ggufs)
    except StepError as e:
        signal = _crash_signal(str(e))
        if signal is None:
            raise
        # e.g. a VM that reports AMX but cannot run its tiles (seen: SIGILL on one Xeon VM, SIGSEGV
        # inside ggml_backend_amx_mul_mat on another): the same flags with AMX off
        print(f"llama.cpp died of {signal} in its verify step; rebuilding with AMX off", flush=True)
        info["cmake_flags"] = [*CMAKE_FLAGS, *NO_AMX_FLAGS]
        info["variant"] = (f"native with AMX off (the native build died of {signal}: "
                           + str(e).splitlines()[0] + ")")
        ctx.bin_dir = build_llama(ctx, llama, (*CMAKE_FLAGS, *NO_AMX_FLAGS))
        verify_gguf(ctx, ggufs)
    try:
        v = subprocess.run([ctx.bin_dir / "llama-server", "--version"], capture_output=True, text=True,
                           timeout=60)
        info["server_version"] = (v.stdout + v.stderr).strip().splitlines()[-2:]
    except (OSError, subprocess.SubprocessError):
        pass
    return ggufs
