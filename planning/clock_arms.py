"""Per-step counts of the GPU bench's arms, replayed from a routing trace (pure numpy).

Why: the clock (``step_time``) needs what each step moved, per layer, in the arm's own
rules: which routed experts were resident, which the online cache promoted (copied before the
fused kernel, then read from their slot), which misses the CPU path computed and which crossed
the link. This replays the bench's exact workload (``bench-gpu --trace``: each batch's prompt as
one prefill step, then one step per decoded token; the timed steps are the full-batch decode
steps but the first and the last, 61 per request at bs1, 120 at bs8 as in the bench JSON) through:

* ``stock_gpu`` -- every expert resident; ``stock_offload`` -- each layer's GPU byte share
  (vLLM's first-come offload of w13 then w2, ``benchmarks/learned/inputs.offload_order_fractions``);
* ``static`` -- a fixed set per layer (the batch's set, installed before it runs);
* ``cache`` -- the server's capped LFRU (``cache_policies.LFRU``, float32, rule for rule),
  reinstalled before each batch from its set with the set's prior score
  (``server_ext/cache/online_cache.LayerCache.install``: prior_weight / (1 - decay));
* either with ``cpu`` -- the CPU path's split (``server_ext/cpu_experts/split.plan_split``, ported:
  per layer step of at most ``max_tokens`` tokens, the CPU takes the ``n`` missed experts with the
  fewest missed pairs that minimise ``max(link, cpu)`` under the server's cost model; larger steps
  up to ``max_step_tokens`` the same with at most ``pair_budget`` missed pairs; after the
  cache's promotions, so a promoted miss is never also computed on the CPU);
* ``fast`` -- the composed mode (``serve --fast``, ``server_ext/layer.py``): the split runs first on
  the step's misses as routed, choosing ``n`` by the same cost model and which experts by the
  cache's scores before this step's update (lowest first, ties: fewest missed pairs, lowest id;
  in a budgeted step fewest missed pairs first, then the scores);
  the cache then updates its scores and promotes up to its cap from the link's share only;
* ``fast_bg`` -- a prediction for issue 25's off-critical-path promotions (not in the server): the fast
  order, and the cache may also promote CPU-computed experts, copied on a copy stream beside the CPU and
  published next step, as many of the hottest as the link has room for under the split's cost model
  (the CPU's time minus the link's reads and in-line copies, in whole experts);
* ``SplitRule.slices`` > 1 -- a prediction for a split finer than an expert (not in the server): each missed expert
  is ``slices`` slices of its intermediate dimension and the split assigns slices, so one expert is computed
  partly by the CPU and partly over the link (counts become fractions of experts). In the fast order an expert
  the CPU computes any slice of is not promoted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from .cache_policies import LFRU
from .step_time import ClockError, StepCounts
from .traces import RoutingTrace


@dataclass(frozen=True)
class SplitRule:
    """The server's split cost model (``CostModel``): what it believes, not what the clock measures; ``slices`` > 1
    is a design the server does not have."""

    link_GBps: float
    cpu_GBps: float
    fixed_s: float = 25e-6
    pair_s: float = 1e-6
    max_tokens: int = 8
    max_step_tokens: int = 0
    """``CostModel.max_step_tokens``: larger steps up to this many tokens join under the pair budget (0: none)."""
    pair_budget: int = 0
    slices: int = 1
    """Equal slices of each missed expert's intermediate dimension the split assigns one by one (1: whole experts,
    the server's rule). With more, one expert can be computed partly by the CPU and partly over the link -- exact,
    since an expert's output is a sum over its intermediate columns -- a design not built: a prediction."""

    def __post_init__(self) -> None:
        if self.slices < 1:
            raise ValueError(f"slices must be >= 1: {self.slices}")

    @property
    def step_tokens(self) -> int:
        return max(self.max_tokens, self.max_step_tokens)

    def pair_limit(self, tokens: int, top_k: int) -> int:
        """``CostModel.pair_limit``: every pair up to ``max_tokens``, the budget up to ``step_tokens``, none past it."""
        if tokens <= self.max_tokens:
            return tokens * top_k
        return self.pair_budget if tokens <= self.step_tokens else 0


