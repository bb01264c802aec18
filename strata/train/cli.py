"""`strata train`: flags for every TrainConfig field, `--config FILE.toml`, `--check`, `--export DIR`.

With --lora the run ends by writing the adapter as a PEFT directory: to --export DIR when given,
else to OUT_DIR/adapter (a run that trains an adapter always leaves one)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import typing
from pathlib import Path

from strata.comm.world import World
from strata.config import DTYPES
from strata.hardware.processes import die_with_parent
from strata.train.config import (
    ACTIVATION_CHECKPOINTING,
    ALL_LINEAR,
    BASE_QUANTIZATION,
    COMM_DTYPES,
    DISTRIBUTED,
    LORA_TARGETS,
    PRECISIONS,
    QUANT_GROUP_SIZES,
    TrainConfig,
    build_config,
    load_toml,
)
from strata.train.launch import LocalTrainRanks
from strata.train.moe_loss import imbalance, text_histogram
from strata.train.preflight import run_checks
from strata.train.trainer import Trainer, TrainResult

logger = logging.getLogger(__name__)

NAME = "train"
HELP = "train a model (mixed precision, checkpointing, DDP/FSDP)"
EPILOG = """examples:
  strata train --data data/shakespeare/train --eval-data data/shakespeare/heldout --max-steps 200
  strata train --config train.toml --lr 1e-3              # flags override the file's keys
  strata train --model smol-135m --data corpus/ --precision bfloat16 --activation-checkpointing full
  torchrun --nproc-per-node 2 -m strata train --data corpus/   # DDP, one host or many
  strata train --data corpus/ --nproc-per-node 2 --distributed fsdp  # ranks spawned locally
  strata train --data corpus/ --export out/model            # then: strata generate --model out/model
  strata train --data corpus/ --check                       # preflight checklist, trains nothing
  strata train --lora --model demo --data data/shakespeare/train/sonnets.txt --lr 1e-3 --export out/sonnets
  strata train --lora --model ./Llama-3.2-1B --quantization int4 --lora-rank 8 --lora-target-modules q_proj v_proj \
      --data corpus/ --precision bfloat16     # QLoRA-style: a frozen int4 base; then
  strata serve --model ./Llama-3.2-1B --enable-lora --lora-modules mine=runs/train/adapter
