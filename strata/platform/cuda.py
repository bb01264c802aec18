"""The GPU platform: CUDA graphs / torch.compile capture the decode step (graph/capture.py: graph
replay takes the host work off the critical path), so there are no host-side tuners: one decode
step per scheduler call unless num_scheduler_steps says otherwise, no decode-first cap (a prefill
chunk of the default budget takes milliseconds), torch's kernels and the Triton ones
(kernels/triton) chosen by the dispatch points themselves."""

from __future__ import annotations

from strata.platform.base import Platform


class CudaPlatform(Platform):
    name = "cuda"
