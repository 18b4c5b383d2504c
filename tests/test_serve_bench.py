"""``reap-swap bench-serve`` without servers: bad input refused before anything starts, the arms' command
lines, the workload's tags, and the table / ratio assembly on synthetic repeats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reap_swap.benchmarks.serve_arms import ARMS, REAP_TRACE_EXTENSION, STOCK_TRACE_EXTENSION, ServeSettings, arm_server
from reap_swap.benchmarks.serve_report import join_repeats, markdown, ratios
from reap_swap.cli import main as cli_main
from reap_swap.paths import learned128_cpu_dir

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "benchmarks" / "traces" / "learned128_t0.8.npz"


def refused(args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """Run the real command line; it must exit 2, write nothing and name the problem on stderr."""
    out, work = tmp_path / "out.json", tmp_path / "work"
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench-serve", *args, "--out", str(out), "--workdir", str(work)])
    assert exc.value.code == 2
    assert not out.exists() and not work.exists()
    err = capsys.readouterr().err
    assert "reap-swap bench-serve: error:" in err
    return err


@pytest.mark.parametrize("args, message", [
    (["--arms", "stock_offload,reap_turbo"], "unknown arm(s) 'reap_turbo'"),
    (["--arms", "reap_static,reap_static"], "names an arm twice"),
    (["--device", "cpu", "--arms", "stock_gpu,reap_fast"], "reap_fast run the CPU expert path, which needs CUDA"),
    (["--concurrency", "1,0,8"], "--concurrency must list positive integers"),
    (["--concurrency", "-4"], "--concurrency must list positive integers"),
    (["--concurrency", "one"], "is not a comma-separated list of integers"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--slots-fraction", "1.5"], "--slots-fraction must be in (0, 1]"),
    (["--trace", str(TRACE)], "--trace with reap arms needs --sets"),
    (["--sets", str(TRACE)], "--sets needs --trace"),
    (["--trace", "/nonexistent/trace.npz", "--arms", "stock_gpu"], "--trace /nonexistent/trace.npz: no such file"),
    (["--concurrency", "1,8,1"], "--concurrency names a concurrency twice: 1,8,1"),
    (["--kv-cache-gib", "0"], "--kv-cache-gib must be > 0, got 0.0"),
    (["--deadline-s", "-5"], "--deadline-s must be > 0, got -5.0"),
    (["--request-timeout-s", "0"], "--request-timeout-s must be > 0"),
    (["--trace-layers", "0,1,2,3", "--arms", "stock_gpu"], "--trace-layers needs --trace"),
    (["--trace", str(TRACE), "--trace-layers", "0,a", "--arms", "stock_gpu"], "--trace-layers '0,a' is not a comma-separated list of integers"),
])
def test_bad_input_is_refused_naming_the_problem(args: list[str], message: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert message in refused(["--model", str(learned128_cpu_dir()), *args], tmp_path, capsys)


def test_missing_model_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(["--model", str(tmp_path / "no-model")], tmp_path, capsys)
    assert "no-model: no such model directory (config.json missing)" in err
    assert "one of the arguments --model --shape is required" in refused([], tmp_path, capsys)


def test_a_trace_of_another_shape_is_refused_before_any_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    small = REPO / "benchmarks" / "traces" / "small_moe_realistic_t0.8.npz"  # 16 experts top-4; the model has 128 top-8
    out = tmp_path / "out.json"
    code = cli_main(["bench-serve", "--model", str(learned128_cpu_dir()), "--device", "cpu", "--arms", "stock_gpu",
                     "--trace", str(small), "--out", str(out), "--workdir", str(tmp_path / "w")])
    assert code == 2 and not out.exists()
    assert "top-4 of 16" in capsys.readouterr().err


def test_settings_the_model_cannot_take_are_refused_before_any_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Trace layers the trace lacks, sets of another expert count, requests longer than the model's positions."""
    sets = json.loads((REPO / "benchmarks" / "results" / "learned_sets.json").read_text())
    other = tmp_path / "sets_256.json"
    other.write_text(json.dumps({**sets, "num_experts": 256}))
    base = ["bench-serve", "--model", str(learned128_cpu_dir()), "--device", "cpu", "--workdir", str(tmp_path / "w")]
    for args, message in (
        (["--arms", "stock_gpu", "--trace", str(TRACE), "--trace-layers", "0,8,15,24"], "learned128_t0.8.npz has layers 0..23"),
        (["--arms", "reap_static", "--trace", str(TRACE), "--sets", str(other)], "38 slots of 256 experts; the model has 128"),
        (["--arms", "stock_gpu", "--prompt-tokens", "2000"], "a model length of 2080 tokens (prompt + --max-tokens + 16); the model's max_position_embeddings is 2048"),
    ):
        out = tmp_path / "out.json"
        assert cli_main([*base, *args, "--out", str(out)]) == 2 and not out.exists()
        err = capsys.readouterr().err
        assert "reap-swap bench-serve: error:" in err and message in err, (args, err)
    assert not (tmp_path / "w" / "logs").exists()