def _candidates(pairs: np.ndarray, rule: SplitRule, tokens: int, priority: np.ndarray | None) -> np.ndarray:
    """``plan_split``'s candidate order over one layer step's missed experts (see ``split_cpu``)."""
    m = len(pairs)
    if priority is None:
        keys: tuple[np.ndarray, ...] = (np.arange(m), pairs)
    else:
        prio = np.asarray(priority, dtype=np.float32)
        keys = (np.arange(m), prio, pairs) if tokens > rule.max_tokens else (np.arange(m), pairs, prio)
    return np.lexsort(keys)


def _cpu_units(pairs: np.ndarray, rule: SplitRule, expert_bytes: int, tokens: int, priority: np.ndarray | None,
               top_k: int, slices: int) -> tuple[np.ndarray, int]:
    """(candidate order, slices the CPU takes): the split rule over ``slices`` slices per expert, taken in turn.

    An expert's pairs count whole from its first slice on (every token routed to it goes to the CPU's tables)."""
    m = len(pairs)
    limit = rule.pair_limit(tokens, top_k)
    order = _candidates(pairs, rule, tokens, priority)
    if m == 0 or limit == 0:
        return order, 0
    unit_pairs = np.zeros((m, slices), dtype=np.int64)
    unit_pairs[:, 0] = pairs[order]  # the first slice of each candidate carries its pairs
    prefix = np.concatenate([[0], np.cumsum(unit_pairs.ravel())])
    u = np.arange(m * slices + 1, dtype=np.float64)
    cpu = (u > 0) * rule.fixed_s + u * (expert_bytes / slices / (rule.cpu_GBps * 1e9)) + prefix * rule.pair_s
    link = (m * slices - u) * (expert_bytes / slices / (rule.link_GBps * 1e9))
    return order, int(np.argmin(np.where(prefix <= limit, np.maximum(cpu, link), np.inf)))


def split_cpu(pairs: np.ndarray, rule: SplitRule, expert_bytes: int, tokens: int,
              priority: np.ndarray | None = None, top_k: int = 8) -> np.ndarray:
    """Indices (into ``pairs``: one layer step's missed experts, in id order) the CPU computes.

    ``plan_split``'s rule: candidates by (missed pairs, id) -- with ``priority`` (the cache's scores,
    composed mode) by (priority, missed pairs, id), in a budgeted step (more than ``max_tokens``
    tokens) by (missed pairs, priority, id); the first ``n`` minimising ``max(cpu(n), link(n))``
    whose missed pairs fit ``rule.pair_limit(tokens, top_k)`` (ties: the smallest ``n``); none when
    the step has too many tokens. Whole experts, whatever ``rule.slices``.
    """
    order, n = _cpu_units(pairs, rule, expert_bytes, tokens, priority, top_k, 1)
    return order[:n]


def split_shares(pairs: np.ndarray, rule: SplitRule, expert_bytes: int, tokens: int,
                 priority: np.ndarray | None = None, top_k: int = 8) -> np.ndarray:
    """Each missed expert's share (0..1, in steps of ``1 / rule.slices``) the CPU computes.

    ``split_cpu``'s rule over slices: the same candidate order, each expert's slices in turn; the CPU takes the
    first ``u`` slices minimising ``max(cpu(u), link(rest))`` (ties: the smallest ``u``) whose pairs fit the step's
    pair limit. An expert's pairs count whole from its first slice on: every token routed to it goes to the CPU's
    tables, whatever share of its columns the CPU computes. One slice per expert is ``split_cpu`` exactly.
    """
    p = rule.slices
    order, u = _cpu_units(pairs, rule, expert_bytes, tokens, priority, top_k, p)
    share = np.zeros(len(pairs))
    share[order] = np.clip(u - p * np.arange(len(pairs)), 0, p) / p
    return share


@dataclass(frozen=True)
class CacheRule:
    cap: int = 4
    decay: float = 0.95
    hysteresis: float | None = None
    prior_weight: float = 1.0


@dataclass(frozen=True)
class Arm:
    name: str
    kind: str  # stock_gpu | stock_offload | static | cache | fast (cache + cpu, split first) | fast_bg (+ background copies)
    cache: CacheRule | None = None
    cpu: SplitRule | None = None
    gpu_fraction: tuple[float, ...] = ()
    """stock_offload: each layer's GPU byte share."""
    link_idle_ms: float = 0.0
    """fast_bg: link time per layer step the copy stream may also use outside the MoE (the step's attention and dense
    compute, spread over the layers), on top of the CPU's share; 0: only the time the CPU computes."""


@dataclass(frozen=True)
class Request:
    """Trace request ``index`` run for ``gen`` tokens after a ``prompt_len``-token prompt."""

    index: int
    prompt_len: int
    gen: int


