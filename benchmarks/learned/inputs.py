"""Inputs of ``bench-gpu --trace``: the learned sets file, the trace workload, offline hit rates (pure numpy).

The benchmark model replays a trained model's routing trace
(``trace_routing``), so the experts a request touches are known before it
runs. The hit rate of a resident set over the trace rows a request consumes
is then exactly what the engine's miss accounting must measure; any
difference is a bug in the replay or the accounting, not noise.

Sets file (``reap-swap learned-sets``; layer keys are MoE layer indices, the
trace's ``meta.moe_layers``)::

    {"slots_per_layer": 38, "layers": [0, ...], "num_experts": 128,
     "sets": {"static_topk": {"layer_<i>": [e, ...]}, "plan": {...}, ...},
     "per_request": {"classifier": {<trace name>: {"<index>:<request id>": {"layer_<i>": [...]}}},
                     "classifier_bs8": {<trace name>: {"<group>": {...}}}, "oracle": ...,
                     "classifier_bs<B>": ... (learned-sets --extra-batches B)},
     "scores": {<trace name>: {<arm>: {"hit_rate_decode": ..., ...}}}}

The ``<trace name>`` level (the trace file's stem) may be absent. Group g of
the batch-8 workload is trace requests ``8g .. 8g+7``; of ``classifier_bs<B>``, ``Bg .. Bg+B-1``.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from reap_swap.planning.clock_arms import offload_fractions
from reap_swap.planning.traces import RoutingTrace

from .sets import SetsError  # the one error of a bad sets file, re-exported for the bench
from ..tp import tp_of  # noqa: F401 - re-exported for the learned arms
from ..trace_routing import prompt_lengths

LayerSets = dict[int, list[int]]
"""Trace layer -> resident experts."""
Target = dict[str, list[int]]
"""``layer_<model layer>`` -> resident experts (what ``reap_swap`` takes)."""


@dataclass(frozen=True)
class TraceRequest:
    """One engine request replaying trace request ``index``: its prompt is ``prompt_len`` tokens, it generates ``gen``."""

    index: int
    name: str
    prompt_len: int
    decode_rows: int
    gen: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


Batch = tuple[str, list[TraceRequest], Target | None]
"""(tag, requests run together, resident set to swap to first or None)."""


@dataclass
class LearnedSets:
    slots: int
    num_experts: int
    layers: list[int]
    static: LayerSets
    plan: LayerSets
    classifier: dict[str, LayerSets]
    classifier_bs8: dict[str, LayerSets]
    scores: dict[str, Any]
    classifier_extra: dict[int, dict[str, LayerSets]] = field(default_factory=dict)
    """``classifier_bs<B>`` of ``learned-sets --extra-batches``: by group size B, then consecutive group index."""


def _experts(ids: Any) -> list[int]:
    if isinstance(ids, Mapping):  # {"experts": [...], ...}
        ids = ids.get("experts", [])
    return sorted({int(e) for e in ids})


def _layer_sets(raw: Any, where: str, num_experts: int, slots: int) -> LayerSets:
    if not _is_payload(raw):
        raise SetsError(f"{where}: expected a non-empty object of layer_<i> -> experts")
    out: LayerSets = {}
    for key, ids in raw.items():
        try:
            layer, experts = int(str(key).removeprefix("layer_")), _experts(ids)
        except (TypeError, ValueError):
            raise SetsError(f"{where}: bad entry {key!r}") from None
        if len(experts) > slots:
            raise SetsError(f"{where} layer {layer}: {len(experts)} experts exceed {slots} slots")
        if experts and not (0 <= experts[0] and experts[-1] < num_experts):
            raise SetsError(f"{where} layer {layer}: expert ids outside 0..{num_experts - 1}")
        out[layer] = experts
    return out


def _is_payload(v: Any) -> bool:
    return isinstance(v, Mapping) and bool(v) and all(str(k).startswith("layer_") for k in v)


def _for_trace(block: Any, trace_name: str, where: str) -> Mapping[str, Any]:
    """``block[trace_name]`` when the file nests by trace, else ``block`` itself."""
    if not isinstance(block, Mapping):
        return {}
    inner = block.get(trace_name)
    if isinstance(inner, Mapping) and not _is_payload(inner):
        return inner
    if all(_is_payload(v) for v in block.values()):
        return block
    raise SetsError(f"{where}: no entry for trace {trace_name!r} (has {sorted(block)[:6]})")


def load_sets(path: str | Path, trace_name: str) -> LearnedSets:
    """The sets of ``path`` that apply to the trace named ``trace_name`` (its file stem)."""
    data = json.loads(Path(path).read_text())
    try:
        slots_raw, num_experts = data["slots_per_layer"], int(data["num_experts"])
        sets, per_request = data["sets"], data.get("per_request") or {}
    except (KeyError, TypeError, ValueError) as exc:
        raise SetsError(f"{path}: not a learned sets file ({exc})") from None
    # one bank size for every layer: a per-layer count becomes its maximum
    slots = int(max(slots_raw.values()) if isinstance(slots_raw, Mapping) else max(slots_raw) if isinstance(slots_raw, list) else slots_raw)
    layers_raw = data.get("layers")
    layers = list(range(int(layers_raw))) if isinstance(layers_raw, int) else [int(x) for x in layers_raw or []]

    def per(name: str) -> dict[str, LayerSets]:
        block = _for_trace(per_request.get(name), trace_name, f"per_request.{name}")
        return {str(k): _layer_sets(v, f"per_request.{name}.{k}", num_experts, slots) for k, v in block.items()}

    scores = data.get("scores") or {}
    return LearnedSets(
        slots=slots,
        num_experts=num_experts,
        layers=layers,
        static=_layer_sets(sets.get("static_topk"), "sets.static_topk", num_experts, slots),
        plan=_layer_sets(sets.get("plan"), "sets.plan", num_experts, slots),
        classifier=per("classifier"),
        classifier_bs8=per("classifier_bs8"),
        scores=dict(scores.get(trace_name) if isinstance(scores.get(trace_name), Mapping) else scores),
        classifier_extra={int(m.group(1)): per(k) for k in per_request if (m := re.fullmatch(r"classifier_bs(\d+)", k)) and k != "classifier_bs8"},
    )


def default_trace_layers(trace_layers: int, model_layers: int) -> list[int]:
    """All trace layers 1:1 when the counts match, else ``model_layers`` spread evenly over the trace's."""
    if trace_layers == model_layers:
        return list(range(model_layers))
    return [int(round(x)) for x in np.linspace(0, trace_layers - 1, model_layers)]