def settings(**kw: object) -> ServeSettings:
    base = dict(model="/m", device="cuda", dtype="bfloat16", max_model_len=300, max_num_seqs=32, kv_cache_gib=4.0, offload_gib=11.5625,
                slots=38, start={"layer_0": [1, 2]}, load_format="dummy", cores=list(range(16)))
    return ServeSettings(**{**base, **kw})  # type: ignore[arg-type]


def test_arm_servers_differ_only_in_where_experts_live() -> None:
    s = settings()
    servers = {name: arm_server(name, s) for name in ARMS}
    stock, offload = servers["stock_gpu"].args, servers["stock_offload"].args
    assert offload[: len(stock)] == stock and offload[len(stock):] == ["--cpu-offload-gb", "11.5625", "--cpu-offload-params", "experts"]
    assert "--max-num-seqs" in stock and stock[stock.index("--kv-cache-memory-bytes") + 1] == str(4 * 2**30)
    assert json.loads(stock[stock.index("--compilation-config") + 1]) == {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]}
    reap = servers["reap_static"].args
    assert reap[:6] == ["--model", "/m", "--resident-experts-per-layer", "38", "--start-resident", '{"layer_0":[1,2]}']
    assert reap[6:] == stock and not servers["reap_static"].calibrate
    assert servers["reap_cache"].args[-2:] == ["--online-cache", "lfru"]
    fast = servers["reap_fast"]
    assert "--fast" in fast.args and fast.args[-2:] == ["--cpu-experts-cpus", ",".join(map(str, range(2, 16)))]
    assert fast.cpu_affinity == [0, 1]
    assert all("--worker-extension-cls" not in a.args for a in servers.values())  # no trace: stock vLLM, stock serve
    assert arm_server("reap_static", settings(start=None)).calibrate


def test_a_trace_reaches_every_server_through_its_worker_extension() -> None:
    s = settings(trace="/t.npz", trace_layers=[0, 8, 15, 23], device="cpu", dtype="float32")
    stock, reap = arm_server("stock_offload", s), arm_server("reap_static", s)
    assert stock.args[stock.args.index("--worker-extension-cls") + 1] == STOCK_TRACE_EXTENSION
    assert reap.args[reap.args.index("--worker-extension-cls") + 1] == REAP_TRACE_EXTENSION
    for arm in (stock, reap):
        assert arm.env["REAP_BENCH_TRACE"] == "/t.npz" and arm.env["REAP_BENCH_TRACE_LAYERS"] == "0,8,15,23"
        assert arm.env["VLLM_DISABLE_COMPILE_CACHE"] == "1" and arm.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    with pytest.raises(ValueError, match="unknown arm"):
        arm_server("reap_turbo", s)


def test_serve_keeps_a_worker_extension_given_to_it_instead_of_its_own() -> None:
    from reap_swap.server_ext.launcher import WORKER_EXTENSION, build_parser, vllm_argv

    args, rest = build_parser().parse_known_args(["--model", "/m", "--resident-experts-per-layer", "4"])
    own = vllm_argv(args, rest)
    assert own[own.index("--worker-extension-cls") + 1] == WORKER_EXTENSION
    given = vllm_argv(args, ["--worker-extension-cls", REAP_TRACE_EXTENSION])
    assert given.count("--worker-extension-cls") == 1 and given[-1] == REAP_TRACE_EXTENSION


