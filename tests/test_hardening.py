"""Issue 11 (hardening), the parts that need no vLLM server (pure logic, real files).

The real-server and real-proxy halves are in ``test_hardening_server.py``; the process manager
in ``test_procs.py``; crash-safe observation in ``test_observe_crash.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from reap_swap.plan import layer_index, parse_plan
from reap_swap.server_ext.control.active_set import PayloadError, parse_swap_request
from reap_swap.server_ext.control.auth import ControlAuth
from reap_swap.server_ext.config import from_env
from reap_swap.server_ext.control.control_plane import ControlPlane
from reap_swap.server_ext.control.errors import HTTPError
from reap_swap.server_ext.control.ratelimit import TokenBucket
from reap_swap.server_ext.step.request_ids import engine_id_matches_exact
from reap_swap.server_ext.bank.slots import SlotTable
from tests.conftest import tiny_plan_dict

PLAN_DICT = tiny_plan_dict()
PLAN = parse_plan(PLAN_DICT)
CORE = {i: (0, 1, 2, 3) for i in range(4)}
EXPERT_BYTES = 98304


# -- 1. control plane closed by default --------------------------------------------------------

def test_control_auth_refuses_browsers_and_checks_credentials() -> None:
    open_auth = ControlAuth.create(None)
    open_auth.check({"host": "127.0.0.1:8000"})
    for headers, code in (
        ({"host": "attacker.example:8000"}, "non_loopback_host"),  # DNS rebinding onto a loopback server
        ({"host": "127.0.0.1:8000", "origin": "https://attacker.example"}, "cross_origin_refused"),
        ({"host": "127.0.0.1:8000", "sec-fetch-site": "cross-site"}, "cross_origin_refused"),
    ):
        with pytest.raises(HTTPError) as info:
            open_auth.check(headers)
        assert info.value.code == code and info.value.status == 403
    keyed = ControlAuth.create(None, ["sk-1", "sk-2"])
    keyed.check({"authorization": "Bearer sk-2", "host": "anything"})
    for auth in ("", "Bearer sk-3", "Basic sk-1"):
        with pytest.raises(HTTPError) as info:
            keyed.check({"authorization": auth})
        assert info.value.status == 401
    token = ControlAuth.create("ctl", ["sk-1"])
    token.check({"x-reap-control-token": "ctl"})
    with pytest.raises(HTTPError) as info:
        token.check({"authorization": "Bearer sk-1"})  # an API key is not the admin credential
    assert info.value.code == "missing_control_token"


def _serve_args(**kw: Any) -> argparse.Namespace:
    from reap_swap.server_ext.launcher import build_parser

    args, _ = build_parser().parse_known_args(["--model", "m", "--resident-experts-per-layer", "4"])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_serve_binds_loopback_and_generates_a_private_token_for_network_binds(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch,
                                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from reap_swap.server_ext.launcher import control_token, vllm_argv

    monkeypatch.delenv("REAP_CONTROL_TOKEN", raising=False)
    args = _serve_args()
    assert args.host == "127.0.0.1" and vllm_argv(args, [])[2:4] == ["--host", "127.0.0.1"]
    assert control_token(args) is None  # loopback: no token needed
    path = tmp_path / "token"
    token = control_token(_serve_args(host="0.0.0.0", control_token_file=path))
    assert token and len(token) >= 32 and path.read_text().strip() == token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert str(path) in capsys.readouterr().err
    assert control_token(_serve_args(host="0.0.0.0", control_token_file=path)) == token  # reused, not regenerated
    generated = control_token(_serve_args(host=""))  # every interface, no file given: a 0700 folder of its own
    assert generated and len(generated) >= 32


# -- 2. no quadratic work on untrusted input ---------------------------------------------------

HOSTILE_BYTES = from_env({}).max_body_bytes


def _fit(make: Any) -> bytes:
    """The largest ``make(n)`` that still fits the server's body limit."""
    lo, hi = 1, HOSTILE_BYTES
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(make(mid)) <= HOSTILE_BYTES else (lo, mid - 1)
    body = make(lo)
    assert HOSTILE_BYTES * 0.95 < len(body) <= HOSTILE_BYTES
    return body


def _swap_body(active: Any) -> bytes:
    return json.dumps({"request_id": "x", "phase": "prefill", "active_set": active}).encode()