def model_target(sets: LayerSets, trace: RoutingTrace, trace_layers: Sequence[int]) -> Target:
    """Model layer j takes the set of the MoE layer trace axis ``trace_layers[j]`` recorded."""
    moe = [int(x) for x in trace.meta["moe_layers"]]
    missing = sorted({moe[t] for t in trace_layers if moe[t] not in sets})
    if missing:
        raise SetsError(f"the sets have no entry for MoE layer(s) {missing}")
    return {f"layer_{j}": list(sets[moe[t]]) for j, t in enumerate(trace_layers)}


def classifier_set(sets: LearnedSets, req: TraceRequest) -> LayerSets | None:
    """A request's classifier set, keyed ``<index>:<trace id>`` (or the id, or the index)."""
    for key in (f"{req.index}:{req.name}", req.name, str(req.index)):
        if key in sets.classifier:
            return sets.classifier[key]
    return None


def _requests(trace: RoutingTrace, gen: int) -> list[TraceRequest]:
    prompts = prompt_lengths(trace)
    names = [str(r.get("id", i)) for i, r in enumerate(trace.meta.get("requests", []))]
    lengths = np.diff(trace.offsets)
    out = []
    for r in range(trace.num_requests):
        decode = int(lengths[r]) - prompts[r]
        out.append(TraceRequest(r, names[r] if r < len(names) else str(r), prompts[r], decode, max(0, min(gen, decode))))
    return out


def _spread(n: int, count: int) -> list[int]:
    """``count`` indices of ``range(n)`` evenly spaced, first and last included (all of them when ``count >= n``)."""
    if count >= n:
        return list(range(n))
    if count == 1:
        return [0]
    return sorted({round(i * (n - 1) / (count - 1)) for i in range(count)})


def select_bs1(trace: RoutingTrace, count: int, gen: int, keep: Callable[[TraceRequest], bool] = lambda q: True) -> list[TraceRequest]:
    """``count`` trace requests with a prompt, at least ``gen`` decode rows and ``keep`` true, spread evenly over the trace.

    Traces list requests source by source (a corpus' domains in turn), so the first few
    would all be one kind of prompt; spreading takes every kind the trace holds.
    """
    eligible = [q for q in _requests(trace, gen) if q.prompt_len > 0 and q.decode_rows >= gen and keep(q)]
    chosen = [eligible[i] for i in _spread(len(eligible), count)]
    if len(chosen) < count:
        raise SetsError(f"only {len(chosen)} trace requests have a prompt, >= {gen} decode rows and a set; {count} asked")
    return chosen


