"""The online expert cache's device core (``server_ext/cache/online_cache.py``) on CPU tensors:
rules by hand, adversarial safety (routed and protected experts are never evicted, the cap
holds), a consistent table over thousands of random steps with the right bytes behind it,
the promotion copy (torch reference and Triton under its interpreter), and per-step parity
with the simulator's capped LFRU on recorded traces."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from reap_swap.planning import simulate as sim
from reap_swap.planning.cache_policies import LFRU
from reap_swap.planning.traces import DECODE, PREFILL, load
from reap_swap.server_ext.cache.online_cache import CacheParams, LayerCache, check_bijection
from reap_swap.server_ext.cache.promote import copy_rows_triton, promote_copy_reference, promote_copy_triton

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO / "benchmarks" / "traces"


class Layer:
    """A bank-shaped layer: rows [0, S) slots, [H, H + E) host rows; expert e's bytes are distinct."""

    def __init__(self, e: int, s: int, pad: int = 1, cap: int = 2, hysteresis: float | None = None, decay: float = 0.9,
                 start: tuple[int, ...] = (), protected: tuple[int, ...] = ()):
        self.e, self.s, self.h = e, s, s + pad
        gen = torch.Generator().manual_seed(e * 100 + s)
        self.orig = {"w13": torch.randn(e, 6, 4, generator=gen), "w2": torch.randint(0, 255, (e, 5), generator=gen, dtype=torch.uint8)}
        self.rows = []
        for t in self.orig.values():
            bank = torch.zeros((self.h + e, *t.shape[1:]), dtype=t.dtype)
            bank[self.h :] = t
            self.rows.append(bank)
        self.phys_map = self.h + torch.arange(e, dtype=torch.int32)
        owners = [-1] * s
        for slot, x in enumerate(start):
            owners[slot] = x
            self.phys_map[x] = slot
            for bank in self.rows:
                bank[slot] = bank[self.h + x]
        self.cache = LayerCache(e, s, self.h, self.phys_map, CacheParams(cap, decay, hysteresis))
        self.cache.install(owners, prior=(), protected=protected)

    def resident(self) -> set[int]:
        return {int(x) for x in self.cache.expert_in_slot.tolist() if x >= 0}

    def step(self, ids: list[list[int]] | torch.Tensor, valid_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hits as routed per pair, remapped ids, trigger rows) of one step."""
        ids_t = torch.as_tensor(ids, dtype=torch.int32)
        hits = self.phys_map[ids_t.long()] < self.h
        vr = None if valid_rows is None else torch.tensor([valid_rows], dtype=torch.int32)
        trig = torch.full((self.cache.cap,), 7, dtype=torch.int32)
        out = self.cache.step(ids_t, self.rows, vr, trig)
        return hits, out, trig

    def check(self) -> None:
        owners = self.cache.expert_in_slot.tolist()
        assert check_bijection(owners, self.phys_map.tolist(), self.h) == []
        for slot, x in enumerate(owners):
            if x >= 0:
                for bank, t in zip(self.rows, self.orig.values()):
                    assert torch.equal(bank[slot], t[x]), f"slot {slot} does not hold expert {x}'s bytes"

    def gathered(self, out: torch.Tensor, ids: torch.Tensor) -> None:
        """What the fused kernel reads through the remapped ids is each routed expert's bytes."""
        for bank, t in zip(self.rows, self.orig.values()):
            assert torch.equal(bank[out.long()], t[ids.long()])


def test_rules_by_hand() -> None:
    lay = Layer(6, 2, cap=1)
    hits, out, trig = lay.step([[3, 4]])
    assert hits.tolist() == [[False, False]] and lay.resident() == {3}, "cap 1; the higher id loses the tie"
    assert out.tolist() == [[0, lay.h + 4]] and trig.tolist() == [0], "promoted ids are remapped in the same step"
    lay.step([[4, 5]])  # fills the second free slot with 4 (score 1.9 vs 1.0)
    assert lay.resident() == {3, 4}
    hits, _, trig = lay.step([[4, 5]])  # 5 (1.9) replaces 3 (0.81); 4 is routed, so never a victim
    assert hits.tolist() == [[True, False]] and lay.resident() == {4, 5} and trig.tolist() == [0]
    hits, _, trig = lay.step([[0]])  # 0 (1.0) replaces the colder of 4 (2.44) and 5 (1.71): 5
    assert lay.resident() == {0, 4} and trig.tolist() == [0]
    lay.check()
    c = lay.cache.counters()
    assert c == {"promotions": 4, "evictions": 2, "steps": 4}


def test_hysteresis_and_protection() -> None:
    lay = Layer(4, 1, cap=1, hysteresis=1.0, start=(0,))
    lay.cache.score[0] = 0.5
    lay.step([[1]])  # 1.0 > 0.45 + 1.0 is false: no promotion
    assert lay.resident() == {0}
    lay.step([[1]])  # 1.9 > 0.405 + 1.0
    assert lay.resident() == {1}
    prot = Layer(4, 1, cap=1, start=(0,), protected=(0,))
    for _ in range(5):
        prot.step([[1], [2]])
    assert prot.resident() == {0}, "a protected resident is never a victim"


