"""`strata train --export DIR`: the trained model as an HF checkpoint directory (config.json,
model.safetensors with HF tensor names, tokenizer files, generation_config.json) that Strata and
transformers both load. The fused q/k/v and gate/up matrices are cut back into HF's separate
tensors by the loader's own name map (graph/loader.checkpoint_targets), read in reverse."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from strata.graph.loader import checkpoint_targets
from strata.graph.models.llama import CausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def hf_state_dict(model: CausalLM, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    out = {}
    with torch.no_grad():
        for name, target in checkpoint_targets(model, model.config).items():
            t = target.param if target.rows is None else target.param[target.rows]
            out[name] = t.detach().to("cpu", dtype).contiguous().clone()
    return out


@contextlib.contextmanager
def atomic_dir(dest: Path):
    """Fill a temporary directory beside `dest` (the with-block writes into the path it yields),
    then rename it over `dest`'s place: readers see the old directory or the whole new one."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        yield tmp
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_hf(model: CausalLM, config: dict[str, Any], tokenizer_dir: Path, dest: Path,
              bos: int | None, eos: list[int], dtype: torch.dtype = torch.float32) -> Path:
    """Write the directory atomically (a temp dir renamed over `dest`'s place)."""
    with atomic_dir(dest) as tmp:
        cfg = {**config, "torch_dtype": str(dtype).removeprefix("torch."), "bos_token_id": bos,
               "eos_token_id": eos[0] if len(eos) == 1 else eos}
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
        gen = {"bos_token_id": bos, "eos_token_id": cfg["eos_token_id"], "do_sample": True,
               "temperature": 0.8, "top_p": 0.95}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")
        save_file(hf_state_dict(model, dtype), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copyfile(tokenizer_dir / name, tmp / name)
    return Path(dest)
