"""Prometheus metrics of the server (prometheus-client), in a registry of its own.

Two kinds of time are exported: per-request stage time summed over requests
(`strata_request_stage_seconds_total{stage=tokenize|queue|prefill|decode|detokenize|stream}`) and
the engine loop's wall time per step phase (`strata_engine_step_seconds_total{phase=schedule|
forward|sample}`); together they let the analyzer attribute where a request's time went.

LoRA adapters: per adapter, requests and tokens (`strata_lora_*_total{lora_name=...}`), and vLLM's
`vllm:lora_requests_info` gauge (labels max_lora, running_lora_adapters, waiting_lora_adapters:
comma-separated names; value: when it was last set, as vLLM's). vLLM adds a series per label
combination ever seen; here the previous one is removed, so the one series is the current state.
"""

from __future__ import annotations

import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from strata.protocol.stats import EngineStats

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                   0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
disable_created_metrics()  # the *_created series only add noise to every scrape

REQUEST_STAGES = ("tokenize", "queue", "prefill", "decode", "detokenize", "stream")


class _ForModel:
    """A metric with a trailing `model_name` label (as vLLM's carry), bound to one model: callers use
    it as the unlabelled metric, or `.labels(endpoint, status)` for its own labels."""

    def __init__(self, metric, model_name: str) -> None:
        self._metric, self._model = metric, model_name
        self._child = metric.labels(model_name) if metric._labelnames == ("model_name",) else None  # shown at 0

    def labels(self, *values: str):
        return self._metric.labels(*values, self._model)

    def __getattr__(self, name: str):  # inc / set / observe of the unlabelled metric
        return getattr(self._child, name)


