"""`strata generate` end to end on the demo model: streaming, batch JSONL, clear errors."""

from __future__ import annotations

import json

import pytest

from strata.cli import main


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path_factory.getbasetemp() / "strata-cache"))


def test_generate_prompt_streams(capsys):
    rc = main(["generate", "--prompt", "Hello there", "--max-tokens", "8", "--dtype", "float32", "--ignore-eos"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert out.startswith("Hello there")
    assert "8 tokens" in err and "finish=length" in err


def test_generate_batch_jsonl(tmp_path, capsys):
    src = tmp_path / "prompts.jsonl"
    dst = tmp_path / "results.jsonl"
    rows = [
        {"prompt": "one two three"},
        {"prompt_token_ids": [4096, 10, 11, 12], "max_tokens": 3},
        {"prompt": "seeded", "temperature": 1.0, "seed": 3, "max_tokens": 5},
    ]
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    args = ["generate", "--input", str(src), "--output", str(dst), "--max-tokens", "6", "--ignore-eos",
            "--dtype", "float32"]
    assert main(args) == 0
    results = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [len(r["outputs"][0]["token_ids"]) for r in results] == [6, 3, 5]
    assert results[0]["prompt"] == "one two three"
    # the seeded request is reproducible run to run
    assert main(args) == 0
    again = [json.loads(line) for line in dst.read_text().splitlines()]
    assert again[2]["outputs"][0]["token_ids"] == results[2]["outputs"][0]["token_ids"]


def test_generate_with_a_lora_adapter(capsys, tmp_path):
    """--lora DIR: the adapter's tokens (those LLM.generate gives with it), not the base's; a
    directory that is not an adapter is a clear error."""
    from strata import LLM, LoRARequest, SamplingParams
    from strata.demo.lora import sonnets

    adapter = str(sonnets.ADAPTER_DIR)
    args = ["generate", "--prompt", "Shall I compare thee", "--max-tokens", "12", "--dtype", "float32"]
    assert main([*args, "--lora", adapter]) == 0
    with_lora = capsys.readouterr().out
    assert main(args) == 0
    base = capsys.readouterr().out
    with LLM(dtype="float32", enable_lora=True) as llm:
        want = llm.generate(["Shall I compare thee"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False,
                            lora_request=LoRARequest("sonnets", 1, adapter))[0].outputs[0].text
    assert with_lora.rstrip("\n") == "Shall I compare thee" + want and with_lora != base
    assert main([*args, "--lora", str(tmp_path)]) == 2
    assert "adapter_config.json" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", "hi", "--temperature", "-1"], "temperature"),
        (["--prompt", "hi", "--top-p", "0"], "top_p"),
        (["--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
        (["--prompt", "hi", "--model", "/nonexistent/model"], "does not exist"),
        ([], "exactly one of --prompt"),
    ],
)
def test_generate_errors_are_clear(args, message, capsys):
    rc = main(["generate", "--dtype", "float32", *args])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err


def test_bad_jsonl_names_the_line(tmp_path, capsys):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"prompt": "ok"}\nnot json\n')
    assert main(["generate", "--input", str(src), "--dtype", "float32"]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err


def test_generate_says_what_the_built_in_and_random_models_are(capsys, tmp_path):
    """The demo model is named as such, with how to run a real one; --random-model says its weights
    are random. One line each, on stderr (stdout stays the generated text)."""
    from strata.demo.model import DEMO_SUMMARY, demo_config
    from strata.model_config import ModelConfig

    assert f"{ModelConfig.from_dict(demo_config()).num_params() / 1e6:.0f}M parameters" in DEMO_SUMMARY
    assert main(["generate", "--prompt", "Hi", "--max-tokens", "2", "--dtype", "float32"]) == 0
    out, err = capsys.readouterr()
    note = [line for line in err.splitlines() if line.startswith("note:")]
    assert note == [f"note: the built-in demo model ({DEMO_SUMMARY}); for a real model: strata generate "
                    "Qwen/Qwen2.5-0.5B-Instruct --prompt ... (or --model PATH)"]
    assert "note" not in out
    src = tmp_path / "ids.jsonl"
    src.write_text('{"prompt_token_ids": [5, 6, 7]}\n')  # the random checkpoint has no tokenizer
    assert main(["generate", "--random-model", "tiny", "--input", str(src), "--max-tokens", "2",
                 "--dtype", "float32"]) == 0
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("note:")][0].startswith(
        "note: --random-model tiny has random weights: its text is noise")
