"""Text <-> token ids for a HF checkpoint directory, plus streaming detokenization.

`Tokenizer` wraps a `tokenizers` fast tokenizer (tokenizer.json) and reads
tokenizer_config.json for the special tokens and the chat template, which it renders
the way transformers does. `IncrementalDetokenizer` turns a stream of sampled ids
into text deltas that never split a character and add up to a plain decode.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import jinja2.utils
import tokenizers

from strata.errors import ConfigError, ModelLoadError, RequestError

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # what the ByteFallback decoder treats as a raw byte


def _token_content(value: Any, field: str, source: Path) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or {"content": ...}."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ModelLoadError(f"{source}: {field} must be a string or {{'content': ...}}, got {value!r}")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot read JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _pick_chat_template(value: Any, source: Path) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of {"name", "template"} (take "default")."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" not in named:
            logger.warning("%s: chat templates %s have no 'default'; chat is disabled", source, sorted(named))
        return named.get("default")
    raise ModelLoadError(f"{source}: chat_template must be a string or a list, got {type(value).__name__}")


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace() minus underscore attributes (templates from the Hub are untrusted)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # self arrives in args, as in jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the same sandboxed environment transformers uses."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def load_chat_template(value: str) -> str:
    """`--chat-template FILE|STRING` (vLLM's rule): a readable file's text, else the string itself
    if it looks like a Jinja template; anything else is refused (a mistyped path must not become a
    one-line template)."""
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--chat-template {value}: cannot read ({exc})") from None
    if any(c in value for c in "{}\n"):
        return value
    raise ConfigError(f"--chat-template {value!r}: no such file, and not a Jinja template (no {{ }} in it); "
                      "give a template file or the template text")


class Tokenizer:
    """A fast tokenizer with the special tokens and chat template of its checkpoint."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
        name: str = "tokenizer",
    ) -> None:
        self._backend = backend
        self.name = name
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self.bos_token_id = self._special_id("bos_token", bos_token)
        self.eos_token_id = self._special_id("eos_token", eos_token)
        self.pad_token_id = self._special_id("pad_token", pad_token)
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None
        # Ids that decode(skip_special_tokens=True) drops: added tokens flagged special.
        self._skipped_ids = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        ids = (self.bos_token_id, self.eos_token_id, self.pad_token_id)
        self.all_special_ids: set[int] = set(self._skipped_ids) | {i for i in ids if i is not None}
        self._byte_ids = self._find_byte_fallback_ids(backend)

    @classmethod
    def from_dir(cls, path: str | Path, chat_template: str | None = None) -> Tokenizer:
        """Load tokenizer.json and (if present) tokenizer_config.json from a checkpoint directory.

        chat_template (`--chat-template FILE|STRING`) replaces the checkpoint's template; it is
        compiled here, so a broken one stops start-up instead of failing every chat request."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(
                f"{tok_file} not found: Strata needs a HF fast tokenizer (tokenizer.json) in the model directory"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust side raises plain Exception on bad JSON
            raise ModelLoadError(f"{tok_file}: cannot load tokenizer ({exc})") from exc
        cfg_file = path / "tokenizer_config.json"
        cfg = _read_json(cfg_file) if cfg_file.is_file() else {}
        cls._add_missing_tokens(backend, cfg.get("added_tokens_decoder") or {}, cfg_file)
        template = _pick_chat_template(cfg.get("chat_template"), cfg_file)
        jinja_file = path / "chat_template.jinja"  # newer checkpoints keep the template here
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        if chat_template is not None:
            template = load_chat_template(chat_template)
            try:
                _compile_template(template)
            except jinja2.TemplateSyntaxError as exc:
                raise ConfigError(f"--chat-template: the template does not compile: {exc}") from None
        return cls(
            backend,
            bos_token=_token_content(cfg.get("bos_token"), "bos_token", cfg_file),
            eos_token=_token_content(cfg.get("eos_token"), "eos_token", cfg_file),
            pad_token=_token_content(cfg.get("pad_token"), "pad_token", cfg_file),
            chat_template=template,
            name=str(path),
        )

    @staticmethod
    def _add_missing_tokens(backend: tokenizers.Tokenizer, entries: dict[str, Any], source: Path) -> None:
        """Add tokens listed in added_tokens_decoder that tokenizer.json lacks (as transformers does)."""
        for key, entry in sorted(entries.items(), key=lambda kv: int(kv[0])):
            content = _token_content(entry, f"added_tokens_decoder[{key}]", source)
            existing = backend.token_to_id(content)
            if existing is not None:
                if existing != int(key):
                    logger.warning("%s: %r has id %d in tokenizer.json, not %s", source, content, existing, key)
                continue
            flags = {k: bool(entry.get(k, False)) for k in ("single_word", "lstrip", "rstrip")}
            special = bool(entry.get("special", False))
            added = tokenizers.AddedToken(
                content, special=special, normalized=bool(entry.get("normalized", not special)), **flags
            )
            if special:
                backend.add_special_tokens([added])
            else:
                backend.add_tokens([added])
            if backend.token_to_id(content) != int(key):
                logger.warning("%s: added %r got id %s, config says %s",
                               source, content, backend.token_to_id(content), key)

    @staticmethod
    def _find_byte_fallback_ids(backend: tokenizers.Tokenizer) -> frozenset[int]:
        """Ids of <0xHH> tokens when the decoder groups them into bytes (sentencepiece byte fallback)."""
        decoder = backend.decoder
        if decoder is None or b'"ByteFallback"' not in decoder.__getstate__():
            return frozenset()
        vocab = backend.get_vocab(with_added_tokens=True)
        return frozenset(i for tok, i in vocab.items() if _BYTE_TOKEN.fullmatch(tok))

    def _special_id(self, field: str, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ModelLoadError(f"{self.name}: {field} {token!r} from tokenizer_config.json is not in the vocabulary")
        return token_id

    def to_json(self) -> str:
        """The fast tokenizer as tokenizer.json text (with the added tokens of tokenizer_config)."""
        return self._backend.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens applies the post-processor (e.g. a leading BOS)."""
        if not isinstance(text, str):
            raise RequestError(f"text to encode must be a string, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """encode() for many texts at once (parallel in the Rust backend)."""
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise RequestError(f"texts[{i}] must be a string, got {type(text).__name__}")
        return [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; ids outside the vocabulary are dropped (as the backend does)."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` with the checkpoint's chat template, as transformers would.

        The result already holds any BOS the template writes: encode it with
        add_special_tokens=False. Extra kwargs become template variables (e.g. tools).
        """
        if self.chat_template is None:
            raise RequestError(
                f"{self.name} has no chat template (no chat_template in tokenizer_config.json); "
                "use plain-text completion or pick a model with a chat template"
            )
        if self._template is None:
            try:
                self._template = _compile_template(self.chat_template)
            except jinja2.TemplateSyntaxError as exc:
                raise ConfigError(f"{self.name}: chat_template does not compile: {exc}") from exc
        if not isinstance(messages, list):
            raise RequestError(f"messages must be a list, got {type(messages).__name__}")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise RequestError(f"messages[{i}] must be a dict with a string 'role', got {message!r}")
        special = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token}
        variables = {k: v for k, v in special.items() if v is not None}
        variables |= {"tools": None, "documents": None, **kwargs}
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as exc:
            raise RequestError(f"chat template rejected the messages: {exc}") from exc