class Metrics:
    def __init__(self, model_name: str = "strata") -> None:
        r = self.registry = CollectorRegistry()
        self.model_name = model_name
        self.requests = Counter("strata_requests", "HTTP requests by endpoint and status", ["endpoint", "status", "model_name"], registry=r)
        self.ttft = Histogram("strata_time_to_first_token_seconds", "arrival to first token", buckets=LATENCY_BUCKETS, labelnames=["model_name"], registry=r)
        self.tpot = Histogram("strata_time_per_output_token_seconds", "(e2e - ttft) / (tokens - 1) per request",
                              buckets=LATENCY_BUCKETS, labelnames=["model_name"], registry=r)
        self.itl = Histogram("strata_inter_token_latency_seconds", "gap between successive tokens of a sequence",
                             buckets=LATENCY_BUCKETS, labelnames=["model_name"], registry=r)
        self.e2e = Histogram("strata_e2e_request_latency_seconds", "arrival to last token", buckets=LATENCY_BUCKETS, labelnames=["model_name"], registry=r)
        self.queue = Histogram("strata_request_queue_time_seconds", "engine arrival to first scheduled",
                               buckets=LATENCY_BUCKETS, labelnames=["model_name"], registry=r)
        self.running = Gauge("strata_num_requests_running", "sequences in the running batch", ["model_name"], registry=r)
        self.waiting = Gauge("strata_num_requests_waiting", "sequences waiting for admission", ["model_name"], registry=r)
        self.swapped = Gauge("strata_num_requests_swapped", "sequences parked in host memory", ["model_name"], registry=r)
        self.prefill_cap = Gauge("strata_prefill_cap_tokens", "decode-first: prefill tokens a step may take while "
                                 "sequences decode (0: no cap); on CPU it follows measured step times", ["model_name"],
                                 registry=r)
        self.kv_usage = Gauge("strata_kv_cache_usage_ratio", "KV blocks owned by sequences / all blocks", ["model_name"], registry=r)
        self.kv_reserved = Gauge("strata_kv_cache_reserved_bytes", "KV cache bytes reserved", ["model_name"], registry=r)
        self.kv_live = Gauge("strata_kv_cache_live_token_bytes", "KV bytes holding computed tokens", ["model_name"], registry=r)
        self.kv_waste = Gauge("strata_kv_cache_waste_bytes", "unfilled slots of partially filled blocks", ["model_name"], registry=r)
        self.prompt_tokens = Counter("strata_prompt_tokens", "prompt tokens of admitted requests", ["model_name"], registry=r)
        self.generation_tokens = Counter("strata_generation_tokens", "tokens generated", ["model_name"], registry=r)
        self.preemptions = Counter("strata_preemptions", "sequences preempted", ["model_name"], registry=r)
        self.prefix_queries = Counter("strata_prefix_cache_queries", "full blocks looked up in the prefix cache", ["model_name"], registry=r)
        self.prefix_hits = Counter("strata_prefix_cache_hits", "of those, found cached", ["model_name"], registry=r)
        self.prefix_evictions = Counter("strata_prefix_cache_evictions", "cached blocks evicted", ["model_name"], registry=r)
        self.stage = Counter("strata_request_stage_seconds", "per-request stage time, summed over requests",
                             ["stage", "model_name"], registry=r)
        self.step_phase = Counter("strata_engine_step_seconds", "engine loop wall time per step phase", ["phase", "model_name"], registry=r)
        # speculative decoding (--speculative-model): vLLM's spec_decode_* series, plus the two ratios
        self.spec_drafts = Counter("strata_spec_decode_num_drafts", "sequence-steps that verified a draft",
                                   ["model_name"], registry=r)
        self.spec_draft_tokens = Counter("strata_spec_decode_num_draft_tokens", "draft tokens verified",
                                         ["model_name"], registry=r)
        self.spec_accepted_tokens = Counter("strata_spec_decode_num_accepted_tokens", "draft tokens accepted",
                                            ["model_name"], registry=r)
        self.spec_acceptance = Gauge("strata_spec_decode_acceptance_rate", "accepted / draft tokens since start",
                                     ["model_name"], registry=r)
        self.spec_tokens_per_step = Gauge("strata_spec_decode_tokens_per_step", "tokens a drafting sequence "
                                          "gains per step (accepted + 1) since start", ["model_name"], registry=r)
        # mixture of experts: tokens routed to each expert of each MoE layer (hot experts, imbalance)
        self.expert_tokens = Counter("strata_moe_expert_tokens", "tokens routed to an expert (prefill and decode)",
                                     ["layer", "expert", "model_name"], registry=r)
        # LoRA adapters (--enable-lora): per adapter, as the request's `model` named it
        self.lora_requests = Counter("strata_lora_requests", "generation requests admitted, by LoRA adapter",
                                     ["lora_name", "model_name"], registry=r)
        self.lora_prompt_tokens = Counter("strata_lora_prompt_tokens", "prompt tokens of admitted requests, by "
                                          "LoRA adapter", ["lora_name", "model_name"], registry=r)
        self.lora_generation_tokens = Counter("strata_lora_generation_tokens", "tokens generated, by LoRA adapter",
                                              ["lora_name", "model_name"], registry=r)
        self.lora_info = Gauge("vllm:lora_requests_info", "Running stats on lora requests (vLLM's): the adapters "
                               "of the running and waiting requests; value: when last set (unix seconds)",
                               ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=r)
        self.in_flight = Gauge("strata_http_requests_in_flight", "generation requests being served", ["model_name"], registry=r)
        # GPU start-up checks (hardware/startup_checks.py): 0/1 for alerts, and the detail as an info gauge
        self.gpu_check_warning = Gauge("strata_gpu_check_warning", "1 when a GPU start-up check warned "
                                       "(kernel_image, pcie_link, tf32); the log has the fix", ["check", "device"],
                                       registry=r)
        self.gpu_check_info = Gauge("strata_gpu_check_info", "GPU start-up checks: status and detail (value 1)",
                                    ["check", "device", "status", "detail"], registry=r)
        # every request and engine series carries model_name, last, so that dashboards and the analyzer
        # matching `{stage="...` keep working
        for name, metric in list(vars(self).items()):
            if isinstance(metric, Counter | Gauge | Histogram) and metric._labelnames[-1:] == ("model_name",):
                setattr(self, name, _ForModel(metric, model_name))
        for s in REQUEST_STAGES:
            self.stage.labels(s)
        self._last = EngineStats()
        self._gpu_info: dict[tuple[str, str], tuple[str, ...]] = {}
        self._lora_info: tuple[str, str, str] | None = None

    def on_engine_stats(self, s: EngineStats) -> None:
        """Gauges take the engine's values; counters advance by what changed since the last report."""
        self.running.set(s.running)
        self.waiting.set(s.waiting)
        self.swapped.set(s.swapped)
        self.prefill_cap.set(s.prefill_cap)
        self.kv_usage.set(s.kv_usage)
        self.kv_reserved.set(s.kv_reserved_bytes)
        self.kv_live.set(s.kv_token_bytes)
        self.kv_waste.set(s.kv_waste_bytes)
        last = self._last
        for counter, now, before in (
            (self.preemptions, s.preemptions, last.preemptions),
            (self.prefix_queries, s.prefix_queries, last.prefix_queries),
            (self.prefix_hits, s.prefix_hits, last.prefix_hits),
            (self.prefix_evictions, s.prefix_evictions, last.prefix_evictions),
            (self.spec_drafts, s.spec_steps, last.spec_steps),
            (self.spec_draft_tokens, s.spec_drafted, last.spec_drafted),
            (self.spec_accepted_tokens, s.spec_accepted, last.spec_accepted),
        ):
            if now > before:
                counter.inc(now - before)
        if s.spec_drafted:
            self.spec_acceptance.set(s.spec_accepted / s.spec_drafted)
            self.spec_tokens_per_step.set(s.spec_emitted / s.spec_steps)
        for layer, counts in s.expert_tokens.items():
            before = last.expert_tokens.get(layer, ())
            for e, n in enumerate(counts):
                delta = n - (before[e] if e < len(before) else 0)
                if delta > 0:
                    self.expert_tokens.labels(layer, str(e)).inc(delta)
        for phase, secs in s.stage_seconds.items():
            delta = secs - last.stage_seconds.get(phase, 0.0)
            if delta > 0:
                self.step_phase.labels(phase).inc(delta)
        if s.max_loras:
            self._set_lora_info(s, time.time())
        self._last = s

    def _set_lora_info(self, s: EngineStats, now: float) -> None:
        labels = (str(s.max_loras), ",".join(s.lora_waiting), ",".join(s.lora_running))
        if self._lora_info is not None and self._lora_info != labels:
            self.lora_info.remove(*self._lora_info)
        self._lora_info = labels
        self.lora_info.labels(*labels).set(now)

    def on_engine_done(self, record: dict) -> None:
        """A request finished in the engine: its queue, prefill and decode time."""
        tl = record["timeline"]
        arrival, sched, first, end = tl["arrival"], tl["first_scheduled"], tl["first_token"], tl["finished"]
        if sched is not None:
            self.queue.observe(max(0.0, sched - arrival))
            self.stage.labels("queue").inc(max(0.0, sched - arrival))
            if first is not None:
                self.stage.labels("prefill").inc(max(0.0, first - sched))
                if end is not None:
                    self.stage.labels("decode").inc(max(0.0, end - first))

    def gpu_checks(self, checks) -> None:
        """Record start-up checks (startup_checks.GpuCheck); a check run again replaces its info series."""
        for c in checks:
            self.gpu_check_warning.labels(c.check, c.device).set(0 if c.ok else 1)
            labels = (c.check, c.device, "ok" if c.ok else "warn", c.detail)
            old = self._gpu_info.get((c.check, c.device))
            if old is not None and old != labels:  # one info series per check and device
                self.gpu_check_info.remove(*old)
            self._gpu_info[(c.check, c.device)] = labels
            self.gpu_check_info.labels(*labels).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)
