"""LLMEngine: composes the layers (model, KV memory, scheduler, runner, sampler) into steps.

`add_request` queues a validated request; each `step` schedules, runs one forward pass, samples,
detokenises, applies stop conditions and returns outputs for the requests it advanced.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time

import torch

from strata.config import EngineConfig
from strata.engine import speculative
from strata.engine.build import build_engine
from strata.engine.grammar import GrammarMasks
from strata.engine.parallel import STOP, RankDied, encode_step
from strata.engine.request import Request, SeqStatus
from strata.engine.sampler import SamplerOutput
from strata.errors import RequestError
from strata.graph.moe import MoEBlock
from strata.hardware.profile import HardwareProfile
from strata.memory.blocks import KVUsage
from strata.protocol.lora import LoRAError, LoRARequest
from strata.protocol.outputs import CompletionOutput, RequestOutput
from strata.protocol.sampling_params import RequestOutputKind, SamplingParams
from strata.protocol.stats import EngineStats
from strata.protocol.validation import ModelLimits, validate_request

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, detokenize: bool = True, workload: str = "streaming",
                 profile: HardwareProfile | None = None) -> None:
        """detokenize=False: outputs carry token ids only and stop strings are left to the caller
        (the server detokenises in its front-end process, off the engine's critical path).
        workload: "offline" (LLM.generate), "streaming" (driven step by step) or "serving"
        (`strata serve`): the platform's step policy follows it (platform/base.py). profile: the
        machine's measured hardware profile (None: probed once, by the build)."""
        self.config = config
        self.detokenize = detokenize
        parts = build_engine(config, detokenize, profile, workload)  # engine/build.py: the ordered assembly
        self.config = parts.config  # with what dtype="auto" resolved to (e.g. bf16 weight storage)
        ckpt = parts.checkpoint
        self.model_path, self.model_config, self.tokenizer = ckpt.path, ckpt.model_config, ckpt.tokenizer
        self.eos_token_ids, self.generation_defaults = ckpt.eos_token_ids, ckpt.generation_defaults
        self.threads, self.dtype, self.max_model_len = parts.threads, parts.dtype, parts.max_model_len
        self.model, self.plan, self.kv_caches = parts.model, parts.plan, parts.kv_caches
        self.block_manager, self.fusion = parts.block_manager, parts.fusion
        self.runner, self.scheduler, self.sampler = parts.runner, parts.scheduler, parts.sampler
        self.ranks, self._control = parts.ranks, parts.control  # tensor parallelism (engine/parallel.py)
        self.platform = parts.platform
        self.lora = parts.lora  # engine/lora_manager.LoRAManager with enable_lora
        self.policy = parts.policy  # the tuners' decisions (platform/policy.py), fed after every step
        self.requests: dict[str, Request] = {}
        self.last_schedule = None
        self.step_observers: list = []  # callables(engine) run after every step (benchmarks, metrics)
        self.num_steps = 0
        self.grammar_masks = GrammarMasks(self.model_config.vocab_size)  # structured output
        self.stage_seconds = {"schedule": 0.0, "forward": 0.0, "sample": 0.0}  # cumulative, per step phase
        self.warming_up = False  # while warm_up runs (a tuner may leave its steps out)

    def close(self) -> None:
        """Free the model, the KV cache and the swap space now (requests in flight are aborted);
        the engine refuses work afterwards. Dropping the last reference frees the same."""
        if self.runner is None:
            return
        for rid in list(self.requests):
            self.abort(rid)
        if self.runner.swapper is not None:
            self.runner.swapper.close()
        if self.lora is not None:
            self.lora.close()
        ranks = self.ranks
        if ranks is not None:
            with contextlib.suppress(Exception):  # the others may be gone already
                self._control.broadcast_bytes(STOP)
        self.model = self.kv_caches = self.runner = self.scheduler = self.sampler = self.fusion = None
        self.block_manager = self.last_schedule = self.ranks = self._control = None
        for observer in self.step_observers:
            getattr(observer, "close", lambda: None)()  # e.g. the adaptive threads' kernel cap
        self.step_observers = []
        self.grammar_masks.close()
        if ranks is not None:
            # nothing may hold a Communicator (the sharded model does) when the world is destroyed:
            # torch's process-group teardown then aborts the process at exit now and then
            gc.collect()
            ranks.close()

    def _check_open(self) -> None:
        if self.runner is None:
            failure = getattr(self, "_failure", None)
            if failure is not None:
                raise RankDied(f"this engine failed earlier: {failure}")
            raise RequestError("this engine was closed (LLM.close() / the end of `with LLM(...)`); build a new one")

    @property
    def scratch_block(self) -> int | None:
        """The device block padded rows of a captured decode step write to (block manager's)."""
        return self.block_manager.scratch_block

    @property
    def host_pool(self):
        """The swap space's host blocks (owned by the block manager); None in recompute mode."""
        return None if self.block_manager is None else self.block_manager.host

    def default_sampling_params(self, **overrides) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json defaults, then `overrides`."""
        return SamplingParams(**{**self.generation_defaults, **overrides})

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
        self.warming_up = True
        try:
            while self.has_unfinished():
                self.step()
        finally:
            self.warming_up = False
        self.stage_seconds = dict.fromkeys(self.stage_seconds, 0.0)
        for counts in self._expert_counters().values():  # the warm-up's routing is not the workload's
            counts.zero_()
        return time.perf_counter() - t0

    def _expert_counters(self) -> dict[int, torch.Tensor]:
        layers = getattr(self.model, "layers", None) or []
        return {i: layer.mlp.token_counts for i, layer in enumerate(layers)
                if isinstance(getattr(layer, "mlp", None), MoEBlock)}

    def expert_token_counts(self) -> dict[int, list[int]]:
        """Tokens each expert of each MoE layer received so far, {layer: [count per expert]}
        (prefill and decode; {} for a dense model). /metrics and the analyzer show these."""
        return {i: c.tolist() for i, c in self._expert_counters().items()}

    # --- requests ------------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError(f"{self.model_path} has no tokenizer.json; pass prompt token ids instead of text")
        return self.tokenizer.encode(prompt)

    # --- LoRA adapters ---------------------------------------------------------------------
    def _lora_manager(self):
        if self.lora is None:
            raise LoRAError("LoRA adapters need an engine started with enable_lora=True (--enable-lora)")
        return self.lora

    def add_lora(self, lora: LoRARequest, wait: bool = True):
        """Register an adapter and read its weights, checked against the base (LoRAError if it does
        not fit). wait=False: read on a worker thread while steps go on; returns the future."""
        self._check_open()
        return self._lora_manager().add(lora, wait)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Refuse the adapter to new requests (those holding it finish); False if it was unknown."""
        return self._lora_manager().remove(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.lora is None else self.lora.list()

    def validate(self, index: int, prompt_ids: list[int], params: SamplingParams,
                 lora_request: LoRARequest | None = None) -> None:
        """Raise RequestError naming the request index; nothing is scheduled on failure. An adapter
        not yet known is registered and read here (vLLM's LLM.generate(lora_request=) does too)."""
        if lora_request is not None:
            if not isinstance(lora_request, LoRARequest):
                raise RequestError(f"request {index}: lora_request must be a LoRARequest, got "
                                   f"{type(lora_request).__name__}", param="lora_request")
            manager = self._lora_manager()
            if not manager.known(lora_request):
                manager.add(lora_request)
        limits = ModelLimits(self.model_config.vocab_size, self.max_model_len)
        validate_request(params, limits, [prompt_ids], index=index)  # the model's limits (protocol/validation.py)
        # what only the engine can judge:
        if params.prompt_logprobs is not None and self.ranks is not None:
            raise RequestError(f"request {index}: prompt_logprobs is not implemented with tensor parallelism",
                               param="prompt_logprobs")
        if params.structured is not None:
            grammars = self.scheduler.lifecycle.grammars
            if grammars is None:
                raise RequestError(f"request {index}: structured output needs the checkpoint's tokenizer "
                                   f"({self.model_path} has no tokenizer.json)", param="structured")
            grammars.matcher(params.structured)  # compiles it now (cached), so a bad one fails here

    def add_request(
        self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        """Queue a request (validated by `validate` first); lora_request: the adapter it runs with,
        one the engine knows (add_lora, or validate)."""
        self._check_open()
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if lora_request is not None and not self._lora_manager().known(lora_request):
            raise LoRAError(f"LoRA adapter {lora_request.lora_name} (id {lora_request.lora_int_id}) is not "
                            "loaded in this engine; add it first (add_lora / --lora-modules)")
        req = Request(request_id, prompt, list(prompt_ids), params, lora_request)
        self.requests[request_id] = req
        self.scheduler.add_request(req)
        self.runner.weights_may_have_changed()  # the caller held control
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is; all of its blocks are freed at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.abort(req)
        req.timeline.finished = time.time()
        return self._output(req)

    def finish_sequence(self, request_id: str, index: int, reason: str, stop_reason: str | None = None) -> None:
        """End one completion of a request (a stop string found by a front end); frees its blocks."""
        req = self.requests.get(request_id)
        if req is None:
            return
        self.scheduler.finish_sequence(req, index, reason, stop_reason)
        if req.finished:
            req.timeline.finished = time.time()
            self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # --- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """schedule -> execute -> sample -> update; outputs for the requests that advanced."""
        self._check_open()
        with self.policy.step():  # the platform's kernel thread cap, for this engine's steps only
            return self._step()

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        self.last_schedule = out  # for observers (the analyzer classifies steps by it)
        masks = self.grammar_masks.start(out.scheduled)  # beside the forward pass
        t1 = time.perf_counter()
        logits, seqs = self._execute(out)
        self.num_steps += 1
        if self.runner.prompt_logits:
            self._record_prompt_logprobs()
        t2 = time.perf_counter()
        constrain = None if masks is None else (lambda x: self.grammar_masks.apply(x, seqs, masks))
        sampled = self.sampler(logits, seqs, constrain) if seqs else None
        if sampled is not None and self.scheduler.speculator is not None:  # keep the accepted drafts
            seqs, tokens, lps = speculative.accept(out.scheduled, seqs, sampled.token_ids, sampled.logprobs,
                                                   self.scheduler.speculator)
            sampled = SamplerOutput(tokens, lps)
        touched = self.scheduler.update(out, seqs, sampled)
        if self.lora is not None:  # removed adapters' weights go once no request holds them
            self.lora.retire({r.lora_id for r in self.requests.values() if r.lora_id})
        more_forward = 0.0
        if out.num_steps > 1:
            touched, more_forward = self._more_steps(out, seqs, sampled, touched)
        t3 = time.perf_counter()
        if self.scheduler.speculator is not None and seqs:  # does drafting pay on this machine?
            self.scheduler.speculator.observe_step(any(s.draft for s in out.scheduled), t3 - t0, len(seqs))
        st = self.stage_seconds
        st["schedule"] += t1 - t0
        st["forward"] += t2 - t1 + more_forward
        st["sample"] += t3 - t2 - more_forward  # sampling, stop checks and (offline) detokenisation
        self.policy.observe(self)  # the tuners first: they set what the next step runs with
        for observe in self.step_observers:
            observe(self)
        outputs = []
        for req in touched:
            if req.finished:
                req.timeline.finished = time.time()
                self.requests.pop(req.request_id, None)
            elif req.params.output_kind is RequestOutputKind.FINAL_ONLY:
                continue
            outputs.append(self._output(req))
        return outputs

    def _more_steps(self, out, seqs, sampled, touched):
        """Multi-step decode: the scheduler reserved blocks for out.num_steps tokens of every
        sequence; run the decode steps after the first until then or until a sequence finishes
        (the batch changes: the next scheduler call sees it). out.num_steps becomes the steps run.
        Returns the requests advanced and the seconds spent in forward passes."""
        touched = {r.request_id: r for r in touched}
        steps, forward = 1, 0.0
        while steps < out.num_steps and not any(s.finished for s in seqs):
            t = time.perf_counter()
            logits, seqs = self.runner.execute_next(sampled.token_ids)
            forward += time.perf_counter() - t
            sampled = self.sampler(logits, seqs)
            for r in self.scheduler.update(out, seqs, sampled):
                touched[r.request_id] = r
            steps += 1
        out.num_steps = steps
        return list(touched.values()), forward

    def _record_prompt_logprobs(self) -> None:
        """Logprob of each prompt token given the tokens before it (+ the top N), once per position
        (a preempted request recomputes its prompt; the entries it has are kept)."""
        for seq, start, logits in self.runner.prompt_logits:
            req = seq.request
            lp = logits.log_softmax(-1)
            targets = torch.tensor(seq.token_ids[start + 1 : start + 1 + lp.shape[0]])
            chosen = lp.gather(1, targets[:, None]).squeeze(1).tolist()
            top_n = req.params.prompt_logprobs
            top = lp.topk(top_n, dim=-1) if top_n else None
            for i, (t, v) in enumerate(zip(targets.tolist(), chosen)):
                if start + 1 + i != len(req.prompt_logprobs):
                    continue
                d = dict(zip(top.indices[i].tolist(), top.values[i].tolist())) if top is not None else {}
                d[t] = v
                req.prompt_logprobs.append(d)
        self.runner.prompt_logits = []

    def _execute(self, out):
        """Run the step: with tensor parallelism, first hand its plan to the other ranks."""
        if self.ranks is None:
            return self.runner.execute(out)
        try:
            # a local rank that died while the engine idled is named now, not left to the next
            # collective to notice (the plan broadcast's wait is not bounded: see parallel.py)
            self.ranks.check_alive()
            self._control.broadcast_bytes(encode_step(out, self.lora))
            return self.runner.execute(out)
        except RankDied as dead:
            failed = RankDied(f"{dead}; the engine cannot continue")
        except RuntimeError as e:  # a collective failed: a rank died or hung past comm_timeout
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            failed = RankDied(f"tensor-parallel step failed ({why}); the engine cannot continue")
            try:
                self.ranks.check_alive()
            except RankDied as dead:
                failed = RankDied(f"{dead}; the step failed ({why}) and the engine cannot continue")
        self._fail_all(failed)
        raise failed from None

    def _fail_all(self, error: Exception) -> None:
        """The ranks are out of step for good: abort everything and close."""
        logger.error("%s; aborting %d request(s) and closing the ranks", error, len(self.requests))
        for rid in list(self.requests):
            self.abort(rid)
        ranks = self.ranks
        self.ranks = self._control = self.model = self.kv_caches = None
        self.runner = None
        gc.collect()
        with contextlib.suppress(Exception):
            ranks.close(broken=True)
        self._failure = error
        self.runner = None  # refuses further work (_check_open)

    def __del__(self) -> None:
        if getattr(self, "ranks", None) is not None:  # do not leave the other ranks waiting
            with contextlib.suppress(Exception):
                self.close()

    def _output(self, req: Request) -> RequestOutput:
        tl = req.timeline
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=s.index, text="" if s.output_text is None else s.output_text.text,
                    token_ids=list(s.output_token_ids),
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
            prompt_logprobs=None if req.prompt_logprobs is None else list(req.prompt_logprobs),
            token_times=list(tl.token_times) if req.finished else None,
        )

    def kv_usage(self) -> KVUsage:
        """KV bytes reserved vs owned, cached and free, and the bytes holding live tokens vs the
        waste in partially filled last blocks (see BlockManager.kv_usage)."""
        return self.block_manager.kv_usage(self.scheduler.running, self.plan.kv_bytes_per_token)

    def stats(self) -> EngineStats:
        """The engine's load and counters now: sequences running / waiting / swapped, KV usage,
        preemptions, the prefix cache's counters, steps and their phase seconds, speculative
        decoding's counters (0 without it) and the decode-first prefill cap (0: none)."""
        sch = self.scheduler
        usage = self.kv_usage()
        pc = self.block_manager.stats
        spec = {}
        if sch.speculator is not None:
            st = sch.speculator.stats
            spec = {"spec_steps": st.steps, "spec_drafted": st.drafted, "spec_accepted": st.accepted,
                    "spec_emitted": st.emitted}
        return EngineStats(
            running=len(sch.running), waiting=len(sch.waiting), swapped=len(sch.swapped),
            kv_usage=(usage.owned_bytes / usage.reserved_bytes) if usage.reserved_bytes else 0.0,
            kv_reserved_bytes=usage.reserved_bytes, kv_owned_bytes=usage.owned_bytes,
            kv_token_bytes=usage.token_bytes, kv_waste_bytes=usage.waste_bytes,
            preemptions=sch.num_preemptions, prefix_queries=pc.queries, prefix_hits=pc.hits,
            prefix_evictions=pc.evictions, steps=self.num_steps, stage_seconds=dict(self.stage_seconds),
            prefill_cap=self.policy.prefill_cap or 0,
            expert_tokens={str(i): c for i, c in self.expert_token_counts().items()}, **spec,
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict:
        if self.lora is None:
            return {}
        sch = self.scheduler

        def names(seqs) -> tuple:
            return tuple(sorted({s.request.lora_request.lora_name for s in seqs if s.request.lora_id}))

        return {"lora_running": names(sch.running), "lora_waiting": names((*sch.waiting, *sch.swapped)),
                "max_loras": self.lora.max_loras}

    def check_blocks(self) -> None:
        """Invariant check for tests: the block manager agrees with every live block table."""
        live = [s for r in self.requests.values() for s in r.seqs if s.status is not SeqStatus.FINISHED]
        self.block_manager.check([s.block_table for s in live], [s.host_blocks for s in live])
