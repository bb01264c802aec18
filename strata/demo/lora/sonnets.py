"""The demo adapter: the demo model (plays and poems) fine-tuned by `strata train --lora` on
Shakespeare's Sonnets 1-140, so that it writes fourteen-line verse addressed to "thee" where the
base writes play scenes with speaker names. Sonnets 141-154 are held out for the adapter's
held-out loss (the base saw all 154 among its 40 training texts). 40 steps of 8 x 128 tokens
(~1.5 epochs of the 27k-token training part): past ~2 epochs the held-out loss rises again.

    python -m strata.demo.lora.sonnets            # split the sonnets, train, copy the adapter here
    strata serve --enable-lora --lora-modules sonnets=strata/demo/lora/sonnets

The adapter ships in this directory (PEFT format: adapter_config.json, adapter_model.safetensors,
and strata_train.json, the run's record); `TRAIN_FLAGS` is the command that made it.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

ADAPTER_DIR = Path(__file__).resolve().parent / "sonnets"
HELD_OUT_FROM = 141  # sonnets 141-154: the held-out text
_HEADING = re.compile(r"(?m)^([IVXLC]+)\n")  # each sonnet opens with its number in Roman numerals
TRAIN_FLAGS = (
    "--lora", "--model", "demo", "--lora-rank", "8", "--lora-alpha", "16", "--lora-dropout", "0.05",
    "--seq-len", "128", "--micro-batch-size", "8", "--max-steps", "40", "--warmup-steps", "4",
    "--lr", "2e-3", "--min-lr-ratio", "0.1", "--weight-decay", "0.0", "--precision", "float32", "--seed", "0",
    "--eval-every", "5", "--eval-batches", "32", "--log-every", "5", "--save-every", "0",
)
FILES = ("adapter_config.json", "adapter_model.safetensors", "strata_train.json")


def split(sonnets: Path, dest: Path) -> tuple[Path, Path]:
    """Write dest/train/sonnets_1-140.txt and dest/heldout/sonnets_141-154.txt; their directories."""
    text = sonnets.read_text(encoding="utf-8")
    heads = list(_HEADING.finditer(text))
    if len(heads) != 154:
        raise SystemExit(f"{sonnets}: expected 154 numbered sonnets, found {len(heads)}")
    cut = heads[HELD_OUT_FROM - 1].start()
    train, held = dest / "train", dest / "heldout"
    for d in (train, held):
        d.mkdir(parents=True, exist_ok=True)
    (train / f"sonnets_1-{HELD_OUT_FROM - 1}.txt").write_text(text[heads[0].start():cut], encoding="utf-8")
    (held / f"sonnets_{HELD_OUT_FROM}-154.txt").write_text(text[cut:], encoding="utf-8")
    return train, held


def train_command(train: Path, held: Path, out: Path, threads: int | None) -> list[str]:
    cmd = [sys.executable, "-m", "strata", "train", *TRAIN_FLAGS, "--data", str(train), "--eval-data", str(held),
           "--out-dir", str(out), "--export", str(out / "adapter"), "--no-resume"]
    return cmd + (["--threads", str(threads)] if threads else [])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m strata.demo.lora.sonnets", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default="data/shakespeare/train/sonnets.txt", help="the Sonnets' text")
    p.add_argument("--out-dir", default="runs/lora-sonnets", help="the split, the run, its checkpoints")
    p.add_argument("--threads", type=int, default=None, help="torch threads of the training run")
    p.add_argument("--no-install", action="store_true", help=f"leave {ADAPTER_DIR} as it is")
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    train, held = split(Path(args.corpus), out / "data")
    cmd = train_command(train, held, out, args.threads)
    print(" ".join(cmd[1:]), file=sys.stderr)
    code = subprocess.call(cmd)
    if code or args.no_install:
        return code
    ADAPTER_DIR.mkdir(exist_ok=True)
    for name in FILES:
        shutil.copyfile(out / "adapter" / name, ADAPTER_DIR / name)
    print(f"installed the adapter in {ADAPTER_DIR}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
