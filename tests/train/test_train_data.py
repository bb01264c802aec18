"""Training data: tokenized in workers (same stream whatever their number), packed with
BOS/EOS at document boundaries, read in a seeded order that depends on the step alone."""

from __future__ import annotations

import json

import torch

from strata.train.data import PackedWindows, batch_for, data_files, read_pieces, tokenize
from strata.train.model_init import load_tokenizer, resolve


def test_stream_is_identical_with_and_without_workers(tiny_train_dir, tmp_path):
    src = resolve(str(tiny_train_dir / "config.json"), None)
    tok = load_tokenizer(src.tokenizer_dir)
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": f"Document number {i}."}) for i in range(5)) + "\n")
    files = data_files([str(tiny_train_dir / "train.txt"), str(jsonl)])
    in_process = tokenize(files, tok, 1, 2, num_workers=0)
    with_workers = tokenize(files, tok, 1, 2, num_workers=2)
    assert torch.equal(in_process, with_workers)
    # 1 text document + 5 JSONL documents: each starts with BOS and ends with EOS
    assert int((in_process == 1).sum()) == 6 and int((in_process == 2).sum()) == 6
    assert in_process[0] == 1 and in_process[-1] == 2


def test_text_files_are_cut_at_line_boundaries(tmp_path):
    f = tmp_path / "long.txt"
    f.write_text("".join(f"line {i} of a long play\n" for i in range(20_000)))
    pieces = read_pieces([f])
    assert len(pieces) > 1 and pieces[0].first and pieces[-1].last
    assert all(p.text.endswith("\n") for p in pieces)
    assert "".join(p.text for p in pieces) == f.read_text()


def test_order_is_a_function_of_the_sample_index():
    stream = torch.arange(1000)
    a, b = PackedWindows(stream, 9, seed=3), PackedWindows(stream, 9, seed=3)
    first = [a.window(k)[0].item() for k in range(a.num_windows * 2)]
    assert [b.window(k)[0].item() for k in reversed(range(b.num_windows * 2))] == first[::-1]
    epoch0, epoch1 = first[: a.num_windows], first[a.num_windows:]
    assert sorted(epoch0) == sorted(epoch1) and epoch0 != epoch1  # each epoch a new permutation
    inputs, targets = a.samples(0, 4)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert PackedWindows(stream, 9, seed=4).window(0)[0] != a.window(0)[0] or a.num_windows == 1


def test_data_parallel_ranks_read_what_accumulation_reads():
    one = [batch_for(s, m, 0, micro_batch=3, grad_accum=2, world_size=1) for s in range(3) for m in range(2)]
    two = [batch_for(s, 0, r, micro_batch=3, grad_accum=1, world_size=2) for s in range(3) for r in range(2)]
    assert one == two
