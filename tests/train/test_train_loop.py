"""The training loop on a tiny model: loss goes down, the schedule and decay groups are what
they say, activation checkpointing leaves gradients unchanged, and non-finite steps are skipped."""

from __future__ import annotations

import math

import pytest
import torch

from strata.cli import main
from strata.errors import ConfigError
from strata.train.activation_checkpoint import apply_activation_checkpointing
from strata.train.config import TrainConfig, build_config, load_toml
from strata.train.model_init import build_model, resolve
from strata.train.optim import lr_at, param_groups
from strata.train.trainer import LanguageModelLoss, Trainer, TrainingError
from tests.train.train_fixtures import metrics, train_argv


def _config(d, out, **kw) -> TrainConfig:
    base = dict(model=str(d / "config.json"), data=[str(d / "train.txt")], out_dir=str(out), seq_len=32,
                micro_batch_size=2, max_steps=5, warmup_steps=1, precision="float32", num_workers=0,
                tensorboard=False, threads=1, resume=False)
    return TrainConfig(**{**base, **kw})


def test_loss_decreases_and_held_out_loss_is_reported(tiny_train_dir, tmp_path, capsys):
    out = tmp_path / "run"
    argv = train_argv(tiny_train_dir, out, "--max-steps", "15", "--lr", "1e-2", "--eval-data",
                      str(tiny_train_dir / "eval.txt"), "--eval-batches", "2", "--json")
    assert main(argv) == 0
    rows = metrics(out)
    first, last = rows[1]["loss"], rows[15]["loss"]
    assert last < first - 1.0, (first, last)
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and row["peak_memory_bytes"] > 0 and row["grad_norm"] > 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert '"eval_loss"' in summary and '"steps": 15' in summary
    assert (out / "checkpoints" / "step-00000015" / "manifest.json").is_file()


def test_tensorboard_events_are_written(tiny_train_dir, tmp_path):
    out = tmp_path / "tb"
    assert main(train_argv(tiny_train_dir, out, "--max-steps", "2", "--tensorboard")) == 0
    events = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_schedule_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(lr=1e-3, warmup_steps=10, max_steps=100, min_lr_ratio=0.1, data=["x"])
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert all(lr > 0 for lr in lrs)
    assert lrs[:10] == sorted(lrs[:10]) and lrs[9] == pytest.approx(1e-3)
    assert lrs[10:] == sorted(lrs[10:], reverse=True)
    assert lrs[-1] == pytest.approx(1e-4, rel=0.01)


def test_weight_decay_skips_norms_biases_and_embeddings(tiny_train_dir):
    src = resolve(str(tiny_train_dir / "config.json"), None)
    model = build_model(src, 0, None)
    decay, no_decay = param_groups(model, 0.1)
    decayed = {id(p) for p in decay["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in decayed}
    assert names and all(n.endswith("proj.weight") for n in names)
    assert id(model.embed_tokens.weight) not in decayed
    assert no_decay["weight_decay"] == 0.0
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


@pytest.mark.parametrize("mode", ["full", "selective", "attention"])
def test_activation_checkpointing_gives_the_same_gradients(tiny_train_dir, mode):
    src = resolve(str(tiny_train_dir / "config.json"), None)
    torch.manual_seed(0)
    ids = torch.randint(0, 4000, (2, 24))
    targets = torch.randint(0, 4000, (2, 24))

    def grads(ac: str) -> tuple[float, dict[str, torch.Tensor]]:
        lm = build_model(src, 0, None)
        wrapped = apply_activation_checkpointing(lm, ac, every=2)
        assert (wrapped > 0) == (ac != "none")
        loss = LanguageModelLoss(lm)(ids, targets)
        loss.backward()
        prefix = "_checkpoint_wrapped_module."  # what torch's wrapper adds (its state_dict strips it)
        return loss.item(), {n.replace(prefix, ""): p.grad.clone() for n, p in lm.named_parameters()}

    ref_loss, ref = grads("none")
    loss, got = grads(mode)
    assert loss == ref_loss
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=0, msg=name)


def test_chunked_loss_equals_the_whole_loss(tiny_train_dir):
    src = resolve(str(tiny_train_dir / "config.json"), None)
    torch.manual_seed(0)
    ids, targets = torch.randint(0, 4000, (2, 24)), torch.randint(0, 4000, (2, 24))
    results = []
    for chunk in (0, 7):  # 48 tokens: 7 chunks, the last one short
        lm = build_model(src, 0, None)
        loss = LanguageModelLoss(lm, chunk_tokens=chunk)(ids, targets)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in lm.named_parameters()}))
    (ref_loss, ref), (loss, got) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-7, msg=name)


