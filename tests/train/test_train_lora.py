"""`strata train --lora`: only the adapter trains (the base frozen, bit for bit), the PEFT export
loads in peft with the trained model's logits and in Strata's adapter reader, resume is
bit-identical and checks the base, activation checkpointing keeps the gradients, and the flags /
TOML keys are validated with messages naming the fix."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file

from strata.errors import ConfigError, StrataError
from strata.graph.loader import load_model
from strata.graph.lora import LoRABatch, lora_batch
from strata.graph.lora_adapter import attach_banks, read_adapter
from strata.kernels.dispatch import reference_kernels
from strata.train import checkpoint as ckpt
from strata.train.cli import add_arguments, config_from_args
from strata.train.config import TrainConfig, load_toml
from strata.train.export import export_hf
from strata.train.model_init import build_model, resolve
from strata.train.trainer import Trainer
from tests.train.train_fixtures import metrics

IDS = torch.tensor([[1, 40, 300, 7, 900, 12, 5, 77, 3, 250]])


def make_base(tiny_train_dir: Path, dest: Path, seed: int, **over) -> Path:
    """An HF checkpoint of the tiny Llama (random weights of `seed`; `over`: config changes, another
    family) on the demo tokenizer."""
    config = tiny_train_dir / "config.json"
    if over:
        dest.mkdir(parents=True, exist_ok=True)
        config = dest.parent / f"{dest.name}-config.json"
        config.write_text(json.dumps({**json.loads((tiny_train_dir / "config.json").read_text()), **over}))
    src = resolve(str(config), None)
    model = build_model(src, seed, None)
    return export_hf(model, src.config, src.tokenizer_dir, dest, model.config.bos_token_id,
                     list(model.config.eos_token_ids))


@pytest.fixture(scope="module")
def tiny_base(tiny_train_dir, tmp_path_factory) -> Path:
    return make_base(tiny_train_dir, tmp_path_factory.mktemp("lora") / "base", seed=0)


def lora_config(tiny_train_dir: Path, base: Path, out: Path, **over) -> TrainConfig:
    kw = dict(model=str(base), data=[str(tiny_train_dir / "train.txt")], out_dir=str(out), seq_len=32,
              micro_batch_size=2, max_steps=4, warmup_steps=1, log_every=1, precision="float32", num_workers=0,
              tensorboard=False, lr=1e-2, lora=True, lora_rank=4, lora_alpha=8.0)
    kw.update(over)
    return TrainConfig(**kw)


def trained_logits(trainer: Trainer) -> torch.Tensor:
    """The trained model's own forward, through its adapter slot (eval mode: no dropout)."""
    lm = trainer.lm.eval()
    with torch.no_grad(), reference_kernels(), lora_batch(LoRABatch.every_row(0)):
        return lm.compute_logits(lm(IDS, torch.arange(IDS.shape[1])[None]))[0]


