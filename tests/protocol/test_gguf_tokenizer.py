"""strata.protocol.gguf_tokenizer: tokenizer.json rebuilt from GGUF metadata, against the HF original.

The references are HF tokenizer.json files: the packaged demo tokenizer (a real byte-level BPE
vocabulary and merges, Llama 3 special tokens) as it is, and with the pre-tokenizer, normalizer
and BPE flags of Llama 3 / Qwen2.5 / SmolLM copied from those models' own tokenizer.json. Each
is turned into GGUF metadata the way llama.cpp's convert_hf_to_gguf.py does it, converted back,
and must give the same ids and the same decoded text. SentencePiece ("llama") is checked
against a plain re-implementation of SentencePiece BPE encoding on a vocabulary trained here.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers, trainers

from strata.demo.model import demo_model_path
from strata.errors import ModelLoadError
from strata.protocol.gguf_tokenizer import PRE_TOKENIZERS, tokenizer_files
from strata.protocol.tokenizer import Tokenizer

SOURCE = "/models/test.gguf"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

TEXTS = [
    "Hello, world! This is a test of the tokenizer.",
    "The quick brown fox jumps over the lazy dog. I'm sure they've done it; we'll see, you'd know.",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }",
    "numbers 12345 3.14 1,000,000 and 2024-01-31 0x1F",
    "whitespace   runs\t\ttabs    and  trailing   ",
    "   leading spaces",
    "line one\nline two\n\n\nline five\r\nwindows\r\n",
    "unicode: café naïve résumé Ελληνικά русский",
    "emoji 🙂🚀👍🏽 and CJK 日本語のテキスト 中文 한국어",
    "MIXED Case WORDS, ALLCAPS and camelCaseIdentifiers_with_underscores",
    "",
    " ",
    "\n",
    "a",
]

# The pre-tokenizers and BPE flags of the original models' tokenizer.json files.
LLAMA3_PRE = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},  # noqa: E501
     "behavior": "Isolated", "invert": False},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
QWEN2_PRE = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},  # noqa: E501
     "behavior": "Isolated", "invert": False},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
SMOLLM_PRE = {"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": True},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
BYTE_LEVEL_PP = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


# Tokens (and the merges making them) that tell the pre-tokenizers apart: digit groups (Llama 3
# splits 3 digits, Qwen2 / SmolLM single ones, GPT-2 keeps " 12345" whole), newline runs and
# punctuation + newline (Llama 3 / Qwen2), "_w" (a non-letter before a word), "'T" (the
# case-insensitive contractions) and " zzyzx", a vocabulary word no merge leads to (Llama 3's
# ignore_merges). The demo vocabulary (trained on Shakespeare) has none of them.
EXTRA = [("12", "1 2"), ("123", "12 3"), ("45", "4 5"), ("\u01201", "\u0120 1"), ("\u012012", "\u01201 2"),
         ("\u0120123", "\u012012 3"), ("\u010a\u010a", "\u010a \u010a"), ("\u010a\u010a\u010a", "\u010a\u010a \u010a"),
         (".\u010a", ". \u010a"), ("_w", "_ w"), ("'T", "' T"), ("\u0120zzyzx", None)]
DISCRIMINATING = ["x 12345 y 123 45 6789", "para one.\n\n\npara two.\nend", "DON'T WON'T it'S",
                  "snake_with_words", "say zzyzx now, zzyzx!", "decomposed e\u0301 vs composed \u00e9"]


def _demo() -> tuple[dict[str, Any], dict[str, Any]]:
    """The demo tokenizer, its last-learned tokens swapped for EXTRA (ids unchanged)."""
    demo = demo_model_path()
    spec = json.loads((demo / "tokenizer.json").read_text(encoding="utf-8"))
    cfg = json.loads((demo / "tokenizer_config.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = spec["model"]["vocab"]
    top = max(vocab.values())
    by_id = {i: t for t, i in vocab.items()}
    dropped = {by_id[top - k] for k in range(len(EXTRA))}
    merges = [m for m in spec["model"]["merges"] if not ({*m, "".join(m)} & dropped)]
    for tok in dropped:
        del vocab[tok]
    for k, (tok, merge) in enumerate(EXTRA):
        assert tok not in vocab
        vocab[tok] = top - len(EXTRA) + 1 + k
        if merge is not None:
            merges.append(merge.split(" "))
    spec["model"]["merges"] = merges
    return spec, cfg


def _added(content: str, token_id: int, special: bool) -> dict[str, Any]:
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": special}


def reference(family: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tokenizer.json, tokenizer_config.json) of the demo vocabulary dressed as `family`."""
    spec, cfg = _demo()
    spec = copy.deepcopy(spec)
    if family == "gpt-2":
        return spec, cfg
    if family == "llama-bpe":  # Llama 3: ignore_merges, BOS added, ByteLevel + template processor
        spec["pre_tokenizer"] = LLAMA3_PRE
        spec["model"]["ignore_merges"] = True
        spec["post_processor"] = {"type": "Sequence", "processors": [
            {**BYTE_LEVEL_PP, "trim_offsets": False}, spec["post_processor"]]}
        return spec, cfg
    # Qwen2.5 / SmolLM: no BOS added; ChatML tokens (and Qwen3's non-special <think>) appended
    nxt = 1 + max(t["id"] for t in spec["added_tokens"])
    extra = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<think>", False)]
    spec["added_tokens"] += [_added(c, nxt + i, s) for i, (c, s) in enumerate(extra)]
    spec["post_processor"] = BYTE_LEVEL_PP
    cfg = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
           "chat_template": CHAT_TEMPLATE}
    if family == "qwen2":
        spec["normalizer"] = {"type": "NFC"}
        spec["pre_tokenizer"] = QWEN2_PRE
    elif family == "smollm":
        spec["pre_tokenizer"] = SMOLLM_PRE
    else:
        raise AssertionError(family)
    return spec, cfg


