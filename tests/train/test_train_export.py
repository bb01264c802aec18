"""`strata train --export DIR` writes an HF directory that Strata and transformers both load,
with equal logits."""

from __future__ import annotations

import json

import torch
import transformers

from strata.cli import main
from strata.graph.loader import load_model
from tests.train.train_fixtures import train_argv


def test_export_loads_in_strata_and_transformers_with_equal_logits(tiny_train_dir, tmp_path):
    export = tmp_path / "export"
    assert main(train_argv(tiny_train_dir, tmp_path / "run", "--max-steps", "3", "--export", str(export))) == 0
    names = {p.name for p in export.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]

    ids = torch.tensor([[1, 40, 300, 7, 900, 12, 5]])
    hf = transformers.AutoModelForCausalLM.from_pretrained(export, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids).logits[0]
    ours = load_model(export, torch.float32)
    with torch.no_grad():
        got = ours.compute_logits(ours(ids, torch.arange(ids.shape[1])[None]))[0]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    tok = transformers.AutoTokenizer.from_pretrained(export)
    assert tok.decode(tok("To be, or not to be").input_ids, skip_special_tokens=True) == "To be, or not to be"