@pytest.mark.parametrize("targets", [["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                     ["q_proj", "v_proj", "down_proj"]], ids=["all-seven", "q-v-down-rslora"])
def test_only_the_adapter_trains_and_peft_loads_the_export(tiny_train_dir, tiny_base, tmp_path, targets):
    rslora = len(targets) < 7  # the second case scales by alpha / sqrt(r), as peft's use_rslora
    cfg = lora_config(tiny_train_dir, tiny_base, tmp_path / "run", lora_target_modules=targets, lora_dropout=0.1,
                      use_rslora=rslora)
    trainer = Trainer(cfg)
    base = {k: v.clone() for k, v in trainer.lm.state_dict().items() if ".lora." not in k}
    trainable = {n for n, p in trainer.lm.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora.lora_a", "lora.lora_b")) for n in trainable)
    optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for p in trainer.lm.parameters() if p.requires_grad}
    assert trainer.fit(progress=False).steps == 4
    after = trainer.lm.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items()), "a base tensor changed"
    # a segment left out (k of the fused qkv when only q and v are targeted) stays exactly zero
    qkv = trainer.lm.layers[0].self_attn.qkv_proj.lora
    k_a, k_b = qkv.segment_weights(0, 1)
    assert ("k_proj" in targets) == bool(k_a.abs().sum() > 0)
    assert "k_proj" in targets or (k_b.abs().sum() == 0 and qkv.scale[0, 1] == 0)
    if "o_proj" not in targets:
        assert trainer.lm.layers[0].self_attn.o_proj._modules.get("lora") is None

    export = trainer.export(tmp_path / "adapter")
    config = json.loads((export / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert sorted(config["target_modules"]) == sorted(targets) and config["bias"] == "none"
    assert config["base_model_name_or_path"] == str(tiny_base) and config["lora_dropout"] == 0.1
    assert config["use_rslora"] is rslora
    tensors = load_file(str(export / "adapter_model.safetensors"))
    assert len(tensors) == 2 * 2 * len(targets)  # two layers, A and B per targeted module
    a = tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"]
    b = tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    assert a.shape == (4, 64) and b.shape == (32, 4) and b.abs().sum() > 0  # trained away from zero

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_base, dtype=torch.float32).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no unexpected / missing keys, no unknown config fields
        model = peft.PeftModel.from_pretrained(hf, export).eval()
    with torch.no_grad():
        ref = model(IDS).logits[0]
    ours = trained_logits(trainer)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    with torch.no_grad(), model.disable_adapter():
        assert (model(IDS).logits[0] - ref).abs().max() > 1e-3  # the adapter does change the output

    served = load_model(tiny_base, torch.float32)  # as `strata serve --lora-modules` reads it
    sites = attach_banks(served, slots=2, rank=8)
    weights = read_adapter("mine", export, served, sites, max_rank=8, base_name=str(tiny_base))
    assert weights.rank == 4 and weights.config.target_modules == tuple(sorted(targets))
    for module, segments in weights.modules.values():
        module.lora.set_slot(1, segments)
    with torch.no_grad(), lora_batch(LoRABatch.every_row(1)):
        got = served.compute_logits(served(IDS, torch.arange(IDS.shape[1])[None]))[0]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_adapter_is_written_by_default_and_the_checkpoint_holds_only_it(tiny_train_dir, tiny_base, tmp_path):
    from strata.cli import main

    out = tmp_path / "run"
    argv = ["train", "--lora", "--model", str(tiny_base), "--data", str(tiny_train_dir / "train.txt"),
            "--out-dir", str(out), "--seq-len", "32", "--micro-batch-size", "2", "--max-steps", "2",
            "--warmup-steps", "1", "--precision", "float32", "--num-workers", "0", "--no-tensorboard",
            "--lora-rank", "2", "--lora-target-modules", "q_proj", "v_proj", "--json"]
    assert main(argv) == 0
    assert {p.name for p in (out / "adapter").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    saved = ckpt.latest_intact(out / "checkpoints")
    assert {p.name for p in saved.iterdir()} == {"adapter.safetensors", "optimizer.safetensors", "rng-rank0.json",
                                                  "rng-rank0.safetensors", "state.json", "manifest.json"}
    tensors = load_file(str(saved / "adapter.safetensors"))
    assert tensors and all(".lora." in k for k in tensors)
    state = json.loads((saved / "state.json").read_text())
    assert state["lora"]["base"]["model"] == str(tiny_base) and len(state["lora"]["base"]["sha256"]) == 64
    assert state["lora"]["adapter"]["rank"] == 2


def test_resume_is_bit_identical_and_checks_the_base(tiny_train_dir, tiny_base, tmp_path):
    over = dict(max_steps=6, save_every=3, lora_dropout=0.1)  # dropout: the RNG state must resume too
    straight = Trainer(lora_config(tiny_train_dir, tiny_base, tmp_path / "straight", **over))
    straight.fit(progress=False)

    interrupted = Trainer(lora_config(tiny_train_dir, tiny_base, tmp_path / "resumed", **over))
    with reference_kernels():
        for _ in range(3):
            interrupted.train_step()
    interrupted.save_checkpoint()  # as fit does at step 3, then the run dies
    resumed = Trainer(lora_config(tiny_train_dir, tiny_base, tmp_path / "resumed", **over))
    resumed.fit(progress=False)
    assert resumed.step == 6
    a, b = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert sorted(b) == [4, 5, 6]
    for step in (4, 5, 6):
        assert a[step]["loss"] == b[step]["loss"] and a[step]["grad_norm"] == b[step]["grad_norm"], step
    wa = load_file(str(tmp_path / "straight" / "checkpoints" / "step-00000006" / "adapter.safetensors"))
    wb = load_file(str(tmp_path / "resumed" / "checkpoints" / "step-00000006" / "adapter.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)

    other = make_base(tiny_train_dir, tmp_path / "other-base", seed=1)
    with pytest.raises(StrataError, match="trained on another base"):
        Trainer(lora_config(tiny_train_dir, other, tmp_path / "resumed", **over)).maybe_resume()
    with pytest.raises(StrataError, match="--lora-rank"):
        Trainer(lora_config(tiny_train_dir, tiny_base, tmp_path / "resumed", **over, lora_rank=8)).maybe_resume()
    with pytest.raises(StrataError, match="written by a LoRA run"):
        Trainer(lora_config(tiny_train_dir, tiny_base, tmp_path / "resumed", **over, lora=False)).maybe_resume()


@pytest.mark.parametrize("mode", ["full", "attention", "selective"])
def test_activation_checkpointing_keeps_the_adapter_gradients(tiny_train_dir, tiny_base, tmp_path, mode):
    def grads(ac: str) -> dict[str, torch.Tensor]:
        trainer = Trainer(lora_config(tiny_train_dir, tiny_base, tmp_path / ac, activation_checkpointing=ac,
                                      ac_every=1))
        with torch.no_grad():  # B away from zero, so that every A gets a gradient too
            for p in trainer.params:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.01)
        inputs, targets = trainer.data.samples(0, 2)
        with reference_kernels(), trainer._adapters():
            trainer.module(inputs, targets).backward()
        return {n: p.grad.clone() for n, p in trainer.lm.named_parameters() if p.requires_grad}

    ref, got = grads("none"), grads(mode)
    assert len(ref) == len(got) and all(g.abs().sum() > 0 for g in ref.values())
    for (_, a), (_, b) in zip(sorted(ref.items()), sorted(got.items()), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_flags_and_toml_keys(tmp_path):
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args(["--lora", "--lora-rank", "8", "--lora-alpha", "16", "--lora-dropout", "0.05",
                                         "--lora-target-modules", "q_proj", "v_proj", "--use-rslora",
                                         "--quantization", "int4", "--quantization-group-size", "32"]))
    assert (cfg.lora, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout) == (True, 8, 16.0, 0.05)
    assert cfg.lora_target_modules == ["q_proj", "v_proj"] and cfg.use_rslora
    assert (cfg.quantization, cfg.quantization_group_size) == ("int4", 32)
    assert TrainConfig().lora_target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"]
    toml = tmp_path / "train.toml"
    toml.write_text('[train]\nlora = true\nlora_rank = 4\nlora_target_modules = "all-linear"\n')
    cfg = config_from_args(p.parse_args(["--config", str(toml), "--lora-rank", "2"]))
    assert cfg.lora and cfg.lora_rank == 2 and cfg.lora_target_modules == ["all-linear"]
    assert TrainConfig(lora_target_modules="q_proj,v_proj").lora_target_modules == ["q_proj", "v_proj"]
    assert load_toml(toml)["lora_target_modules"] == ["all-linear"]

    with pytest.raises(ConfigError, match="add --lora"):
        TrainConfig(quantization="int8")
    with pytest.raises(ConfigError, match="use --distributed ddp"):
        TrainConfig(lora=True, distributed="fsdp", nproc_per_node=2)
    with pytest.raises(ConfigError, match="lora_rank"):
        TrainConfig(lora=True, lora_rank=0)
    with pytest.raises(ConfigError, match="lora_dropout"):
        TrainConfig(lora=True, lora_dropout=1.0)
    with pytest.raises(ConfigError, match="all-linear already means"):
        TrainConfig(lora=True, lora_target_modules=["all-linear", "q_proj"])


def test_bad_targets_and_bases_are_clear_errors(tiny_train_dir, tiny_base, tmp_path):
    with pytest.raises(ConfigError, match=r"no such projection.*q_proj k_proj v_proj.*all-linear"):
        Trainer(lora_config(tiny_train_dir, tiny_base, tmp_path / "a", lora_target_modules=["qkv_proj"]))
    with pytest.raises(ConfigError, match="needs trained weights"):
        Trainer(lora_config(tiny_train_dir, tiny_train_dir / "config.json", tmp_path / "b"))


def test_preflight_times_and_prices_the_lora_run(tiny_train_dir, tiny_base, tmp_path):
    from strata.train.preflight import preflight

    cfg = lora_config(tiny_train_dir, tiny_base, tmp_path / "check", quantization="int8")
    results = {r.name: r for r in preflight(cfg, capacity=8 << 30, runtime_baseline_bytes=100 << 20)}
    assert results["data loader"].status == "PASS" and "forward + backward" in results["data loader"].detail
    assert results["memory"].status == "PASS"


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_other_families_export_what_peft_computes(tiny_train_dir, tmp_path, family):
    arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]  # q/k/v biases; q/k norms
    base = make_base(tiny_train_dir, tmp_path / "base", seed=2, architectures=[arch], model_type=family)
    trainer = Trainer(lora_config(tiny_train_dir, base, tmp_path / "run", max_steps=3))
    trainer.fit(progress=False)
    export = trainer.export(tmp_path / "adapter")
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(hf, export).eval()
    with torch.no_grad():
        ref = model(IDS).logits[0]
    torch.testing.assert_close(trained_logits(trainer), ref, rtol=1e-4, atol=1e-4)
