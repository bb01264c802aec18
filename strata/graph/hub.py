"""Models by name: `ORG/NAME[@revision]` -> a local snapshot directory, through huggingface_hub.

The lookup order is the one transformers and vLLM users know: a local path always wins; then the
Hugging Face cache (--download-dir, else $HF_HUB_CACHE, else $HF_HOME/hub, else
~/.cache/huggingface/hub), read without any network access; then, unless HF_HUB_OFFLINE is set, a
download with huggingface_hub's progress bars. Only the files Strata reads are fetched
(HUB_FILES: safetensors, config, tokenizer and generation files); pickle checkpoints (*.bin, *.pt)
never are, since loading them can run code (graph/loader.py refuses them too).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from strata.errors import ConfigError, ModelLoadError

logger = logging.getLogger(__name__)

# the files of a Hub repo Strata reads; everything else (pickle weights, ONNX, GGUF, ...) stays remote
HUB_FILES = (
    "*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt", "chat_template.json", "chat_template.jinja",
)
# huggingface_hub's repo id rule (validate_repo_id): ORG/NAME of letters, digits, '-', '_', '.'
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_TRUE = ("1", "true", "yes", "on")


# vLLM's `repo_id:quant_type` / llama.cpp's `-hf repo:quant`: a GGUF by its quantization type
_GGUF_QUANT = re.compile(r"(?i)(?:I?Q\d(?:_[A-Z0-9]+)*|F16|F32|BF16|TQ\d_\d|MXFP4)")


def split_gguf_quant(model: str) -> tuple[str, str | None]:
    """'PATH_OR_ID:Q4_K_M' -> ('PATH_OR_ID', 'Q4_K_M'); anything else (an existing path with a
    colon included) -> (model, None)."""
    head, colon, tail = model.rpartition(":")
    if not colon or not head or not _GGUF_QUANT.fullmatch(tail) or Path(model).expanduser().exists():
        return model, None
    return head, tail


def _gguf_patterns(quant: str) -> list[str]:
    """Hub file patterns of one quantization's GGUF files (names carry it in either case)."""
    return sorted({f"*{q}*.gguf" for q in (quant, quant.upper(), quant.lower())} |
                  {f"*/*{q}*.gguf" for q in (quant, quant.upper(), quant.lower())})


def pick_gguf(directory: Path, quant: str, shown: str) -> Path:
    """The GGUF model file of quantization `quant` in `directory` (or one level down, as GGUF repos
    keep big splits in a folder per type): the first part of a split; none or several is an error
    naming what is there."""
    pattern = re.compile(rf"(?i)(?:^|[-_.]){re.escape(quant)}(?:[-_.]|$)")
    files = sorted(p for p in [*directory.glob("*.gguf"), *directory.glob("*/*.gguf")] if p.is_file())
    models = [p for p in files if "-of-" not in p.name or "-00001-of-" in p.name]
    found = [p for p in models if pattern.search(p.name.split("-00001-of-")[0].removesuffix(".gguf"))]
    if len(found) == 1:
        return found[0]
    have = ", ".join(p.name for p in models) or "no GGUF files"
    if not found:
        raise ModelLoadError(f"{shown}: no {quant} GGUF file in {directory} (it has {have}); pick one of those types")
    raise ModelLoadError(f"{shown}: {len(found)} GGUF files match {quant} ({', '.join(p.name for p in found)}); "
                         "pass --model with the one file")


def local_model(spec: str) -> Path | None:
    """A local --model (a directory, a .gguf file, DIR:QUANT) as resolve_model gives it, without
    the Hub; None when it names nothing local."""
    name, quant = split_gguf_quant(spec)
    if not Path(name).expanduser().exists():
        return None
    return resolve_model(spec)


def split_revision(model: str) -> tuple[str, str | None]:
    """'ORG/NAME@rev' -> ('ORG/NAME', 'rev'); without '@', revision None."""
    name, at, rev = model.partition("@")
    return name, (rev if at else None)


def is_hub_id(model: str) -> bool:
    """ORG/NAME or ORG/NAME@revision (a path that exists is never asked about)."""
    name, rev = split_revision(model)
    return bool(_REPO_ID.fullmatch(name)) and ".." not in name and rev != ""


