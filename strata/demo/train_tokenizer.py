"""Train the demo model's byte-level BPE tokenizer on the repository's Shakespeare corpus.

The outputs (tokenizer.json, tokenizer_config.json) ship in the package; this script
exists so they can be rebuilt and checked. Training is deterministic: running it
again produces byte-identical files (`--check` verifies that without writing).
The corpus (data/shakespeare/train/, see its README) lives in the repository, not the wheel.

    python -m strata.demo.train_tokenizer [--corpus DIR] [--check]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

logger = logging.getLogger(__name__)

DEMO_DIR = Path(__file__).resolve().parent
CORPUS_DIR = DEMO_DIR.parents[1] / "data" / "shakespeare" / "train"
BPE_VOCAB_SIZE = 4096  # byte alphabet + merges; special tokens come after, Llama-3 style
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
EOT_TOKEN = "<|eot_id|>"
SPECIAL_TOKENS = [
    BOS_TOKEN,
    EOS_TOKEN,
    "<|start_header_id|>",
    "<|end_header_id|>",
    EOT_TOKEN,
]
VOCAB_MULTIPLE = 64  # reserved special tokens pad the vocabulary up to a multiple of this

# Llama-3 chat template: bos, then one header/content/eot block per message.
CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}"
    "{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def build_tokenizer(corpus: str) -> Tokenizer:
    """Train byte-level BPE on `corpus` and add specials, reserved tokens and BOS post-processing."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.splitlines(keepends=True), trainer)
    base = tok.get_vocab_size()
    n_specials = len(SPECIAL_TOKENS)
    n_reserved = -(base + n_specials) % VOCAB_MULTIPLE
    names = SPECIAL_TOKENS + [f"<|reserved_special_token_{i}|>" for i in range(n_reserved)]
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in names])
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    logger.info("trained %d BPE tokens + %d special tokens", base, len(names))
    return tok


def tokenizer_config() -> dict:
    """The tokenizer_config.json that accompanies the demo tokenizer."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOT_TOKEN,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }


def read_corpus(corpus_dir: Path) -> str:
    """Every *.txt under `corpus_dir`, in name order, one after another."""
    files = sorted(corpus_dir.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no *.txt files in {corpus_dir} (the corpus ships in the repository's data/)")
    return "\n".join(f.read_text(encoding="utf-8") for f in files)


def render(corpus_dir: Path = CORPUS_DIR) -> dict[str, str]:
    """File name -> exact file text for both artifacts."""
    return render_text(read_corpus(corpus_dir))


def render_text(corpus: str) -> dict[str, str]:
    """The artifacts for a corpus given as text."""
    tok = build_tokenizer(corpus)
    return {
        "tokenizer.json": tok.to_str(pretty=True) + "\n",
        "tokenizer_config.json": json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=CORPUS_DIR, help="directory of *.txt to train on")
    parser.add_argument("--out", type=Path, default=DEMO_DIR, help="directory to write into")
    parser.add_argument("--check", action="store_true", help="compare with files in --out, write nothing")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    files = render(args.corpus)
    stale = []
    for name, text in files.items():
        path = args.out / name
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        else:
            path.write_text(text, encoding="utf-8")
            logger.info("wrote %s", path)
    if stale:
        logger.error("out of date: %s (rerun without --check)", ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
