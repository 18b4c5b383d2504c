"""Pure aggregation of benchmarks/serve_load.py on synthetic timings."""

from reap_swap.benchmarks.serve_load import RequestRecord, aggregate, percentile


def test_percentile() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert abs(percentile([0.0, 10.0], 99) - 9.9) < 1e-9


def test_aggregate_synthetic() -> None:
    a = RequestRecord(start=0.0, first=0.1, chunks=[0.1, 0.2, 0.3, 0.4], end=0.4, tokens=4, tokens_from_usage=True)
    b = RequestRecord(start=0.0, first=0.3, chunks=[0.3, 0.5], end=0.5, tokens=2, tokens_from_usage=True)
    bad = RequestRecord(start=0.0, error="HTTP 500")
    s = aggregate([a, b, bad], wall=1.0)
    assert s["errors"] == 1 and s["requests"] == 3
    assert s["completion_tokens"] == 6 and s["output_tok_s"] == 6.0
    assert abs(s["ttft_ms_p50"] - 200.0) < 1e-6
    assert abs(s["itl_ms_p50"] - 100.0) < 1e-6 and abs(s["itl_ms_p99"] - 197.0) < 1e-6


def test_usage_spreads_multi_token_chunks() -> None:
    r = RequestRecord(start=0.0, first=0.1, chunks=[0.1, 0.5], end=0.5, tokens=5, tokens_from_usage=True)
    assert len(r.itls()) == 4 and abs(sum(r.itls()) - 0.4) < 1e-9
    assert abs(r.decode_tps() - 10.0) < 1e-9