HOSTILE = {
    "duplicate ids": lambda n: _swap_body({"layer_0": [5] * n}),
    "distinct ids": lambda n: _swap_body({"layer_0": list(range(n))}),
    "many layers": lambda n: _swap_body({f"layer_{i}": [0] for i in range(n)}),
    "many fields": lambda n: json.dumps({f"f{i}": 1 for i in range(n)}).encode(),
    "huge layer key": lambda n: _swap_body({"layer_" + "9" * n: [0]}),
    "huge request id": lambda n: json.dumps({"request_id": "x" * n, "active_set": {}}).encode(),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_maximum_size_hostile_payload_is_refused_in_linear_time(name: str) -> None:
    body = _fit(HOSTILE[name])
    best = 1e9
    for _ in range(3):
        t = time.perf_counter()
        with pytest.raises(PayloadError):
            parse_swap_request(json.loads(body), PLAN, CORE, PLAN.capacity())
        best = min(best, time.perf_counter() - t)
    assert best < 0.05, f"{name}: {best * 1e3:.1f} ms"


@pytest.mark.parametrize("key", ["layer_²", "²", "layer_٣", "layer_" + "1" * 5000, "layer_-1", "layer_ 1"])
def test_exotic_layer_keys_are_unknown_layers_not_crashes(key: str) -> None:
    assert layer_index(key) is None
    with pytest.raises(PayloadError) as info:
        parse_swap_request({"request_id": "r", "phase": "prefill", "active_set": {key: [0, 1, 2, 3]}}, PLAN, CORE, PLAN.capacity())
    assert info.value.code == "unknown_layer"


# -- 3. swap failure repair (several ranks: a fault we cannot cause on one CPU) ------------------

class FakeRanks:
    """Ranks holding real slot tables; ``collective_rpc`` semantics: every rank runs, the first failure raises."""

    def __init__(self, ranks: int = 2):
        self.tables = [{i: SlotTable(16, 8) for i in range(4)} for _ in range(ranks)]
        for tables in self.tables:
            for t in tables.values():
                p = t.plan((0, 1, 2, 3))
                t.apply_evictions(p)
                t.apply_loads(p)
        self.fail_swap_on: dict[int, int] = {}  # rank -> layers applied before failing
        self.fail_reads = 0
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def _resident(self, rank: int) -> dict[str, list[int]]:
        return {f"layer_{i}": list(t.resident()) for i, t in self.tables[rank].items()}

    def _swap(self, rank: int, target: dict[str, list[int]]) -> dict[str, Any]:
        for n, key in enumerate(sorted(target, key=lambda k: int(k.removeprefix("layer_")))):
            if self.fail_swap_on.get(rank) == n:
                del self.fail_swap_on[rank]
                raise RuntimeError(f"rank {rank} failed mid-swap")
            t = self.tables[rank][int(key.removeprefix("layer_"))]
            p = t.plan(target[key])
            t.apply_evictions(p)
            t.apply_loads(p)
        return {"bytes_copied": 0, "experts_loaded": 0, "experts_evicted": 0, "copy_ms": 0.0, "publish_ms": 0.0,
                "resident": self._resident(rank)}

    async def __call__(self, method: str, *args: Any) -> list[Any]:
        self.calls.append((method, args))
        if method == "reap_resident_sets" and self.fail_reads:
            self.fail_reads -= 1
            raise RuntimeError("worker busy")
        results, first_error = [], None
        for rank in range(len(self.tables)):
            try:
                if method == "reap_install":
                    results.append({"layers": [0, 1, 2, 3], "num_experts": 16, "slots": {f"layer_{i}": 8 for i in range(4)},
                                    "expert_bytes": EXPERT_BYTES, "resident": self._resident(rank)})
                elif method == "reap_swap":
                    results.append(self._swap(rank, *args))
                elif method == "reap_resident_sets":
                    results.append({"rank": rank, "resident": self._resident(rank)})
                else:
                    results.append(None)
            except Exception as exc:  # noqa: BLE001
                first_error = first_error or exc
        if first_error:
            raise first_error
        return results


def _plane(tmp_path: Path, ranks: FakeRanks, **env: str) -> ControlPlane:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(PLAN_DICT))
    plane = ControlPlane(from_env({"REAP_PLAN_FILE": str(path), **env}), ranks)
    asyncio.run(plane.start())
    return plane


def _swap(plane: ControlPlane, active: dict[str, list[int]], rid: str = "r", phase: str = "prefill") -> dict[str, Any]:
    return asyncio.run(plane.swap({"request_id": rid, "phase": phase, "active_set": active}))


