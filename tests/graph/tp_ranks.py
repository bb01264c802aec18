"""One rank of tests/graph/test_tensor_parallel.py: shard tiny models, write what they compute.

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/graph/tp_ranks.py CASES OUT

CASES is a JSON list of {"name", "path", "quant": null | "int8" | "int4", "group_size"}. For each
case every rank loads the checkpoint (strata.graph.loader.load_model, fp32), quantises it if asked,
and rank 0 computes the unsharded references first; then every rank shards the model
(strata.graph.tensor_parallel.shard_model over a gloo Communicator) and computes the same things.
Results go to OUT/<name>.rank<r>.safetensors (tensors) and OUT/<name>.rank<r>.json (facts); a
failure writes OUT/error.rank<r>.txt and exits 1. Every collective is bounded by the process
group's timeout, and the parent test kills the ranks on its own deadline.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import sys
import traceback
from pathlib import Path

import torch
from safetensors.torch import save_file

STEPS = 5  # greedy steps of the manual loop over the plain forward
BATCH = [[5, 17, 99, 230, 31, 7, 64, 300, 12, 45, 211],
         [250, 3, 88, 140, 9, 377, 51, 26, 190, 14, 333]]


@torch.no_grad()
def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    return model.compute_logits(model(ids, pos)).float()


@torch.no_grad()
def greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids, out = list(prompt), []
    for _ in range(steps):
        tok = int(logits_of(model, torch.tensor([ids]))[0, -1].argmax())
        out.append(tok)
        ids.append(tok)
    return out


@torch.no_grad()
def mlp_rows(model, x: torch.Tensor) -> torch.Tensor:
    """Layer 0's MLP on [rows, hidden] (the engine's flattened shape: the fused SwiGLU kernels)."""
    return model.layers[0].mlp(x).float()


@torch.no_grad()
def paged_greedy(model, prompt: list[int], steps: int, backend: str, forward=None) -> torch.Tensor:
    """Logits [1 + steps, vocab] of one sequence over the paged KV cache: a prefill, then decodes
    (backend "cpu": the numba fused rotary + KV write + decode reads Attention.heads/kv_heads;
    "sdpa": write_kv + attend_cached). The cache is sized from model.config, this rank's heads.
    `forward`: the step to run (default the model; graph/fusion.py's FusedStep)."""
    from strata.kernels.attention import AttentionMetadata, PrefillSpan
    from strata.memory.kv_cache import allocate_kv_cache

    bs = 16
    forward = forward or model
    caches = allocate_kv_cache(model.config, 4, bs, torch.float32, "cpu")
    table = torch.arange(4)
    n = len(prompt)
    pos = torch.arange(n)
    meta = AttentionMetadata(pos.clone(), [PrefillSpan(0, n, 0, table, None)], n, None, None, backend=backend)
    rows = [model.compute_logits(forward(torch.tensor(prompt), pos, meta, caches)[-1:])]
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(rows[-1][0].argmax()))
        p = torch.tensor([len(ids) - 1])
        mask = None
        if meta.backend.uses_decode_mask:
            mask = (torch.arange(4 * bs)[None, :] <= p[:, None]).view(1, 1, 1, -1)
        meta = AttentionMetadata(p.clone(), [], 0, table[None, :], mask, p + 1, backend=backend)
        rows.append(model.compute_logits(forward(torch.tensor(ids[-1:]), p, meta, caches)))
    return torch.cat(rows).float()


def probes(model, vocab: int) -> dict[str, torch.Tensor]:
    ids = torch.tensor(BATCH) % vocab
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, model.norm.weight.shape[0], generator=g)
    with torch.no_grad():
        emb = model.embed_tokens(torch.arange(vocab)).float()
    return {
        "logits": logits_of(model, ids),
        "greedy": torch.tensor(greedy(model, ids[0].tolist(), STEPS)),
        "mlp": mlp_rows(model, x),
        "embed": emb,
        "paged_cpu": paged_greedy(model, ids[1].tolist(), STEPS, "cpu"),
        "paged_sdpa": paged_greedy(model, ids[1].tolist(), STEPS, "sdpa"),
    }


def run_case(case: dict, rank: int, world_size: int, comm, out: Path) -> None:
    from strata.graph.loader import load_model
    from strata.graph.tensor_parallel import shard_model
    from strata.memory.quant import model_weight_bytes, quantize_model

    model = load_model(case["path"], torch.float32, "cpu", 64)
    if case.get("quant"):
        quantize_model(model, case["quant"], case.get("group_size", 64))
    vocab = model.config.vocab_size
    tensors: dict[str, torch.Tensor] = {}
    facts: dict = {"full_bytes": model_weight_bytes(model)}
    if rank == 0:
        tensors.update({f"ref_{k}": v for k, v in probes(model, vocab).items()})
    shard_model(model, rank, world_size, comm)
    tensors.update({f"tp_{k}": v for k, v in probes(model, vocab).items()})
    if case.get("fuse"):  # graph/fusion.py over the shard: the collectives stay inside leaves
        from strata.graph.fusion import expected_counts, fuse_model

        step = fuse_model(model)
        facts["fusion_counts"] = step.counts
        facts["fusion_expected"] = expected_counts(len(model.layers))
        prompt = (torch.tensor(BATCH[1]) % vocab).tolist()
        tensors["tp_fused_paged_cpu"] = paged_greedy(model, prompt, STEPS, "cpu", step)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    head, embed = model.lm_head.inner, model.embed_tokens.inner
    facts.update(
        shard_bytes=model_weight_bytes(model), heads=attn.heads, kv_heads=attn.kv_heads,
        q_size=attn.q_size, kv_size=attn.kv_size, intermediate=mlp.intermediate,
        qkv_out=int(getattr(attn.qkv_proj, "out_features", 0)),
        config_heads=model.config.num_heads, config_kv_heads=model.config.num_kv_heads,
        head_rows=int(getattr(head, "out_features", 0)),
        tied_float=hasattr(head, "weight") and hasattr(embed, "weight") and head.weight is embed.weight,
        tied_quant=getattr(embed, "head", [None])[0] is head,
    )
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / f"{case['name']}.rank{rank}.safetensors"))
    (out / f"{case['name']}.rank{rank}.json").write_text(json.dumps(facts))


def main() -> int:
    cases_file, out = Path(sys.argv[1]), Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    faulthandler.enable()  # a native crash still prints where it happened
    try:
        torch.set_num_threads(1)
        from strata.comm.collectives import Communicator
        from strata.comm.world import World, destroy_world, init_world

        world = World.from_env()
        init_world(world, "cpu", timeout_s=float(os.environ.get("TP_TEST_TIMEOUT_S", "30")))
        comm = Communicator()
        try:
            for case in json.loads(cases_file.read_text()):
                run_case(case, world.rank, world.world_size, comm, out)
        finally:
            # No reference to the process group may outlive destroy_world: a ProcessGroupGloo
            # destroyed during interpreter teardown aborts the process now and then (torch 2.13:
            # "terminate called without an active exception", then SIGABRT/SIGBUS), after all
            # the work is done. The sharded models (their modules hold comm) went with run_case.
            comm = None
            gc.collect()
            destroy_world()
        print(f"rank {rank}: all cases done, world destroyed", flush=True)
    except BaseException:
        (out / f"error.rank{rank}.txt").write_text(traceback.format_exc())
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
