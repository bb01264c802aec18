"""A HF fast tokenizer (tokenizer.json + tokenizer_config.json) rebuilt from a GGUF file's metadata.

A GGUF file carries its tokenizer in `tokenizer.*` metadata keys (llama.cpp's names, see the
`gguf` package's Keys.Tokenizer): the tokens in id order, their types, the BPE merges (or the
SentencePiece scores), the special token ids and the name of the pre-tokenizer. The GGUF loader
writes what tokenizer_files() returns into a directory that Tokenizer.from_dir() reads.

Supported (`tokenizer.ggml.model`):
  - "gpt2": byte-level BPE (Llama 3, Qwen2/2.5/3, SmolLM, GPT-2 style); `tokenizer.ggml.pre`
    names the split regex (PRE_TOKENIZERS below; an unknown name is refused, not guessed).
  - "llama": SentencePiece BPE (Llama 2, Mistral v0.1, TinyLlama): a tokenizers BPE with byte
    fallback whose merges come from the scores (a pair merges into a piece of the vocabulary,
    higher score first: SentencePiece's own rule), with Llama 2's tokenizer.json normalizer
    and decoder.
A GGUF that holds the original tokenizer.json (`tokenizer.huggingface.json`) gets that file.

Nothing read here is evaluated; every value is checked for type, length and range first.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

from strata.errors import ModelLoadError

logger = logging.getLogger(__name__)

# GGUF token types (gguf.constants.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_TOKEN_TYPES = (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE)

K_MODEL = "tokenizer.ggml.model"
K_PRE = "tokenizer.ggml.pre"
K_TOKENS = "tokenizer.ggml.tokens"
K_TYPES = "tokenizer.ggml.token_type"
K_SCORES = "tokenizer.ggml.scores"
K_MERGES = "tokenizer.ggml.merges"
K_BOS = "tokenizer.ggml.bos_token_id"
K_EOS = "tokenizer.ggml.eos_token_id"
K_UNK = "tokenizer.ggml.unknown_token_id"
K_PAD = "tokenizer.ggml.padding_token_id"
K_ADD_BOS = "tokenizer.ggml.add_bos_token"
K_ADD_EOS = "tokenizer.ggml.add_eos_token"
K_ADD_PREFIX = "tokenizer.ggml.add_space_prefix"
K_HF_JSON = "tokenizer.huggingface.json"
K_CHAT_TEMPLATE = "tokenizer.chat_template"

SPIECE_UNDERLINE = "\u2581"  # '▁', SentencePiece's space

# The split regexes, as the models' own tokenizer.json files write them (llama.cpp's
# llama-vocab.cpp carries the same ones, rewritten for its regex engine).
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT: these four applied one after the other
_DEFAULT_REGEXES = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_REGEX, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class _Pre:
    """How one family of `tokenizer.ggml.pre` names splits text before byte-level BPE."""

    kind: str  # "split" (regexes, then ByteLevel without its regex), "bytelevel", "digits"
    regexes: tuple[str, ...] = ()
    ignore_merges: bool = False  # a pre-token that is a whole vocabulary entry is kept (Llama 3)
    nfc: bool = False  # Qwen2's tokenizer.json normalizes to NFC first
    add_bos: bool = False  # llama.cpp's default when tokenizer.ggml.add_bos_token is absent


_LLAMA3 = _Pre("split", (_LLAMA3_REGEX,), ignore_merges=True, add_bos=True)
_QWEN2 = _Pre("split", (_QWEN2_REGEX,), nfc=True)
_GPT2 = _Pre("bytelevel")
_SMOLLM = _Pre("digits")  # single digits, then GPT-2's regex (SmolLM / StarCoder tokenizer.json)
PRE_TOKENIZERS: dict[str, _Pre] = {
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "falcon3": _LLAMA3,
    "dbrx": _Pre("split", (_LLAMA3_REGEX,)), "smaug-bpe": _Pre("split", (_LLAMA3_REGEX,)),
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
    "gpt-2": _GPT2, "phi-2": _GPT2, "mpt": _GPT2, "olmo": _GPT2,
    "smollm": _SMOLLM, "starcoder": _SMOLLM, "refact": _SMOLLM,
    "default": _Pre("split", _DEFAULT_REGEXES),
}
MODELS = ("gpt2", "llama")


def tokenizer_files(meta: dict[str, Any], source: str) -> dict[str, str]:
    """GGUF metadata -> {"tokenizer.json": text, "tokenizer_config.json": text}.

    `meta` maps GGUF metadata keys to plain values (str, int, float, bool, lists of them);
    `source` (the GGUF path) names the file in errors. Raises ModelLoadError for a tokenizer
    this module cannot rebuild faithfully (an unknown model or pre-tokenizer) or bad metadata."""
    g = _Meta(meta, source)
    model = g.get_str(K_MODEL, required=True)
    if model not in MODELS:
        raise ModelLoadError(
            f"{source}: {K_MODEL} = {model!r} is not supported (supported: {', '.join(MODELS)}); "
            f"{_FIX}")
    tokens = g.str_list(K_TOKENS)
    n = len(tokens)
    if n == 0:
        raise ModelLoadError(f"{source}: {K_TOKENS} is empty")
    types = g.int_list(K_TYPES, n) if K_TYPES in meta else [NORMAL] * n
    bad = next((i for i, t in enumerate(types) if t not in _TOKEN_TYPES), None)
    if bad is not None:
        raise ModelLoadError(f"{source}: {K_TYPES}[{bad}] = {types[bad]} is not a GGUF token type "
                             f"(one of {', '.join(map(str, _TOKEN_TYPES))})")
    ids = {k: g.token_id(k, n) for k in (K_BOS, K_EOS, K_UNK, K_PAD)}
    add_bos, add_eos = g.get_bool(K_ADD_BOS), g.get_bool(K_ADD_EOS)
    template = g.get_str(K_CHAT_TEMPLATE)

    hf_json = g.get_str(K_HF_JSON)
    if hf_json is not None:
        try:
            tokenizers.Tokenizer.from_str(hf_json)
        except Exception as exc:  # the Rust side raises plain Exception
            raise ModelLoadError(f"{source}: {K_HF_JSON} is not a loadable tokenizer.json ({exc})") from exc
        text = hf_json
    else:
        if model == "gpt2":
            pre_name = g.get_str(K_PRE)
            if pre_name is None:
                logger.warning("%s: no %s; using llama.cpp's 'default' pre-tokenizer", source, K_PRE)
                pre_name = "default"
            pre = PRE_TOKENIZERS.get(pre_name)
            if pre is None:
                raise ModelLoadError(
                    f"{source}: {K_PRE} = {pre_name!r} is not a known pre-tokenizer (supported: "
                    f"{', '.join(sorted(PRE_TOKENIZERS))}); {_FIX}")
            if add_bos is None:
                add_bos = pre.add_bos
            backend = _byte_level_bpe(g, tokens, types, pre)
        else:
            scores = g.float_list(K_SCORES, n)
            if add_bos is None:
                add_bos = True  # llama.cpp's default for SentencePiece vocabularies
            add_prefix = g.get_bool(K_ADD_PREFIX)
            backend = _sentencepiece_bpe(
                source, tokens, types, scores, ids[K_UNK], True if add_prefix is None else add_prefix)
        _add_special_tokens(backend, tokens, types)
        backend.post_processor = _post_processor(
            source, tokens, ids[K_BOS] if add_bos else None, ids[K_EOS] if add_eos else None,
            byte_level=model == "gpt2")
        text = backend.to_str()

    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                              "clean_up_tokenization_spaces": False}
    for key, field in ((K_BOS, "bos_token"), (K_EOS, "eos_token"), (K_UNK, "unk_token"),
                       (K_PAD, "pad_token")):
        if ids[key] is not None:
            config[field] = tokens[ids[key]]
    if add_bos is not None:
        config["add_bos_token"] = add_bos
    if add_eos is not None:
        config["add_eos_token"] = add_eos
    if template is not None:
        config["chat_template"] = template
    return {"tokenizer.json": text,
            "tokenizer_config.json": json.dumps(config, ensure_ascii=False, indent=2)}


_FIX = ("use the model's original tokenizer instead: a directory holding its tokenizer.json "
        "(and tokenizer_config.json)")


class _Meta:
    """Typed, checked reads of GGUF metadata values."""

    def __init__(self, meta: dict[str, Any], source: str) -> None:
        if not isinstance(meta, dict):
            raise ModelLoadError(f"{source}: GGUF metadata must be a dict, got {type(meta).__name__}")
        self.meta, self.source = meta, source

    def _bad(self, key: str, problem: str) -> ModelLoadError:
        sep = "" if problem.startswith("[") else " "  # "key[3] must be ...", "key is missing"
        return ModelLoadError(f"{self.source}: GGUF metadata {key}{sep}{problem}")

    def get_str(self, key: str, required: bool = False) -> str | None:
        value = self.meta.get(key)
        if value is None:
            if required:
                raise self._bad(key, "is missing")
            return None
        if not isinstance(value, str):
            raise self._bad(key, f"must be a string, got {type(value).__name__}")
        return value

    def get_bool(self, key: str) -> bool | None:
        value = self.meta.get(key)
        if value is None or isinstance(value, bool):
            return value
        raise self._bad(key, f"must be a bool, got {value!r}")

    def token_id(self, key: str, n: int) -> int | None:
        value = self.meta.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(key, f"must be an integer token id, got {value!r}")
        if not 0 <= value < n:
            raise self._bad(key, f"= {value} is outside the vocabulary (0..{n - 1}, from {K_TOKENS})")
        return value

    def _list(self, key: str, n: int | None) -> list[Any]:
        value = self.meta.get(key)
        if value is None:
            raise self._bad(key, "is missing")
        if not isinstance(value, list):
            raise self._bad(key, f"must be a list, got {type(value).__name__}")
        if n is not None and len(value) != n:
            raise self._bad(key, f"has {len(value)} entries but {K_TOKENS} has {n}")
        return value

    def str_list(self, key: str, n: int | None = None) -> list[str]:
        value = self._list(key, n)
        bad = next((i for i, v in enumerate(value) if not isinstance(v, str)), None)
        if bad is not None:
            raise self._bad(key, f"[{bad}] must be a string, got {type(value[bad]).__name__}")
        return value

    def int_list(self, key: str, n: int) -> list[int]:
        value = self._list(key, n)
        bad = next((i for i, v in enumerate(value) if isinstance(v, bool) or not isinstance(v, int)), None)
        if bad is not None:
            raise self._bad(key, f"[{bad}] must be an integer, got {value[bad]!r}")
        return value

    def float_list(self, key: str, n: int) -> list[float]:
        value = self._list(key, n)
        bad = next((i for i, v in enumerate(value)
                    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v), None)
        if bad is not None:
            raise self._bad(key, f"[{bad}] must be a number, got {value[bad]!r}")
        return [float(v) for v in value]


def _vocab(tokens: list[str], source: str) -> dict[str, int]:
    """token -> id; a repeated token keeps its first id (a later copy cannot be told apart)."""
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        if vocab.setdefault(tok, i) != i:
            logger.warning("%s: %s[%d] %r repeats id %d; the later copy is left out",
                           source, K_TOKENS, i, tok, vocab[tok])
    return vocab


def _byte_level_bpe(g: _Meta, tokens: list[str], types: list[int], pre: _Pre) -> tokenizers.Tokenizer:
    vocab = _vocab(tokens, g.source)
    merges: list[tuple[str, str]] = []
    for i, merge in enumerate(g.str_list(K_MERGES)):
        cut = merge.find(" ", 1)  # llama.cpp's rule: the first space after the first character
        left, right = (merge[:cut], merge[cut + 1:]) if cut > 0 else (merge, "")
        if not left or not right or left not in vocab or right not in vocab:
            raise g._bad(K_MERGES, f"[{i}] = {merge!r} is not two tokens of {K_TOKENS} separated by a space")
        merges.append((left, right))
    backend = tokenizers.Tokenizer(models.BPE(
        vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=pre.ignore_merges))
    if pre.nfc:
        backend.normalizer = normalizers.NFC()
    if pre.kind == "split":
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(tokenizers.Regex(r), behavior="isolated", invert=False) for r in pre.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre.kind == "digits":
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(source: str, tokens: list[str], types: list[int], scores: list[float],
                       unk_id: int | None, add_prefix: bool) -> tokenizers.Tokenizer:
    """SentencePiece BPE as a tokenizers BPE: merges ranked by the score of the piece they make
    (transformers' SentencePieceExtractor rule), byte fallback to the <0xXX> tokens."""
    vocab = _vocab(tokens, source)
    mergeable = {tok: i for tok, i in vocab.items() if types[i] in (NORMAL, USER_DEFINED)}
    found: list[tuple[float, int, int, int, str, str]] = []
    for piece, i in mergeable.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            li, ri = mergeable.get(left), mergeable.get(right)
            if li is not None and ri is not None:
                found.append((-scores[i], i, li, ri, left, right))
    found.sort()  # higher score first; ties by the piece's id, then the ids of its two halves
    merges = [(left, right) for *_, left, right in found]
    unk = tokens[unk_id] if unk_id is not None else None
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    steps: list[normalizers.Normalizer] = [normalizers.Prepend(SPIECE_UNDERLINE)] if add_prefix else []
    backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", SPIECE_UNDERLINE)])
    dec: list[decoders.Decoder] = [decoders.Replace(SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        dec.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(dec)
    return backend


def _add_special_tokens(backend: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control and unknown tokens become special added tokens (matched whole, skipped on decode),
    user-defined ones plain added tokens (matched whole, kept), as in the HF tokenizer.json. They
    are already in the model's vocabulary, so they keep their ids."""
    special = [tokenizers.AddedToken(t, special=True, normalized=False)
               for t, k in zip(tokens, types) if k in (CONTROL, UNKNOWN)]
    user = [tokenizers.AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types) if k == USER_DEFINED]
    if special:
        backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)


def _post_processor(source: str, tokens: list[str], bos: int | None, eos: int | None,
                    byte_level: bool) -> processors.PostProcessor | None:
    steps: list[processors.PostProcessor] = [processors.ByteLevel(trim_offsets=False)] if byte_level else []
    if bos is not None or eos is not None:
        pre = f"{tokens[bos]}:0 " if bos is not None else ""
        post = f" {tokens[eos]}:0" if eos is not None else ""
        pre1 = f"{tokens[bos]}:1 " if bos is not None else ""
        post1 = f" {tokens[eos]}:1" if eos is not None else ""
        specials = [(tokens[i], i) for i in dict.fromkeys(x for x in (bos, eos) if x is not None)]
        try:
            steps.append(processors.TemplateProcessing(
                single=f"{pre}$A:0{post}", pair=f"{pre}$A:0{post} {pre1}$B:1{post1}", special_tokens=specials))
        except Exception as exc:
            raise ModelLoadError(f"{source}: cannot build the BOS/EOS template from {K_BOS} / {K_EOS} ({exc})") from exc
    if not steps:
        return None
    return steps[0] if len(steps) == 1 else processors.Sequence(steps)
