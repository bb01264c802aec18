"""Tensor parallelism applied to a built model from outside (torchtitan / gpt-fast style).

`shard_model(model, rank, world_size, comm)` runs on every rank over the same loaded (and possibly
quantised) CausalLM and keeps, in place, this rank's share of every weight (Megatron layout):

  qkv_proj      column-parallel: this rank's query heads [r*H/tp, (r+1)*H/tp) and its KV heads,
                fused again as [q | k | v]. KV heads: num_kv_heads/tp each when tp divides them;
                when num_kv_heads < tp (tp a multiple of it) each rank keeps the one KV head its query
                heads use (replicated over tp/num_kv_heads ranks). Biases sliced alike.
  o_proj        row-parallel: the input columns of this rank's query heads, then ONE all-reduce;
                a bias is added once, after it.
  gate_up_proj  column-parallel: the rank's slice of each half, fused again as [gate_r; up_r].
  down_proj     row-parallel: the rank's intermediate columns, then ONE all-reduce (+ bias after).
  embed_tokens  vocab-parallel: rows [r*Vr, (r+1)*Vr), Vr = ceil(vocab/tp) (the last shard padded
                with zero rows); ids outside the shard look up row 0 and are zeroed, then all-reduce
                (a sum with exact zeros: the embedding is bit-identical to the full one).
  lm_head       vocab-parallel: this rank's logits, all-gathered in rank order and trimmed to the
                vocabulary, so `compute_logits` returns the full logits on every rank. A tied
                embedding stays tied on the shard (float: one Parameter; quantised: the
                QuantEmbedding over the sharded QuantLinear).
  norms, rotary, q/k norms: replicated.

Attention.heads / kv_heads / q_size / kv_size and GatedMLP.intermediate are set to the shard's, so
every path (the plain causal forward, the paged step, the CPU fused decode, the fused SwiGLU
kernels, graph/fusion.py's patterns) runs on the shard unchanged: the column-parallel projections
stay plain Linear / QuantLinear modules, and each collective lives inside a leaf module
(RowParallelLinear, VocabParallelEmbedding, VocabParallelHead), which FX tracing keeps whole.

Quantised projections (memory/quant.py) are sliced, never re-quantised: by output rows
(column-parallel: qweight rows and their scales) or by input columns (row-parallel: int8 keeps its
per-row scale, so the shards' partial sums add up to the full layer's up to summation order; int4
cuts at group boundaries, so each shard's width must be a whole number of groups).

Order in a build: load -> quantize -> shard -> (KV cache for per_rank_config) -> fuse -> capture.
FX tracing bakes the head counts into view shapes, so shard before fusing or capturing.
`comm` is duck-typed (all_reduce(t) -> t summed in place, all_gather(t, dim) -> concatenation in
rank order, rank, world_size): the graph layer does not import strata.comm.

The modules holding the collectives and the weight slicing are in graph/tensor_parallel_layers.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from strata.errors import ConfigError
from strata.graph.expert_parallel import ExpertParallelMoE, expert_range
from strata.graph.layers import GatedMLP
from strata.graph.models.llama import Attention, CausalLM
from strata.graph.moe import MoEBlock
from strata.graph.tensor_parallel_layers import (
    Comm,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    column_parallel,
    float_embedding,
    int4_cols_ok,
    pad_rows,
    row_parallel,
    vocab_rows,
)
from strata.memory.arena import rehome_in_arena
from strata.memory.quant import QuantEmbedding
from strata.model_config import ModelConfig

__all__ = [
    "Comm", "RowParallelLinear", "ShardCut", "ShardSpec", "VocabParallelEmbedding", "VocabParallelHead",
    "check_shardable", "per_rank_config", "projection_cuts", "shard_kv_heads", "shard_model", "shard_spec",
]


# --- the partition ---------------------------------------------------------------------------------


def _divisors(n: int) -> str:
    return ", ".join(str(k) for k in range(1, n + 1) if n % k == 0)


def _dense_layers(cfg: ModelConfig) -> bool:
    return any(not cfg.is_moe_layer(i) for i in range(cfg.num_layers))


def check_shardable(cfg: ModelConfig, world_size: int, expert_parallel: bool = False) -> None:
    """ConfigError unless heads, KV heads and the MLP (an MoE model's experts, with
    `expert_parallel`) split evenly over `world_size` ranks."""
    tp = world_size
    if not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tensor_parallel_size = {tp!r}: expected an integer >= 1")
    if tp == 1:
        return
    if cfg.moe is not None:
        if not expert_parallel:
            raise ConfigError(f"tensor_parallel_size = {tp}: {cfg.architecture} is a mixture of experts; its "
                              "experts are split across ranks with --enable-expert-parallel (experts are not "
                              "sharded by columns): add it, or use tensor_parallel_size 1")
        if cfg.qk_norm_whole:
            raise ConfigError(f"tensor_parallel_size = {tp}: {cfg.architecture}'s q/k norms span every head "
                              "(a sharded norm needs its own all-reduce, not built): use tensor_parallel_size 1")
        expert_range(cfg.moe.num_experts, 0, tp)
    elif not cfg.llama_structure or cfg.architecture == "Phi3ForCausalLM":
        raise ConfigError(
            f"tensor_parallel_size = {tp}: tensor parallelism is built and checked for the Llama, Mistral "
            f"and Qwen families; {cfg.architecture} is not sharded yet: use tensor_parallel_size 1"
        )
    if cfg.num_heads % tp:
        raise ConfigError(
            f"tensor_parallel_size = {tp}: num_attention_heads = {cfg.num_heads} is not divisible by "
            f"{tp}; each rank holds whole query heads, so expected tensor_parallel_size in "
            f"{{{_divisors(cfg.num_heads)}}}"
        )
    kv = cfg.num_kv_heads
    if kv % tp and tp % kv:
        raise ConfigError(
            f"tensor_parallel_size = {tp}: num_key_value_heads = {kv} neither divides by {tp} nor "
            f"divides {tp}; KV heads are split evenly or (fewer than ranks) replicated, so expected "
            f"a tensor_parallel_size dividing {kv} or a multiple of it"
        )
    if cfg.intermediate_size % tp and _dense_layers(cfg):
        raise ConfigError(
            f"tensor_parallel_size = {tp}: intermediate_size = {cfg.intermediate_size} is not "
            f"divisible by {tp}; expected tensor_parallel_size in {{{_divisors(cfg.intermediate_size)}}}"
        )


def shard_kv_heads(num_heads: int, num_kv_heads: int, rank: int, world_size: int) -> range:
    """The (global) KV heads rank `rank` holds: num_kv_heads / tp of them, or the one its query
    heads use when num_kv_heads < tp (then replicated on tp / num_kv_heads ranks)."""
    if num_kv_heads >= world_size:
        per = num_kv_heads // world_size
        return range(rank * per, (rank + 1) * per)
    head = rank * num_kv_heads // world_size  # = (first query head) // (query heads per KV head)
    return range(head, head + 1)


@dataclass(frozen=True)
class ShardSpec:
    """What rank `rank` of `world_size` holds (global indices)."""

    rank: int
    world_size: int
    head_dim: int
    q_heads: range  # query heads
    kv_heads: range  # KV heads (one, replicated, when the model has fewer than ranks)
    kv_replicated: bool
    intermediate: range  # columns of the MLP's intermediate activation
    vocab_size: int  # the full vocabulary (the logits every rank returns)
    vocab_start: int  # first token id of this rank's embedding / lm_head rows
    vocab_rows: int  # rows each rank stores (ceil(vocab / tp)); the last shard is padded
    vocab_real: int  # of those, real token rows (vocab_rows less this shard's padding)


def shard_spec(cfg: ModelConfig, rank: int, world_size: int, expert_parallel: bool = False) -> ShardSpec:
    check_shardable(cfg, world_size, expert_parallel)
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank = {rank}: outside tensor_parallel_size = {world_size}")
    hq = cfg.num_heads // world_size
    inter = cfg.intermediate_size // world_size
    rows = -(-cfg.vocab_size // world_size)
    start = rank * rows
    return ShardSpec(
        rank, world_size, cfg.head_dim, range(rank * hq, (rank + 1) * hq),
        shard_kv_heads(cfg.num_heads, cfg.num_kv_heads, rank, world_size),
        cfg.num_kv_heads < world_size, range(rank * inter, (rank + 1) * inter),
        cfg.vocab_size, start, rows, max(0, min(rows, cfg.vocab_size - start)),
    )


def per_rank_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """The config of one rank's shard, for the KV cache and the memory planner: num_heads,
    num_kv_heads (at least 1: replicated below tp) and intermediate_size per rank, head_dim
    explicit; hidden_size and vocab_size stay the model's (the logits are the full vocabulary;
    the embedding and lm_head hold ceil(vocab / tp) rows each). An MoE config keeps its router's
    view (all experts: the router is replicated)."""
    check_shardable(cfg, world_size, expert_parallel=cfg.moe is not None)
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // world_size,
        num_kv_heads=max(1, cfg.num_kv_heads // world_size),
        intermediate_size=cfg.intermediate_size // world_size,
        head_dim=cfg.head_dim,
    )


# --- the model -------------------------------------------------------------------------------------


def _check_int4(model: CausalLM, spec: ShardSpec) -> None:
    tp, d = spec.world_size, spec.head_dim
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        checks = [("self_attn.o_proj", attn.o_proj, attn.heads // tp * d)]
        if not isinstance(mlp, MoEBlock):  # experts are split whole, never by columns
            checks.append(("mlp.down_proj", mlp.down_proj, mlp.intermediate // tp))
        for name, proj, width in checks:
            if not int4_cols_ok(proj, width):
                raise ConfigError(
                    f"tensor_parallel_size = {tp}: layers.{i}.{name} is {proj.method} with group size "
                    f"{proj.group_size}, and its row-parallel shard of {width} input columns is not a "
                    f"whole number of groups; use a quantization_group_size dividing {width} (>= 32), "
                    "int8, or a smaller tensor_parallel_size"
                )


def _shard_attention(attn: Attention, spec: ShardSpec, comm: Comm) -> None:
    d = attn.head_dim
    q_size, kv_size = attn.q_size, attn.kv_size
    k0, v0 = q_size, q_size + kv_size
    spans = [slice(spec.q_heads.start * d, spec.q_heads.stop * d),
             slice(k0 + spec.kv_heads.start * d, k0 + spec.kv_heads.stop * d),
             slice(v0 + spec.kv_heads.start * d, v0 + spec.kv_heads.stop * d)]
    attn.qkv_proj = column_parallel(attn.qkv_proj, spans)
    attn.o_proj = row_parallel(attn.o_proj, spans[0], comm)
    attn.heads, attn.kv_heads = len(spec.q_heads), len(spec.kv_heads)
    attn.q_size, attn.kv_size = attn.heads * d, attn.kv_heads * d


def _shard_mlp(mlp: GatedMLP, spec: ShardSpec, comm: Comm) -> None:
    full, cols = mlp.intermediate, slice(spec.intermediate.start, spec.intermediate.stop)
    mlp.gate_up_proj = column_parallel(mlp.gate_up_proj, [cols, slice(full + cols.start, full + cols.stop)])
    mlp.down_proj = row_parallel(mlp.down_proj, cols, comm)
    mlp.intermediate = len(spec.intermediate)


def _shard_vocab(model: CausalLM, spec: ShardSpec, comm: Comm) -> None:
    head, embed = model.lm_head, model.embed_tokens
    real, rows = slice(spec.vocab_start, spec.vocab_start + spec.vocab_real), spec.vocab_rows
    new_head = vocab_rows(head, real, rows)
    if isinstance(embed, QuantEmbedding):  # tied and quantised: the embedding reads the head
        new_embed: nn.Module = QuantEmbedding(new_head, embed.dtype)
    elif isinstance(head, nn.Linear) and head.weight is embed.weight:  # tied, float
        new_embed = float_embedding(new_head.weight)  # the same Parameter: still tied
    else:  # untied: the embedding stays float (memory/quant.py), the head may be quantised
        new_embed = float_embedding(pad_rows(embed.weight.detach()[real], rows))
    model.lm_head = VocabParallelHead(new_head, spec.vocab_size, comm)
    model.embed_tokens = VocabParallelEmbedding(new_embed, spec.vocab_start, spec.vocab_real, comm)


def shard_model(model: CausalLM, rank: int, world_size: int, comm: Comm, expert_parallel: bool = False) -> CausalLM:
    """Keep rank `rank`'s share of every weight of `model` (in place; returned). Runs on every
    rank over the same built model (after quantize_model, before fusion or capture). Everything is
    checked before anything changes: ConfigError for heads, KV heads, intermediate size or an int4
    group that do not split over `world_size`, or a `comm` of another rank or world.
    expert_parallel: an MoE layer keeps this rank's experts (graph/expert_parallel.py)."""
    if world_size > 1 and comm is None:
        raise ConfigError(f"shard_model: tensor_parallel_size = {world_size} needs a communicator")
    if comm is not None and (comm.rank != rank or comm.world_size != world_size):
        raise ConfigError(
            f"shard_model: comm is rank {comm.rank} of {comm.world_size}, asked for rank {rank} of "
            f"{world_size}; pass the communicator of this rank's world"
        )
    if getattr(model, "tensor_parallel", None) is not None:
        raise ConfigError("shard_model: this model is already sharded")
    cfg = model.config
    spec = shard_spec(cfg, rank, world_size, expert_parallel)
    if world_size == 1:
        return model
    _check_int4(model, spec)
    embed = model.embed_tokens
    if isinstance(embed, QuantEmbedding) and embed.head[0] is not model.lm_head:
        raise ConfigError("shard_model: the tied QuantEmbedding does not read the model's lm_head")
    with torch.no_grad():
        for layer in model.layers:
            _shard_attention(layer.self_attn, spec, comm)
            if isinstance(layer.mlp, MoEBlock):
                layer.mlp = ExpertParallelMoE(layer.mlp, rank, world_size, comm)
            else:
                _shard_mlp(layer.mlp, spec, comm)
        _shard_vocab(model, spec, comm)
        rehome_in_arena(model)
    model.config = per_rank_config(cfg, world_size)
    model.tensor_parallel = spec
    model.full_config = cfg
    return model


