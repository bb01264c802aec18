"""ModelConfig: the parts of an HF config.json that the decoder families need.

config.json is untrusted input. Every field Strata reads is checked once, here, against a small
declarative schema (SCHEMA, ROPE_SCHEMAS: type, range, default) and the decoder's cross-field
rules (query heads in whole groups per KV head, hidden_size = heads x head_dim unless head_dim is
given, an even head_dim for rotary, token ids inside the vocabulary). A bad value is a
ModelLoadError naming the file, the field, the value and what is accepted. Fields Strata does not
read are ignored: real configs carry many.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from strata.config import DTYPES
from strata.errors import ConfigError, ModelLoadError
from strata.text_table import fmt_bytes

# architecture -> family flags; every family is a Llama-shaped decoder with small differences
# (the rest of each family's differences are ModelConfig fields read by _family_fields below).
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
    "Gemma3ForCausalLM": {"qkv_bias": False, "qk_norm": True},  # Gemma 3 text (1B, or a text-only export)
    "Phi3ForCausalLM": {"qkv_bias": False, "qk_norm": False},  # Phi-3, Phi-3.5-mini, Phi-4-mini
    # mixture-of-experts families (MoEConfig below; graph/moe.py)
    "MixtralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2MoeForCausalLM": {"qkv_bias": True, "qk_norm": False},  # + a gated shared expert
    "Qwen3MoeForCausalLM": {"qkv_bias": False, "qk_norm": True},
    "OlmoeForCausalLM": {"qkv_bias": False, "qk_norm": True},  # q/k norms over the whole projection
}
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")

# architectures people bring that Strata refuses by name, with what it would take
NOT_YET: dict[str, str] = {
    "GptOssForCausalLM": "gpt-oss needs attention sinks, MXFP4 experts and its clamped SwiGLU",
    "DeepseekV2ForCausalLM": "DeepSeek-V2 needs multi-head latent attention (MLA) and grouped routing",
    "DeepseekV3ForCausalLM": "DeepSeek-V3 needs multi-head latent attention (MLA) and sigmoid group routing",
    "Qwen3NextForCausalLM": "Qwen3-Next needs gated delta-net (linear attention) layers",
    "PhimoeForCausalLM": "Phi-MoE needs sparsemixer routing",
}

REQUIRED = object()  # Field.default: the field must be present and not null
MAX_CONFIG_BYTES = 16 * 2**20  # a model's config.json is a few KiB; refuse to parse anything huge


@dataclass(frozen=True)
class Field:
    """One config.json field: its JSON type, accepted range and default.

    kind: int (strict: true/false and 255.5 are not integers), float (integers accepted; finite),
    bool or str. lo/hi: inclusive bounds unless lo_open/hi_open; a bound may be the name of a
    field read before it (e.g. "vocab_size"). default: REQUIRED, or the value an absent or null
    field takes. many: an integer or a list of integers (token ids). choices: the accepted strings.
    """

    kind: type
    lo: float | str | None = None
    hi: float | str | None = None
    default: Any = REQUIRED
    lo_open: bool = False
    hi_open: bool = False
    many: bool = False
    choices: tuple[str, ...] = ()


_SIZE = 2**24  # upper bound of lengths and vocabularies: far above any released model, below overflow

# The fields Strata reads. The bounds are sanity limits well above every released model of these
# families (whether the weights fit in memory is checked when loading, graph/loader.py).
SCHEMA: dict[str, Field] = {
    "hidden_size": Field(int, 1, 2**17),
    "intermediate_size": Field(int, 1, 2**20),
    "num_hidden_layers": Field(int, 1, 1024),
    "num_attention_heads": Field(int, 1, 1024),
    "num_key_value_heads": Field(int, 1, "num_attention_heads", default=None),  # None: = attention heads
    "head_dim": Field(int, 2, 1024, default=None),  # None: hidden_size / num_attention_heads
    "vocab_size": Field(int, 1, _SIZE),
    "max_position_embeddings": Field(int, 1, _SIZE, default=2048),
    "rms_norm_eps": Field(float, 0, 1, default=1e-6, lo_open=True),
    "rope_theta": Field(float, 1, default=None, lo_open=True),  # None: rope_parameters', else 10000
    "tie_word_embeddings": Field(bool, default=False),
    "attention_bias": Field(bool, default=False),
    "mlp_bias": Field(bool, default=False),
    "use_sliding_window": Field(bool, default=False),  # read for Qwen only
    "sliding_window": Field(int, 1, _SIZE, default=None),  # None: full attention
    "bos_token_id": Field(int, 0, "vocab_size", default=None, hi_open=True, many=True),
    "eos_token_id": Field(int, 0, "vocab_size", default=None, hi_open=True, many=True),
    "torch_dtype": Field(str, default=None),  # unknown names: float32, as before
    "dtype": Field(str, default=None),  # transformers >= 5 writes `dtype`
}

# rope_parameters (transformers >= 5) or rope_scaling: the fields of each rope type Strata
# implements (graph/layers.py: RotaryEmbedding, _llama3_inv_freq)
ROPE_TYPE = Field(str, default="default",
                  choices=("default", "linear", "dynamic", "llama3", "yarn", "longrope", "su"))
ROPE_SCHEMAS: dict[str, dict[str, Field]] = {
    "default": {},
    "linear": {"factor": Field(float, 1)},
    # dynamic NTK: the pre-training length is max_position_embeddings, as in transformers and vLLM
    "dynamic": {"factor": Field(float, 1)},
    "llama3": {
        "factor": Field(float, 1),
        "low_freq_factor": Field(float, 0, default=1.0, lo_open=True),
        "high_freq_factor": Field(float, "low_freq_factor", default=4.0, lo_open=True),
        "original_max_position_embeddings": Field(int, 1, _SIZE),
    },
    # Qwen2.5 long context, DeepSeek; null fields are completed by _yarn (transformers' defaults)
    "yarn": {
        "factor": Field(float, 1, default=None),  # None: max_position_embeddings / original
        "original_max_position_embeddings": Field(int, 1, _SIZE, default=None),
        "beta_slow": Field(float, 0, default=1.0, lo_open=True),
        "beta_fast": Field(float, "beta_slow", default=32.0),
        "mscale": Field(float, 0, default=None),
        "mscale_all_dim": Field(float, 0, default=None),
        "attention_factor": Field(float, 0, default=None, lo_open=True),
        "truncate": Field(bool, default=True),
    },
    # Phi-3 / Phi-4-mini ("su" is its old name); short_factor / long_factor are checked in _longrope
    "longrope": {
        "factor": Field(float, 0, default=None, lo_open=True),
        "attention_factor": Field(float, 0, default=None, lo_open=True),
        "original_max_position_embeddings": Field(int, 1, _SIZE, default=None),
    },
}
ROPE_SCHEMAS["su"] = ROPE_SCHEMAS["longrope"]

# fields only the Gemma 3 and Phi-3 families read (ModelConfig._family_fields); kept apart from SCHEMA
# because the Llama-family configs never carry them
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
FAMILY_SCHEMA: dict[str, Field] = {
    "hidden_act": Field(str, default="silu", choices=ACTIVATIONS),  # Phi-3
    "hidden_activation": Field(str, default="gelu_pytorch_tanh", choices=ACTIVATIONS),  # Gemma 3
    "query_pre_attn_scalar": Field(float, 0, default=256.0, lo_open=True),
    "final_logit_softcapping": Field(float, 0, default=None, lo_open=True),
    "attn_logit_softcapping": Field(float, 0, default=None, lo_open=True),
    "use_bidirectional_attention": Field(bool, default=False),
    "sliding_window_pattern": Field(int, 1, 1024, default=6),  # Gemma 3: every 6th layer is global
    "rope_local_base_freq": Field(float, 1, default=10000.0, lo_open=True),
    "partial_rotary_factor": Field(float, 0, 1, default=None, lo_open=True),
    "original_max_position_embeddings": Field(int, 1, _SIZE, default=None),
}
LAYER_TYPES = ("sliding_attention", "full_attention")

# the MoE families' fields (_moe below); absent fields take transformers' defaults for the family
MOE_SCHEMA: dict[str, Field] = {
    # the expert count: Mixtral's name (and what transformers >= 5 writes for Qwen3-MoE), the others'
    "num_local_experts": Field(int, 1, 4096, default=None),
    "num_experts": Field(int, 1, 4096, default=None),
    "num_experts_per_tok": Field(int, 1, 4096, default=None),
    "moe_intermediate_size": Field(int, 1, 2**20, default=None),  # Qwen MoE (Mixtral, OLMoE: intermediate_size)
    "shared_expert_intermediate_size": Field(int, 0, 2**20, default=5632),  # Qwen2-MoE
    "norm_topk_prob": Field(bool, default=False),
    "decoder_sparse_step": Field(int, 1, 1024, default=1),
    "router_aux_loss_coef": Field(float, 0, default=None),
    "router_z_loss_coef": Field(float, 0, default=0.0),
    "router_jitter_noise": Field(float, 0, default=0.0),  # Mixtral, training only
    "clip_qkv": Field(float, 0, default=None, lo_open=True),  # OLMoE
    "qkv_bias": Field(bool, default=True),  # Qwen2-MoE
}
# per family: (experts, experts per token, expert width field or None = intermediate_size, aux coef)
MOE_DEFAULTS: dict[str, tuple[int, int, str | None, float]] = {
    "MixtralForCausalLM": (8, 2, None, 0.001),
    "Qwen2MoeForCausalLM": (60, 4, "moe_intermediate_size", 0.001),
    "Qwen3MoeForCausalLM": (128, 8, "moe_intermediate_size", 0.001),
    "OlmoeForCausalLM": (64, 8, None, 0.01),
}
_MOE_WIDTH_DEFAULT = {"Qwen2MoeForCausalLM": 1408, "Qwen3MoeForCausalLM": 768}


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP (graph/moe.py): a fp32 router picks `top_k` of `num_experts` gated
    MLPs per token (softmax, top-k, renormalised when `norm_topk_prob`: Mixtral always), plus an
    always-on shared expert behind a sigmoid gate where `shared_intermediate_size` (Qwen2-MoE).
    `sparse`: which layers are MoE (the rest keep the dense MLP of intermediate_size)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_intermediate_size: int
    sparse: tuple[bool, ...]
    router_aux_loss_coef: float
    router_z_loss_coef: float = 0.0


def _moe(arch: str, d: dict[str, Any], source: str, layers: int, inter: int) -> MoEConfig:
    """The MoE block's fields, checked; the sparse-layer rule is transformers' (Qwen MoE: layer i
    is sparse unless listed in mlp_only_layers, and when (i + 1) % decoder_sparse_step == 0)."""
    m = _Reader(d, source, MOE_SCHEMA)
    experts_default, k_default, width_field, aux_default = MOE_DEFAULTS[arch]
    count_field = "num_experts" if d.get("num_experts") is not None else "num_local_experts"
    experts = m.get(count_field) or experts_default
    top_k = m.get("num_experts_per_tok") or k_default
    if top_k > experts:
        raise ModelLoadError(f"{source}: num_experts_per_tok = {top_k} exceeds {count_field} = {experts}; "
                             f"expected num_experts_per_tok in [1, {experts}]")
    width = (m.get(width_field) or _MOE_WIDTH_DEFAULT[arch]) if width_field else inter
    sparse = [True] * layers
    if arch.startswith("Qwen"):
        step = m.get("decoder_sparse_step")
        only = d.get("mlp_only_layers") or []
        if not (isinstance(only, list) and all(type(i) is int and 0 <= i < layers for i in only)):
            raise ModelLoadError(f"{source}: mlp_only_layers = {_show(only)} is not a list of layer indices; "
                                 f"expected integers in [0, {layers})")
        sparse = [i not in only and (i + 1) % step == 0 for i in range(layers)]
    shared = m.get("shared_expert_intermediate_size") if arch == "Qwen2MoeForCausalLM" else 0
    aux = m.get("router_aux_loss_coef")
    return MoEConfig(
        num_experts=experts, top_k=top_k, intermediate_size=width,
        norm_topk_prob=True if arch == "MixtralForCausalLM" else m.get("norm_topk_prob"),
        shared_intermediate_size=shared, sparse=tuple(sparse),
        router_aux_loss_coef=aux_default if aux is None else aux,
        router_z_loss_coef=m.get("router_z_loss_coef"),
    )


def _show(value: Any) -> str:
    """A value as config.json spells it (JSON), cut short."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):  # not JSON (from_dict of a Python dict), or an int too long to print
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


