"""LLMEngine: composes the layers (model, KV memory, scheduler, runner, sampler) into steps.

`add_request` queues a validated request; each `step` schedules, runs one forward pass, samples,
detokenises, applies stop conditions and returns outputs for the requests it advanced.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from pathlib import Path

import torch

from strata.config import DTYPES, EngineConfig
from strata.engine.request import CompletionOutput, Request, RequestOutput, SeqStatus, Sequence
from strata.engine.runner import ModelRunner
from strata.engine.sampler import Sampler
from strata.engine.sampling_params import SamplingParams
from strata.engine.scheduler import Scheduler
from strata.errors import ConfigError, ModelLoadError, RequestError
from strata.graph.loader import check_model_dir, load_model
from strata.hardware.placement import set_compute_threads
from strata.memory.blocks import BlockManager, KVUsage
from strata.memory.kv_cache import allocate_kv_cache
from strata.memory.planner import plan_memory
from strata.memory.swap import HostBlockPool, KVSwapper, PreemptionCostModel
from strata.model_config import ModelConfig
from strata.text_table import fmt_bytes

logger = logging.getLogger(__name__)



def _resolve_dtype(name: str, device: str, checkpoint: torch.dtype) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    from strata.hardware.probe import auto_dtype

    return auto_dtype(device, checkpoint)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot parse ({e})") from None


class LLMEngine:
    def __init__(self, config: EngineConfig, detokenize: bool = True) -> None:
        """detokenize=False: outputs carry token ids only and stop strings are left to the caller
        (the server detokenises in its front-end process, off the engine's critical path)."""
        self.config = config
        self.detokenize = detokenize
        self.threads = set_compute_threads(config.num_threads)
        if config.model is None:
            from strata.demo.model import demo_model_path

            path = demo_model_path()
        else:
            path = check_model_dir(config.model)
        self.model_path = path
        self.model_config = cfg = ModelConfig.from_file(path / "config.json")
        self.tokenizer = self._load_tokenizer(path)
        gen = _read_json(path / "generation_config.json")
        self.eos_token_ids = self._eos_ids(cfg, gen)
        self.generation_defaults = self._generation_defaults(gen)
        self.dtype = _resolve_dtype(config.dtype, config.device, cfg.torch_dtype)
        self.max_model_len = self._max_model_len(cfg)
        t0 = time.perf_counter()
        self.model = load_model(path, self.dtype, config.device, self.max_model_len)
        logger.info("loaded %s (%s, %s) in %.2fs", path, cfg.architecture, self.dtype, time.perf_counter() - t0)
        if config.quantization is not None:  # applied to the built model from outside (issue 4)
            from strata.memory.quant import quantize_model

            t0 = time.perf_counter()
            quantize_model(self.model, config.quantization, config.quantization_group_size)
            logger.info("quantized to %s in %.2fs", config.quantization, time.perf_counter() - t0)
        self.plan = plan_memory(
            cfg, self.dtype, config.block_size, self.max_model_len, config.max_num_seqs,
            config.kv_cache_memory, config.memory_fraction, config.device,
            config.quantization, config.quantization_group_size,
        )
        # with a captured decode step, one extra block past the manager's range takes padded rows' KV
        self.scratch_block = self.plan.num_blocks
        extra = 1 if (config.compile or config.cuda_graphs) else 0
        self.kv_caches = allocate_kv_cache(
            cfg, self.plan.num_blocks + extra, config.block_size, self.dtype, config.device
        )
        self.block_manager = BlockManager(self.plan.num_blocks, config.block_size, config.enable_prefix_caching)
        logger.info(
            "KV cache reserved: %s (%d blocks of %d tokens); prefix caching %s",
            fmt_bytes(self.plan.kv_cache_bytes), self.plan.num_blocks, config.block_size,
            "on" if config.enable_prefix_caching else "off",
        )
        self.host_pool = self._host_pool()
        self._cost_model: PreemptionCostModel | None = None
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
            self.host_pool, self._prefer_swap,
        )
        backend = self._attention_backend()
        self.runner = ModelRunner(self.model, self.kv_caches, config.block_size, config.device, backend)
        if self.host_pool is not None:
            self.runner.swapper = KVSwapper(self.kv_caches, self.host_pool)
        self.fusion = None  # graph/fusion.FusedStep when config.fuse
        if config.fuse:
            from strata.graph.fusion import fuse_model

            t0 = time.perf_counter()
            self.fusion = self.runner.forward = fuse_model(self.model)
            logger.info("fusion: %s in %.2fs", self.fusion.summary(), time.perf_counter() - t0)
        from strata.graph.capture import build_decode_capture

        self.runner.decode_step = build_decode_capture(self)
        self.sampler = Sampler(cfg.vocab_size, self.eos_token_ids, config.seed)
        self.requests: dict[str, Request] = {}
        self.last_schedule = None
        self.step_observers: list = []  # callables(engine) run after every step (benchmarks, metrics)
        self._seq_ids = itertools.count()
        self.num_steps = 0
        self.stage_seconds = {"schedule": 0.0, "forward": 0.0, "sample": 0.0}  # cumulative, per step phase

    # --- setup helpers -------------------------------------------------------------------
    @staticmethod
    def _load_tokenizer(path: Path):
        if not (path / "tokenizer.json").is_file():
            logger.info("%s has no tokenizer.json: only token-id prompts will work", path)
            return None
        from strata.engine.tokenizer import Tokenizer

        return Tokenizer.from_dir(path)

    def _eos_ids(self, cfg: ModelConfig, gen: dict) -> list[int]:
        eos = gen.get("eos_token_id")
        ids = [] if eos is None else (list(eos) if isinstance(eos, list) else [eos])
        ids += cfg.eos_token_ids
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return sorted({int(i) for i in ids})

    @staticmethod
    def _generation_defaults(gen: dict) -> dict:
        """Sampling defaults from generation_config.json, used where a request sets nothing."""
        out = {k: gen[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty") if k in gen}
        if gen.get("do_sample") is False:
            out["temperature"] = 0.0  # HF semantics: greedy whatever the temperature says
        if out.get("top_k") == 0:
            out["top_k"] = -1  # HF's "disabled"
        return out

    def default_sampling_params(self, **overrides) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json defaults, then `overrides`."""
        return SamplingParams(**{**self.generation_defaults, **overrides})

    def _max_model_len(self, cfg: ModelConfig) -> int:
        limit = cfg.max_position_embeddings
        want = self.config.max_model_len or limit
        if want > limit:
            raise ConfigError(
                f"max_model_len: {want} exceeds the model's max_position_embeddings ({limit}); "
                f"use max_model_len <= {limit}"
            )
        if cfg.sliding_window is not None and want > cfg.sliding_window:
            logger.warning(
                "max_model_len %d capped to the sliding window %d (sliding-window attention is "
                "not implemented; within the window it is exact)", want, cfg.sliding_window,
            )
            want = cfg.sliding_window
        return want

    def _host_pool(self) -> HostBlockPool | None:
        """Swap space for preempted sequences (none in recompute mode)."""
        cfg = self.config
        if cfg.preemption_mode == "recompute":
            return None
        per_block = self.plan.kv_bytes_per_token * cfg.block_size
        size = cfg.swap_space if cfg.swap_space is not None else min(self.plan.kv_cache_bytes, 4 * 2**30)
        blocks = size // per_block
        if blocks == 0:
            if cfg.preemption_mode == "swap":
                raise ConfigError(f"swap_space: {size} bytes hold no {per_block}-byte KV block; raise it")
            return None
        logger.info("swap space: %s = %d host blocks", fmt_bytes(blocks * per_block), blocks)
        return HostBlockPool(self.model_config, blocks, cfg.block_size, self.dtype, pin=cfg.device.startswith("cuda"))

    def _prefer_swap(self, seq: Sequence) -> bool:
        """The preemption policy: swap mode always swaps; auto asks the cost model."""
        if self.config.preemption_mode == "swap":
            return True
        if self._cost_model is None:
            self._cost_model = self._build_cost_model()
        return self._cost_model.prefer_swap(seq.num_computed_tokens)

    def _build_cost_model(self) -> PreemptionCostModel:
        """From the hardware profile: link = host<->device copy rate, compute = measured GEMM rate."""
        from strata.hardware.probe import probe

        hw = probe(self.config.device)
        name = str(self.dtype).removeprefix("torch.")
        gflops = hw.matmul_gflops.get(name) or hw.matmul_gflops.get("float32") or 1.0
        # on CPU both pools are host memory: a copy reads and writes, so about half the bandwidth;
        # on GPUs the host link (PCIe) is not in the profile yet: assume PCIe 4.0 x16 in practice
        link = hw.mem_bandwidth_gbs / 2 if self.config.device == "cpu" else 25.0
        rate = gflops * 1e9 / (2 * self.model_config.num_params())
        model = PreemptionCostModel(self.plan.kv_bytes_per_token, link, rate)
        logger.info("preemption cost model: link %.1f GB/s, recompute %.0f tok/s", link, rate)
        return model

    def _attention_backend(self) -> str:
        """auto: the numba paged-decode kernel for fp32 on CPU when numba is present, the Triton
        kernel on CUDA when triton is importable, else SDPA."""
        from strata.kernels import attention, cpu_attention

        choice = self.config.attention_backend
        cpu_ok = self.config.device == "cpu" and self.dtype == torch.float32 and cpu_attention.available()
        if choice == "cpu" and not cpu_ok:
            raise ConfigError(
                "attention_backend: 'cpu' needs numba, device cpu and dtype float32; use 'auto' or 'sdpa'"
            )
        triton_ok = attention.triton_usable(self.config.device)
        if choice == "triton" and not triton_ok:
            raise ConfigError(
                "attention_backend: 'triton' needs a CUDA device and triton (pip install 'strata[triton]'); "
                "use 'auto' or 'sdpa'"
            )
        if choice == "auto":
            choice = "cpu" if cpu_ok else "triton" if triton_ok else "sdpa"
        logger.info("attention backend: %s", choice)
        return choice

    def warm_up(self, prompt_tokens: int = 24, output_tokens: int = 4) -> float:
        """Two short greedy requests, so kernels are compiled before anything is measured or
        served; resets the step-phase clocks. Returns the seconds it took."""
        t0 = time.perf_counter()
        if self.runner.decode_step is not None:  # --compile / --cuda-graphs: compile or capture now
            self.runner.decode_step.warm_up()
        vocab = self.model_config.vocab_size
        ids = [(7 * i + 3) % vocab for i in range(prompt_tokens)]
        params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
        for i in range(2):  # two requests: the batched decode paths too
            self.add_request(f"warmup-{i}", None, ids[i:], params)
        while self.has_unfinished():
            self.step()
        self.stage_seconds = dict.fromkeys(self.stage_seconds, 0.0)
        return time.perf_counter() - t0

    # --- requests ------------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError(f"{self.model_path} has no tokenizer.json; pass prompt token ids instead of text")
        return self.tokenizer.encode(prompt)

    def validate(self, index: int, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError naming the request index; nothing is scheduled on failure."""
        params.validate(index, self.model_config.vocab_size)
        if not prompt_ids:
            raise RequestError(f"request {index}: prompt is empty; give at least one token")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"request {index}: prompt has {len(prompt_ids)} tokens but max_model_len is "
                f"{self.max_model_len} (room for at least one new token is needed); shorten the "
                "prompt or raise max_model_len"
            )
        vocab = self.model_config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise RequestError(f"request {index}: prompt token ids must be in [0, {vocab})")
        if params.logprobs is not None and params.logprobs > vocab:
            raise RequestError(f"request {index}: logprobs must be <= vocab size {vocab}")

    def add_request(
        self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams
    ) -> Request:
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        req = Request(request_id, prompt, list(prompt_ids), params)
        seq = self._new_seq(req, 0)
        self.requests[request_id] = req
        self.scheduler.add(seq)
        return req

    def _new_seq(self, req: Request, index: int) -> Sequence:
        seq = Sequence(next(self._seq_ids), req, index, list(req.prompt_token_ids))
        if self.tokenizer is not None and self.detokenize:
            from strata.engine.output_text import OutputText

            seq.output_text = OutputText(self.tokenizer, req.prompt_token_ids, req.params)
        req.seqs.append(seq)
        return seq

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is; all of its blocks are freed at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
        req.forked = True
        req.timeline.finished = time.time()
        return self._output(req)

    def finish_sequence(self, request_id: str, index: int, reason: str, stop_reason: str | None = None) -> None:
        """End one completion of a request (a stop string found by a front end); frees its blocks."""
        req = self.requests.get(request_id)
        if req is None:
            return
        for seq in req.seqs:
            if seq.index == index and not seq.finished:
                seq.finish_reason, seq.stop_reason = reason, stop_reason
                self.scheduler.finish(seq)
        if req.finished:
            req.timeline.finished = time.time()
            self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # --- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        self.last_schedule = out  # for observers (the analyzer classifies steps by it)
        t1 = time.perf_counter()
        now = time.time()
        for s in out.scheduled:
            tl = s.seq.request.timeline
            if tl.first_scheduled is None:
                tl.first_scheduled = now
        logits, order = self.runner.execute(out)
        self.scheduler.update(out)
        self.num_steps += 1
        t2 = time.perf_counter()
        touched: dict[str, Request] = {}
        if order:
            seqs, rows = self._expand_forks(order)
            if rows is not None:
                logits = logits[rows]
            sampled = self.sampler(logits, seqs)
            now = time.time()
            for seq, tok, lp in zip(seqs, sampled.token_ids, sampled.logprobs):
                self._append(seq, tok, lp, now)
                touched[seq.request.request_id] = seq.request
        t3 = time.perf_counter()
        st = self.stage_seconds
        st["schedule"] += t1 - t0
        st["forward"] += t2 - t1
        st["sample"] += t3 - t2  # sampling, stop checks and (offline) detokenisation
        for observe in self.step_observers:
            observe(self)
        outputs = []
        for req in touched.values():
            if req.finished:
                req.timeline.finished = time.time()
                self.requests.pop(req.request_id, None)
            outputs.append(self._output(req))
        return outputs

    def _expand_forks(self, order: list[Sequence]):
        """A request with n > 1 forks into n sequences when its prompt is first computed."""
        if all(s.request.forked for s in order):
            return order, None
        seqs, rows = [], []
        for r, seq in enumerate(order):
            req = seq.request
            seqs.append(seq)
            rows.append(r)
            if not req.forked:
                req.forked = True
                for i in range(1, req.params.n):
                    child = self._new_seq(req, i)
                    self.scheduler.fork(seq, child)
                    seqs.append(child)
                    rows.append(r)
        return seqs, torch.tensor(rows, device=self.runner.device)

    def _append(self, seq: Sequence, token: int, logprob: dict | None, now: float) -> None:
        p = seq.request.params
        seq.token_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        timeline = seq.request.timeline
        timeline.token_times.append(now)
        if timeline.first_token is None:
            timeline.first_token = now
        n_out = seq.num_output_tokens
        reason, stop_reason = None, None
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                reason = "stop"
            elif token in p.stop_token_ids:
                reason, stop_reason = "stop", token
        if reason is None and (
            (p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens >= self.max_model_len
        ):
            reason = "length"
        if seq.output_text is not None:
            stop = seq.output_text.add(token, n_out, reason is not None)
            if stop is not None:
                reason, stop_reason = "stop", stop
            seq.text = seq.output_text.text
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason, stop_reason
            self.scheduler.finish(seq)

    def _output(self, req: Request) -> RequestOutput:
        tl = req.timeline
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=s.index, text=s.text, token_ids=list(s.output_token_ids),
                    finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                    logprobs=list(s.logprobs) if req.params.logprobs is not None else None,
                )
                for s in sorted(req.seqs, key=lambda s: s.index)
            ],
            finished=req.finished,
            arrival_time=tl.arrival,
            first_token_time=tl.first_token,
            finished_time=tl.finished,
            num_preemptions=sum(s.num_preemptions for s in req.seqs),
            first_scheduled_time=tl.first_scheduled,
        )

    def kv_usage(self) -> KVUsage:
        """KV bytes reserved vs owned, cached and free, and the bytes holding live tokens vs the
        waste in partially filled last blocks (see BlockManager.kv_usage)."""
        return self.block_manager.kv_usage(self.scheduler.running, self.plan.kv_bytes_per_token)

    def check_blocks(self) -> None:
        """Invariant check for tests: the block manager agrees with every live block table."""
        live = [s for r in self.requests.values() for s in r.seqs if s.status is not SeqStatus.FINISHED]
        self.block_manager.check([s.block_table for s in live])
        if self.host_pool is not None:
            parked = sum(len(s.host_blocks) for s in live)
            if parked + self.host_pool.num_free != self.host_pool.num_blocks:
                raise AssertionError(
                    f"host pool: {parked} parked + {self.host_pool.num_free} free != {self.host_pool.num_blocks}"
                )
