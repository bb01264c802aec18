"""The LoRA adapters a server serves, as the front end knows them (torch-free).

The registry maps the names requests may give in `model` to the engine's LoRARequests. It is the
front end's own copy: a restarted engine process starts empty, and engine_client replays the
registry into it before it takes requests. Ids are never reused, so an adapter unloaded and loaded
again (or replaced) never shares an id with weights a running request still holds.

Runtime loading (POST /v1/load_lora_adapter) takes paths inside --lora-dir only: the path is
resolved (symlinks included) before the check, and the adapter's two files must resolve inside too.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from strata.errors import ConfigError
from strata.protocol.lora import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    LoRAError,
    LoRARequest,
    read_adapter_config,
)

UPDATES_OFF = ("runtime LoRA loading is off: start the server with --enable-lora --enable-lora-updates "
               "--lora-dir DIR (adapters are then loaded from inside DIR only)")


def parse_lora_modules(items: list[str] | None) -> list[tuple[str, str, str | None]]:
    """--lora-modules: `name=path` or vLLM's JSON `{"name": ..., "path": ..., "base_model_name": ...}`
    per item -> [(name, path, base_model_name)], names unique."""
    out: list[tuple[str, str, str | None]] = []
    for item in items or ():
        text = item.strip()
        if text.startswith("{"):
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--lora-modules {item!r}: not valid JSON ({e})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("path"), str):
                raise ConfigError(f"--lora-modules {item!r}: a JSON item needs string fields \"name\" and \"path\" "
                                  "(and optionally \"base_model_name\")")
            if extra := sorted(set(obj) - {"name", "path", "base_model_name"}):
                raise ConfigError(f"--lora-modules {item!r}: unknown field {extra[0]!r} (fields: name, path, "
                                  "base_model_name)")
            base = obj.get("base_model_name")
            if base is not None and not isinstance(base, str):
                raise ConfigError(f"--lora-modules {item!r}: base_model_name must be a string")
            name, path = obj["name"], obj["path"]
        else:
            name, sep, path = text.partition("=")
            if not sep or not name or not path:
                raise ConfigError(f"--lora-modules {item!r}: give NAME=PATH (e.g. sonnets=./adapters/sonnets) or "
                                  "a JSON object {\"name\": ..., \"path\": ...}")
            base = None
        if any(name == n for n, _, _ in out):
            raise ConfigError(f"--lora-modules: the name {name!r} is given twice; each adapter needs its own name")
        out.append((name, path, base))
    return out


def inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


@dataclass
class LoRARegistry:
    """Adapters by name (what `model` may say), the names being loaded, and the runtime rules."""

    enabled: bool = False  # --enable-lora
    updates: bool = False  # --enable-lora-updates: the load/unload routes answer
    lora_dir: str | None = None  # --lora-dir: runtime loading is confined to it
    adapters: dict[str, LoRARequest] = field(default_factory=dict)
    loading: set[str] = field(default_factory=set)  # names a load is under way for
    next_id: int = 1

    def get(self, name: str | None) -> LoRARequest | None:
        return self.adapters.get(name) if name is not None else None

    def names(self) -> tuple[str, ...]:
        return tuple(self.adapters)

    def holds(self, lora: LoRARequest) -> bool:
        """Whether `lora` (that id) is still served: a request resolved before an unload is not sent."""
        return self.adapters.get(lora.lora_name) == lora

    def new(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """A LoRARequest with a fresh id (LoRAError for a bad name); not registered yet."""
        lora = LoRARequest(name, self.next_id, path, base_model_name)
        self.next_id += 1
        return lora

    def add(self, lora: LoRARequest) -> None:
        self.adapters[lora.lora_name] = lora

    def remove(self, name: str) -> LoRARequest | None:
        return self.adapters.pop(name, None)

    def check_name(self, name: str, base_names: tuple[str, ...]) -> None:
        """A 400 for a name a new adapter cannot take (served by the base, already loaded, loading)."""
        if not name:
            raise LoRAError("lora_name is empty: give the name requests will send as `model`")
        if name in base_names:
            raise LoRAError(f"lora_name {name!r} is the base model's served name; pick another name for the adapter")
        if name in self.loading:
            raise LoRAError(f"LoRA adapter {name!r} is being loaded by another request; wait for that to finish")
        if name in self.adapters:
            raise LoRAError(f"LoRA adapter {name!r} has already been loaded; unload it first or pick another name")

    def runtime_path(self, given: str) -> str:
        """The adapter directory a runtime load may read: `given` (relative: to --lora-dir) resolved,
        inside --lora-dir, with its config and weights resolving inside it too; checked as a PEFT dir."""
        root = Path(os.path.realpath(self.lora_dir))
        raw = Path(given).expanduser()
        path = Path(os.path.realpath(raw if raw.is_absolute() else root / raw))
        if not inside(path, root):
            raise LoRAError(f"lora_path {given!r} resolves to {path}, outside --lora-dir {root}; runtime loading "
                            "reads adapters from inside --lora-dir only (copy the adapter there)")
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            f = path / name
            if f.exists() and not inside(Path(os.path.realpath(f)), root):
                raise LoRAError(f"lora_path {given!r}: {name} is a link to outside --lora-dir {root}; copy the file "
                                "into the adapter's directory")
        return str(path)


def check_adapter_files(lora: LoRARequest) -> None:
    """The checks that need no torch (files, config, refused features), before the engine reads it."""
    read_adapter_config(lora.path, lora.lora_name)