def test_padding_rows_are_ignored() -> None:
    lay = Layer(8, 2, cap=2)
    _, out, trig = lay.step([[1, 2], [6, 7], [6, 7]], valid_rows=1)
    assert lay.resident() == {1, 2} and lay.cache.score[6] == 0
    assert trig.tolist() == [0, 0]
    lay.gathered(out, torch.tensor([[1, 2], [6, 7], [6, 7]]))


def _adversarial_ids(rng: np.random.Generator, lay: Layer, t: int, k: int) -> list[list[int]]:
    """Rows that route the residents (so every eviction would hit a routed expert) mixed with random ones."""
    res = sorted(lay.resident())
    rows = []
    for _ in range(t):
        pick = list(rng.choice(res, size=min(k // 2, len(res)), replace=False)) if res and rng.random() < 0.7 else []
        rest = [x for x in rng.permutation(lay.e) if x not in pick][: k - len(pick)]
        rows.append([int(x) for x in pick + rest])
    return rows


@pytest.mark.parametrize("cap,hyst", [(1, None), (3, None), (2, 0.5)])
def test_random_steps_keep_a_bijection_and_never_evict_routed_or_protected(cap: int, hyst: float | None) -> None:
    rng = np.random.default_rng(cap)
    e, s, k = 16, 5, 4
    protected = (2,)
    lay = Layer(e, s, pad=3, cap=cap, hysteresis=hyst, start=(2, 9), protected=protected)
    for step in range(2000):
        t = int(rng.integers(1, 4))
        ids = _adversarial_ids(rng, lay, t, k)
        valid = int(rng.integers(1, t + 1))
        before_map = lay.phys_map.clone()
        before = lay.resident()
        hits, out, trig = lay.step(ids, valid_rows=valid)
        after = lay.resident()
        routed = {x for row in ids[:valid] for x in row}
        evicted, promoted = before - after, after - before
        assert not evicted & routed, f"step {step}: evicted {evicted & routed}, which this step routes"
        assert not evicted & set(protected)
        assert len(promoted) <= cap and promoted <= routed, "at most cap promotions, only of experts routed by real rows"
        assert torch.equal(hits, before_map[torch.tensor(ids).long()] < lay.h), "hits are as routed, before promotion"
        for x in before & after:
            assert lay.phys_map[x] == before_map[x], "a kept resident never moves"
        assert int((trig >= 0).sum()) == len(promoted) and all(0 <= r < valid for r in trig.tolist() if r >= 0)
        lay.gathered(out, torch.tensor(ids))  # padding rows too: an expert only they route may go, read from its host row
        if step % 97 == 0:
            lay.check()
    lay.check()
    assert 2 in lay.resident()
    c = lay.cache.counters()
    assert c["promotions"] > 100 and c["evictions"] > 50


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_promote_copy_bytes_exact(monkeypatch: pytest.MonkeyPatch, impl: str, dtype: torch.dtype) -> None:
    if impl == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    h, e = 5, 8
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 255, (h + e, 3, 7), generator=gen).to(dtype), torch.randint(0, 255, (h + e, 2, 4099), generator=gen).to(dtype)]
    before = [r.clone() for r in rows]
    valid = torch.tensor([True, False, True, False])
    cand = torch.tensor([6, 1, 0, 7])
    slot = torch.tensor([3, 2, 0, 9])  # an invalid pair's slot may be anything
    if impl == "triton":
        promote_copy_triton(rows, h, valid, cand, slot, block=1024)
    else:
        promote_copy_reference(rows, h, valid, cand, slot)
    for r, b in zip(rows, before):
        want = b.clone()
        want[3] = b[h + 6]
        want[0] = b[h + 0]
        assert torch.equal(r.view(torch.uint8) if dtype != torch.uint8 else r, want.view(torch.uint8) if dtype != torch.uint8 else want)


def test_step_with_triton_copy_equals_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rng = np.random.default_rng(5)
    a, b = Layer(12, 4, cap=2), Layer(12, 4, cap=2)
    for _ in range(30):
        ids = [[int(x) for x in rng.permutation(12)[:3]] for _ in range(2)]
        a.step(ids)
        ids_t = torch.tensor(ids, dtype=torch.int32)
        b.cache.step(ids_t, b.rows, None, None, copy=lambda *args: copy_rows_triton(*args, block=16))
    for ra, rb in zip(a.rows, b.rows):
        assert torch.equal(ra, rb)
    b.check()


# ------------------------------------------------------------------ parity with the simulator


def _layer_steps(reqs: list, layer: int) -> list[tuple[int, np.ndarray]]:
    """(phase, ids [T, K]) per step as ``simulate`` cuts them: a request's prefill is one step."""
    out = []
    for r in reqs:
        ids = r.ids[:, layer].astype(np.int64)
        pre = r.phase == PREFILL
        if pre.any():
            out.append((PREFILL, ids[pre]))
        for t in np.flatnonzero(r.phase == DECODE):
            out.append((DECODE, ids[t : t + 1]))
    return out


def _parity(path: Path, layers: list[int], requests: int | None, cap: int, hysteresis: float | None, slots_fraction: float = 0.3) -> tuple[int, int, int]:
    """Replays trace layers through the device core and the simulator's capped LFRU; (steps, promotions, evictions)."""
    trace = load(path)
    calib, scored, _ = sim.split_requests(trace)
    scored = scored[:requests] if requests else scored
    e = trace.num_experts
    s = max(1, int(round(slots_fraction * e)))
    checked = promotions = evictions = 0
    for layer in layers:
        mass = np.zeros(e)
        for r in calib:
            mass += np.bincount(r.ids[:, layer].astype(np.int64).ravel(), weights=r.weights[:, layer].ravel(), minlength=e)
        static = sim.top_by_mass(mass, s)
        py = LFRU(s, e, static, cap=cap, hysteresis=hysteresis, dtype=np.float32)
        dev = LayerCache(e, s, s, torch.arange(s, s + e, dtype=torch.int32), CacheParams(cap, 0.9, hysteresis))
        owners = [int(x) for x in static[:s]]
        dev.phys_map[torch.tensor(owners)] = torch.arange(len(owners), dtype=torch.int32)
        dev.install(owners)
        noop = lambda *args: None  # noqa: E731 - bytes are checked elsewhere; this is the policy
        for n, (_, ids) in enumerate(_layer_steps(scored, layer)):
            routed = np.unique(ids)
            before = dev.phys_map.clone()
            prom0, ev0 = int(dev.promotions), int(dev.evictions)
            dev.step(torch.from_numpy(ids.astype(np.int32)), [], None, None, copy=noop)
            res = py.access(routed, np.ones(routed.size))
            dev_hits = (before[torch.from_numpy(routed)] < s).numpy()
            assert np.array_equal(dev_hits, res.hits), f"layer {layer} step {n}: hits differ"
            assert int(dev.promotions) - prom0 == res.promoted and int(dev.evictions) - ev0 == res.evicted, f"layer {layer} step {n}"
            assert np.array_equal((dev.phys_map < s).numpy(), py.resident), f"layer {layer} step {n}: resident sets differ"
            checked += 1
        np.testing.assert_array_equal(dev.score.numpy(), py.count)
        promotions += int(dev.promotions)
        evictions += int(dev.evictions)
    return checked, promotions, evictions


def test_parity_small_moe_trace() -> None:
    path = TRACES / "small_moe_realistic_t0.8.npz"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    steps, promoted, evicted = _parity(path, list(range(6)), None, cap=2, hysteresis=None)
    assert steps > 9000 and promoted > 1000 and evicted > 1000
    steps, promoted, _ = _parity(path, [1], 12, cap=1, hysteresis=0.5)
    assert steps > 300 and promoted > 30


def test_parity_learned128_slice() -> None:
    path = TRACES / "learned128_t0.8.npz"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    steps, promoted, evicted = _parity(path, [0, 9, 17, 23], 12, cap=4, hysteresis=None)
    assert steps > 2000 and promoted > 1000 and evicted > 1000


def test_uncapped_lfru_is_the_capped_rule_with_a_large_cap() -> None:
    """Equal whenever every miss finds a victim (the order of the misses then does not matter):
    here at most 2 routed experts against 5 slots."""
    rng = np.random.default_rng(11)
    a, b = LFRU(5, 16, np.arange(3)), LFRU(5, 16, np.arange(3), cap=16)
    for _ in range(500):
        routed = rng.choice(16, size=int(rng.integers(1, 3)), replace=False)
        ra, rb = a.access(routed, np.ones(routed.size)), b.access(routed, np.ones(routed.size))
        assert np.array_equal(ra.hits, rb.hits) and ra.promoted == rb.promoted
        assert np.array_equal(a.resident, b.resident)


def test_simulate_scores_lfru_cap_with_the_server_defaults() -> None:
    from reap_swap.server_ext import config

    assert (sim.DEFAULT_CAP, sim.DEFAULT_DECAY) == (config.DEFAULT_CACHE_CAP, config.DEFAULT_CACHE_DECAY)
    path = TRACES / "small_moe_realistic_t0.8.npz"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    res = sim.simulate(load(path), 0.3, ("lfru", "lfru_cap"), cap=1)
    assert res["lfru_cap"] == {"cap": 1, "hysteresis": None, "decay": sim.DEFAULT_DECAY}
    capped, free = res["policies"]["lfru_cap"], res["policies"]["lfru"]
    assert 0 < capped["promotions_per_token"] < free["promotions_per_token"]


def test_fused_triton_step_equals_the_torch_core() -> None:
    """The one-program CUDA step (interpreted) keeps every tensor of the state bit-identical to the torch core.
    In a subprocess: Triton's reductions run interpreted only when TRITON_INTERPRET is set before it is imported."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.fused_policy_check"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fused == core" in proc.stdout
