"""GGUF models (issue 44): tiny files written with the `gguf` package's writer load and compute the
logits of transformers on the weights the file dequantizes to (gguf.quants.dequantize)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from strata.graph.gguf_model import gguf_files, unpermute_rows
from strata.graph.hub import check_model_dir
from strata.graph.loader import load_model
from tests.graph.gguf_writer import write_gguf

ATOL = 1e-4


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    # the loader is under test here: its weights against the file's, in exact fp32 arithmetic (the
    # int8-activation kernels' q8_0 rounding has its own twins in tests/kernels/test_cpu_quant.py)
    monkeypatch.setenv("STRATA_INT4_FP32_ACTIVATIONS", "1")
    monkeypatch.setenv("STRATA_INT8_FP32_ACTIVATIONS", "1")


def _reference_logits(tiny, reference: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """transformers' logits with the file's dequantized weights swapped in (restored after)."""
    hf = tiny.hf
    saved = {k: v.clone() for k, v in hf.state_dict().items()}
    try:
        state = dict(saved)
        state.update(reference)
        if hf.config.tie_word_embeddings:
            state["lm_head.weight"] = reference["model.embed_tokens.weight"]
        hf.load_state_dict(state)
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0].float()
    finally:
        hf.load_state_dict(saved)


def _strata_logits(path, ids: list[int], storage=None, group=64) -> torch.Tensor:
    m = load_model(check_model_dir(path), torch.float32, "cpu", 256, storage, group)
    t = torch.tensor([ids])
    with torch.no_grad():
        return m.compute_logits(m(t, torch.arange(len(ids))[None])).float()[0]


def test_unpermute_inverts_the_converters_permutation():
    rows, heads = 24, 3
    hf = np.arange(rows)
    gguf_rows = hf.reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(-1)
    assert (gguf_rows[unpermute_rows(rows, heads)] == hf).all()


@pytest.mark.parametrize("family", ["llama", "llama3", "qwen2", "qwen3", "mistral", "phi3", "phi4mini"])
@pytest.mark.parametrize("kind", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0], ids=lambda t: t.name)
def test_logits_equal_the_dequantized_reference(tiny_models, tmp_path, prompt_of, family, kind):
    tiny = tiny_models[family]
    path = tmp_path / f"{family}.gguf"
    reference = write_gguf(tiny.hf, path, kind)
    ids = prompt_of(1, 40)
    want = _reference_logits(tiny, reference, ids)
    torch.testing.assert_close(_strata_logits(path, ids), want, atol=ATOL, rtol=1e-5)


@pytest.fixture(scope="module")
def gemma3_six(tmp_path_factory):
    """A Gemma 3 whose hyperparameters a GGUF can say (llama.cpp's gemma3 rules): every 6th layer
    global, attention scaled by head_dim, soft-capped logits."""
    import transformers as tf

    from tests.conftest import TinyModel, _randomise

    torch.manual_seed(11)
    cfg = tf.Gemma3TextConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=8,
                              sliding_window_pattern=6, query_pre_attn_scalar=32, final_logit_softcapping=30.0,
                              rope_theta=1000000.0, rope_local_base_freq=10000.0, max_position_embeddings=256,
                              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = "eager"
    hf = tf.Gemma3ForCausalLM(cfg)
    _randomise(hf, 11)
    return TinyModel("gemma3-six", tmp_path_factory.mktemp("g3"), hf.float().eval(), [2], 384, 6, 2, 32)


@pytest.mark.parametrize("kind", [T.F32, T.Q8_0, T.Q4_0], ids=lambda t: t.name)
def test_gemma3_gguf_equals_the_dequantized_reference(gemma3_six, tmp_path, prompt_of, kind):
    """llama.cpp's gemma3 tensors (its norm names, norms stored as 1 + w) and hyperparameters;
    40 tokens so the 8-token window slides."""
    path = tmp_path / "g3.gguf"
    reference = write_gguf(gemma3_six.hf, path, kind)
    ids = prompt_of(8, 40)
    torch.testing.assert_close(_strata_logits(path, ids), _reference_logits(gemma3_six, reference, ids),
                               atol=ATOL, rtol=1e-5)


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """A 1-layer Llama 256 columns wide: K-quant super-blocks are 256 values."""
    import transformers as tf

    from tests.conftest import TinyModel

    torch.manual_seed(7)
    cfg = tf.LlamaConfig(vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, initializer_range=0.1)
    cfg._attn_implementation = "eager"
    hf = tf.LlamaForCausalLM(cfg).float().eval()
    return TinyModel("llama-wide", tmp_path_factory.mktemp("wide"), hf, [2], 384, 1, 2, 64)


@pytest.mark.parametrize("kind", [T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_k_quants_equal_the_dequantized_reference(wide_llama, tmp_path, prompt_of, kind):
    path = tmp_path / "wide.gguf"
    reference = write_gguf(wide_llama.hf, path, kind, embed_type=T.Q6_K)
    ids = prompt_of(4, 40)
    want = _reference_logits(wide_llama, reference, ids)
    torch.testing.assert_close(_strata_logits(path, ids), want, atol=ATOL, rtol=1e-5)


# type -> the layout of a module holding only it: (method, group size, zero points)
_EXACT_LAYOUT = {T.Q8_0: ("int8", 32, False), T.Q5_0: ("int8", 32, False), T.Q4_0: ("int4", 32, False),
                 T.Q4_1: ("int4", 32, True), T.Q4_K: ("int4", 32, True), T.Q5_1: ("int8", 32, True),
                 T.Q5_K: ("int8", 32, True), T.Q6_K: ("int8", 16, False)}


def _layout(module) -> tuple[str, int, bool]:
    return module.method, module.group_size, module.scale.dim() == 3


@pytest.mark.parametrize("storage", ["int8", "int4"])
@pytest.mark.parametrize("kind", list(_EXACT_LAYOUT), ids=lambda t: t.name)
def test_block_types_load_exactly_into_quantized_storage(wide_llama, tmp_path, prompt_of, kind, storage):
    """Every block type under int8 or int4 storage: held in the grouped layout that reproduces it
    (graph/gguf_blocks.py), so the weights dequantize to the file's (int8 layouts bit for bit;
    int4 with zero points up to the rounding of z - 8 * s) and the logits are the reference's."""
    path = tmp_path / "wide.gguf"
    reference = write_gguf(wide_llama.hf, path, kind, embed_type=kind)
    m = load_model(check_model_dir(path), torch.float32, "cpu", 256, storage, 32)
    down, qkv = m.layers[0].mlp.down_proj, m.layers[0].self_attn.qkv_proj
    assert _layout(down) == _layout(qkv) == _layout(m.lm_head) == _EXACT_LAYOUT[kind]
    want = reference["model.layers.0.mlp.down_proj.weight"]
    tol = dict(atol=0, rtol=0) if down.method == "int8" or kind == T.Q4_0 else dict(atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(down.dequantize(), want, **tol)
    ids = prompt_of(5, 40)
    want_logits = _reference_logits(wide_llama, reference, ids)
    torch.testing.assert_close(_strata_logits(path, ids, storage, 32), want_logits, atol=ATOL, rtol=1e-5)


_Q4_K_M = {"attn_v.weight": T.Q6_K, "ffn_down.weight": T.Q6_K, "output.weight": T.Q6_K}  # the rest Q4_K


def test_a_q4_k_m_mix_takes_the_layouts_that_hold_each_module(wide_llama, tmp_path, prompt_of):
    """llama-quantize's Q4_K_M: Q4_K with Q6_K attn_v / ffn_down / output. The fused qkv holds
    [Q4_K; Q4_K; Q6_K]: int8 by 16 with zero points; gate_up int4 group 32 with zero points; the
    Q6_K down and head int8 by 16. All exact: the logits are the dequantized reference's."""
    path = tmp_path / "q4km.gguf"
    reference = write_gguf(wide_llama.hf, path, T.Q4_K, types=_Q4_K_M)
    m = load_model(check_model_dir(path), torch.float32, "cpu", 256, "int4", 32)
    layer = m.layers[0]
    assert _layout(layer.self_attn.qkv_proj) == ("int8", 16, True)
    assert _layout(layer.mlp.gate_up_proj) == ("int4", 32, True)
    assert _layout(layer.mlp.down_proj) == _layout(m.lm_head) == ("int8", 16, False)
    v = reference["model.layers.0.self_attn.v_proj.weight"]  # its Q6_K rows, bit for bit
    torch.testing.assert_close(layer.self_attn.qkv_proj.dequantize()[-v.shape[0]:], v, atol=0, rtol=0)
    ids = prompt_of(6, 40)
    torch.testing.assert_close(_strata_logits(path, ids, "int4", 32), _reference_logits(wide_llama, reference, ids),
                               atol=ATOL, rtol=1e-5)


def test_q4_0_repacks_exactly_into_int4_group_32(tiny_models, tmp_path, prompt_of):
    """Q4_0 into int4 group 32 is a byte copy: the model's int4 weights dequantize to the file's."""
    tiny = tiny_models["llama"]
    path = tmp_path / "q4.gguf"
    reference = write_gguf(tiny.hf, path, T.Q4_0)
    m = load_model(check_model_dir(path), torch.float32, "cpu", 256, "int4", 32)
    got = m.layers[0].mlp.down_proj.dequantize()
    torch.testing.assert_close(got, reference["model.layers.0.mlp.down_proj.weight"], atol=0, rtol=0)
    ids = prompt_of(2, 30)
    torch.testing.assert_close(_strata_logits(path, ids, "int4", 32), _reference_logits(tiny, reference, ids),
                               atol=ATOL, rtol=1e-5)


def test_split_files_load_as_one(tiny_models, tmp_path, prompt_of):
    tiny = tiny_models["qwen2"]
    first = tmp_path / "m.gguf"
    reference = write_gguf(tiny.hf, first, T.Q8_0, split=3)
    part1 = tmp_path / "m-00001-of-00003.gguf"
    assert len(gguf_files(check_model_dir(part1))) == 3
    ids = prompt_of(3, 30)
    torch.testing.assert_close(_strata_logits(part1, ids), _reference_logits(tiny, reference, ids), atol=ATOL, rtol=1e-5)
    # a directory holding the parts is the model too
    torch.testing.assert_close(_strata_logits(tmp_path, ids), _reference_logits(tiny, reference, ids), atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("kind,storage", [(T.Q4_0, ("int4", 32)), (T.BF16, ("bf16", 64)), (T.F16, (None, 64))],
                         ids=["Q4_0", "BF16", "F16"])
def test_llm_serves_a_gguf_file_in_the_nearest_format(tiny_models, tmp_path, prompt_of, llm_factory, engine_clean,
                                                      kind, storage):
    """`LLM(model=file.gguf)`: the projections in the format nearest the file's (Q4_0: int4 group
    32, exact), greedy tokens equal to transformers' on the dequantized weights."""
    from strata import SamplingParams

    tiny = tiny_models["qwen2"]
    path = tmp_path / "m.gguf"
    reference = write_gguf(tiny.hf, path, kind)
    llm = llm_factory(path)
    assert (llm.engine.config.quantization, llm.engine.config.quantization_group_size) == storage
    prompts = [prompt_of(20, 12), prompt_of(21, 30)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    engine_clean(llm)
    for prompt, out in zip(prompts, outs):
        ids = list(prompt)
        for _ in range(8):
            ids.append(int(_reference_logits(tiny, reference, ids)[-1].argmax()))
        assert list(out.outputs[0].token_ids) == ids[len(prompt):]


def test_plan_reads_a_gguf_file(tiny_models, tmp_path):
    """`strata plan --model file.gguf`: the config from the file's metadata, weights in the format
    the engine would serve them in (Q4_0: int4 group 32)."""
    from strata.graph.gguf_model import default_storage, derived_dir
    from strata.planner.plan import resolve_model

    tiny = tiny_models["qwen3"]
    path = tmp_path / "q.gguf"
    write_gguf(tiny.hf, path, T.Q4_0)
    cfg, _ = resolve_model(str(path))
    assert (cfg.architecture, cfg.num_layers, cfg.head_dim, cfg.qk_norm) == ("Qwen3ForCausalLM", 2, 32, True)
    method, group, why = default_storage(derived_dir(path))
    assert (method, group) == ("int4", 32) and "Q4_0" in why


def test_unsupported_types_are_refused_by_name(tiny_models, tmp_path):
    import gguf

    tiny = tiny_models["llama"]
    path = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    cfg = tiny.hf.config
    for add, v in ((w.add_block_count, 1), (w.add_context_length, 256), (w.add_embedding_length, 64),
                   (w.add_feed_forward_length, 128), (w.add_head_count, 4), (w.add_head_count_kv, 2)):
        add(v)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tensor("token_embd.weight", np.zeros((cfg.vocab_size, 64 // 32 * 18), np.uint8), raw_dtype=T.IQ4_NL)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from strata.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match=r"IQ4_NL.*supported: F32, F16, BF16, Q8_0, Q4_0"):
        load_model(check_model_dir(path), torch.float32, "cpu", 256)


def test_int4_storage_keeps_the_files_8_bit_tensors_int8(tiny_models, tmp_path):
    """A Q4_0 file with a Q8_0 embedding (what llama-quantize writes): under int4 storage the tied
    head stays int8 and the Q4_0 projections are int4 group 32."""
    tiny = tiny_models["llama"]
    path = tmp_path / "mix.gguf"
    write_gguf(tiny.hf, path, T.Q4_0, embed_type=T.Q8_0)
    m = load_model(check_model_dir(path), torch.float32, "cpu", 256, "int4", 32)
    assert (m.lm_head.method, m.lm_head.group_size, m.lm_head.scale.dim()) == ("int8", 32, 2)  # Q8_0: exact
    assert (m.layers[0].mlp.down_proj.method, m.layers[0].mlp.down_proj.group_size) == ("int4", 32)


def test_q8_0_repacks_exactly_into_grouped_int8(tiny_models, tmp_path, prompt_of):
    """Q8_0 under int8 storage is grouped int8 (a scale per 32 columns): its codes copied, its
    scales widened, so the model's weights dequantize to the file's bit for bit."""
    tiny = tiny_models["qwen2"]
    path = tmp_path / "q8.gguf"
    reference = write_gguf(tiny.hf, path, T.Q8_0)
    m = load_model(check_model_dir(path), torch.float32, "cpu", 256, "int8")
    down = m.layers[1].mlp.down_proj
    assert (down.method, down.group_size, tuple(down.scale.shape)) == ("int8", 32, (down.out_features, down.in_features // 32))
    torch.testing.assert_close(down.dequantize(), reference["model.layers.1.mlp.down_proj.weight"], atol=0, rtol=0)
    ids = prompt_of(4, 30)
    torch.testing.assert_close(_strata_logits(path, ids, "int8"), _reference_logits(tiny, reference, ids),
                               atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("kind", [T.Q8_0, T.Q4_0, "Q4_K_M"], ids=lambda t: getattr(t, "name", t))
def test_group_32_layouts_decode_fused_as_eager(tiny_models, wide_llama, tmp_path, prompt_of, llm_factory,
                                                 engine_clean, monkeypatch, caplog, kind):
    """A GGUF's exact layouts (grouped int8 by 32 or 16, int4 group 32, with and without zero
    points) with their int8-activation kernels on: the fused CPU decode layer gives the eager
    path's tokens and logprobs (kernels/cpu_decode_layer.py)."""
    from strata import SamplingParams

    monkeypatch.delenv("STRATA_INT4_FP32_ACTIVATIONS")
    monkeypatch.delenv("STRATA_INT8_FP32_ACTIVATIONS")
    path = tmp_path / "m.gguf"
    if kind == "Q4_K_M":
        write_gguf(wide_llama.hf, path, T.Q4_K, types=_Q4_K_M)
    else:
        write_gguf(tiny_models["llama"].hf, path, kind, embed_type=T.Q8_0)
    llm = llm_factory(path, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": prompt_of(50 + i, 4 + 9 * i)} for i in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=10, logprobs=1, ignore_eos=True)
    runs = []
    for fused in ("1", "0"):
        monkeypatch.setenv("STRATA_FUSED_DECODE", fused)
        with caplog.at_level("INFO", logger="strata.platform.cpu_decode_step"):
            outs = llm.generate(prompts, sp, use_tqdm=False)
        if fused == "1":  # every layer ran fused (cpu_decode_step logs the others)
            assert "no layer runs fused" not in caplog.text and "run eagerly" not in caplog.text, caplog.text
        runs.append([(list(o.outputs[0].token_ids), [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                     for o in outs])
    engine_clean(llm)
    for (ta, la), (tb, lb) in zip(*runs):
        assert ta == tb
        assert max(abs(getattr(a, "logprob", a) - getattr(b, "logprob", b)) for a, b in zip(la, lb)) <= 1e-5


def test_a_quantization_type_picks_the_gguf_in_a_directory(tiny_models, tmp_path, monkeypatch):
    """`--model DIR:Q4_0` (vLLM's repo:quant_type form) picks that type's file among several, in
    either case; none or a bare directory of several is one error naming the files."""
    from strata.errors import ModelLoadError

    tiny = tiny_models["llama"]
    repo = tmp_path / "Tiny-GGUF"
    repo.mkdir()
    write_gguf(tiny.hf, repo / "tiny-Q8_0.gguf", T.Q8_0)
    write_gguf(tiny.hf, repo / "tiny-Q4_0.gguf", T.Q4_0)
    for spec, want in ((f"{repo}:Q4_0", ("int4", 32, False)), (f"{repo}:q8_0", ("int8", 32, False))):
        m = load_model(check_model_dir(spec), torch.float32, "cpu", 256, "int4", 32)
        assert _layout(m.layers[0].mlp.down_proj) == want
    with pytest.raises(ModelLoadError, match=r"no Q5_K GGUF file .*tiny-Q4_0.gguf, tiny-Q8_0.gguf"):
        check_model_dir(f"{repo}:Q5_K")
    with pytest.raises(ModelLoadError, match=r"holds 2 GGUF models.*:TYPE"):
        check_model_dir(repo)


def test_a_hub_gguf_repo_by_quantization_type(tiny_models, tmp_path, monkeypatch):
    """ORG/NAME:Q8_0 from the Hugging Face cache (offline): that file's snapshot, no config.json needed."""
    from strata.errors import ModelLoadError
    from tests.graph.test_hub import COMMIT_MAIN, add_snapshot

    src = tmp_path / "src"
    src.mkdir()
    write_gguf(tiny_models["qwen2"].hf, src / "Tiny-Q8_0.gguf", T.Q8_0)
    cache = tmp_path / "hf" / "hub"
    add_snapshot(cache, "org/Tiny-GGUF", COMMIT_MAIN, src, refs=("main",))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    m = load_model(check_model_dir("org/Tiny-GGUF:Q8_0"), torch.float32, "cpu", 256, "int8")
    assert _layout(m.layers[0].mlp.down_proj) == ("int8", 32, False)
    with pytest.raises(ModelLoadError, match=r"org/Tiny-GGUF:Q4_K_M: no Q4_K_M GGUF of it in the Hugging Face cache"):
        check_model_dir("org/Tiny-GGUF:Q4_K_M")


def test_planned_weight_bytes_are_the_loaded_layouts(wide_llama, tmp_path):
    """The planner's weight bytes for a GGUF (memory/planner.weight_bytes with the file's layouts)
    equal what the loaded model holds, a Q4_K_M mix's zero points and groups of 16 included."""
    from strata.graph.gguf_model import gguf_formats
    from strata.memory.planner import weight_bytes
    from strata.memory.quant import model_weight_bytes
    from strata.model_config import ModelConfig

    path = tmp_path / "q4km.gguf"
    write_gguf(wide_llama.hf, path, T.Q4_K, types=_Q4_K_M)
    d = check_model_dir(path)
    cfg = ModelConfig.from_file(d / "config.json")
    m = load_model(d, torch.float32, "cpu", 256, "int4", 32)
    layouts = gguf_formats(d, cfg.tie_word_embeddings, "int4")
    assert weight_bytes(cfg, torch.float32, "int4", 32, layouts) == model_weight_bytes(m)


@pytest.mark.parametrize("kind,layout", [(T.Q4_K, ("int4", 32, True)), (T.Q6_K, ("int8", 16, False))],
                         ids=["Q4_K", "Q6_K"])
def test_compiled_k_quant_repack_equals_the_numpy_twin(kind, layout):
    """kernels/cpu_gguf.py's one-pass repack writes what gguf_weights' numpy path writes, bit for bit."""
    from strata.graph import gguf_weights
    from strata.kernels import cpu_gguf
    from strata.memory.quant import QuantLinear
    from tests.graph.gguf_writer import _random_k_blocks

    if not cpu_gguf.available():
        pytest.skip("numba is not installed: the numpy path is the only one")
    rows, cols = 48, 512
    raw = _random_k_blocks(rows, cols, kind, seed=3)
    method, group, zero = layout
    fast, slow = (QuantLinear.empty(method, rows, cols, group, None, "cpu", grouped_int8=method == "int8", zero=zero)
                  for _ in range(2))
    gguf_weights._blocks_into(kind, raw, fast, slice(0, rows))
    gguf_weights._blocks_into_np(kind, raw, slow, slice(0, rows))
    assert torch.equal(fast.qweight, slow.qweight) and torch.equal(fast.scale, slow.scale)


@pytest.mark.parametrize("family,kind,types", [
    ("mixtral", T.F32, None), ("mixtral", T.F16, None), ("olmoe", T.F32, None),
    ("qwen3moe", T.Q8_0, None), ("qwen3moe", T.Q4_0, None), ("qwen3moe", T.Q4_1, None),
    ("qwen2moe", T.Q8_0, {"ffn_down_shexp.weight": T.F16}),
], ids=lambda v: getattr(v, "name", None) or ("mixed" if isinstance(v, dict) else v))
def test_moe_gguf_logits_equal_the_dequantized_reference(tiny_models, tmp_path, prompt_of, family, kind, types):
    """llama.cpp's MoE layout: 3-D expert stacks (ffn_*_exps) split into each expert's projection,
    the router F32, Qwen2-MoE's shared expert (its gate a vector); the loader's layouts hold the
    quantised stacks exactly (Q4_0 / Q4_1 experts: int4 group 32)."""
    tiny = tiny_models[family]
    path = tmp_path / f"{family}.gguf"
    reference = write_gguf(tiny.hf, path, kind, types=types)
    ids = prompt_of(2, 40)
    want = _reference_logits(tiny, reference, ids)
    # held exactly in int8 / int4 (a float tensor among them would be requantised: those load in fp32)
    storage = None if types else {T.Q8_0: "int8", T.Q4_0: "int4", T.Q4_1: "int4"}.get(kind)
    torch.testing.assert_close(_strata_logits(path, ids, storage, 32), want, atol=ATOL, rtol=1e-5)
    from strata.model_config import ModelConfig

    cfg = ModelConfig.from_file(check_model_dir(path) / "config.json")
    assert cfg.architecture == tiny.hf.config.architectures[0] and cfg.moe is not None
    assert cfg.moe.sparse == tuple(tiny.hf.config.to_dict().get("mlp_only_layers") and
                                   [i not in tiny.hf.config.mlp_only_layers for i in range(2)] or [True, True])


def test_moe_gguf_serves_greedy_as_the_reference(tiny_models, tmp_path, prompt_of):
    """The engine on a Q8_0 Qwen3-MoE file (served int8, exact; the fused decode's expert dispatch):
    greedy tokens equal transformers' on the weights the file dequantizes to."""
    from strata import LLM, SamplingParams

    tiny = tiny_models["qwen3moe"]
    path = tmp_path / "qwen3moe-q8_0.gguf"
    reference = write_gguf(tiny.hf, path, T.Q8_0)
    prompt = prompt_of(4, 12)
    ids = list(prompt)
    for _ in range(16):
        ids.append(int(_reference_logits(tiny, reference, ids)[-1].argmax()))
    llm = LLM(model=str(path), max_model_len=96, block_size=16, kv_cache_memory="1MiB", num_threads=1)
    assert llm.engine.config.quantization == "int8"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == ids[len(prompt):]
