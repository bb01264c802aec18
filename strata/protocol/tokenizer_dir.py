"""--tokenizer DIR: which directory's tokenizer serves a model (engine/build.py, the server's
front end and tokenizer workers). No torch here: the server front end imports it."""

from __future__ import annotations

import logging
from pathlib import Path

import tokenizers

from strata.errors import ConfigError

logger = logging.getLogger(__name__)

# in a derived GGUF model directory (graph/gguf_model.py): the GGUF files behind it
GGUF_POINTER = "strata_gguf.json"

# a sample both tokenizers of a GGUF model encode when --tokenizer is given: scripts, digits,
# whitespace runs and the chat markup their pre-tokenizers split differently when they differ
_TOKENIZER_PROBE = ("Hello, world!  It's 2026: 12345 tokens.\n\n\tdef f(x):\n        return x**2  # ok\n"
                    "Grüße aus Zürich — naïve café. Привет, мир! 你好，世界。 こんにちは 🙂 <|im_start|>user")


def tokenizer_dir(model_dir: Path, tokenizer: str | None, vocab_size: int) -> Path:
    """The directory whose tokenizer serves `model_dir`: --tokenizer DIR, else the model's own. A
    DIR whose ids run past the model's vocabulary is refused; for a GGUF model (whose tokenizer
    Strata derived from the file) DIR's vocabulary must be the file's, token for token, and an
    encoding that differs on a probe text is named in a warning (DIR's is used, as asked)."""
    if tokenizer is None:
        return model_dir
    d = Path(tokenizer).expanduser()
    if not (d / "tokenizer.json").is_file():
        raise ConfigError(f"--tokenizer {tokenizer}: no tokenizer.json there; give a local directory holding the "
                          "tokenizer files (tokenizer.json, tokenizer_config.json)")
    theirs = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    vocab = theirs.get_vocab(with_added_tokens=True)
    if vocab and max(vocab.values()) >= vocab_size:
        raise ConfigError(f"--tokenizer {tokenizer}: its ids run to {max(vocab.values())}, past the model's "
                          f"{vocab_size}-token vocabulary; it is not this model's tokenizer")
    if (model_dir / GGUF_POINTER).is_file() and (model_dir / "tokenizer.json").is_file():
        own = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        mine = own.get_vocab(with_added_tokens=True)
        if mine != vocab:
            by_id = {i: t for t, i in vocab.items()}
            diff = next(((i, t) for t, i in sorted(mine.items(), key=lambda kv: kv[1]) if by_id.get(i) != t),
                        (None, None))
            raise ConfigError(f"--tokenizer {tokenizer}: its vocabulary is not the GGUF's ({len(vocab)} vs {len(mine)} "
                              f"tokens; id {diff[0]} is {by_id.get(diff[0])!r} there, {diff[1]!r} in the file); "
                              "give the tokenizer of the model the GGUF was converted from")
        a, b = own.encode(_TOKENIZER_PROBE).ids, theirs.encode(_TOKENIZER_PROBE).ids
        if a != b:
            at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            logger.warning("--tokenizer %s: same vocabulary as the GGUF's, but a probe text encodes differently "
                           "from token %d (%d vs %d tokens): its pre-tokenizer differs; using %s as asked",
                           tokenizer, at, len(b), len(a), d)
    logger.info("tokenizer: %s (--tokenizer)", d)
    return d