def gguf_metadata_for_hf_tokenizer(spec: dict[str, Any] | str | Path, cfg: dict[str, Any] | None = None,
                                   pre: str = "gpt-2") -> dict[str, Any]:
    """GGUF tokenizer metadata for a byte-level BPE tokenizer.json, as convert_hf_to_gguf.py writes it:
    every id below the vocabulary size in order (a hole becomes an unused "[PAD<id>]"), added
    tokens CONTROL when special else USER_DEFINED, the merges as "a b", the special ids of
    tokenizer_config.json, add_bos_token from the post-processor. `pre` is the name llama.cpp
    would pick by hashing the tokenizer's output (not recomputed here)."""
    if not isinstance(spec, dict):
        path = Path(spec)
        spec = json.loads(path.read_text(encoding="utf-8"))
        cfg_file = path.with_name("tokenizer_config.json")
        if cfg is None and cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    cfg = cfg or {}
    backend = tokenizers.Tokenizer.from_str(json.dumps(spec))
    vocab = backend.get_vocab(with_added_tokens=True)
    added = backend.get_added_tokens_decoder()
    reverse = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(max(reverse) + 1):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        else:
            tokens.append(reverse[i])
            types.append((CONTROL if added[i].special else USER_DEFINED) if i in added else NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.add_bos_token": _template_adds_bos(spec.get("post_processor")),
    }
    for field, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                       ("pad_token", "padding_token_id"), ("unk_token", "unknown_token_id")):
        if cfg.get(field):
            meta[f"tokenizer.ggml.{key}"] = vocab[cfg[field]]
    if cfg.get("chat_template"):
        meta["tokenizer.chat_template"] = cfg["chat_template"]
    return meta


def _template_adds_bos(processor: dict[str, Any] | None) -> bool:
    """Whether the post-processor's template puts a special token first (gguf's SpecialVocab rule)."""
    if not processor:
        return False
    if processor["type"] == "Sequence":
        return any(_template_adds_bos(p) for p in processor["processors"])
    return processor["type"] == "TemplateProcessing" and "SpecialToken" in processor["single"][0]


def _special_texts(backend: tokenizers.Tokenizer) -> list[str]:
    """Texts with the vocabulary's special tokens written inline."""
    have = [t for t in ("<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|im_start|>",
                        "<|im_end|>", "<think>") if backend.token_to_id(t) is not None]
    assert have
    return [f"{have[0]}user{have[-1]}\nHi there!{have[0]}", " ".join(have) + " tail",
            "".join(have) + "glued" + have[0] + "12345"]


def _check_same(ref: tokenizers.Tokenizer, got: tokenizers.Tokenizer, texts: list[str]) -> None:
    for text in texts:
        for add in (True, False):
            want = ref.encode(text, add_special_tokens=add).ids
            assert got.encode(text, add_special_tokens=add).ids == want, (text, add)
        ids = ref.encode(text, add_special_tokens=False).ids
        for skip in (True, False):
            assert got.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text