"""

FLAG_HELP = {
    "model": "named size (demo, tiny, tiny-moe, smol-135m, qwen-0.5b), a config.json, or an HF checkpoint dir",
    "tokenizer": "directory with tokenizer.json (default: the model's, else the demo tokenizer)",
    "data": "text files, JSONL files (a \"text\" field) or directories of them (repeatable)",
    "eval_data": "held-out text for the evaluation loss (repeatable)",
    "num_workers": "DataLoader worker processes that tokenize (0 = this process)",
    "precision": "compute dtype under autocast; auto = by measurement on this device",
    "activation_checkpointing": "recompute activations in backward: " + " | ".join(ACTIVATION_CHECKPOINTING),
    "ac_every": "selective checkpointing: every k-th decoder layer",
    "loss_chunk_tokens": "run the LM head + loss over this many tokens at a time, recomputed in "
                         "backward: the [tokens, vocab] logits never exist whole (0 = off)",
    "fused_loss": "LM head + cross-entropy fused by chunks of tokens, their gradients computed in the "
                  "forward: no [tokens, vocab] logits, nothing recomputed (--loss-chunk-tokens wins)",
    "router_aux_loss_coef": "MoE: weight of the load-balancing loss added to the LM loss; None = the "
                            "model config's router_aux_loss_coef",
    "router_z_loss_coef": "MoE: weight of the router z-loss (0 = off); None = the model config's "
                          "router_z_loss_coef",
    "distributed": "data parallelism when there are several ranks: ddp or fsdp (FSDP2 fully_shard)",
    "nproc_per_node": "spawn this many ranks locally (under torchrun its environment decides)",
    "ddp_comm_dtype": "compress DDP's gradient all-reduce to 16 bits (torch comm hook)",
    "save_every": "checkpoint every N steps (0 = only at the end and on SIGTERM)",
    "keep_last": "checkpoints to keep",
    "grad_clip": "clip gradients to this global norm (0 = off)",
    "min_lr_ratio": "the cosine schedule ends at lr x this",
    "spike_factor": "report a loss above this x the running median",
    "max_skipped_steps": "stop after this many non-finite steps in a row",
    "lora": "train a LoRA adapter on the frozen base (an HF checkpoint dir, or a named size as strata serve "
            "serves it: demo = the demo checkpoint) and write it as a PEFT adapter directory (--export DIR, "
            "else OUT_DIR/adapter)",
    "lora_rank": "LoRA rank r",
    "lora_alpha": "LoRA alpha (the update is scaled by alpha / r, or alpha / sqrt(r) with --use-rslora)",
    "lora_dropout": "dropout on the LoRA branch's input (PEFT's lora_dropout)",
    "lora_target_modules": f"PEFT module names to adapt ({' '.join(LORA_TARGETS)}; Phi-3: qkv_proj "
                           f"gate_up_proj ...) or {ALL_LINEAR}",
    "use_rslora": "rank-stabilised LoRA: scale by alpha / sqrt(r)",
    "quantization": "--lora: hold the frozen base's projections in int8 / int4 (QLoRA-style; gradients "
                    "flow through the dequantized weights)",
    "quantization_group_size": "int4: input columns sharing one scale",
}
CHOICES = {"precision": PRECISIONS, "activation_checkpointing": ACTIVATION_CHECKPOINTING,
           "distributed": DISTRIBUTED, "ddp_comm_dtype": COMM_DTYPES, "quantization": BASE_QUANTIZATION,
           "quantization_group_size": QUANT_GROUP_SIZES}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="TOML file of TrainConfig keys (flags override it)")
    p.add_argument("--check", action="store_true", help="run the preflight checklist and exit")
    p.add_argument("--export", default=None, metavar="DIR",
                   help="write the trained model as an HF directory (--lora: the PEFT adapter directory)")
    p.add_argument("--export-dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype of the exported weights (training keeps fp32 masters)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    defaults = TrainConfig()
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        default = getattr(defaults, f.name)
        help_text = FLAG_HELP.get(f.name, f.name.replace("_", " "))
        hint = hints[f.name]
        if f.name in ("data", "eval_data"):
            p.add_argument(_flag(f.name), action="append", default=None, help=help_text)
        elif f.name == "lora_target_modules":
            p.add_argument(_flag(f.name), nargs="+", default=None, metavar="NAME",
                           help=f"{help_text} (default: {' '.join(default)})")
        elif hint is bool:
            p.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, default=None,
                           help=f"{help_text} (default: {default})")
        else:
            base = next((t for t in typing.get_args(hint) if t is not type(None)), hint) if typing.get_args(hint) else hint
            p.add_argument(_flag(f.name), type=base, default=None, choices=CHOICES.get(f.name),
                           help=f"{help_text} (default: {default})")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    file_values = load_toml(args.config) if args.config else {}
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    return build_config(file_values, flags)


def run(args: argparse.Namespace) -> int:
    die_with_parent()
    cfg = config_from_args(args)
    if args.check:
        return run_checks(cfg)
    if cfg.nproc_per_node > 1 and World.from_env() is None:
        raw = getattr(args, "raw_argv", sys.argv[1:])
        train_args = raw[raw.index("train") + 1:]
        with LocalTrainRanks(cfg.nproc_per_node, train_args) as ranks:
            code = _run(cfg, args)
        if ranks.failed():
            print(f"error: training rank(s) exited with {ranks.failed()}", file=sys.stderr)
            return 1
        return code
    return _run(cfg, args)


def _run(cfg: TrainConfig, args: argparse.Namespace) -> int:
    trainer = Trainer(cfg)
    if trainer.rank == 0 and cfg.lora:
        base = f"{cfg.quantization} " if cfg.quantization else ""
        print(f"training a rank-{cfg.lora_rank} LoRA adapter ({trainer.trainable_params / 1e6:.3f}M parameters, "
              f"{len(trainer.lora_sites)} modules) on the frozen {base}base {cfg.model} "
              f"({trainer.model_config.num_params() / 1e6:.2f}M)", file=sys.stderr)
    if trainer.rank == 0:
        print(f"training {cfg.model} ({trainer.model_config.num_params() / 1e6:.2f}M parameters) on "
              f"{trainer.data.tokens:,} tokens x {trainer.world_size} rank(s); precision "
              f"{trainer.precision.name} ({trainer.precision_reason}); activation checkpointing "
              f"{cfg.activation_checkpointing} ({trainer.num_checkpointed} wrapped)", file=sys.stderr)
    clean = False
    try:
        result = trainer.fit()
        export = None
        dest = args.export or (str(trainer.out / "adapter") if cfg.lora else None)
        if dest and not result.stopped_by_signal:
            export = trainer.export(Path(dest), DTYPES[args.export_dtype])
        clean = True
    finally:
        trainer.close(clean)
    if trainer.rank == 0:
        summary = {"steps": result.steps, "final_loss": result.final_loss, "eval_loss": result.eval_loss,
                   "skipped_steps": result.skipped_steps, "checkpoint": str(result.checkpoint),
                   "export": str(export) if export else None, "stopped_by_signal": result.stopped_by_signal}
        if cfg.lora:
            summary["adapter"] = summary["export"]
        if result.expert_load is not None:
            first, last = result.expert_load
            summary["expert_load"] = {"first_step": first.sum(0).tolist(), "last_step": last.sum(0).tolist(),
                                      "imbalance": [imbalance(first), imbalance(last)],
                                      "plot": str(result.expert_plot) if result.expert_plot else None}
            _print_expert_load(result)
        if args.json:
            print(json.dumps(summary))
        else:
            ev = f", held-out loss {result.eval_loss:.4f}" if result.eval_loss is not None else ""
            print(f"trained to step {result.steps}: loss {result.final_loss:.4f}{ev}; checkpoint "
                  f"{result.checkpoint}" + (f"; exported {export}" if export else ""), file=sys.stderr)
    return 143 if result.stopped_by_signal else 0


def _print_expert_load(result: TrainResult) -> None:
    """The MoE run's per-expert token histogram, first step vs last (stderr, beside the summary)."""
    first, last = result.expert_load
    plot = f"; plot {result.expert_plot}" if result.expert_plot else ""
    print(f"tokens per expert (all MoE layers), first vs last step of this run; load imbalance (max/mean "
          f"per layer) {imbalance(first):.2f} -> {imbalance(last):.2f}{plot}", file=sys.stderr)
    print(text_histogram(first.sum(0).tolist(), last.sum(0).tolist()), file=sys.stderr)
