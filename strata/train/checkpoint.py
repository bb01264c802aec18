"""Training checkpoints: safetensors for tensors, JSON for everything else (never pickle), written
atomically, verified on load, the last K kept.

    OUT/checkpoints/step-00000010/
        model.safetensors       the model's tensors under its own parameter names
        optimizer.safetensors   every optimizer-state tensor, keyed by its path in the state dict
        rng-rank<R>.safetensors torch's CPU (and CUDA) generator state of rank R
        state.json              step, counters, optimizer skeleton, GradScaler, Python/NumPy RNG
        manifest.json           size and SHA-256 of every file above: written last

A checkpoint is written into a temporary directory beside the others and renamed into place
only when complete, so a kill mid-write leaves the previous one untouched; on load, a checkpoint
whose manifest is missing or disagrees with its files (truncated, edited) is reported and
skipped for the next older one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

PREFIX = "step-"
MANIFEST = "manifest.json"


# ---------------------------------------------------------------- nested state <-> tensors + JSON


def flatten(tree: Any, tensors: dict[str, torch.Tensor], path: str = "") -> Any:
    """A JSON skeleton of `tree` with its tensors moved into `tensors` (keyed by path). Dict keys
    keep their type (optimizer states are keyed by int)."""
    if isinstance(tree, torch.Tensor):
        tensors[path] = tree.detach().cpu().contiguous().clone()
        return {"__tensor__": path}
    if isinstance(tree, dict):
        return {"__dict__": [[k, flatten(v, tensors, f"{path}/{k}")] for k, v in tree.items()]}
    if isinstance(tree, (list, tuple)):
        kind = "__tuple__" if isinstance(tree, tuple) else "__list__"
        return {kind: [flatten(v, tensors, f"{path}/{i}") for i, v in enumerate(tree)]}
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    raise TypeError(f"cannot store {type(tree).__name__} at {path!r} in a checkpoint (JSON + safetensors only)")


def unflatten(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return tensors[skeleton["__tensor__"]]
        if "__dict__" in skeleton:
            return {k: unflatten(v, tensors) for k, v in skeleton["__dict__"]}
        if "__tuple__" in skeleton:
            return tuple(unflatten(v, tensors) for v in skeleton["__tuple__"])
        if "__list__" in skeleton:
            return [unflatten(v, tensors) for v in skeleton["__list__"]]
    return skeleton


def unique_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the second name of a shared tensor (tied embeddings): safetensors refuses aliases."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.device.type != "meta" else (id(t), 0)
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().cpu().contiguous()
    return out


# ---------------------------------------------------------------- RNG


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, JSON) of every generator this process draws from."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    version, internal, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    js = {"python": [version, list(internal), gauss],
          "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)]}
    return tensors, js


def set_rng_state(tensors: dict[str, torch.Tensor], js: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = sorted(k for k in tensors if k.startswith("torch_cuda_"))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])
    version, internal, gauss = js["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = js["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


# ---------------------------------------------------------------- files


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_dirs(root: Path) -> list[Path]:
    """Complete-looking checkpoint directories, newest step first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]), reverse=True)


def verify(path: Path) -> str | None:
    """None when `path` is intact, else what is wrong with it."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return "no manifest.json (the write did not finish)"
    try:
        files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"unreadable manifest.json ({e})"
    for name, meta in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != meta["bytes"]:
            return f"{name} is {f.stat().st_size} bytes, the manifest says {meta['bytes']} (truncated?)"
        if _sha256(f) != meta["sha256"]:
            return f"{name} does not match its SHA-256 in the manifest (corrupted)"
    return None


class CheckpointWriter:
    """Builds one checkpoint directory: every rank adds files, rank 0 commits it."""

    def __init__(self, root: Path, step: int) -> None:
        self.root, self.step = root, step
        self.final = root / f"{PREFIX}{step:08d}"

    def staging(self) -> Path:
        """The shared temporary directory of this step (created by rank 0 before the others write)."""
        return self.root / f".tmp-{PREFIX}{self.step:08d}"

    def begin(self) -> Path:
        tmp = self.staging()
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        return tmp

    @staticmethod
    def write_tensors(directory: Path, name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file(tensors, str(directory / name), metadata={"format": "pt"})

    @staticmethod
    def write_json(directory: Path, name: str, data: Any) -> None:
        (directory / name).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")

    def commit(self, keep_last: int) -> Path:
        """Manifest, fsync, rename into place, prune to the newest `keep_last`."""
        tmp = self.staging()
        files = {}
        for f in sorted(tmp.iterdir()):
            _fsync(f)
            files[f.name] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
        (tmp / MANIFEST).write_text(json.dumps({"step": self.step, "files": files}, indent=1), encoding="utf-8")
        _fsync(tmp / MANIFEST)
        if self.final.exists():
            shutil.rmtree(self.final)
        os.rename(tmp, self.final)
        _fsync(self.root)
        for old in checkpoint_dirs(self.root)[keep_last:]:
            shutil.rmtree(old, ignore_errors=True)
        return self.final


def latest_intact(root: Path) -> Path | None:
    """The newest checkpoint that verifies; damaged newer ones are reported and passed over."""
    for path in checkpoint_dirs(root):
        problem = verify(path)
        if problem is None:
            return path
        logger.warning("checkpoint %s is damaged: %s; trying the previous one", path, problem)
    return None


def read_tensors(path: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(path / name))


def read_json(path: Path, name: str) -> Any:
    return json.loads((path / name).read_text(encoding="utf-8"))

