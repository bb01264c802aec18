"""Training data: documents from text/JSONL files, tokenized in DataLoader workers, packed into
fixed windows, shuffled deterministically by seed.

Packing: each document becomes BOS + tokens + EOS and the documents are concatenated into one
stream, cut into non-overlapping windows of seq_len + 1 tokens (inputs and shifted targets).
Document boundaries are marked by EOS separation, not by the attention mask: a window may span
two documents and attend across the EOS (as GPT-2 / nanoGPT-style packing does); the model learns
that what follows an EOS starts afresh.

Order: sample k of the run (k counts from 0 over all steps, ranks and micro-batches) is window
perm_e[k mod N] of epoch e = k div N, where perm_e is a torch.randperm seeded by (seed, e). The
position in the data is therefore a function of the step alone, so a resumed run reads exactly
the windows the uninterrupted one would have, and a DDP rank reads its share of each step's
global batch (see `batch_for`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import tokenizers
import torch
from torch.utils.data import DataLoader, Dataset

from strata.errors import ConfigError

logger = logging.getLogger(__name__)

PIECE_CHARS = 1 << 16  # text files are tokenized in pieces of about this many characters, cut at lines


@dataclass(frozen=True)
class Piece:
    doc: int  # document index; a new document starts with BOS, its last piece ends with EOS
    text: str
    first: bool
    last: bool


def data_files(paths: list[str], what: str = "--data") -> list[Path]:
    """Files named directly plus *.txt / *.jsonl inside named directories, in a fixed order."""
    files: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted(q for q in p.rglob("*") if q.suffix in (".txt", ".jsonl") and q.is_file())
            if not found:
                raise ConfigError(f"{what} {p}: no *.txt or *.jsonl files in this directory")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise ConfigError(f"{what} {p}: no such file or directory")
    if not files:
        raise ConfigError(f"{what}: no training data given (pass text files, JSONL files or directories)")
    return files


def _split_text(text: str) -> list[str]:
    pieces, start = [], 0
    while start < len(text):
        end = min(len(text), start + PIECE_CHARS)
        if end < len(text):
            cut = text.rfind("\n", start, end)
            end = cut + 1 if cut > start else end
        pieces.append(text[start:end])
        start = end
    return pieces or [""]


def read_pieces(files: list[Path]) -> list[Piece]:
    """Documents as pieces: a .txt file is one document; a .jsonl line's "text" field is one."""
    pieces: list[Piece] = []
    doc = 0
    for f in files:
        try:
            raw = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{f}: not UTF-8 text ({e})") from None
        if f.suffix == ".jsonl":
            for lineno, line in enumerate(raw.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{f}:{lineno}: not JSON ({e.msg})") from None
                text = record.get("text") if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise ConfigError(f'{f}:{lineno}: expected an object with a string "text" field')
                pieces.append(Piece(doc, text, True, True))
                doc += 1
        else:
            parts = _split_text(raw)
            pieces.extend(Piece(doc, t, i == 0, i == len(parts) - 1) for i, t in enumerate(parts))
            doc += 1
    return pieces


class _TokenizePieces(Dataset):
    """Map-style dataset: piece i -> its token ids (runs in the DataLoader's worker processes)."""

    def __init__(self, pieces: list[Piece], tokenizer_json: str, bos: int | None, eos: int) -> None:
        self.pieces, self.tokenizer_json, self.bos, self.eos = pieces, tokenizer_json, bos, eos
        self._tok: tokenizers.Tokenizer | None = None

    def __len__(self) -> int:
        return len(self.pieces)

    def __getitem__(self, i: int) -> torch.Tensor:
        if self._tok is None:  # built in the worker, from JSON text: nothing pickled but strings
            self._tok = tokenizers.Tokenizer.from_str(self.tokenizer_json)
        piece = self.pieces[i]
        ids = self._tok.encode(piece.text, add_special_tokens=False).ids
        if piece.first and self.bos is not None:
            ids = [self.bos, *ids]
        if piece.last:
            ids = [*ids, self.eos]
        return torch.tensor(ids, dtype=torch.int32)


def tokenize(files: list[Path], tokenizer: tokenizers.Tokenizer, bos: int | None, eos: int,
             num_workers: int) -> torch.Tensor:
    """One int32 stream of every document's tokens, in file order, tokenized by `num_workers`
    DataLoader workers (0: in this process). Deterministic whatever the worker count."""
    pieces = read_pieces(files)
    ds = _TokenizePieces(pieces, tokenizer.to_str(), bos, eos)
    loader = DataLoader(ds, batch_size=None, num_workers=num_workers, shuffle=False,
                        multiprocessing_context="spawn" if num_workers else None)
    stream = torch.cat([ids for ids in loader]) if pieces else torch.empty(0, dtype=torch.int32)
    logger.info("tokenized %d files (%d documents) into %d tokens with %d worker(s)",
                len(files), pieces[-1].doc + 1 if pieces else 0, stream.numel(), num_workers)
    return stream


class PackedWindows:
    """The token stream cut into windows of seq_len + 1, read in seeded per-epoch orders."""

    def __init__(self, stream: torch.Tensor, seq_len: int, seed: int, what: str = "--data") -> None:
        self.seq_len, self.seed = seq_len, seed
        self.num_windows = (stream.numel() - 1) // seq_len
        if self.num_windows < 1:
            raise ConfigError(
                f"{what}: {stream.numel()} tokens make no window of --seq-len {seq_len} + 1; give more "
                "text or a shorter --seq-len")
        self.stream = stream.long()
        self._perm_epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    @property
    def tokens(self) -> int:
        return self.num_windows * self.seq_len

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.num_windows, generator=g), epoch
        return self._perm

    def window(self, k: int) -> torch.Tensor:
        """Sample k of the run: seq_len + 1 tokens."""
        epoch, i = divmod(k, self.num_windows)
        start = int(self._order(epoch)[i]) * self.seq_len
        return self.stream[start : start + self.seq_len + 1]

    def samples(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [count, seq_len], for samples first .. first + count - 1."""
        rows = torch.stack([self.window(k) for k in range(first, first + count)])
        return rows[:, :-1], rows[:, 1:]

    def in_order(self, limit: int, batch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The first `limit` windows in stream order, in batches (evaluation: no shuffling)."""
        n = min(limit, self.num_windows)
        for first in range(0, n, batch):
            idx = range(first, min(n, first + batch))
            rows = torch.stack([self.stream[i * self.seq_len : i * self.seq_len + self.seq_len + 1] for i in idx])
            yield rows[:, :-1], rows[:, 1:]


def batch_for(step: int, micro: int, rank: int, *, micro_batch: int, grad_accum: int,
              world_size: int) -> int:
    """First sample index of (step, micro-batch, rank): each step consumes micro_batch x grad_accum x
    world_size consecutive samples, micro-batch-major, so one process accumulating N micro-batches
    reads exactly what N data-parallel ranks read in one."""
    per_step = micro_batch * grad_accum * world_size
    return step * per_step + (micro * world_size + rank) * micro_batch