def hub_cache_dir(download_dir: str | None = None) -> Path:
    """Where Hub snapshots live: --download-dir, $HF_HUB_CACHE, $HF_HOME/hub, ~/.cache/huggingface/hub
    (read now, not when huggingface_hub was imported)."""
    if download_dir:
        return Path(download_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def _missing(path: Path) -> str | None:
    """What a snapshot lacks to be loadable, or None."""
    if not (path / "config.json").is_file():
        return "config.json"
    if not any(path.glob("*.safetensors")):
        return "*.safetensors weights"
    return None


def resolve_model(model: str, revision: str | None = None, download_dir: str | None = None) -> Path:
    """A model directory for `model`: a local path as it is, else a Hub id's cached (or freshly
    downloaded) snapshot. Every failure is one ModelLoadError naming the id, the cache and the fix."""
    from strata.graph.gguf_model import derived_dir

    model, quant = split_gguf_quant(model)
    local = Path(model).expanduser()
    if local.exists():
        if quant is not None:
            if not local.is_dir():
                raise ModelLoadError(f"{model}:{quant}: a quantization type picks a GGUF file in a directory; "
                                     f"{model} is a file: pass it alone")
            return derived_dir(pick_gguf(local, quant, f"{model}:{quant}"))
        return derived_dir(local) or local
    if not is_hub_id(model):
        raise ModelLoadError(
            f"model directory {model!r} does not exist; pass --model PATH to an HF model directory, "
            "or ORG/NAME[@REVISION] of a Hugging Face Hub model"
        )
    repo_id, at_rev = split_revision(model)
    if at_rev is not None and revision is not None and at_rev != revision:
        raise ConfigError(f"model {model!r} names revision {at_rev!r} but --revision is {revision!r}; give one")
    revision = at_rev or revision
    shown = repo_id + (f"@{revision}" if revision else "")
    cache = hub_cache_dir(download_dir)
    if quant is not None:
        return derived_dir(pick_gguf(_gguf_snapshot(repo_id, revision, cache, quant, shown), quant,
                                     f"{shown}:{quant}"))
    path = _cached(repo_id, revision, cache)
    if path is not None:
        lacks = _missing(path)
        if lacks is None:
            logger.info("%s: %s (Hugging Face cache)", shown, path)
            return path
        if hub_offline():
            raise ModelLoadError(
                f"{shown}: the cached snapshot {path} has no {lacks}; unset HF_HUB_OFFLINE to download "
                "the rest, or fill it with `hf download " + repo_id + "`"
            )
    if hub_offline():
        raise ModelLoadError(
            f"{shown}: not in the Hugging Face cache {cache} and HF_HUB_OFFLINE is set; download it "
            f"once with network access (unset HF_HUB_OFFLINE, or `hf download {repo_id}`), or point "
            "--download-dir / HF_HUB_CACHE at a cache that has it"
        )
    path = _download(repo_id, revision, cache, shown)
    lacks = _missing(path)
    if lacks is not None:
        raise ModelLoadError(
            f"{shown}: the Hub repo has no {lacks} (Strata loads only safetensors weights; pickle "
            "checkpoints can run code when loaded); pick a repo that ships model.safetensors"
        )
    logger.info("%s: downloaded to %s", shown, path)
    return path


def _gguf_snapshot(repo_id: str, revision: str | None, cache: Path, quant: str, shown: str) -> Path:
    """The snapshot directory holding repo_id's `quant` GGUF files: cached, else downloaded (only
    those files) unless HF_HUB_OFFLINE."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = _gguf_patterns(quant)
    cached = ""
    try:
        path = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True,
                                      allow_patterns=patterns))
        try:
            pick_gguf(path, quant, shown)
            return path
        except ModelLoadError:
            names = sorted(p.name for p in [*path.glob("*.gguf"), *path.glob("*/*.gguf")])
            cached = f" (cached: {', '.join(names)})" if names else ""
    except LocalEntryNotFoundError:
        pass
    if hub_offline():
        raise ModelLoadError(f"{shown}:{quant}: no {quant} GGUF of it in the Hugging Face cache {cache}{cached} "
                             f"and HF_HUB_OFFLINE is set; download it once (`hf download {repo_id} --include "
                             f"'{patterns[0]}'`) or unset HF_HUB_OFFLINE")
    return _download(repo_id, revision, cache, shown, patterns)


def _cached(repo_id: str, revision: str | None, cache: Path) -> Path | None:
    """The cached snapshot of repo_id at revision (branch, tag or commit), without network, or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True,
                                      allow_patterns=list(HUB_FILES)))
    except LocalEntryNotFoundError:
        return None
    except Exception as e:  # e.g. an incomplete snapshot (IncompleteSnapshotError)
        logger.info("%s: cached snapshot not usable (%s)", repo_id, e)
        return None


def _download(repo_id: str, revision: str | None, cache: Path, shown: str, patterns: list[str] | None = None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"not in the Hugging Face cache {cache}"
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                      allow_patterns=patterns or list(HUB_FILES)))
    except GatedRepoError:
        problem = "is gated: accept its licence on huggingface.co and set HF_TOKEN"
    except RevisionNotFoundError:
        problem = f"has no revision {revision!r}: give a branch, tag or commit that exists"
    except RepositoryNotFoundError:
        problem = "was not found on the Hub (a private repo needs HF_TOKEN): check the name"
    except LocalEntryNotFoundError as e:
        cause = e.__cause__ or e
        problem = (f"is {where} and could not be downloaded ({type(cause).__name__}); connect to the "
                   "network, or point --download-dir / HF_HUB_CACHE at a cache that has it, or pass "
                   "--model PATH to a local copy")
    except (HfHubHTTPError, OSError) as e:
        problem = (f"is {where} and the download failed ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
                   "retry, or pass --model PATH to a local copy")
    raise ModelLoadError(f"{shown} {problem}")


def check_model_dir(path: str | Path, revision: str | None = None, download_dir: str | None = None) -> Path:
    """The model directory for a path, or for a Hub id ORG/NAME[@revision] (graph/hub.py: the HF
    cache, then a download unless HF_HUB_OFFLINE); a local path always wins."""
    path = resolve_model(str(path), revision, download_dir)
    if not path.is_dir():
        raise ModelLoadError(f"{path}: not a directory; --model expects an HF model directory or a .gguf file")
    return path