def test_rank_failing_mid_swap_is_repaired_from_every_ranks_real_state(tmp_path: Path) -> None:
    ranks = FakeRanks(2)
    plane = _plane(tmp_path, ranks)
    ranks.fail_swap_on[1] = 1  # rank 0 commits everything, rank 1 fails after layer 0
    with pytest.raises(HTTPError) as info:
        _swap(plane, {"layer_0": [0, 1, 2, 3, 4], "layer_2": [0, 1, 2, 3, 9]})
    assert info.value.status == 503 and info.value.code == "swap_failed"
    sent = [a[0] for m, a in ranks.calls if m == "reap_swap"]
    assert all(set(p) == {"layer_0", "layer_1", "layer_2", "layer_3"} for p in sent)  # every layer, every time
    assert ranks._resident(0) == ranks._resident(1)  # repaired to one set
    assert plane.inconsistent is None and plane.resident[2] == (0, 1, 2, 3, 9) == tuple(ranks._resident(1)["layer_2"])
    assert _swap(plane, {"layer_1": [0, 1, 2, 3, 5]})["status"] == "ok"


def test_resident_routes_answer_503_until_ranks_can_be_read_again(tmp_path: Path) -> None:
    ranks = FakeRanks(2)
    plane = _plane(tmp_path, ranks)
    ranks.fail_swap_on[0] = 1
    ranks.fail_reads = 2  # the re-read after the failure and the one at the next attempt fail too
    with pytest.raises(HTTPError):
        _swap(plane, {"layer_0": [0, 1, 2, 3, 4]})
    assert plane.inconsistent is not None and plane.status()["resident"]["consistent"] is False
    with pytest.raises(HTTPError) as info:
        _swap(plane, {"layer_1": [0, 1, 2, 3, 5]})
    assert info.value.status == 503 and info.value.code == "resident_state_inconsistent"
    assert _swap(plane, {"layer_1": [0, 1, 2, 3, 5]})["status"] == "ok"  # reads work again: resynced, then swapped
    assert plane.resident[0] == tuple(ranks._resident(0)["layer_0"]) == tuple(ranks._resident(1)["layer_0"])


# -- 6. bounded records, budgets and rates ---------------------------------------------------------

def test_rejected_payloads_create_no_records_and_cannot_evict_real_ones(tmp_path: Path) -> None:
    plane = _plane(tmp_path, FakeRanks(1))
    _swap(plane, {"layer_0": [0, 1, 2, 3, 4]}, rid="real")
    for i in range(5000):
        with pytest.raises(HTTPError):
            _swap(plane, {"layer_0": [99]}, rid=f"junk-{i}")
    assert list(plane.records) == ["real"] and plane.forensics("real")["last_swap"]["request_id"] == "real"
    assert len(plane.rejections) <= 1024 and plane.counters.rejected == 5000


def test_no_refresh_budget_spent_on_noops(tmp_path: Path) -> None:
    plane = _plane(tmp_path, FakeRanks(1))
    for _ in range(3):
        assert _swap(plane, {"layer_0": [0, 1, 2, 3]}, rid="d", phase="decode_refresh")["refreshes_used"] == 0
    assert _swap(plane, {"layer_0": [0, 1, 2, 3, 4]}, rid="d", phase="decode_refresh")["refreshes_used"] == 1


def test_forensics_are_bounded_by_bytes_and_keep_refresh_budgets(tmp_path: Path) -> None:
    """Issue 31, point 7: swap forensics were bounded by count (4096 ids x 8 results of ~44 KB each at
    48 layers x 128 experts: ~1.4 GB); now by their JSON bytes, oldest first, and evicting a request's
    forensics never hands it a fresh refresh budget."""
    bound = 48 << 10
    plane = _plane(tmp_path, FakeRanks(1), REAP_FORENSICS_MAX_BYTES=str(bound))
    assert _swap(plane, {"layer_0": [0, 1, 2, 3, 9]}, rid="d", phase="decode_refresh")["refreshes_used"] == 1
    sizes = [len(json.dumps(_swap(plane, {"layer_0": [0, 1, 2, 3, 4 + i % 4]}, rid=f"req-{i}"))) for i in range(400)]
    held = plane.status()["limits"]["records"]
    assert held["max_bytes"] == bound and 0 < held["bytes"] <= bound
    assert held["held"] < 400 and held["held"] >= bound // (max(sizes) + 64) - 1, held
    assert held["bytes"] == sum(len(b) for swaps in plane.records.values() for b in swaps)
    assert plane.forensics("req-399")["last_swap"]["request_id"] == "req-399"
    assert plane.forensics("req-0")["last_swap"] is None  # its forensics went first
    gone = plane.forensics("d")
    assert gone["last_swap"] is None and gone["refreshes_used"] == 1  # the budget is remembered apart
    with pytest.raises(HTTPError) as info:
        _swap(plane, {"layer_0": [0, 1, 2, 3, 10]}, rid="d", phase="decode_refresh")
    assert info.value.status == 409 and info.value.code == "refresh_budget_exhausted"
    for _ in range(8):  # one id's repeated swaps: its last 8 results only
        _swap(plane, {"layer_0": [0, 1, 2, 3, 11]}, rid="again")
        _swap(plane, {"layer_0": [0, 1, 2, 3, 12]}, rid="again")
    assert plane.forensics("again")["swaps"] == 8