# --- what a shard keeps of each projection (for tensors laid out like the weights: LoRA's A/B) -----


@dataclass(frozen=True)
class ShardCut:
    """What a sharded projection keeps of the full one. Column-parallel: `rows`, per segment (q, k,
    v / gate, up), the rows of the full segment this rank holds, with the full segments' sizes
    `full_out`. Row-parallel: `cols`, the full input columns it holds, of `full_in`."""

    full_in: int
    full_out: tuple[int, ...]
    rows: tuple[slice, ...] | None = None
    cols: slice | None = None


def _span(heads: range, d: int) -> slice:
    return slice(heads.start * d, heads.stop * d)


def projection_cuts(model: CausalLM) -> dict[int, ShardCut]:
    """id(module holding the weight: a column-parallel Linear, a row-parallel projection's inner)
    -> its ShardCut, for every attention and dense-MLP projection of a sharded model."""
    spec, cfg = model.tensor_parallel, model.full_config
    d, tp = spec.head_dim, spec.world_size
    q, kv = _span(spec.q_heads, d), _span(spec.kv_heads, d)
    cuts: dict[int, ShardCut] = {}
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = attn.qkv_proj
        cuts[id(qkv)] = ShardCut(qkv.in_features, (cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d),
                                 rows=(q, kv, kv))
        o = attn.o_proj.inner
        cuts[id(o)] = ShardCut(cfg.num_heads * d, (o.out_features,), cols=q)
        if isinstance(mlp, GatedMLP):
            inter = mlp.intermediate  # the shard's
            cols = slice(spec.intermediate.start, spec.intermediate.stop)
            gate_up, down = mlp.gate_up_proj, mlp.down_proj.inner
            cuts[id(gate_up)] = ShardCut(gate_up.in_features, (inter * tp, inter * tp), rows=(cols, cols))
            cuts[id(down)] = ShardCut(inter * tp, (down.out_features,), cols=cols)
    return cuts