class _Reader:
    """Reads one JSON object's fields through a schema table, checking each on first read; the
    values read so far resolve bounds that name another field."""

    def __init__(self, d: dict[str, Any], source: str, schema: dict[str, Field], prefix: str = "") -> None:
        self.d, self.source, self.schema, self.prefix = d, source, schema, prefix
        self.values: dict[str, Any] = {}

    def error(self, name: str, value: Any, problem: str, f: Field) -> ModelLoadError:
        return ModelLoadError(
            f"{self.source}: {self.prefix}{name} = {_show(value)} {problem}; expected {self.accepted(f)}"
        )

    def _bound(self, b: float | str) -> tuple[float, str]:
        if isinstance(b, str):
            return self.values[b], f"{self.prefix}{b}={self.values[b]}"
        return b, f"{b:g}" if isinstance(b, float) else str(b)

    def accepted(self, f: Field) -> str:
        if f.kind is bool:
            text = "true or false"
        elif f.kind is str:
            text = ("one of " + ", ".join(f.choices)) if f.choices else "a string"
        else:
            noun = "an integer" if f.kind is int else "a number"
            lo = self._bound(f.lo)[1] if f.lo is not None else None
            hi = self._bound(f.hi)[1] if f.hi is not None else None
            if lo is not None and hi is not None:
                text = f"{noun} in {'(' if f.lo_open else '['}{lo}, {hi}{')' if f.hi_open else ']'}"
            elif lo is not None:
                text = f"{noun} {'>' if f.lo_open else '>='} {lo}"
            else:
                text = noun
            if f.many:
                text = f"{noun} or a list of integers, each in {text.removeprefix(noun + ' in ')}"
        if f.default is not REQUIRED:
            text += " (or null)"
        return text

    def get(self, name: str) -> Any:
        f = self.schema[name]
        raw = self.d.get(name)
        if raw is None:
            if f.default is REQUIRED:
                problem = "is null" if name in self.d else "is missing"
                raise ModelLoadError(f"{self.source}: {self.prefix}{name} {problem}; expected {self.accepted(f)}")
            value = f.default
        elif f.many and isinstance(raw, list):
            value = [self._check(f"{name}[{i}]", x, f) for i, x in enumerate(raw)]
        else:
            value = self._check(name, raw, f)
            value = [value] if f.many else value
        self.values[name] = value
        return value

    def _check(self, name: str, x: Any, f: Field) -> Any:
        shown = x  # as written in the file (x may become a float below)
        if f.kind is bool or f.kind is str:
            if not isinstance(x, f.kind):
                raise self.error(name, shown, "is not " + ("true or false" if f.kind is bool else "a string"), f)
            if f.choices and x not in f.choices:
                raise self.error(name, shown, "is not supported", f)
            return x
        if isinstance(x, bool) or not isinstance(x, (int, float)) or (f.kind is int and not isinstance(x, int)):
            raise self.error(name, shown, f"is not {'an integer' if f.kind is int else 'a number'}", f)
        if f.kind is float:
            try:
                x = float(x)
            except OverflowError:
                x = math.inf
            if not math.isfinite(x):
                raise self.error(name, shown, "is not finite", f)
        if f.lo is not None:
            lo = self._bound(f.lo)[0]
            if x < lo or (f.lo_open and x == lo):
                raise self.error(name, shown, "is out of range", f)
        if f.hi is not None:
            hi = self._bound(f.hi)[0]
            if x > hi or (f.hi_open and x == hi):
                raise self.error(name, shown, "is out of range", f)
        return x