def test_loads_name_their_trace_requests_and_repeat_alike() -> None:
    from reap_swap.benchmarks import serve_workload as wl
    from reap_swap.benchmarks.trace_routing import tag_of
    from reap_swap.planning import traces

    trace = traces.load(TRACE)
    pool = wl.trace_pool(trace, 64)
    assert pool and all(q.prompt_len > 0 and q.decode_rows >= 64 and q.gen == 64 for q in pool)
    a = wl.build_load(len(pool) + 2, "reap_static.c2", 8192, 0, 256, pool)
    assert [tag_of("cmpl-" + rid + "-0-1a2b3c4d") for rid in a.request_ids] == [q.index for q in pool] + [pool[0].index, pool[1].index]
    assert [len(p) for p in a.prompts[:3]] == [q.prompt_len for q in pool[:3]]
    assert a.prompts[0] == a.prompts[len(pool)]  # the same trace request: the same prompt
    assert wl.build_load(3, "other", 8192, 0, 256, pool).prompts == a.prompts[:3]  # whatever the arm
    tail = wl.build_load(2, "warm", 8192, 0, 256, pool, start=len(pool) - 2)
    assert [q.index for q in tail.trace_requests] == [q.index for q in pool[-2:]]  # the warm-up's requests: the pool's end
    plain = wl.build_load(3, "x", 100, 0, 17)
    assert [len(p) for p in plain.prompts] == [17] * 3 and plain.trace_requests is None and len(set(plain.request_ids)) == 3
    assert wl.requests_at(32, 3, 8) == 96 and wl.requests_at(1, 3, 8) == 8


def run(tok_s: float, ttft: float, itl99: float, errors: int = 0) -> dict[str, object]:
    return {"output_tok_s": tok_s, "ttft_ms_p50": ttft, "ttft_ms_p99": ttft * 2, "itl_ms_p50": 10.0, "itl_ms_p99": itl99,
            "decode_tok_s_per_request_p50": 50.0, "requests": 8, "errors": errors, "completion_tokens": 512, "texts": ["x"] * 8,
            "error_messages": ["HTTP 500"] * errors}


def test_repeats_join_as_medians_with_totals() -> None:
    row = join_repeats([run(100.0, 50.0, 30.0), run(120.0, 40.0, 20.0, errors=1), run(90.0, 70.0, 25.0)])
    assert row["output_tok_s"] == 100.0 and row["ttft_ms_p50"] == 50.0 and row["itl_ms_p99"] == 25.0
    assert (row["requests"], row["errors"], row["completion_tokens"], row["repeats"]) == (24, 1, 1536, 3)
    assert row["error_messages"] == ["HTTP 500"] and all("texts" not in r for r in row["runs"])


def test_ratios_against_stock_offload_and_the_table() -> None:
    arms = {
        "stock_offload": {"by_concurrency": {"1": join_repeats([run(40.0, 100.0, 30.0)]), "32": join_repeats([run(160.0, 900.0, 60.0)])}},
        "reap_fast": {"by_concurrency": {"1": join_repeats([run(120.0, 50.0, 10.0)]), "32": join_repeats([run(400.0, 450.0, 30.0)])}},
        "reap_cache": {"error": "RuntimeError: server died"},
        "stock_gpu": {"by_concurrency": {"32": join_repeats([run(800.0, 300.0, 15.0)])}},
    }
    r = ratios(arms)
    assert r["output_tok_s"]["reap_fast_vs_stock_offload_c32"] == 2.5 and r["output_tok_s"]["reap_fast_vs_stock_offload_c1"] == 3.0
    assert r["ttft_ms_p50"]["reap_fast_vs_stock_offload_c32"] == 0.5 and r["itl_ms_p99"]["reap_fast_vs_stock_offload_c1"] == pytest.approx(1 / 3)
    assert r["output_tok_s"]["stock_gpu_vs_stock_offload_c32"] == 5.0 and r["output_tok_s"]["reap_fast_vs_stock_gpu_c32"] == 0.5
    assert not any("reap_cache" in k or "stock_offload_vs" in k for m in r.values() for k in m)
    table = markdown({"tag": "t", "routing": "dummy", "arms": arms, "ratios": r})
    assert "| reap_fast | 32 | 400.0 | 450.0 | 900.0 | 10.00 | 30.00 | 8 | 0 | — |" in table
    assert "| reap_cache | — | RuntimeError: server died |" in table
    assert "reap_fast_vs_stock_offload_c32 2.50×" in table