def groups_bs8(trace: RoutingTrace, batch: int, count: int, gen: int, keep: Callable[[int], bool] = lambda g: True) -> list[list[TraceRequest]]:
    """``count`` groups g (trace requests ``batch*g .. batch*g+batch-1``) whose requests can all decode, spread evenly."""
    reqs = _requests(trace, gen)
    out = []
    for g in range(trace.num_requests // batch):
        group = reqs[g * batch : (g + 1) * batch]
        if all(q.prompt_len > 0 and q.gen >= 2 for q in group) and keep(g):
            out.append(group)
    if len(out) >= count:
        return [out[i] for i in _spread(len(out), count)]
    raise SetsError(f"only {len(out)} complete groups of {batch} decodable trace requests (with a group set); {count} asked")


def request_rows(trace: RoutingTrace, req: TraceRequest) -> tuple[np.ndarray, np.ndarray]:
    """(prefill rows, decode rows) the engine feeds for ``req``: the prompt, then each generated token fed back."""
    start, length = int(trace.offsets[req.index]), int(trace.offsets[req.index + 1] - trace.offsets[req.index])
    pos = np.minimum(np.arange(req.prompt_len + req.gen - 1), length - 1)  # the replay's clamp
    rows = start + pos
    return rows[: req.prompt_len], rows[req.prompt_len :]


def pair_hits(trace: RoutingTrace, rows: np.ndarray, trace_layers: Sequence[int], resident: Callable[[int], np.ndarray]) -> tuple[float, int]:
    """(hit pairs, routed pairs) of ``rows``; ``resident(j)`` is model layer j's [E] weight of a routed expert counting as a hit."""
    hits, pairs = 0.0, 0
    for j, t in enumerate(trace_layers):
        ids = np.asarray(trace.ids[rows, t, :], dtype=np.int64)
        hits += float(resident(j)[ids].sum())
        pairs += int(ids.size)
    return hits, pairs


def membership(target: Target, num_experts: int) -> Callable[[int], np.ndarray]:
    """A routed expert of model layer j is a hit when ``target["layer_<j>"]`` holds it."""
    masks: dict[int, np.ndarray] = {}
    for key, ids in target.items():
        m = np.zeros(num_experts)
        m[list(ids)] = 1.0
        masks[int(key.removeprefix("layer_"))] = m
    return lambda j: masks[j]


def layer_fractions(fractions: Sequence[float], num_experts: int) -> Callable[[int], np.ndarray]:
    """Stock offload: every expert of model layer j is on the GPU to the byte share ``fractions[j]``."""
    return lambda j: np.full(num_experts, float(fractions[j]))


def offline_rates(
    trace: RoutingTrace, trace_layers: Sequence[int], runs: Sequence[tuple[Sequence[TraceRequest], Callable[[int], np.ndarray]]]
) -> dict[str, Any]:
    """Hit rates over ``runs`` (requests, residency while they ran), the keys ``llm_probe.decode_hits`` returns."""
    dh = dp = ph = pp = 0.0
    decoded = 0
    for reqs, resident in runs:
        for q in reqs:
            pre, dec = request_rows(trace, q)
            h, p = pair_hits(trace, dec, trace_layers, resident)
            dh, dp, decoded = dh + h, dp + p, decoded + len(dec)
            h, p = pair_hits(trace, pre, trace_layers, resident)
            ph, pp = ph + h, pp + p
    return {
        "hit_rate_decode": dh / dp if dp else None,
        "hit_rate_prefill": ph / pp if pp else None,
        "missed_pairs_per_token": (dp - dh) / decoded if decoded else None,
        "routed_pairs_decode": int(dp),
    }


def offload_order_fractions(layers: int, experts: int, expert_bytes: int, offload_bytes: float) -> list[float]:
    """GPU byte share of each layer's experts under vLLM's first-come offload (w13 then w2, layer by layer).

    ``UVAOffloader`` offloads a parameter while the bytes offloaded so far are below the
    budget, so the last parameter may overshoot it. A fallback when the loaded
    parameters carry no offload marker. (One rule with the decode clock's, ``planning.clock_arms``.)
    """
    return list(offload_fractions(layers, experts, expert_bytes, offload_bytes))


SCORE_KEYS = ("hit_rate_decode", "decode_hit_rate", "decode", "hit_rate", "coverage", "mean")


def predicted(scores: Mapping[str, Any], key: str) -> float | None:
    """The sets file's offline score for ``key`` (a number, or the first hit-rate-like field of an object)."""
    v = scores.get(key)
    if isinstance(v, Mapping):
        v = next((v[k] for k in SCORE_KEYS if isinstance(v.get(k), (int, float))), None)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