def _architecture(d: dict[str, Any], source: str) -> str:
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    archs = d.get("architectures")
    if archs is None or archs == []:
        problem = "missing" if "architectures" not in d else "null" if archs is None else "empty"
        raise ModelLoadError(
            f"{source}: architectures is {problem}; expected a list "
            f"naming the model class, one of {supported}"
        )
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        hint = f", e.g. [{_show(archs)}]" if isinstance(archs, str) else ""
        raise ModelLoadError(
            f"{source}: architectures = {_show(archs)} is not a list of strings; expected a list of "
            f"model class names{hint}"
        )
    if archs[0] in NOT_YET:
        raise ModelLoadError(f"{source}: architecture {archs[0]!r} is not supported yet ({NOT_YET[archs[0]]}); "
                             f"Strata supports {supported}")
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{source}: unsupported architecture {archs[0]!r}; Strata supports {supported}")
    return archs[0]


def _rope(d: dict[str, Any], f: _Reader, source: str, key: str | None = None) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope scaling dict with rope_type, or None for plain rotary). `key`: read that
    entry of d (a Gemma 3 per-layer-type rope_parameters entry) instead of rope_parameters / rope_scaling."""
    key = key or ("rope_parameters" if d.get("rope_parameters") else "rope_scaling")
    raw = d.get(key)
    if raw is not None and not isinstance(raw, dict):
        raise ModelLoadError(
            f"{source}: {key} = {_show(raw)} is not an object; expected null or an object such as "
            '{"rope_type": "linear", "factor": 2.0}'
        )
    rope = dict(raw or {})
    sub = _Reader(rope, source, {"rope_type": ROPE_TYPE, "type": ROPE_TYPE, "rope_theta": SCHEMA["rope_theta"]},
                  prefix=f"{key}.")
    theta = f.get("rope_theta")
    if theta is None:
        theta = sub.get("rope_theta")
    rtype = sub.get("rope_type" if rope.get("rope_type") is not None else "type")
    params = _Reader(rope, source, ROPE_SCHEMAS[rtype], prefix=f"{key}.")
    for name in ROPE_SCHEMAS[rtype]:
        rope[name] = params.get(name)
    rope["rope_type"] = "longrope" if rtype == "su" else rtype
    return (10000.0 if theta is None else theta), (None if rtype == "default" else rope)


def _longrope(rope: dict[str, Any], d: dict[str, Any], max_positions: int, rotary_dim: int, source: str) -> None:
    """Check and complete a longrope (Phi-3) scaling dict in place: factor lists of rotary_dim / 2
    positive numbers, original_max_position_embeddings (its own or the config's top-level field),
    and the attention factor as transformers derives it (_compute_longrope_parameters)."""
    for name in ("short_factor", "long_factor"):
        v = rope.get(name)
        ok = isinstance(v, list) and len(v) == rotary_dim // 2 and all(
            isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in v)
        if not ok:
            raise ModelLoadError(
                f"{source}: rope_scaling.{name} = {_show(v)} is not a list of {rotary_dim // 2} positive numbers; "
                f"longrope needs one factor per rotary frequency (rotary dims {rotary_dim} / 2)"
            )
    orig = rope.get("original_max_position_embeddings") or d.get("original_max_position_embeddings")
    if orig is None:
        raise ModelLoadError(f"{source}: longrope needs original_max_position_embeddings (the pre-training length)")
    rope["original_max_position_embeddings"] = orig
    factor = rope.get("factor") or max_positions / orig
    if rope.get("attention_factor") is None:
        rope["attention_factor"] = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))


def _yarn(rope: dict[str, Any], d: dict[str, Any], max_positions: int, source: str) -> None:
    """Complete a yarn scaling dict in place as transformers does (standardize_rope_params and
    _compute_yarn_parameters): original_max_position_embeddings from the config's top level first,
    then rope_scaling, then max_position_embeddings; factor, when null, the ratio of the two
    lengths; attention_factor, when null, from factor and DeepSeek's mscale / mscale_all_dim."""
    top = d.get("original_max_position_embeddings")
    if top is not None:
        top = _Reader(d, source, FAMILY_SCHEMA).get("original_max_position_embeddings")
    orig = top or rope["original_max_position_embeddings"] or max_positions
    rope["original_max_position_embeddings"] = orig
    if rope["factor"] is None:
        rope["factor"] = max_positions / orig
        if rope["factor"] < 1:
            raise ModelLoadError(
                f"{source}: yarn's factor is null and max_position_embeddings ({max_positions}) / "
                f"original_max_position_embeddings ({orig}) is below 1; give rope_scaling.factor >= 1"
            )

    def mscale(m: float = 1.0) -> float:  # transformers' yarn_get_mscale
        return 1.0 if rope["factor"] <= 1 else 0.1 * m * math.log(rope["factor"]) + 1.0

    if rope["attention_factor"] is None:
        m, m_all = rope["mscale"], rope["mscale_all_dim"]
        rope["attention_factor"] = mscale(m) / mscale(m_all) if m and m_all else mscale()
    if rope["beta_fast"] < rope["beta_slow"]:  # a null beta_fast (32) below a given beta_slow
        raise ModelLoadError(f"{source}: yarn's beta_fast ({rope['beta_fast']:g}) is below beta_slow "
                             f"({rope['beta_slow']:g}); expected beta_fast >= beta_slow (defaults 32 and 1)")


def _layer_windows(arch: str, d: dict[str, Any], fam: _Reader, layers: int, window: int | None,
                   source: str) -> tuple[int | None, ...]:
    """The attention window of each layer (None: full attention): config.json's layer_types where
    given, else the family's rule (Gemma 3: every sliding_window_pattern-th layer is global, the
    rest slide; the others: every layer slides when the config has a window)."""
    if window is None:
        return (None,) * layers
    types = d.get("layer_types")
    if types is not None:
        if not (isinstance(types, list) and len(types) == layers and all(t in LAYER_TYPES for t in types)):
            raise ModelLoadError(
                f"{source}: layer_types = {_show(types)} is not a list of {layers} entries (num_hidden_layers), "
                f"each one of {', '.join(LAYER_TYPES)}"
            )
        return tuple(window if t == "sliding_attention" else None for t in types)
    if arch == "Gemma3ForCausalLM":
        pattern = fam.get("sliding_window_pattern")
        return tuple(window if (i + 1) % pattern else None for i in range(layers))
    return (window,) * layers


def _family_fields(arch: str, d: dict[str, Any], source: str, hidden: int, head_dim: int, max_positions: int,
                   rope: dict[str, Any] | None) -> dict[str, Any]:
    """The ModelConfig fields in which Gemma 3 and Phi-3 differ from the Llama-shaped default; a
    field that asks for something Strata does not implement is refused."""
    fam = _Reader(d, source, FAMILY_SCHEMA)
    out: dict[str, Any] = {}
    if arch == "Gemma3ForCausalLM":
        if fam.get("attn_logit_softcapping") is not None:
            raise ModelLoadError(f"{source}: attn_logit_softcapping is not implemented (Gemma 2's); expected null")
        if fam.get("use_bidirectional_attention"):
            raise ModelLoadError(f"{source}: use_bidirectional_attention (an embedding model) is not implemented; "
                                 "expected false: Strata runs causal decoders")
        out.update(hidden_act=fam.get("hidden_activation"), gemma_norms=True, embed_scale=hidden**0.5,
                   attn_scale=fam.get("query_pre_attn_scalar") ** -0.5,
                   final_logit_softcapping=fam.get("final_logit_softcapping"))
    elif arch == "Phi3ForCausalLM":
        out["hidden_act"] = fam.get("hidden_act")
        partial = fam.get("partial_rotary_factor")
        if partial is None and isinstance(d.get("rope_parameters"), dict):
            partial = d["rope_parameters"].get("partial_rotary_factor")
        dims = int(head_dim * (partial or 1.0))
        if dims % 2 or dims < 2:
            raise ModelLoadError(f"{source}: partial_rotary_factor = {_show(partial)} gives {dims} "
                                 f"rotary dims of head_dim {head_dim}; expected an even number >= 2")
        out["rotary_dim"] = dims if dims != head_dim else None
    if rope is not None and rope["rope_type"] == "longrope":
        _longrope(rope, d, max_positions, out.get("rotary_dim") or head_dim, source)
    elif rope is not None and rope["rope_type"] == "yarn":
        _yarn(rope, d, max_positions, source)
    elif rope is not None and rope["rope_type"] == "dynamic":
        if (out.get("rotary_dim") or head_dim) <= 2:  # the NTK exponent is dims / (dims - 2)
            raise ModelLoadError(f"{source}: dynamic rope needs more than 2 rotary dims (head_dim {head_dim}); "
                                 "expected a head_dim > 2 or another rope_type")
        rope["original_max_position_embeddings"] = max_positions  # transformers' pre-training length
    return out


def _gemma_ropes(d: dict[str, Any], f: _Reader, source: str) -> tuple[float, dict | None, float]:
    """Gemma 3's two rotary embeddings: (global theta, global scaling, local theta). transformers >= 5
    writes rope_parameters per layer type; older configs rope_theta, rope_scaling and rope_local_base_freq
    (the local layers use plain rotary)."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        sub = {"full_attention": params.get("full_attention") or {}, "sliding_attention": params.get("sliding_attention") or {}}
        theta, rope = _rope({**sub, "rope_theta": None}, _Reader({}, source, SCHEMA), source, "full_attention")
        local, local_rope = _rope({**sub}, _Reader({}, source, SCHEMA), source, "sliding_attention")
        if local_rope is not None:
            raise ModelLoadError(f"{source}: rope_parameters.sliding_attention.rope_type = "
                                 f"{_show(local_rope['rope_type'])} is not implemented; expected default")
        return (1e6 if "rope_theta" not in sub["full_attention"] else theta), rope, local
    theta, rope = _rope(d, f, source)
    if d.get("rope_theta") is None:
        theta = 1e6  # Gemma 3's default global theta
    return theta, rope, _Reader(d, source, FAMILY_SCHEMA).get("rope_local_base_freq")


def _divisors(n: int) -> str:
    return ", ".join(str(k) for k in range(1, n + 1) if n % k == 0)


@dataclass
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    torch_dtype: torch.dtype
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # family differences beyond Llama's (defaults: the Llama-shaped decoder); graph/models/llama.py
    layer_windows: tuple[int | None, ...] = ()  # attention window per layer (None: full); () = none
    hidden_act: str = "silu"  # the gated MLP's activation: silu | gelu_pytorch_tanh (Gemma)
    gemma_norms: bool = False  # Gemma: (1 + w) RMSNorms, and a post-norm after attention and MLP too
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: float | None = None  # Gemma: query_pre_attn_scalar ** -0.5; None: head_dim ** -0.5
    final_logit_softcapping: float | None = None  # Gemma: cap * tanh(logits / cap)
    rope_local_theta: float | None = None  # Gemma: the sliding layers' rotary base (plain rotary)
    rotary_dim: int | None = None  # Phi-4-mini: rotate only the first head dims; None: all of head_dim
    moe: MoEConfig | None = None  # mixture-of-experts MLPs (Mixtral, Qwen2/3-MoE, OLMoE)
    qk_norm_whole: bool = False  # OLMoE: q/k norms over the whole projection, not per head
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip, clip]

    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and self.moe.sparse[i]

    @property
    def rotary_dims(self) -> int:
        return self.rotary_dim or self.head_dim

    def layer_window(self, i: int) -> int | None:
        return self.layer_windows[i] if i < len(self.layer_windows) else None

    @property
    def llama_structure(self) -> bool:
        """Whether the layers are the Llama-shaped decoder that graph/fusion.py's patterns describe
        (no Gemma norms, GeGLU, scales or soft-capping, no partial rotary; windows are allowed: the
        attention leaf takes them)."""
        return (not self.gemma_norms and self.hidden_act == "silu" and self.rotary_dim in (None, self.head_dim)
                and self.embed_scale is None and self.final_logit_softcapping is None and self.moe is None)

    @classmethod
    def from_dict(cls, d: Any, source: str = "config.json") -> ModelConfig:
        """Validate a parsed config.json (SCHEMA, ROPE_SCHEMAS and the cross-field rules) and
        build the ModelConfig; any bad value is a ModelLoadError naming `source` and the field."""
        if not isinstance(d, dict):
            kind = {list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(type(d), "a number")
            raise ModelLoadError(
                f"{source}: the top level is {kind}; expected a JSON object of model fields "
                '({"architectures": [...], "hidden_size": ..., ...})'
            )
        arch = _architecture(d, source)
        flags = SUPPORTED_ARCHITECTURES[arch]
        f = _Reader(d, source, SCHEMA)
        hidden = f.get("hidden_size")
        inter = f.get("intermediate_size")
        layers = f.get("num_hidden_layers")
        heads = f.get("num_attention_heads")
        kv_heads = f.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads = {heads} is not a multiple of num_key_value_heads = "
                f"{kv_heads}; each KV head serves a whole group of query heads, so expected "
                f"num_key_value_heads in {{{_divisors(heads)}}}"
            )
        head_dim = f.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ModelLoadError(
                    f"{source}: hidden_size = {hidden} is not divisible by num_attention_heads = {heads} "
                    "and head_dim is not given; expected hidden_size = num_attention_heads x head_dim, "
                    "or an explicit head_dim (as Qwen3 configs give)"
                )
            head_dim = hidden // heads
        if head_dim % 2:
            given = "" if d.get("head_dim") is not None else " (= hidden_size / num_attention_heads)"
            raise ModelLoadError(
                f"{source}: head_dim = {head_dim}{given} is odd; rotary embedding turns pairs of "
                "dimensions, so expected an even head_dim"
            )
        vocab = f.get("vocab_size")
        max_positions = f.get("max_position_embeddings")
        local_theta = None
        if arch == "Gemma3ForCausalLM":
            rope_theta, rope, local_theta = _gemma_ropes(d, f, source)
        else:
            rope_theta, rope = _rope(d, f, source)
        sliding = None
        if not arch.startswith("Qwen") or f.get("use_sliding_window"):
            sliding = f.get("sliding_window")
        family = _family_fields(arch, d, source, hidden, head_dim, max_positions, rope)
        windows = _layer_windows(arch, d, _Reader(d, source, FAMILY_SCHEMA), layers, sliding, source)
        bos = f.get("bos_token_id")
        moe = _moe(arch, d, source, layers, inter) if arch in MOE_ARCHITECTURES else None
        if moe is not None:
            family.update(moe=moe, qk_norm_whole=arch == "OlmoeForCausalLM",
                          clip_qkv=_Reader(d, source, MOE_SCHEMA).get("clip_qkv"))
        qkv_bias = flags["qkv_bias"] and (arch != "Qwen2MoeForCausalLM" or _Reader(d, source, MOE_SCHEMA).get("qkv_bias"))
        dtype_name = f.get("torch_dtype") or f.get("dtype") or "float32"
        attention_bias = f.get("attention_bias")
        return cls(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=vocab,
            rms_norm_eps=f.get("rms_norm_eps"),
            rope_theta=rope_theta,
            rope_scaling=rope,
            max_position_embeddings=max_positions,
            # Gemma 3's configs leave it out: transformers' Gemma3TextConfig defaults it to true
            tie_word_embeddings=(f.get("tie_word_embeddings") if d.get("tie_word_embeddings") is not None
                                 else arch == "Gemma3ForCausalLM"),
            qkv_bias=qkv_bias or attention_bias,
            o_bias=attention_bias and not arch.startswith("Qwen"),
            mlp_bias=f.get("mlp_bias"),
            qk_norm=flags["qk_norm"],
            sliding_window=sliding,
            torch_dtype=DTYPES.get(dtype_name.replace("torch.", ""), torch.float32),
            bos_token_id=bos[0] if bos else None,
            eos_token_ids=f.get("eos_token_id") or [],
            # a window as long as the context never binds (Phi-4-mini's 262144): full attention
            layer_windows=windows if any(w is not None and w < max_positions for w in windows) else (),
            rope_local_theta=local_theta,
            **family,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_file():
            raise ModelLoadError(f"{path}: config.json not found; a model directory needs one")
        try:
            size = path.stat().st_size
            if size > MAX_CONFIG_BYTES:
                raise ModelLoadError(
                    f"{path}: config.json is {fmt_bytes(size)}; a model config is a few KiB "
                    f"(limit {fmt_bytes(MAX_CONFIG_BYTES)}): is this the right file?"
                )
            data = path.read_bytes()
        except OSError as e:
            raise ModelLoadError(f"{path}: cannot read config.json ({e.strerror or e})") from None
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise ModelLoadError(
                f"{path}: config.json is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); "
                "expected UTF-8 JSON text"
            ) from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ModelLoadError(
                f"{path}: cannot parse config.json ({e.msg} at line {e.lineno}, column {e.colno})"
            ) from None
        except (ValueError, RecursionError) as e:  # e.g. an integer of > 4300 digits, deep nesting
            why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            raise ModelLoadError(f"{path}: cannot parse config.json ({why})") from None
        return cls.from_dict(d, str(path))

    def context_limit(self) -> tuple[int, str]:
        """(the longest context the model's rotary allows, how it is derived). yarn and dynamic
        stretch the pre-training window by their factor (vLLM's limits; transformers sets none):
        Qwen2.5's yarn recipe keeps max_position_embeddings at the pre-training length."""
        s, limit = self.rope_scaling or {}, self.max_position_embeddings
        if s.get("rope_type") in ("yarn", "dynamic"):
            orig = s["original_max_position_embeddings"]
            scaled = int(orig * s["factor"])
            if scaled > limit:
                return scaled, (f"{s['rope_type']} rope context (original_max_position_embeddings {orig} "
                                f"x factor {s['factor']:g} = {scaled})")
        return limit, f"max_position_embeddings ({limit})"

    def max_model_len(self, requested: int | None) -> int:
        """The context length an engine (and the planner) uses: `requested`, refused above
        context_limit; the default is that limit, except for dynamic rope, whose table is stretched
        for max_model_len (graph/layers.py: RotaryEmbedding), so the default stays at
        max_position_embeddings, where it is transformers' plain rotary. Sliding-window layers attend
        within their window (kernels/attention: every backend honours AttentionMetadata windows),
        so nothing is capped."""
        limit, why = self.context_limit()
        dynamic = (self.rope_scaling or {}).get("rope_type") == "dynamic"
        want = requested or (self.max_position_embeddings if dynamic else limit)
        if want > limit:
            raise ConfigError(
                f"max_model_len: {want} exceeds the model's {why}; "
                f"use max_model_len <= {limit}"
            )
        return want

    def num_params(self, active: bool = False) -> int:
        """Parameter count implied by the shapes (embeddings counted once when tied); `active`: what
        one token reads (an MoE layer's routed experts and shared expert, not all of them)."""
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        attn = h * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * h
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += (self.num_heads + self.num_kv_heads) * d if self.qk_norm_whole else 2 * d
        total = 0
        for layer in range(self.num_layers):
            mlp = 3 * h * i
            if self.is_moe_layer(layer):
                moe = self.moe
                experts = moe.top_k if active else moe.num_experts
                mlp = experts * 3 * h * moe.intermediate_size + moe.num_experts * h
                if moe.shared_intermediate_size:
                    mlp += 3 * h * moe.shared_intermediate_size + h
            total += attn + mlp + (4 if self.gemma_norms else 2) * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return total + emb + h
