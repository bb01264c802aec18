"""Swap space: round trips are bit-exact, the host pool never leaks, the cost model decides."""

import torch

from strata.memory.swap import HostBlockPool, KVSwapper, PreemptionCostModel
from strata.model_config import ModelConfig

CFG = ModelConfig.from_dict({
    "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
})


def _device_caches(num_blocks=10, block=4):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, num_blocks, block, 2, 8, generator=g) for _ in range(CFG.num_layers)]


def test_swap_round_trip_is_bit_exact():
    dev = _device_caches()
    original = [c.clone() for c in dev]
    host = HostBlockPool(CFG, 6, 4, torch.float32, pin=False)
    swapper = KVSwapper(dev, host)
    dev_blocks = [7, 2, 5]
    host_blocks = host.allocate(3)
    swapper.swap_out(list(zip(dev_blocks, host_blocks)))
    for c in dev:  # the device blocks get reused (overwritten) meanwhile
        c[:, dev_blocks] = -1.0
    new_blocks = [0, 9, 3]
    swapper.start_swap_in(list(zip(host_blocks, new_blocks)))
    swapper.wait()
    host.free(host_blocks)
    for before, after in zip(original, dev):
        assert torch.equal(after[:, new_blocks], before[:, dev_blocks])
    assert host.num_free == 6
    assert (swapper.blocks_out, swapper.blocks_in) == (3, 3)
    swapper.close()


def test_swap_out_waits_for_inflight_swap_in():
    dev = _device_caches()
    host = HostBlockPool(CFG, 4, 4, torch.float32, pin=False)
    swapper = KVSwapper(dev, host)
    hb = host.allocate(2)
    swapper.swap_out([(1, hb[0]), (2, hb[1])])
    expected = [c[:, [1, 2]].clone() for c in dev]
    swapper.start_swap_in([(hb[0], 8), (hb[1], 9)])
    swapper.swap_out([(4, hb[0])])  # reuses a host block still being read: must wait first
    swapper.wait()
    for c, e in zip(dev, expected):
        assert torch.equal(c[:, [8, 9]], e)
    swapper.close()


def test_cost_model_prefers_cheaper_path():
    fast_link = PreemptionCostModel(kv_bytes_per_token=46_080, link_gbs=20.0, prefill_tokens_per_s=500.0)
    assert fast_link.prefer_swap(512)  # 47 MB at 20 GB/s: ~5 ms vs ~1 s of prefill
    slow_link = PreemptionCostModel(kv_bytes_per_token=46_080, link_gbs=0.001, prefill_tokens_per_s=1e6)
    assert not slow_link.prefer_swap(512)