@pytest.mark.parametrize("family", ["gpt-2", "llama-bpe", "qwen2", "smollm"])
def test_byte_level_matches_hf(family: str, tmp_path: Path) -> None:
    spec, cfg = reference(family)
    ref = tokenizers.Tokenizer.from_str(json.dumps(spec))
    files = tokenizer_files(gguf_metadata_for_hf_tokenizer(spec, cfg, pre=family), SOURCE)
    got = tokenizers.Tokenizer.from_str(files["tokenizer.json"])
    assert got.get_vocab(with_added_tokens=True) == ref.get_vocab(with_added_tokens=True)
    texts = TEXTS + DISCRIMINATING + _special_texts(ref)
    _check_same(ref, got, texts)
    for text in TEXTS:  # byte-level BPE is lossless (the texts are NFC already)
        assert got.decode(got.encode(text).ids) == text

    # through Strata's own loader, next to the HF original loaded the same way
    for name, content in files.items():
        (tmp_path / "gguf").mkdir(exist_ok=True)
        (tmp_path / "gguf" / name).write_text(content, encoding="utf-8")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    mine, theirs = Tokenizer.from_dir(tmp_path / "gguf"), Tokenizer.from_dir(tmp_path / "hf")
    assert (mine.bos_token, mine.eos_token, mine.pad_token) == (theirs.bos_token, theirs.eos_token, theirs.pad_token)
    assert (mine.bos_token_id, mine.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert mine.vocab_size == theirs.vocab_size
    assert mine.all_special_ids == theirs.all_special_ids
    assert mine.encode_batch(texts) == theirs.encode_batch(texts)
    for text in texts:
        ids = theirs.encode(text)
        assert mine.decode(ids) == theirs.decode(ids)
    assert mine.chat_template == theirs.chat_template
    msgs = [{"role": "user", "content": "Hi"}]
    assert mine.apply_chat_template(msgs) == theirs.apply_chat_template(msgs)
    if family == "llama-bpe":
        assert mine.encode("Hi")[0] == mine.bos_token_id
    if family == "qwen2":
        assert mine.bos_token is None and mine.encode("Hi") == mine.encode("Hi", add_special_tokens=False)


def test_unused_tokens_keep_their_ids() -> None:
    """An UNUSED "[PAD<id>]" token (convert_hf_to_gguf.py's filler for an id the HF vocabulary
    lacks) stays at its id and is never produced."""
    spec, cfg = reference("gpt-2")
    gone = next(t for t, i in spec["model"]["vocab"].items() if i == 4000)
    spec["model"]["merges"] = [m for m in spec["model"]["merges"] if "".join(m) != gone and gone not in m]
    ref = tokenizers.Tokenizer.from_str(json.dumps(spec))  # the token kept, nothing leads to it
    meta = gguf_metadata_for_hf_tokenizer(spec, cfg)
    meta["tokenizer.ggml.tokens"][4000] = "[PAD4000]"
    meta["tokenizer.ggml.token_type"][4000] = UNUSED
    got = tokenizers.Tokenizer.from_str(tokenizer_files(meta, SOURCE)["tokenizer.json"])
    assert got.token_to_id("[PAD4000]") == 4000 and got.token_to_id(gone) is None
    assert got.token_to_id("<|eot_id|>") == ref.token_to_id("<|eot_id|>")
    assert got.get_vocab_size(with_added_tokens=True) == ref.get_vocab_size(with_added_tokens=True)
    _check_same(ref, got, TEXTS + ["[PAD4000]"])


def test_random_checkpoint_vocabulary() -> None:
    """The 152k-token vocabulary that random_models writes for the Qwen shape (built by `strata
    demo`, so only where it is cached; CI has no such cache)."""
    path = Path.home() / ".cache" / "strata" / "random-qwen-0.5b-s0" / "tokenizer.json"
    if not path.is_file():
        pytest.skip(f"{path} not built here (written by strata.demo.random_models; not in the repo)")
    ref = tokenizers.Tokenizer.from_file(str(path))
    got = tokenizers.Tokenizer.from_str(tokenizer_files(gguf_metadata_for_hf_tokenizer(path), SOURCE)["tokenizer.json"])
    assert got.get_vocab_size(with_added_tokens=True) == ref.get_vocab_size(with_added_tokens=True)
    _check_same(ref, got, TEXTS + _special_texts(ref))


def test_huggingface_json_is_used_as_is() -> None:
    spec, cfg = reference("qwen2")
    meta = gguf_metadata_for_hf_tokenizer(spec, cfg, pre="no-such-pre")
    meta["tokenizer.huggingface.json"] = json.dumps(spec)
    files = tokenizer_files(meta, SOURCE)
    assert files["tokenizer.json"] == meta["tokenizer.huggingface.json"]
    assert json.loads(files["tokenizer_config.json"])["eos_token"] == "<|im_end|>"


# --- SentencePiece ("llama") ---------------------------------------------------------------------

SPM_CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "Once upon a time there was a little model.",
    "def main():\n    print('hello world')\n", "numbers like 12345 and 3.14 are common in text",
    "Tokenizers split text into pieces; pieces become ids.", "the theory of the thing is there",
] * 20
SPM_TEXTS = [t for t in TEXTS if t] + ["Hello   there", "new\nlines\n\nhere", "x"]


