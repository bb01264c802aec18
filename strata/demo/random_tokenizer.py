"""A tokenizer for the random-weight checkpoints: the demo BPE, its vocabulary padded to the model's.

Serving benchmarks send text and stream text back, so a random checkpoint needs a tokenizer whose
vocabulary covers every id the model can emit. The demo tokenizer's merges and special tokens
are kept; ids past them become plain vocabulary entries (" w<id>"), never produced by encoding
(no merge leads to them) but decoded like any word.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from strata.demo.model import demo_model_path


def _byte_level(text: str) -> str:
    """A plain-ASCII string in the ByteLevel alphabet (a space is 'Ġ')."""
    return text.replace(" ", "\u0120")


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """Write tokenizer.json and tokenizer_config.json covering ids [0, vocab_size) into `out`."""
    demo = demo_model_path()
    spec = json.loads((demo / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = spec["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in spec["added_tokens"]}
    if vocab_size < max(taken) + 1:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the demo tokenizer's {max(taken) + 1}")
    for t in spec["added_tokens"]:  # the model vocabulary must cover them, or they get renumbered
        vocab[t["content"]] = t["id"]
    for i in range(vocab_size):
        if i not in taken:
            vocab[_byte_level(f" w{i}")] = i
    tmp = out / "tokenizer.json.tmp"
    tmp.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    tmp.rename(out / "tokenizer.json")
    shutil.copyfile(demo / "tokenizer_config.json", out / "tokenizer_config.json")