def test_deadline_starts_nothing_that_cannot_finish_and_resume_keeps_finished_arms(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    args = ["bench-serve", "--model", str(learned128_cpu_dir()), "--device", "cpu", "--arms", "stock_gpu,reap_static",
            "--concurrency", "1,2", "--out", str(out), "--workdir", str(tmp_path / "w"), "--deadline-s", "1"]
    assert cli_main(args) == 1
    first = json.loads(out.read_text())
    assert set(first["arms"]) == {"stock_gpu", "reap_static"}
    assert all(a["error"].startswith("not run: ") for a in first["arms"].values())
    assert not (tmp_path / "w" / "logs").exists()  # no server was started
    assert first["workload"]["concurrency"] == [1, 2] and first["machine"]["cpus"] >= 1 and "median" in first["aggregation"]
    # an earlier call finished stock_gpu with these settings: --resume keeps it, and only it
    done = {"config": first["arms"]["stock_gpu"]["config"], "workload": first["workload"], "wall_s": 5.0,
            "by_concurrency": {"1": join_repeats([run(10.0, 5.0, 1.0)]), "2": join_repeats([run(18.0, 6.0, 2.0)])}}
    out.write_text(json.dumps({**first, "arms": {"stock_gpu": done}}))
    assert cli_main([*args, "--resume"]) == 1
    second = json.loads(out.read_text())
    assert second["arms"]["stock_gpu"]["resumed"] and second["arms"]["stock_gpu"]["by_concurrency"]["2"]["output_tok_s"] == 18.0
    assert second["arms"]["reap_static"]["error"].startswith("not run: ")
    # other settings (here the concurrencies) make the kept result stale: not kept
    out.write_text(json.dumps({**first, "arms": {"stock_gpu": done}}))
    cli_main([*args[:-4], "--concurrency", "1", *args[-4:], "--resume"])
    assert "error" in json.loads(out.read_text())["arms"]["stock_gpu"]
    # an arm this call does not name stays in only if it was measured with this call's settings (the ratios join it)
    only_reap = [*args[:6], "reap_static", *args[7:], "--resume"]
    out.write_text(json.dumps({**first, "arms": {"stock_gpu": done}}))
    cli_main(only_reap)
    assert json.loads(out.read_text())["arms"]["stock_gpu"]["resumed"]
    out.write_text(json.dumps({**first, "arms": {"stock_gpu": done}}))
    cli_main([*only_reap[:8], "1", *only_reap[9:]])  # --concurrency 1: stock_gpu's loads were another workload
    assert set(json.loads(out.read_text())["arms"]) == {"reap_static"}


def test_dry_run_prints_the_h200_servers_and_starts_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The H200 run's command lines, checked here: 30 % of expert bytes on the GPU in both stock offload and reap."""
    sets = REPO / "benchmarks" / "results" / "learned_sets.json"
    out = tmp_path / "out.json"
    assert cli_main(["bench-serve", "--shape", "30b-a3b-24l", "--arms", "stock_offload,reap_static_cpu,reap_fast", "--trace", str(TRACE),
                     "--sets", str(sets), "--out", str(out), "--workdir", str(tmp_path / "w"), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert not out.exists() and not (tmp_path / "w" / "logs").exists()
    # 24 layers x (128 - 38) experts x 9 437 184 bytes = 18.98 GiB on the host: 38 of 128 (30 %) on the GPU, as the reap slots
    assert "--cpu-offload-gb 18.9844 --cpu-offload-params experts" in text and text.count("--resident-experts-per-layer 38") == 2
    assert "concurrency 32: 96 requests x 3 repeats, 64 tokens each" in text
    assert text.count("REAP_BENCH_TRACE=") == 3 and "--fast" in text and "--load-format dummy" in text
