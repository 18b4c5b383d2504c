"""Routing locality report: coverage, reuse and distinct-expert counts on hand-checked synthetic traces."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from reap_swap.planning.locality import expert_masks, experts_to_cover, locality, main as locality_main, markdown
from reap_swap.planning.traces import DECODE, PREFILL, RequestRoute, build, load

ROOT = Path(__file__).resolve().parents[1]
SMALL = ROOT / "benchmarks" / "traces" / "small_moe_realistic_t0.8.npz"


def _req(rid: str, ids: list, weights: list | None = None, prefill: int = 0, info: dict | None = None, layers: int = 1) -> RequestRoute:
    """One request whose every layer routes the same rows: ids [T][K] (the first ``prefill`` rows are prompt)."""
    a = np.asarray(ids, dtype=np.int64)
    w = np.full(a.shape, 1.0 / a.shape[1]) if weights is None else np.asarray(weights, dtype=np.float64)
    phase = np.array([PREFILL] * prefill + [DECODE] * (a.shape[0] - prefill), dtype=np.uint8)
    return RequestRoute(rid, phase, np.repeat(a[:, None, :], layers, 1), np.repeat(w[:, None, :], layers, 1), info or {})


def _trace(reqs: list[RequestRoute], experts: int = 8):
    layers, k = reqs[0].ids.shape[1:]
    return build({"model": {"path": "synthetic"}, "moe_layers": list(range(layers)), "num_experts": experts, "top_k": k}, reqs)


def test_experts_to_cover_and_masks() -> None:
    assert experts_to_cover(np.array([[5.0, 3.0, 1.5, 0.5]]), 90) == [3]  # 0.5 / 0.8 / 0.95
    assert experts_to_cover(np.array([[5.0, 3.0, 1.5, 0.5]]), 80) == [2]  # exact boundary counts as reached
    assert experts_to_cover(np.zeros((1, 4)), 50) == [None]
    m = expert_masks(np.array([[[0, 63], [64, 127]]]), 128)
    assert m.shape == (1, 2, 2) and int(m[0, 0, 0]) == 1 | (1 << 63) and int(m[0, 0, 1]) == 0 and int(m[0, 1, 1]) == 1 | (1 << 63)


def test_same_experts_every_token_reuse_one() -> None:
    rep = locality(_trace([_req("r", [[2, 5]] * 7, prefill=3, layers=2)]))
    assert rep["reuse_next_token"] == [1.0, 1.0] and rep["reuse_within_8"] == [1.0, 1.0]
    assert rep["reuse"]["next_token"]["prefill"] == [1.0, 1.0] and rep["reuse"]["within_8"]["prefill"] == [1.0, 1.0]
    assert rep["reuse"]["tokens_counted"] == {"decode": 4, "prefill": 2}  # the first prompt token has no predecessor
    assert rep["distinct_per_request"]["decode"]["mean"] == [2.0, 2.0]
    assert rep["experts_for_90pct_mass"] == [2, 2]


def test_disjoint_sets_reuse_zero() -> None:
    rep = locality(_trace([_req("r", [[2 * t, 2 * t + 1] for t in range(10)])], experts=32))
    assert rep["reuse_next_token"] == [0.0] and rep["reuse_within_8"] == [0.0]
    assert rep["distinct_per_request"]["decode"]["mean"] == [20.0]


@pytest.mark.parametrize("period,expected", [(4, 6 / 9), (8, 2 / 9), (9, 0.0)])
def test_within_8_window_edge(period: int, expected: float) -> None:
    """Sets repeat every `period` tokens: token t reuses t - period only when that is at most 8 back."""
    ids = [[2 * (t % period), 2 * (t % period) + 1] for t in range(10)]
    rep = locality(_trace([_req("r", ids)], experts=64))
    assert rep["reuse_next_token"] == [0.0]
    assert rep["reuse_within_8"][0] == pytest.approx(expected)


def test_partial_overlap_and_request_boundary() -> None:
    """Half the experts carry over; nothing carries over from the previous request."""
    a = _req("a", [[0, 1], [1, 2], [2, 3]])
    b = _req("b", [[2, 3], [4, 5]])  # its first token equals a's last: must not count
    rep = locality(_trace([a, b]))
    assert rep["reuse"]["tokens_counted"]["decode"] == 3
    assert rep["reuse_next_token"][0] == pytest.approx((0.5 + 0.5 + 0.0) / 3)
    assert rep["reuse_within_8"][0] == pytest.approx((0.5 + 0.5 + 0.0) / 3)


def _mass_trace(layers: int = 2):
    # request "a" decode: e0 2.25, e1 .75, e2 .75, e3 .25 of 4 (mass); pair counts 3, 2, 2, 1 of 8
    a = _req("a", [[6, 7], [6, 7], [0, 1], [0, 2], [1, 2], [3, 0]],
             [[0.5, 0.5], [0.5, 0.5], [0.75, 0.25], [0.75, 0.25], [0.5, 0.5], [0.25, 0.75]],
             prefill=2, info={"tags": ["dom-a", "x"], "source": "s"}, layers=layers)
    b = _req("b", [[4, 5], [4, 5]], info={"source": "dom-b"}, layers=layers)
    return _trace([a, b])


def test_mass_and_count_coverage_per_domain_and_phase() -> None:
    rep = locality(_mass_trace())
    dom = rep["coverage"]["by_domain"]
    assert set(dom) == {"dom-a", "dom-b"} and dom["dom-a"]["requests"] == 1
    a_dec = dom["dom-a"]["decode"]
    assert [a_dec["mass"][p][0] for p in ("50", "80", "90")] == [1, 3, 3]  # .5625 / .9375
    assert [a_dec["count"][p][0] for p in ("50", "80", "90")] == [2, 3, 4]  # .625 / .875 / 1.0
    assert [dom["dom-a"]["prefill"]["mass"][p][0] for p in ("50", "80", "90")] == [1, 2, 2]
    assert [dom["dom-b"]["decode"]["mass"][p][0] for p in ("50", "80", "90")] == [1, 2, 2]
    assert dom["dom-b"]["prefill"]["tokens"] == 0 and dom["dom-b"]["prefill"]["mass"]["90"] == [None, None]
    # workload decode: 2.25, 1, 1, .75, .75, .25 of 6 -> cum .375 .542 .708 .833 .958
    wl = rep["coverage"]["workload"]
    assert [wl["decode"]["mass"][p][0] for p in ("50", "80", "90")] == [2, 4, 5]
    assert rep["experts_for_90pct_mass"] == [5, 5]
    assert wl["all"]["tokens"] == 8 and wl["decode"]["tokens"] == 6
    dist = rep["distinct_per_request"]
    assert dist["decode"]["mean"][0] == 3.0 and dist["decode"]["p90"][0] == pytest.approx(3.8)  # requests: 4 and 2
    assert dist["request"]["mean"][0] == 4.0 and dist["request"]["median"][0] == 4.0  # 6 and 2


def test_early_late_and_published_block() -> None:
    same = np.array([[0, 1]] * 6)
    moving = np.array([[2 * t, 2 * t + 1] for t in range(6)])
    ids = np.stack([same, same, moving], axis=1)  # layers 0, 1: constant; layer 2: disjoint
    req = RequestRoute("r", np.full(6, DECODE, np.uint8), ids, np.full(ids.shape, 0.5), {"tags": ["py"]})
    rep = locality(_trace([req], experts=128))
    el = rep["early_late"]
    assert el["layers_per_third"] == 1
    assert el["reuse_next_token"] == {"early": 1.0, "late": 0.0, "all": pytest.approx(2 / 3)}
    assert rep["published"]["experts_for_90pct_mass_diverse"] == 65 and rep["published"]["reuse_within_8"] == 0.8
    assert not any("scaled by E/128" in s for s in rep["differences"])  # E == 128: no scaling
    assert any("published diverse: 65" in s for s in rep["differences"])
    assert "| **first 1** |" in markdown(rep)


def _brute_reuse(trace, layer: int, phase: int, window: int) -> float:
    vals = []
    for req in trace.requests():
        for t in range(1, req.num_tokens):
            if req.phase[t] != phase:
                continue
            prev = set(req.ids[max(0, t - window):t, layer].ravel().tolist())
            vals.append(len(set(req.ids[t, layer].tolist()) & prev) / trace.top_k)
    return float(np.mean(vals))


def test_small_moe_trace_sanity_and_brute_force() -> None:
    trace = load(SMALL)
    rep = locality(trace, str(SMALL))
    e, k, layers = rep["num_experts"], rep["top_k"], rep["num_layers"]
    assert (e, k, layers) == (16, 4, 6)
    for key in ("experts_for_90pct_mass", "reuse_next_token", "reuse_within_8"):
        assert len(rep[key]) == layers
    assert all(k <= n <= e for n in rep["experts_for_90pct_mass"])
    for p in ("all", "decode", "prefill"):
        cov = rep["coverage"]["workload"][p]["mass"]
        assert all(a <= b <= c for a, b, c in zip(cov["50"], cov["80"], cov["90"]))
    assert all(0.25 < r < 0.9 for r in rep["reuse_next_token"])  # above random (K/E = 0.25)
    assert all(a <= b <= 1 for a, b in zip(rep["reuse_next_token"], rep["reuse_within_8"]))
    assert all(0 < h <= 1 for h in rep["coverage"]["workload"]["all"]["mass_entropy"])
    assert all(k <= d <= e for d in rep["distinct_per_request"]["decode"]["p90"])
    assert any("16/128" in s for s in rep["differences"])
    for layer in (0, layers - 1):
        assert rep["reuse_next_token"][layer] == pytest.approx(_brute_reuse(trace, layer, DECODE, 1))
        assert rep["reuse_within_8"][layer] == pytest.approx(_brute_reuse(trace, layer, DECODE, 8))
        assert rep["reuse"]["within_8"]["prefill"][layer] == pytest.approx(_brute_reuse(trace, layer, PREFILL, 8))


def test_cli_writes_json_and_markdown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, md = tmp_path / "loc.json", tmp_path / "loc.md"
    assert locality_main([str(SMALL), "--out", str(out), "--md", str(md)]) == 0
    rep = json.loads(out.read_text())
    for key in ("trace", "num_experts", "top_k", "layers", "experts_for_90pct_mass", "reuse_next_token", "reuse_within_8", "published", "differences"):
        assert key in rep
    assert "| layer |" in md.read_text() and "| layer |" in capsys.readouterr().out
    assert locality_main([str(SMALL), str(SMALL), "--out", str(out)]) == 0
    assert len(json.loads(out.read_text())["reports"]) == 2
    assert locality_main([str(tmp_path / "missing.npz"), "--out", str(out)]) == 2
