"""The shipped demo adapter (strata/demo/lora/sonnets): a PEFT directory for the demo checkpoint that
Strata's adapter reader accepts, small, and lower in loss than the base on the held-out sonnets;
its retrain command splits the Sonnets as documented."""

from __future__ import annotations

import json

import torch

from strata.demo.lora import sonnets
from strata.demo.model import DEMO_NAME, demo_model_path
from strata.graph.loader import load_model
from strata.graph.lora import LoRABatch, lora_batch
from strata.graph.lora_adapter import attach_banks, read_adapter
from strata.kernels.dispatch import reference_kernels
from strata.train.model_init import load_tokenizer
from tests.train.train_fixtures import CORPUS


def test_the_sonnets_split_holds_out_141_to_154(tmp_path):
    train, held = sonnets.split(CORPUS / "train" / "sonnets.txt", tmp_path)
    held_text = (held / "sonnets_141-154.txt").read_text()
    assert held_text.startswith("CXLI\n") and held_text.count("\n\n") >= 14
    train_text = (train / "sonnets_1-140.txt").read_text()
    assert train_text.startswith("I\n") and "\nCXL\n" in train_text and "CXLI\n" not in train_text
    cmd = sonnets.train_command(train, held, tmp_path / "run", None)
    assert cmd[cmd.index("--model") + 1] == "demo" and "--lora" in cmd


def test_the_shipped_adapter_loads_and_beats_the_base_on_held_out_sonnets(tmp_path):
    d = sonnets.ADAPTER_DIR
    assert sum(f.stat().st_size for f in d.iterdir()) < 2 << 20
    config = json.loads((d / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == DEMO_NAME and config["r"] == 8
    base = demo_model_path()
    model = load_model(base, torch.float32)
    sites = attach_banks(model, slots=1, rank=8)
    weights = read_adapter("sonnets", d, model, sites, max_rank=8, base_name=str(base))
    for module, segments in weights.modules.values():
        module.lora.set_slot(0, segments)

    _, held = sonnets.split(CORPUS / "train" / "sonnets.txt", tmp_path)
    tok = load_tokenizer(base)  # 128-token windows after BOS, as the run that trained it evaluated
    ids = [model.config.bos_token_id] + tok.encode((held / "sonnets_141-154.txt").read_text()).ids
    rows = torch.tensor([ids[i : i + 129] for i in range(0, len(ids) - 129, 128)])
    inputs, targets = rows[:, :-1], rows[:, 1:]
    positions = torch.arange(128).expand_as(inputs)

    def loss(adapter: bool) -> float:
        with torch.no_grad(), reference_kernels(), lora_batch(LoRABatch.every_row(0) if adapter else None):
            logits = model.compute_logits(model(inputs, positions))
        return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()))

    assert loss(True) < loss(False) - 0.03  # 3.52 vs 3.58 nats when it was trained