def _inject_once(param: torch.nn.Parameter, at_call: int, value: float):
    calls = {"n": 0}

    def hook(grad):
        calls["n"] += 1
        return torch.full_like(grad, value) if calls["n"] == at_call else grad

    return param.register_hook(hook)


def test_fp16_loss_scaler_skips_an_inf_step_and_recovers(tiny_train_dir, tmp_path):
    t = Trainer(_config(tiny_train_dir, tmp_path, precision="float16", max_steps=6, warmup_steps=1))
    assert t.precision.scaler.is_enabled()
    _inject_once(t.lm.layers[0].mlp.down_proj.weight, at_call=2, value=float("inf"))
    results, scales = [], []
    for _ in range(4):
        before = {n: p.detach().clone() for n, p in t.lm.named_parameters()}
        r = t.train_step()
        t._guard(r)
        results.append(r)
        scales.append(t.precision.loss_scale())
        if r.skipped:
            assert all(torch.equal(before[n], p) for n, p in t.lm.named_parameters())
    assert [r.skipped for r in results] == [False, True, False, False]
    assert scales[1] == scales[0] / 2  # backoff
    assert t.skipped_total == 1 and t.skipped_in_row == 0
    assert all(math.isfinite(r.loss) for r in results)


def test_non_finite_gradients_are_skipped_and_too_many_stop_the_run(tiny_train_dir, tmp_path):
    t = Trainer(_config(tiny_train_dir, tmp_path, max_skipped_steps=2, max_steps=10))
    handle = _inject_once(t.lm.norm.weight, at_call=1, value=float("nan"))
    before = {n: p.detach().clone() for n, p in t.lm.named_parameters()}
    r = t.train_step()
    t._guard(r)
    assert r.skipped and t.skipped_total == 1
    assert all(torch.equal(before[n], p) for n, p in t.lm.named_parameters())
    handle.remove()
    t._guard(t.train_step())  # a clean step ends the run of skips
    assert t.skipped_in_row == 0
    t.lm.norm.weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    t._guard(t.train_step())
    with pytest.raises(TrainingError, match="2 non-finite steps in a row"):
        t._guard(t.train_step())


def test_toml_config_with_flag_overrides(tmp_path):
    f = tmp_path / "train.toml"
    f.write_text('[train]\nlr = 0.01\nmax_steps = 50\ndata = "corpus.txt"\nactivation_checkpointing = "full"\n')
    cfg = build_config(load_toml(f), {"lr": 0.002, "max_steps": None})
    assert cfg.lr == 0.002 and cfg.max_steps == 50 and cfg.data == ["corpus.txt"]
    assert cfg.activation_checkpointing == "full"
    f.write_text("[train]\nlearning_rate = 0.01\n")
    with pytest.raises(ConfigError, match="unknown key.*learning_rate"):
        load_toml(f)
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        TrainConfig(activation_checkpointing="some")
    with pytest.raises(ConfigError, match="warmup_steps"):
        TrainConfig(warmup_steps=100, max_steps=100)


def test_bad_data_path_is_one_clear_error(tiny_train_dir, tmp_path, capsys):
    argv = train_argv(tiny_train_dir, tmp_path / "x", "--data", str(tmp_path / "missing.txt"))
    argv[argv.index("--data") + 1] = str(tmp_path / "missing.txt")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "missing.txt: no such file or directory" in err and "Traceback" not in err