def _spm_metadata(n_merges: int = 300) -> dict[str, Any]:
    """A SentencePiece-style vocabulary (as a Llama 2 GGUF holds it): <unk>, <s>, </s>, the 256
    <0xXX> byte tokens, then pieces ('▁' for spaces) scored by the order they were learned."""
    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    bpe.train_from_iterator(SPM_CORPUS, trainers.BpeTrainer(vocab_size=n_merges, show_progress=False))
    learned = sorted(bpe.get_vocab().items(), key=lambda kv: kv[1])
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    scores = [0.0] * len(tokens)
    for rank, (piece, _) in enumerate(learned):
        tokens.append(piece)
        types.append(NORMAL)
        scores.append(-float(rank))
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.padding_token_id": 0,
            "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": False}


def spm_encode(meta: dict[str, Any], text: str, add_prefix: bool = True) -> list[int]:
    """SentencePiece BPE (llama.cpp's llm_tokenizer_spm): merge the adjacent pair whose
    concatenation is the best-scored normal piece, leftmost first, until none is left; a
    symbol outside the vocabulary becomes its UTF-8 bytes' <0xXX> tokens."""
    tokens, types, scores = (meta[f"tokenizer.ggml.{k}"] for k in ("tokens", "token_type", "scores"))
    piece = {t: i for i, t in enumerate(tokens) if types[i] == NORMAL}
    syms = list((("\u2581" if add_prefix else "") + text).replace(" ", "\u2581")) if text else []
    while True:
        best = None
        for i in range(len(syms) - 1):
            j = piece.get(syms[i] + syms[i + 1])
            if j is not None and (best is None or scores[j] > best[0]):
                best = (scores[j], i)
        if best is None:
            break
        i = best[1]
        syms[i : i + 2] = [syms[i] + syms[i + 1]]
    ids: list[int] = []
    for s in syms:
        ids += [piece[s]] if s in piece else [tokens.index(f"<0x{b:02X}>") for b in s.encode()]
    return ids


def test_sentencepiece_matches_spm_encoding(tmp_path: Path) -> None:
    meta = _spm_metadata()
    files = tokenizer_files(meta, SOURCE)
    got = tokenizers.Tokenizer.from_str(files["tokenizer.json"])
    for text in SPM_TEXTS:
        want = spm_encode(meta, text)
        assert got.encode(text, add_special_tokens=False).ids == want, text
        assert got.encode(text).ids == [1] + want
        assert got.decode(want) == text  # Replace '▁', ByteFallback, Fuse, Strip the prefix space
    for name, content in files.items():
        (tmp_path / name).write_text(content, encoding="utf-8")
    tok = Tokenizer.from_dir(tmp_path)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<unk>")
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2
    ids = tok.encode("<s>the theory</s> 日本")
    assert ids[:2] == [1, 1] and 2 in ids  # control tokens in text are matched whole
    # Llama 2's tokenizer.json normalizer prepends '▁' to each piece between special tokens (HF's
    # "legacy" behaviour), so " 日本" after </s> decodes with two spaces, as it does in HF
    assert tok.decode(ids) == "the theory  日本"
    assert tok.decode(ids, skip_special_tokens=False) == "<s><s> the theory</s>  日本"
    assert tok.decode(tok.encode("emoji 🙂 ok")) == "emoji 🙂 ok"


def test_sentencepiece_without_space_prefix() -> None:
    """tokenizer.ggml.add_space_prefix false: no '▁' in front, none stripped on decode."""
    meta = _spm_metadata() | {"tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_bos_token": False}
    got = tokenizers.Tokenizer.from_str(tokenizer_files(meta, SOURCE)["tokenizer.json"])
    for text in SPM_TEXTS:
        want = spm_encode(meta, text, add_prefix=False)
        assert got.encode(text).ids == want, text
        assert got.decode(want) == text


# --- refusals -----------------------------------------------------------------------------------

def _gpt2_meta() -> dict[str, Any]:
    spec, cfg = reference("gpt-2")
    return gguf_metadata_for_hf_tokenizer(spec, cfg)