class IncrementalDetokenizer:
    """Streams the text of generated ids as deltas that never end inside a character.

    Decodes a short window of recent ids (starting a few prompt tokens back) and emits
    what is new, so sentencepiece-style decoders keep their leading spaces. Text is held
    back while it ends in an unfinished UTF-8 sequence or an open run of byte-fallback
    tokens; call flush() once, after the last token, to release any such remainder (an
    open byte run is only closed by a later non-byte token, so a skipped EOS leaves it
    open). The deltas plus flush() equal tokenizer.decode(output_ids), except that for
    decoders that strip a string's first space (sentencepiece/Metaspace) the text keeps
    the leading space it has after the prompt, as vLLM does. Assumes a decoder whose
    output only depends on nearby tokens (ByteLevel, Metaspace, ByteFallback+Fuse+Strip);
    transformers' clean_up_tokenization_spaces is not applied. O(1) amortised per token.
    """

    CONTEXT_TOKENS = 5  # prompt tokens decoded ahead of the output
    WINDOW_TOKENS = 4  # kept when the window slides; >= 4 bytes re-synchronises UTF-8

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = tokenizer._skipped_ids if skip_special_tokens else frozenset()
        self._skip_special_tokens = skip_special_tokens
        self._byte_ids = tokenizer._byte_ids
        self._ids: list[int] = []  # the window: recent ids, minus any that decode would skip
        self._emitted = 0  # chars of decode(self._ids) already accounted for
        self._parts: list[str] = []
        context: list[int] = []
        for i in range(len(prompt_ids) - 1, -1, -1):
            if len(context) == self.CONTEXT_TOKENS:
                break
            if self._kept(int(prompt_ids[i])):
                context.append(int(prompt_ids[i]))
        context.reverse()
        if context and context[-1] not in self._byte_ids:
            text = self._decode(context)
            if text and not text.endswith(REPLACEMENT_CHAR):  # prompt ends on a whole character
                self._ids, self._emitted = context, len(text)

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of the deltas)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def add(self, token_id: int) -> str:
        """Append one generated id; return the newly finished text (possibly empty)."""
        token_id = int(token_id)
        if not self._kept(token_id):
            return ""
        self._ids.append(token_id)
        if token_id in self._byte_ids:
            return ""  # the run of byte tokens is still open; its text depends on what follows
        return self._emit()

    def extend(self, token_ids: Sequence[int]) -> str:
        """add() for several ids with one decode: the same text as adding them one by one (the
        decoder's output depends only on nearby tokens, as add() already assumes), for a caller
        that needs no text in between (protocol/output_text.py, output_kind FINAL_ONLY)."""
        kept = [t for t in map(int, token_ids) if self._kept(t)]
        if not kept:
            return ""
        self._ids.extend(kept)
        if kept[-1] in self._byte_ids:
            return ""
        return self._emit()

    def _emit(self) -> str:
        """Decode the window and emit what is new (up to an unfinished character)."""
        text = self._decode(self._ids)
        end = len(text) - 1 if text.endswith(REPLACEMENT_CHAR) else len(text)
        delta = ""
        if end > self._emitted:
            delta = text[self._emitted : end]
            self._emitted = end
            self._parts.append(delta)
        if len(self._ids) > 2 * self.WINDOW_TOKENS:
            self._slide(text)
        return delta

    def flush(self) -> str:
        """Release any held-back text; call once, after the last token."""
        text = self._decode(self._ids) if self._ids else ""
        delta = text[self._emitted :]
        self._emitted = len(text)
        if delta:
            self._parts.append(delta)
        return delta

    def _kept(self, token_id: int) -> bool:
        """False for ids that decode() drops: skipped specials and ids outside the vocabulary."""
        if token_id in self._skip or token_id < 0:
            return False
        return self._tok._backend.id_to_token(token_id) is not None

    def _decode(self, ids: list[int]) -> str:
        return self._tok._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _slide(self, text: str) -> None:
        """Drop old ids from the window, keeping WINDOW_TOKENS of context, if the text stays aligned."""
        # Safe because add() only decodes once any byte-fallback run has closed, and 4 tokens
        # (>= 4 bytes) bring a UTF-8 decoder started mid-character back in step. The kept
        # text must be non-empty so a Metaspace decoder keeps stripping only its first space.
        kept_ids = self._ids[-self.WINDOW_TOKENS :]
        pending = text[self._emitted :]
        kept = self._decode(kept_ids)
        if len(kept) > len(pending) and kept.endswith(pending):
            self._ids = kept_ids
            self._emitted = len(kept) - len(pending)
