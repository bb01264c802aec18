"""The alpha-beta cost model of the collectives: one formula per algorithm, least-squares fits
from measurements (as NCCL's tuner fits its per-protocol latency and bandwidth), and the JSON
that the hardware profile stores (`strata bench comm` measures, `strata plan` and
Communicator.all_reduce read it).

One message of S bytes over n ranks, alpha = the cost of one step's latency (launch, barrier,
socket round trip), beta = the bytes per second one step moves:

    all_reduce  ring            t = 2(n-1) a + 2(n-1)/n S/b   reduce-scatter + all-gather,
                                                              n-1 steps each of S/n bytes (gloo, NCCL)
    all_reduce  tree            t = log2(n) a + log2(n) S/b   recursive doubling: log2 n steps of S
    all_reduce  shm             t = a + (n+2) S/b             one barrier; a rank writes S into its
                                                              slot, reads the n slots, writes S
    all_gather  ring            t = (n-1) a + (n-1)/n S/b     S = the gathered (output) bytes
    broadcast   tree            t = ceil(log2 n) a + S/b      pipelined down a tree
    all_to_all  pairwise        t = (n-1) a + (n-1)/n S/b     S = the bytes each rank sends (its
                                                              whole buffer, own share included);
                                                              S/n to each of n-1 peers (gloo, NCCL)
    all_to_all  shm             t = a + 2 S/b                 one barrier; a rank writes S into its
                                                              slot and copies S out of the slots

For measurements at one n the model t = A(n) a + B(n) S / b is linear in (a, 1/b); the fit is
weighted least squares on the relative error, sum(((t_model - t) / t)^2), so the microsecond
points count as much as the millisecond ones, with a >= 0 and b > 0. Prediction at another n
scales by the algorithm's A and B (an extrapolation: the fit says which n it was measured at).
One line rarely holds from 8 B to 256 MiB: gloo changes protocol with the size, and a message
that outgrows the caches pays DRAM's bandwidth. So a fit is piecewise: up to three contiguous
size regimes, each with its own alpha and beta, the breakpoints and their number chosen from
the measurements (fit()), as NCCL's tuner keeps one latency and bandwidth per protocol.
nccl-tests' bus bandwidth, the figure comparable across n: algbw = S / t, and busbw = algbw x
2(n-1)/n (all-reduce), x (n-1)/n (all-gather, all-to-all), x 1 (broadcast).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

MODEL_VERSION = 2  # 2: fits in size segments; 1 (one line per fit) still loads

# (alpha steps A(n), bytes factor B(n)) per algorithm
FORMULAS = {
    "ring": (lambda n: 2 * (n - 1), lambda n: 2 * (n - 1) / n),
    "tree": (lambda n: math.log2(n), lambda n: math.log2(n)),
    "shm": (lambda n: 1.0, lambda n: n + 2.0),
    "ring_gather": (lambda n: n - 1, lambda n: (n - 1) / n),
    "tree_bcast": (lambda n: math.ceil(math.log2(n)), lambda n: 1.0),
    "pairwise": (lambda n: n - 1, lambda n: (n - 1) / n),
    "shm_a2a": (lambda n: 1.0, lambda n: 2.0),
}
FORMULA_TEXT = {
    "ring": "2(n-1)*a + 2(n-1)/n*S/b", "tree": "log2(n)*a + log2(n)*S/b", "shm": "a + (n+2)*S/b",
    "ring_gather": "(n-1)*a + (n-1)/n*S/b", "tree_bcast": "ceil(log2 n)*a + S/b",
    "pairwise": "(n-1)*a + (n-1)/n*S/b", "shm_a2a": "a + 2*S/b",
}
# which formula each (collective, transport) runs
ALGORITHM = {
    ("all_reduce", "shm"): "shm", ("all_reduce", "gloo"): "ring", ("all_reduce", "nccl"): "ring",
    ("all_gather", "gloo"): "ring_gather", ("all_gather", "nccl"): "ring_gather",
    ("broadcast", "gloo"): "tree_bcast", ("broadcast", "nccl"): "tree_bcast",
    ("all_to_all", "shm"): "shm_a2a", ("all_to_all", "gloo"): "pairwise", ("all_to_all", "nccl"): "pairwise",
}
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "broadcast": lambda n: 1.0, "all_to_all": lambda n: (n - 1) / n}


def algorithm_for(collective: str, transport: str) -> str:
    base = transport.split("+")[0]  # "shm+bf16": the compressed variant runs the same algorithm
    return ALGORITHM.get((collective, base), "ring")


def bus_bandwidth(collective: str, nbytes: float, seconds: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/s, nccl-tests' definitions."""
    alg = nbytes / seconds if seconds > 0 else float("inf")
    return alg, alg * BUS_FACTOR.get(collective, lambda n: 1.0)(n)