@dataclass(frozen=True)
class Batch:
    requests: tuple[Request, ...]
    sets: dict[int, np.ndarray] = field(default_factory=dict)
    """Trace layer -> the experts installed before the batch (static arms, the cache's start and prior)."""


@dataclass
class Step:
    timed: bool
    decode: bool
    counts: StepCounts
    pairs: int
    missed_pairs: int
    """Pairs whose expert was not resident as routed (before promotions), the bench's miss accounting."""


def offload_fractions(layers: int, experts: int, expert_bytes: int, offload_bytes: float) -> tuple[float, ...]:
    """vLLM's first-come UVA offload: w13 (2/3 of an expert) then w2 (1/3), layer by layer: each layer's
    GPU share of its expert bytes (``benchmarks/learned/inputs.offload_order_fractions`` serves it)."""
    w13, w2 = 2 * expert_bytes * experts / 3, expert_bytes * experts / 3
    done, out = 0.0, []
    for _ in range(layers):
        gpu = 0.0
        for size in (w13, w2):
            if done < offload_bytes:
                done += size
            else:
                gpu += size
        out.append(gpu / (w13 + w2))
    return tuple(out)


def _rows(trace: RoutingTrace, req: Request) -> tuple[np.ndarray, np.ndarray]:
    """(prefill rows, decode rows): the bench's replay (``inputs.request_rows``, its clamp included)."""
    start = int(trace.offsets[req.index])
    length = int(trace.offsets[req.index + 1]) - start
    pos = np.minimum(np.arange(req.prompt_len + req.gen - 1), length - 1)
    return start + pos[: req.prompt_len], start + pos[req.prompt_len :]


def batch_steps(trace: RoutingTrace, batch: Batch) -> Iterator[tuple[bool, bool, np.ndarray]]:
    """(timed, decode, trace rows) per engine step: the prefill, then each decode step while any request runs."""
    rows = [_rows(trace, q) for q in batch.requests]
    yield False, False, np.concatenate([p for p, _ in rows])
    full = min(len(d) for _, d in rows)
    for s in range(max(len(d) for _, d in rows)):
        live = np.array([d[s] for _, d in rows if s < len(d)])
        yield 1 <= s < full - 1, True, live  # the bench times full-batch steps, not the first nor the last