def test_forensics_bound_is_validated(tmp_path: Path) -> None:
    from reap_swap.server_ext.config import ResidencyConfigError

    for bad in ("0", "-5", "lots", "1023"):
        with pytest.raises(ResidencyConfigError, match="REAP_FORENSICS_MAX_BYTES"):
            from_env({"REAP_FORENSICS_MAX_BYTES": bad})
    assert from_env({}).forensics_max_bytes == 64 << 20


def test_bytes_per_second_bucket_binds_whatever_the_request_id(tmp_path: Path) -> None:
    plane = _plane(tmp_path, FakeRanks(1), REAP_SWAP_BYTES_PER_S=str(EXPERT_BYTES))  # burst = one full bank (32 experts)
    codes = []
    for i in range(40):  # 4 experts per swap, a fresh id each time
        try:
            _swap(plane, {f"layer_{i % 4}": [0, 1, 2, 3] + [4 + (i % 12), 4 + ((i + 1) % 12), 4 + ((i + 2) % 12), 4 + ((i + 3) % 12)]},
                  rid=f"id-{i}", phase="decode_refresh")
            codes.append(200)
        except HTTPError as exc:
            codes.append(exc.status)
            assert exc.code == "swap_rate_limited" and int(exc.headers["Retry-After"]) >= 1
    assert codes[:4] == [200] * 4 and 429 in codes


def test_token_bucket_refills_at_its_rate() -> None:
    now = [0.0]
    bucket = TokenBucket(100.0, 200.0, clock=lambda: now[0])
    assert bucket.try_take(150) == 0.0 and bucket.try_take(100) == pytest.approx(0.5)
    now[0] = 0.5
    assert bucket.try_take(100) == 0.0
    assert bucket.try_take(10_000) > 0  # more than the burst waits for a full bucket, never forever
    now[0] = 10.0
    assert bucket.try_take(10_000) == 0.0


@pytest.mark.parametrize("engine, client, expected", [
    ("chatcmpl-abc-1a2b3c4d", "abc", True),
    ("cmpl-abc-0-1a2b3c4d", "abc", True),
    ("cmpl-abc-12-1a2b3c4d", "abc", True),
    ("abc-1a2b3c4d", "abc", True),
    ("chatcmpl-abc-1-1a2b3c4d", "abc", False),  # client "abc-1"'s chat request
    ("chatcmpl-abc-1-1a2b3c4d", "abc-1", True),
    ("cmpl-abc-0-1a2b3c4d", "abc-0", False),
    ("cmpl-abc-0-1a2b3c4d", "cmpl-abc-0", False),
    ("chatcmpl-abcd-1a2b3c4d", "abc", False),
    ("3_cmpl-abc-0-1a2b3c4d", "abc", True),  # child 3 of an n > 1 request
    ("3_chatcmpl-abc-1-1a2b3c4d", "abc", False),
])
def test_engine_ids_match_exactly(engine: str, client: str, expected: bool) -> None:
    assert engine_id_matches_exact(engine, client) is expected


# -- 6. classification within a time budget (a slow classifier is a fault we cannot cause on demand) ---

def test_slow_or_backed_up_classifier_falls_back_to_the_prior_within_its_budget() -> None:
    import threading

    from reap_swap.proxy.classify import Classifier

    release = threading.Event()

    class Stuck:
        expert_prior = None

        def select(self, text: str) -> Any:
            release.wait(10)
            raise RuntimeError("too late")

    async def run() -> tuple[float, list[dict[str, Any]]]:
        clf = Classifier(PLAN, Stuck(), budget_s=0.1, max_queued=2)
        t = time.perf_counter()
        results = await asyncio.gather(*(clf.select(f"prompt {i}") for i in range(4)))
        elapsed = time.perf_counter() - t
        release.set()
        clf.close()
        return elapsed, [info for _, info in results]

    elapsed, infos = asyncio.run(run())
    # four prompts, one stuck classifier thread (held 10 s): nobody waits for it; 2 s leaves room for a loaded box
    # (the suite runs two workers side by side) and is still far from the 10 s a waiting caller would see
    assert elapsed < 2.0
    assert not any(i["classified"] for i in infos)
    assert sum("budget" in i["classify_error"] for i in infos) == 2 and sum("busy" in i["classify_error"] for i in infos) == 2