def model_seconds(algorithm: str, nbytes: float, n: int, alpha_s: float, beta_bps: float) -> float:
    if n <= 1:
        return 0.0
    a, b = FORMULAS[algorithm]
    return a(n) * alpha_s + b(n) * nbytes / beta_bps


@dataclass(frozen=True)
class Segment:
    """One size regime of a fit: the algorithm's formula with its own alpha and beta, for sizes
    from `from_bytes` up to the next segment's."""

    from_bytes: float
    alpha_s: float
    beta_bps: float  # bytes per second


@dataclass(frozen=True)
class Fit:
    """One algorithm's fitted model, with the points it was fitted to. Usually one segment; a
    transport whose cost per byte changes with the size (gloo's protocol switches, a message
    outgrowing the caches) gets up to MAX_SEGMENTS, as NCCL's tuner keeps a latency and a
    bandwidth per protocol (LL, LL128, Simple) and switches by size."""

    collective: str  # all_reduce | all_gather | broadcast | all_to_all
    transport: str  # shm | gloo | nccl (+ "+bfloat16" / "+float16": compressed all-reduce)
    algorithm: str  # a FORMULAS key
    world_size: int  # n of the measurements
    segments: tuple[Segment, ...]  # ascending from_bytes; the first covers every smaller size
    sizes: tuple[int, ...] = ()
    measured_s: tuple[float, ...] = ()

    @classmethod
    def line(cls, collective: str, transport: str, algorithm: str, world_size: int, alpha_s: float,
             beta_bps: float, **kw: Any) -> Fit:
        """A one-segment fit (the plain alpha-beta model)."""
        return cls(collective, transport, algorithm, world_size, (Segment(0.0, alpha_s, beta_bps),), **kw)

    @property
    def alpha_s(self) -> float:
        """The latency term: the smallest messages' segment."""
        return self.segments[0].alpha_s

    @property
    def beta_bps(self) -> float:
        """The bandwidth term: the largest messages' segment."""
        return self.segments[-1].beta_bps

    def segment(self, nbytes: float) -> Segment:
        seg = self.segments[0]
        for s in self.segments[1:]:
            if nbytes >= s.from_bytes:
                seg = s
        return seg

    def predict(self, nbytes: float, n: int | None = None) -> float:
        seg = self.segment(nbytes)
        return model_seconds(self.algorithm, nbytes, n or self.world_size, seg.alpha_s, seg.beta_bps)

    def rel_errors(self) -> list[float]:
        """(model - measured) / measured at each fitted size."""
        return [(self.predict(s) - t) / t for s, t in zip(self.sizes, self.measured_s)]

    def to_json(self) -> dict[str, Any]:
        return {"collective": self.collective, "transport": self.transport, "algorithm": self.algorithm,
                "formula": FORMULA_TEXT[self.algorithm], "world_size": self.world_size,
                "segments": [{"from_bytes": s.from_bytes, "alpha_s": s.alpha_s, "beta_bps": s.beta_bps}
                             for s in self.segments],
                "sizes": list(self.sizes), "measured_s": list(self.measured_s)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Fit:
        alg = str(d["algorithm"])
        if alg not in FORMULAS:
            raise ValueError(f"comm model: unknown algorithm {alg!r}")
        if "segments" in d:
            segs = tuple(Segment(float(s["from_bytes"]), float(s["alpha_s"]), float(s["beta_bps"]))
                         for s in d["segments"])
        else:  # version 1: one line
            segs = (Segment(0.0, float(d["alpha_s"]), float(d["beta_bps"])),)
        if not segs or any(b.from_bytes <= a.from_bytes for a, b in zip(segs, segs[1:])):
            raise ValueError("comm model: a fit needs segments in ascending from_bytes")
        return cls(str(d["collective"]), str(d["transport"]), alg, int(d["world_size"]), segs,
                   tuple(int(s) for s in d.get("sizes", ())), tuple(float(t) for t in d.get("measured_s", ())))


def _fit_line(A: float, B: float, sizes: list[int], seconds: list[float]) -> tuple[float, float, float]:
    """(alpha, beta, sum of squared relative errors) of t = A a + B S / b over the points:
    weighted least squares (see the module docstring), alpha clamped at 0, the slope positive."""
    # rows (A/t, B*S/t) . (a, 1/b) ~ 1
    rows = [(A / t, B * s / t) for s, t in zip(sizes, seconds)]
    sxx = sum(x * x for x, _ in rows)
    syy = sum(y * y for _, y in rows)
    sxy = sum(x * y for x, y in rows)
    sx1, sy1 = sum(x for x, _ in rows), sum(y for _, y in rows)
    det = sxx * syy - sxy * sxy
    a = inv_b = -1.0
    if det > 1e-12 * max(sxx * syy, 1e-300):
        a = (sx1 * syy - sy1 * sxy) / det
        inv_b = (sxx * sy1 - sxy * sx1) / det
    sse = lambda c: sum((c[0] * x + c[1] * y - 1) ** 2 for x, y in rows)  # noqa: E731
    if a < 0 or inv_b <= 0:  # one parameter on its bound: refit the other alone
        cand = []
        if syy > 0:
            cand.append((0.0, sy1 / syy))
        if sxx > 0:
            cand.append((sx1 / sxx, 1e-30))
        a, inv_b = min(cand, key=sse)
    inv_b = max(inv_b, 1e-30)
    return float(a), float(1.0 / inv_b), sse((a, inv_b))


MAX_SEGMENTS = 3
MIN_SEGMENT_POINTS = 4


def fit(collective: str, transport: str, n: int, sizes: list[int], seconds: list[float],
        algorithm: str | None = None, max_segments: int = MAX_SEGMENTS) -> Fit:
    """The algorithm's formula fitted to the (S, t) points, in 1..max_segments contiguous size
    regimes of >= MIN_SEGMENT_POINTS points each. Each regime is a weighted least-squares line
    (module docstring); the breakpoints minimise the total squared relative error (dynamic
    programming over the sorted sizes), and the number of regimes is the one with the lowest
    Bayesian information criterion, N ln(SSE/N) + (3k - 1) ln N: a regime is added only when
    it explains much more than its three parameters could by chance."""
    if len(sizes) != len(seconds) or not sizes:
        raise ValueError("fit: need as many times as sizes, at least one")
    alg = algorithm or algorithm_for(collective, transport)
    fa, fb = FORMULAS[alg]
    A, B = fa(n), fb(n)
    pts = sorted(zip(sizes, seconds))
    S, T = [p[0] for p in pts], [p[1] for p in pts]
    N = len(pts)
    kmax = max(1, min(max_segments, N // MIN_SEGMENT_POINTS))
    lines: dict[tuple[int, int], tuple[float, float, float]] = {}

    def line(i: int, j: int) -> tuple[float, float, float]:  # points i..j-1
        if (i, j) not in lines:
            lines[(i, j)] = _fit_line(A, B, S[i:j], T[i:j])
        return lines[(i, j)]

    # best[k][j]: (sse, cuts) of the first j points in k segments
    best: list[dict[int, tuple[float, tuple[int, ...]]]] = [{0: (0.0, ())}]
    for k in range(1, kmax + 1):
        row = {}
        for j in range(k * MIN_SEGMENT_POINTS if k > 1 else 1, N + 1):
            opts = [(prev + line(i, j)[2], cuts + (i,)) for i, (prev, cuts) in best[k - 1].items()
                    if j - i >= (MIN_SEGMENT_POINTS if kmax > 1 else 1)]
            if opts:
                row[j] = min(opts)
        best.append(row)
    bic = lambda k: N * math.log(max(best[k][N][0], 1e-18) / N) + (3 * k - 1) * math.log(N)  # noqa: E731
    k = min((k for k in range(1, kmax + 1) if N in best[k]), key=bic)
    cuts = best[k][N][1] + (N,)
    segs = []
    for i, j in zip(cuts, cuts[1:]):
        a, b, _ = line(i, j)
        start = 0.0 if i == 0 else math.sqrt(S[i - 1] * S[i])  # boundary: geometric midpoint
        segs.append(Segment(start, a, b))
    return Fit(collective, transport, alg, n, tuple(segs), tuple(int(s) for s in S), tuple(float(t) for t in T))


@dataclass(frozen=True)
class CommModel:
    """The fits of one machine (what the hardware profile's `comm_model` holds)."""

    fits: tuple[Fit, ...] = ()
    source: str = "strata bench comm"
    host: str = ""
    measured_at: str = ""  # ISO date
    notes: tuple[str, ...] = field(default_factory=tuple)

    def get(self, collective: str, transport: str, n: int | None = None) -> Fit | None:
        """The fit measured at n, else the one measured nearest to it (prediction then scales)."""
        cands = [f for f in self.fits if f.collective == collective and f.transport == transport]
        if not cands:
            return None
        if n is None:
            return cands[0]
        return min(cands, key=lambda f: (abs(f.world_size - n), -f.world_size))

    def predict(self, collective: str, transport: str, nbytes: float, n: int) -> float | None:
        f = self.get(collective, transport, n)
        return None if f is None else f.predict(nbytes, n)

    def transports(self, collective: str) -> list[str]:
        return sorted({f.transport for f in self.fits if f.collective == collective})

    def best(self, collective: str, nbytes: float, n: int,
             transports: list[str] | None = None) -> tuple[str, float] | None:
        """(cheapest transport, its seconds) among those fitted (and in `transports`)."""
        opts = [(t, self.predict(collective, t, nbytes, n)) for t in self.transports(collective)
                if transports is None or t in transports]
        opts = [(t, s) for t, s in opts if s is not None]
        return min(opts, key=lambda o: o[1]) if opts else None

    def all_to_all_seconds(self, nbytes: float, n: int, transports: list[str] | None = None) -> float | None:
        """One all-to-all in which every rank sends `nbytes` (its whole buffer), on the cheapest
        fitted transport (of `transports`); None when none is fitted. Price an uneven exchange at
        its busiest rank's bytes (sent or received): the collective ends when that rank does."""
        best = self.best("all_to_all", nbytes, n, transports)
        return None if best is None else best[1]

    def merged(self, newer: CommModel) -> CommModel:
        """`newer`'s fits, plus ours for (collective, transport, n) it did not measure."""
        keys = {(f.collective, f.transport, f.world_size) for f in newer.fits}
        kept = tuple(f for f in self.fits if (f.collective, f.transport, f.world_size) not in keys)
        return CommModel(newer.fits + kept, newer.source, newer.host, newer.measured_at, newer.notes)

    def to_json(self) -> dict[str, Any]:
        return {"version": MODEL_VERSION, "source": self.source, "host": self.host,
                "measured_at": self.measured_at, "notes": list(self.notes),
                "fits": [f.to_json() for f in self.fits]}

    @classmethod
    def from_json(cls, d: dict[str, Any] | None) -> CommModel | None:
        """None for an empty or absent model (profiles cached before `strata bench comm` ran)."""
        if not d:
            return None
        if int(d.get("version", MODEL_VERSION)) not in (1, MODEL_VERSION):
            raise ValueError(f"comm model version {d.get('version')!r}: this Strata reads 1 and {MODEL_VERSION}; "
                             "run `strata bench comm` again")
        return cls(tuple(Fit.from_json(f) for f in d.get("fits", ())), str(d.get("source", "")),
                   str(d.get("host", "")), str(d.get("measured_at", "")),
                   tuple(str(x) for x in d.get("notes", ())))
