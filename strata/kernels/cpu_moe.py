"""The MoE decode step's expert kernels: the router and the routed experts of a few rows.

`route` is the fp32 router for the compiled step: logits = h @ W.T, softmax, top-k (largest first,
the lower expert id first among equals) and the optional renormalisation. It reports a tie at the
k-th place (a value equal to the first one left out): the caller then routes those rows with
torch.topk, so ties break exactly as transformers (and the eager block) break them.

The experts (`experts`): the rows of every (row, expert) pair are gathered expert by expert into
one buffer (expert j's rows at starts[j]), each picked expert runs the per-format few-row kernels
once over its rows (project / project_swiglu: the kernels the eager block's GatedMLP calls), and
the weighted sum goes back to each row in expert order, as the eager block sums it. (Tried: every
picked expert's SwiGLU and down in one parallel pass each, for int4 / int8 with int8
activations; on the qwen3-moe-2b shape, Xeon, batch 1, no faster than a call per expert within
the VM's noise, 30-32 vs 25-35 tok/s: the row dots, not the launches, bound it.) The twin:
graph/moe.MoEBlock (tests/graph/test_cpu_decode.py).
"""

from __future__ import annotations

import numpy as np

try:
    import numba
    from numba import njit

    from strata.kernels.cpu_decode_layer import project, project_swiglu
except ImportError:  # pragma: no cover - exercised only where numba is absent
    numba = None


def available() -> bool:
    return numba is not None


if numba is not None:

    @njit(fastmath=True, cache=True)
    def _dot(a, b):  # pragma: no cover - compiled
        acc = np.float32(0.0)  # fastmath: a vectorised reduction (no BLAS in numba without scipy)
        for c in range(a.shape[0]):
            acc += a[c] * b[c]
        return acc

    @njit(cache=True)
    def route(h, w, top_k, norm, ids, weights):  # pragma: no cover - compiled
        """ids / weights [rows, k] of each row's top-k experts; True when a row has a tie at the
        k-th place (the caller re-routes with torch.topk)."""
        rows, n_exp = h.shape[0], w.shape[0]
        tie = False
        probs = np.empty(n_exp, np.float32)
        for r in range(rows):
            for e in range(n_exp):
                probs[e] = _dot(w[e], h[r])
            m = probs.max()
            s = np.float32(0.0)
            for e in range(n_exp):
                probs[e] = np.exp(probs[e] - m)
                s += probs[e]
            for e in range(n_exp):
                probs[e] = probs[e] / s
            order = np.argsort(-probs, kind="mergesort")  # stable: the lower id first among equals
            if top_k < n_exp and probs[order[top_k - 1]] == probs[order[top_k]]:
                tie = True
            total = np.float32(0.0)
            for j in range(top_k):
                ids[r, j] = order[j]
                weights[r, j] = probs[order[j]]
                total += probs[order[j]]
            if norm:
                for j in range(top_k):
                    weights[r, j] = weights[r, j] / total
        return tie

    @njit(cache=True)
    def gather(h, ids, weights, n_exp, xs, who, wt, active, starts, sizes, counts):  # pragma: no cover
        """Every (row, expert) pair's row into xs, expert by expert (ascending): expert active[j]'s
        rows at starts[j] .. + sizes[j], with their source row (who) and weight (wt). Returns the
        number of experts picked."""
        rows, k = ids.shape
        n, m = 0, 0
        for e in range(n_exp):
            first = n
            for r in range(rows):
                for j in range(k):
                    if ids[r, j] == e:
                        xs[n] = h[r]
                        who[n] = r
                        wt[n] = weights[r, j]
                        n += 1
            if n > first:
                active[m], starts[m], sizes[m] = e, first, n - first
                counts[e] += n - first
                m += 1
        return m

    @njit(cache=True)
    def scatter(ys, who, wt, total, out):  # pragma: no cover - compiled
        out[:] = 0
        for i in range(total):
            for c in range(out.shape[1]):
                out[who[i], c] += ys[i, c] * wt[i]

    @njit(cache=True)
    def experts(h, ids, weights, wgu, sgu, ggu, vgu, wd, sd, gd, vd, xs, act, ys, who, wt, active,
                        starts, sizes, counts, threads, out):  # pragma: no cover - compiled
        """Every picked expert once over its gathered rows; out = the weighted sums."""
        m = gather(h, ids, weights, len(wgu), xs, who, wt, active, starts, sizes, counts)
        for j in range(m):
            e, a, n = active[j], starts[j], sizes[j]
            project_swiglu(wgu[e], sgu[e], xs[a:a + n], act[a:a + n], ggu, vgu[n], threads)
            project(wd[e], sd[e], act[a:a + n], ys[a:a + n], gd, vd[n], threads)
        scatter(ys, who, wt, starts[m - 1] + sizes[m - 1] if m else 0, out)

    def typed_list(arrays: list) -> object:
        """The arrays of every expert as one numba typed list (the kernels index it by expert id)."""
        return numba.typed.List(arrays)