def test_unknown_pre_is_refused() -> None:
    meta = _gpt2_meta() | {"tokenizer.ggml.pre": "brand-new-pre"}
    with pytest.raises(ModelLoadError) as err:
        tokenizer_files(meta, SOURCE)
    msg = str(err.value)
    for part in (SOURCE, "tokenizer.ggml.pre", "'brand-new-pre'", "llama-bpe", "qwen2", "tokenizer.json"):
        assert part in msg


def test_unknown_model_is_refused() -> None:
    with pytest.raises(ModelLoadError, match=r"tokenizer\.ggml\.model = 'bert'.*supported: gpt2, llama.*tokenizer\.json"):
        tokenizer_files(_gpt2_meta() | {"tokenizer.ggml.model": "bert"}, SOURCE)
    with pytest.raises(ModelLoadError, match=r"tokenizer\.ggml\.model is missing"):
        tokenizer_files({k: v for k, v in _gpt2_meta().items() if k != "tokenizer.ggml.model"}, SOURCE)


@pytest.mark.parametrize("key, value, problem", [
    ("tokenizer.ggml.token_type", lambda m: m["tokenizer.ggml.token_type"][:-1], "entries but tokenizer.ggml.tokens has"),
    ("tokenizer.ggml.token_type", lambda m: m["tokenizer.ggml.token_type"][:-1] + [9], "is not a GGUF token type"),
    ("tokenizer.ggml.token_type", lambda m: m["tokenizer.ggml.token_type"][:-1] + ["1"], "must be an integer"),
    ("tokenizer.ggml.tokens", lambda m: "abc", "must be a list"),
    ("tokenizer.ggml.tokens", lambda m: m["tokenizer.ggml.tokens"][:-1] + [7], "must be a string"),
    ("tokenizer.ggml.tokens", lambda m: [], "is empty"),
    ("tokenizer.ggml.merges", lambda m: None, "is missing"),
    ("tokenizer.ggml.merges", lambda m: ["Ġ t", "nosuchtoken x"], "is not two tokens"),
    ("tokenizer.ggml.bos_token_id", lambda m: len(m["tokenizer.ggml.tokens"]), "outside the vocabulary"),
    ("tokenizer.ggml.eos_token_id", lambda m: -1, "outside the vocabulary"),
    ("tokenizer.ggml.eos_token_id", lambda m: True, "must be an integer token id"),
    ("tokenizer.ggml.add_bos_token", lambda m: "yes", "must be a bool"),
    ("tokenizer.ggml.pre", lambda m: 3, "must be a string"),
    ("tokenizer.chat_template", lambda m: ["x"], "must be a string"),
])
def test_bad_metadata_is_refused(key: str, value: Any, problem: str) -> None:
    meta = _gpt2_meta()
    meta[key] = value(meta)
    if meta[key] is None:
        del meta[key]
    with pytest.raises(ModelLoadError) as err:
        tokenizer_files(meta, SOURCE)
    msg = str(err.value)
    assert SOURCE in msg and key in msg and problem in msg, msg


def test_bad_sentencepiece_scores_are_refused() -> None:
    meta = _spm_metadata()
    short = meta | {"tokenizer.ggml.scores": meta["tokenizer.ggml.scores"][:-2]}
    with pytest.raises(ModelLoadError, match=r"tokenizer\.ggml\.scores has \d+ entries but tokenizer\.ggml\.tokens has"):
        tokenizer_files(short, SOURCE)
    nan = meta | {"tokenizer.ggml.scores": meta["tokenizer.ggml.scores"][:-1] + [float("nan")]}
    with pytest.raises(ModelLoadError, match=r"tokenizer\.ggml\.scores\[\d+\] must be a number"):
        tokenizer_files(nan, SOURCE)
    with pytest.raises(ModelLoadError, match=r"tokenizer\.ggml\.scores is missing"):
        tokenizer_files({k: v for k, v in meta.items() if k != "tokenizer.ggml.scores"}, SOURCE)


def test_bad_embedded_hf_json_is_refused() -> None:
    with pytest.raises(ModelLoadError, match=r"tokenizer\.huggingface\.json is not a loadable"):
        tokenizer_files(_gpt2_meta() | {"tokenizer.huggingface.json": "{not json"}, SOURCE)


def test_supported_pre_names_all_build() -> None:
    meta = _gpt2_meta()
    for name in PRE_TOKENIZERS:
        got = tokenizers.Tokenizer.from_str(tokenizer_files(meta | {"tokenizer.ggml.pre": name}, SOURCE)["tokenizer.json"])
        assert got.decode(got.encode(TEXTS[2]).ids) == TEXTS[2], name
