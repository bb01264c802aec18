"""The engine's LoRA adapters: the registry of known adapters, their weights read on the host (an
LRU of `max_cpu_loras`), and the `max_loras` slots of the model's banks (graph/lora.py) that a step's
adapters occupy.

Reading an adapter (safetensors + checks against the base) runs on a worker thread, so a server
loading one keeps stepping; a request whose adapter is still being read waits in the queue
(`ready`). Putting an adapter into a slot is a copy of its host tensors into the banks, done by the
runner when a step needs it; the scheduler keeps the running requests to at most `max_loras`
adapters, so a step's adapters always have slots.

Tensor parallelism: rank 0's manager decides every slot (its LRU is the only one). `step_plan`
gives the step plan (engine/parallel.py) the slots that changed since the last plan, as (slot,
adapter id, name, path), and the adapters retired; a follower (ranks > 0) `follow`s them before
the step, reading each adapter from its path onto its own shard (graph/lora_adapter.py slices it),
and its `slots_for` only looks the slots up.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from strata.errors import StrataError
from strata.graph.lora_adapter import AdapterWeights, Site, attach_banks, read_adapter
from strata.protocol.lora import LoRAError, LoRARequest

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None,
                 base_name: str | None = None, dtype: torch.dtype = torch.float32, follower: bool = False) -> None:
        """follower: a tensor-parallel rank > 0, whose slots rank 0's step plans set (`follow`)."""
        self.model, self.max_loras, self.max_rank = model, max_loras, max_lora_rank
        self.follower = follower
        self.max_cpu_loras = max_cpu_loras or max_loras
        self.base_name = base_name
        self.sites: dict[str, Site] = attach_banks(model, max_loras, max_lora_rank, dtype=dtype)
        self.banks = list({id(s.module): s.module.lora for s in self.sites.values()}.values())
        self._lock = threading.Lock()
        self._known: dict[int, LoRARequest] = {}  # lora_int_id -> request (registered)
        self._names: dict[str, int] = {}
        self._host: OrderedDict[int, AdapterWeights] = OrderedDict()  # read weights, LRU first
        self._reading: dict[int, Future] = {}
        self._retired: dict[int, LoRARequest] = {}  # removed, still held by queued/running requests
        self._slots: list[int | None] = [None] * max_loras  # slot -> lora_int_id
        self._slot_use: list[int] = [0] * max_loras  # step counter of last use (LRU among slots)
        self._clock = 0
        # tensor parallelism, rank 0: what the other ranks were last told of each slot
        self._slot_gen: list[int] = [0] * max_loras  # bumped whenever a slot's content changes
        self._sent: list[tuple[int | None, int]] = [(None, 0)] * max_loras
        self._dropped: list[int] = []  # retired since the last plan: the followers drop their copies
        self._planning = False  # step_plan called: a leader whose followers need `_dropped`
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="strata-lora-read")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- the registry ----------------------------------------------------------------------------
    def add(self, lora: LoRARequest, wait: bool = True) -> Future:
        """Register `lora` and read its weights (on the worker thread): the future's result() raises
        the adapter's LoRAError. wait: block until read (errors raised here)."""
        with self._lock:
            known = self._known.get(lora.lora_int_id)
            if known is not None and (known.lora_name, known.path) != (lora.lora_name, lora.path):
                raise LoRAError(f"LoRA adapter {lora.lora_name}: lora_int_id {lora.lora_int_id} is already "
                                f"adapter {known.lora_name} ({known.path}); give each adapter its own id")
            other = self._names.get(lora.lora_name)
            if other is not None and other != lora.lora_int_id:
                raise LoRAError(f"LoRA adapter {lora.lora_name}: the name is taken by lora_int_id {other}; "
                                "unload it first or pick another name")
            self._retired.pop(lora.lora_int_id, None)  # added again after a remove
            future = self._read_locked(lora)
            if future.done() and future.exception() is None:  # its weights were on the host already
                self._known[lora.lora_int_id] = lora
                self._names[lora.lora_name] = lora.lora_int_id
        if wait:
            future.result()
        return future

    def _read_locked(self, lora: LoRARequest) -> Future:
        lid = lora.lora_int_id
        if lid in self._host:
            done: Future = Future()
            done.set_result(self._host[lid])
            return done
        if lid in self._reading:
            return self._reading[lid]
        future = self._pool.submit(self._read, lora)
        self._reading[lid] = future
        return future

    def _read(self, lora: LoRARequest) -> AdapterWeights:
        try:
            weights = read_adapter(lora.lora_name, lora.path, self.model, self.sites, self.max_rank,
                                   self.base_name)
        except BaseException:
            with self._lock:
                self._reading.pop(lora.lora_int_id, None)
            raise
        with self._lock:
            self._reading.pop(lora.lora_int_id, None)
            if lora.lora_int_id not in self._retired:
                self._known[lora.lora_int_id] = lora
                self._names[lora.lora_name] = lora.lora_int_id
            self._host[lora.lora_int_id] = weights
            self._host.move_to_end(lora.lora_int_id)
            self._trim_host_locked()
        logger.info("LoRA adapter %s (id %d) read: rank %d, %d projections, %.1f MiB", lora.lora_name,
                    lora.lora_int_id, weights.rank, len(weights.modules), weights.nbytes / 2**20)
        return weights

    def _trim_host_locked(self) -> None:
        """Drop host copies past max_cpu_loras, least recently used first, never one in a slot nor
        the newest (just read for a waiting request: dropping it would read it again forever)."""
        for lid in list(self._host)[:-1]:
            if len(self._host) <= self.max_cpu_loras:
                break
            if lid not in self._slots:
                del self._host[lid]

    def remove(self, lora_int_id: int) -> bool:
        """Refuse the adapter to new requests; those already queued or running with it finish (its
        weights are dropped once none holds it: `retire`)."""
        with self._lock:
            lora = self._known.pop(lora_int_id, None)
            if lora is None:
                return False
            self._names.pop(lora.lora_name, None)
            self._retired[lora_int_id] = lora
            return True

    def retire(self, in_use: set[int]) -> None:
        """Drop the weights of removed adapters no request holds any more (the engine calls this)."""
        if not self._retired:
            return
        with self._lock:
            for lid in [i for i in self._retired if i not in in_use]:
                del self._retired[lid]
                self._host.pop(lid, None)
                if self._planning:
                    self._dropped.append(lid)
                if lid in self._slots:
                    slot = self._slots.index(lid)
                    self._slots[slot] = None
                    self._slot_gen[slot] += 1

    def list(self) -> list[LoRARequest]:
        with self._lock:
            return list(self._known.values())

    def known(self, lora: LoRARequest) -> bool:
        with self._lock:
            return self._known.get(lora.lora_int_id) == lora

    def ready(self, lora_int_id: int) -> bool:
        """Whether the adapter's weights are on the host (or in a slot); starts reading them if the
        host LRU dropped them."""
        with self._lock:
            if lora_int_id in self._host:
                return True
            lora = self._known.get(lora_int_id) or self._retired.get(lora_int_id)
            if lora is not None and lora_int_id not in self._reading:
                self._read_locked(lora)
            return False

    # --- slots -----------------------------------------------------------------------------------
    def slots_for(self, lora_ids: set[int], keep: set[int]) -> dict[int, int]:
        """A slot for each adapter of this step (loading those not in one), evicting only adapters
        outside `keep` (the running requests' adapters); {lora_int_id: slot}. A follower only looks
        up the slots rank 0's plan gave them."""
        if self.follower:
            return self._followed(lora_ids)
        self._clock += 1
        out = {}
        for lid in sorted(lora_ids):
            slot = self._slots.index(lid) if lid in self._slots else self._load(lid, lora_ids | keep)
            self._slot_use[slot] = self._clock
            out[lid] = slot
        return out

    def _load(self, lid: int, keep: set[int]) -> int:
        free = [s for s, held in enumerate(self._slots) if held is None or held not in keep]
        if not free:
            raise RuntimeError(f"LoRA: no slot free for adapter {lid} (max_loras {self.max_loras}); the "
                               "scheduler admitted too many adapters")
        slot = min(free, key=lambda s: (self._slots[s] is not None, self._slot_use[s]))
        with self._lock:
            weights = self._host.get(lid)
            lora = self._known.get(lid) or self._retired.get(lid)
        if weights is None:  # dropped from the host after it was admitted (a rare race): read it now
            if lora is None:
                raise RuntimeError(f"LoRA: adapter {lid} scheduled but unknown")
            weights = self._read(lora)
        self._put(slot, lid, weights)
        return slot

    def _put(self, slot: int, lid: int, weights: AdapterWeights) -> None:
        """Adapter `lid`'s weights into `slot` of every bank (the banks it leaves out: zeros)."""
        with self._lock:
            self._host[lid] = weights
            self._host.move_to_end(lid)
            self._slots[slot] = lid
            self._slot_gen[slot] += 1
            self._trim_host_locked()
        touched = set()
        for module, segments in weights.modules.values():
            module.lora.set_slot(slot, segments)
            touched.add(id(module.lora))
        for bank in self.banks:
            if id(bank) not in touched:
                bank.clear_slot(slot)

    # --- tensor parallelism: rank 0 decides, the other ranks follow ------------------------------
    def step_plan(self, lora_ids: set[int]) -> list | None:
        """Rank 0: slots for this step's adapters, then what the other ranks must change before
        it (msgpack-able): [[slot, lora_int_id (0: emptied), name, path], ...] and the adapters
        retired since the last plan; None when nothing changed."""
        self._planning = True
        if lora_ids:
            self.slots_for(lora_ids, set())
        changes = []
        with self._lock:
            for slot, now in enumerate(zip(self._slots, self._slot_gen)):
                if now == self._sent[slot]:
                    continue
                self._sent[slot] = now
                lid = now[0]
                lora = None if lid is None else self._known.get(lid) or self._retired.get(lid)
                changes.append([slot, 0, "", ""] if lora is None else
                               [slot, lid, lora.lora_name, str(lora.path)])
            dropped, self._dropped = self._dropped, []
        return [changes, dropped] if changes or dropped else None

    def follow(self, plan: list) -> None:
        """A follower: apply rank 0's `step_plan` (reading the adapters it has not read yet)."""
        changes, dropped = plan
        with self._lock:
            for lid in dropped:
                self._host.pop(lid, None)
                self._known.pop(lid, None)
        for slot, lid, name, path in changes:
            if not lid:
                self._slots[slot] = None
                continue
            lora = LoRARequest(name, lid, path)
            with self._lock:
                weights = self._host.get(lid) if self._known.get(lid) == lora else None
                self._known[lid] = lora
            if weights is None:  # rank 0 read it already: the same files give the same checks
                weights = read_adapter(name, path, self.model, self.sites, self.max_rank, self.base_name)
            self._put(slot, lid, weights)

    def _followed(self, lora_ids: set[int]) -> dict[int, int]:
        missing = sorted(lid for lid in lora_ids if lid not in self._slots)
        if missing:
            raise StrataError(f"LoRA: rank 0's step plan put no slot for adapter(s) {missing}; the ranks are "
                              "out of step")
        return {lid: self._slots.index(lid) for lid in lora_ids}