class _Layers:
    """One batch's residency state for every layer under ``arm``."""

    def __init__(self, arm: Arm, batch: Batch, layers: int, experts: int, slots: int):
        self.arm = arm
        self.resident = np.zeros((layers, experts), dtype=bool)
        for l, ids in batch.sets.items():
            self.resident[l, np.asarray(ids, dtype=np.int64)] = True
        self.caches: list[LFRU] = []
        if arm.kind in ("cache", "fast", "fast_bg"):
            r = arm.cache or CacheRule()
            for l in range(layers):
                start = np.flatnonzero(self.resident[l])
                c = LFRU(slots, experts, start, r.decay, r.cap, r.hysteresis, dtype=np.float32)
                c.count[start] = np.float32(r.prior_weight / (1.0 - r.decay))
                self.caches.append(c)

    def access(self, l: int, experts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(resident as routed, promoted this step) masks over ``experts``."""
        if self.arm.kind == "cache":
            res = self.caches[l].access(experts, np.zeros(len(experts)))
            return res.hits, self.caches[l].resident[experts] & ~res.hits
        return self.resident[l, experts], np.zeros(len(experts), dtype=bool)


def replay(trace: RoutingTrace, batches: Sequence[Batch], arm: Arm, expert_bytes: int, slots: int) -> list[Step]:
    """Every engine step of ``batches`` under ``arm``, with its per-layer counts."""
    L, E, K = trace.num_layers, trace.num_experts, trace.top_k
    out: list[Step] = []
    if arm.kind == "fast_bg" and arm.cpu is not None and arm.cpu.slices > 1:
        raise ClockError("fast_bg prices the link's room in whole experts: give it an unsliced split")
    reap = arm.kind in ("static", "cache", "fast", "fast_bg")
    for batch in batches:
        state = _Layers(arm, batch, L, E, slots)
        for timed, decode, rows in batch_steps(trace, batch):
            tokens = len(rows)
            fast = arm.kind in ("fast", "fast_bg")
            c = StepCounts.zeros(L, tokens, cache=arm.kind in ("cache", "fast", "fast_bg"),
                                 cpu_path=arm.cpu is not None and tokens <= arm.cpu.step_tokens, reap=reap, promote_beside_cpu=fast)
            if arm.kind == "fast_bg":
                c.background = np.zeros(L)
            pairs = missed_pairs = 0
            for l in range(L):
                experts, per = np.unique(trace.ids[rows, l, :].astype(np.int64), return_counts=True)
                pairs += int(per.sum())
                if arm.kind == "stock_gpu":
                    c.resident[l] = len(experts)
                    continue
                if arm.kind == "stock_offload":
                    f = arm.gpu_fraction[l]
                    c.resident[l], c.link[l] = f * len(experts), (1.0 - f) * len(experts)
                    missed_pairs += int(round((1.0 - f) * per.sum()))
                    continue
                if fast:
                    missed_pairs += _fast_layer(state.caches[l], experts, per, arm.cpu, expert_bytes, tokens, c, l, K,
                                                arm.link_idle_ms if arm.kind == "fast_bg" else None)
                    continue
                hit, promoted = state.access(l, experts)
                missed_pairs += int(per[~hit].sum())
                miss = ~hit & ~promoted
                c.promoted[l] = int(promoted.sum())
                c.resident[l] = int((hit | promoted).sum())
                share = split_shares(per[miss], arm.cpu, expert_bytes, tokens, top_k=K) if arm.cpu is not None else np.zeros(int(miss.sum()))
                c.cpu[l] = share.sum()
                c.cpu_pairs[l] = int(per[miss][share > 0].sum())
                c.link[l] = int(miss.sum()) - share.sum()
            out.append(Step(timed, decode, c, pairs, missed_pairs))
    return out


def _fast_layer(cache: LFRU, experts: np.ndarray, per: np.ndarray, rule: SplitRule | None, expert_bytes: int,
                tokens: int, c: StepCounts, l: int, top_k: int, link_idle_ms: float | None = None) -> int:
    """One layer step of the composed mode into ``c`` (see module doc); returns its missed pairs."""
    hit = cache.resident[experts].copy()
    miss = np.flatnonzero(~hit)
    prio = cache.count[experts[miss]].copy()  # the scores before this step's update
    share = split_shares(per[miss], rule, expert_bytes, tokens, prio, top_k) if rule is not None else np.zeros(len(miss))
    to_cpu = np.flatnonzero(share)
    # an expert the CPU computes any slice of is not copied in line: promoting a sliced one (a whole copy in place of
    # its link slices) made the fast arm slower in every clock replayed (e.g. 6.40 against 5.16 ms, h100-onerun3-v1 bs1)
    on_cpu = experts[miss[to_cpu]]
    exclude = on_cpu
    if link_idle_ms is not None and rule is not None and len(on_cpu):  # whole experts only (replay refuses slices)
        room = _link_room(rule, expert_bytes, len(miss) - len(to_cpu), len(to_cpu), int(per[miss][to_cpu].sum()), link_idle_ms / 1e3)
        hottest = np.lexsort((on_cpu, -prio[to_cpu]))[:room]  # the CPU experts worth a slot first
        exclude = np.delete(on_cpu, hottest)
    res = cache.access(experts, np.zeros(len(experts)), exclude=exclude)
    promoted = cache.resident[experts] & ~res.hits
    bg = promoted & np.isin(experts, on_cpu) if link_idle_ms is not None else np.zeros(len(experts), dtype=bool)  # fast_bg only
    inline = promoted & ~bg
    if c.background is not None:
        c.background[l] = int(bg.sum())
    c.promoted[l] = int(inline.sum())
    c.resident[l] = int((hit | inline).sum())
    c.cpu[l] = share.sum()
    c.cpu_pairs[l] = int(per[miss][to_cpu].sum())
    c.link[l] = float(((1.0 - share) * ~inline[miss]).sum())
    return int(per[~hit].sum())


def _link_room(rule: SplitRule, expert_bytes: int, link_experts: int, cpu_experts: int, cpu_pairs: int, idle_s: float = 0.0) -> int:
    """Whole experts the link can copy while the CPU computes its share (by the split's own cost model) and in
    ``idle_s`` more of link time outside the MoE."""
    b = expert_bytes / 1e9
    cpu_s = rule.fixed_s + cpu_experts * b / rule.cpu_GBps + cpu_pairs * rule.pair_s
    return max(0, int((max(0.0, cpu_s - link_experts * b / rule.link_GBps) + idle_s) // (b / rule.link_GBps)))
