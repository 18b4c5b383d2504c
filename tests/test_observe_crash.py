"""Issue 11 point 7: crash-safe observation and a corpus reader that never aborts on bad fields
(real files, the tiny model in HF transformers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

def _observe(model: Path, out: Path, n: int, **kw: Any) -> dict[str, Any]:
    from reap_swap.paths import example_corpus_files
    from reap_swap.planning.observe import observe

    return observe(model, example_corpus_files(), out, max_samples=n, max_tokens=64, batch_size=4, progress=False, **kw)


def test_crash_mid_run_loses_at_most_n_batches_then_resumes(tiny_model_dir: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    from reap_swap.planning import observe as observe_mod
    from reap_swap.planning.observations import load_observations

    real, calls = observe_mod.observe_batch, [0]

    def dies_on_the_fourth_batch(*args: Any, **kw: Any) -> Any:
        calls[0] += 1
        if calls[0] == 4:
            raise KeyboardInterrupt  # the process is killed here
        return real(*args, **kw)

    crashed = tmp_path / "crashed"
    monkeypatch.setattr(observe_mod, "observe_batch", dies_on_the_fourth_batch)
    with pytest.raises(KeyboardInterrupt):
        _observe(tiny_model_dir, crashed, 24, checkpoint_every=1)
    assert load_observations(crashed).num_samples == 12  # three committed batches survive
    monkeypatch.setattr(observe_mod, "observe_batch", real)
    resumed = _observe(tiny_model_dir, crashed, 24, checkpoint_every=1)
    assert resumed["new_samples"] == 12
    clean = tmp_path / "clean"
    _observe(tiny_model_dir, clean, 24)
    a, b = load_observations(crashed), load_observations(clean)
    assert a.sample_ids == b.sample_ids and a.num_samples == 24
    np.testing.assert_allclose(a.sample_mass, b.sample_mass, rtol=1e-5, atol=1e-6)
    assert (a.coact == b.coact).all()


def test_rows_and_files_the_manifest_does_not_list_are_ignored(tiny_model_dir: Path, tmp_path: Path) -> None:
    from reap_swap.planning.observations import SAMPLES, load_observations

    out = tmp_path / "obs"
    _observe(tiny_model_dir, out, 8)
    ids = load_observations(out).sample_ids
    with open(out / SAMPLES, "a") as fh:  # what a run killed between its chunk and its commit leaves
        fh.write(json.dumps({"id": "ghost", "source": "s", "tags": ["t"], "tokens": 3, "chunk": "chunk-0001.npz"}) + "\n")
        fh.write('{"id": "torn", "sour')
    (out / "chunk-0001.npz").write_bytes(b"half a chunk")
    (out / ".manifest.json.999.tmp").write_text("{")
    assert load_observations(out).sample_ids == ids
    again = _observe(tiny_model_dir, out, 12)  # the next run cleans up and adds only the new samples
    assert again["new_samples"] == 4 and len(again["chunks"]) == 2
    obs = load_observations(out)
    assert obs.num_samples == 12 and "ghost" not in obs.sample_ids and set(ids) <= set(obs.sample_ids)
    assert not list(out.glob(".*.tmp")) and "torn" not in (out / SAMPLES).read_text()


def test_malformed_corpus_fields_skip_the_sample_with_a_count(tmp_path: Path) -> None:
    from reap_swap.planning.corpus import read_corpus
    from reap_swap.proxy.prompts import prompt_from_body

    parts = [{"type": "text", "text": "first part"}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "second"}]
    rows = [
        {"messages": [{"role": "user", "content": "fine"}]},
        {"messages": [{"role": "user", "content": "ctx", "code_context": 5}]},
        {"messages": [{"role": "user", "content": "diffs", "suggested_diffs": "not a list"}]},
        {"messages": [{"role": "user", "content": 5}]},
        {"messages": [{"role": "user", "content": "template breaks on this"}]},
        {"messages": [{"role": "user", "content": parts}]},
    ]
    f = tmp_path / "c.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n" + "[" * 100_000 + "\n")

    def render(msgs: list[dict[str, str]]) -> str:
        if "template breaks" in msgs[-1]["content"]:
            raise ValueError("chat template error")
        return "|".join(m["content"] for m in msgs)

    samples, stats = read_corpus([f], render)
    assert [s.prompt for s in samples] == ["fine", "first part\nsecond"]
    assert samples[1].prompt == prompt_from_body("/v1/chat/completions", {"messages": [{"role": "user", "content": parts}]})
    assert stats.skipped == {"bad_code_context": 1, "bad_suggested_diffs": 1, "bad_content": 1, "chat_template_error": 1,
                             "invalid_json": 1}


def test_sample_identity_does_not_depend_on_the_line_number(tmp_path: Path) -> None:
    from reap_swap.planning.corpus import read_corpus

    rows = [json.dumps({"messages": [{"role": "user", "content": f"question {i}"}]}) for i in range(3)]
    f = tmp_path / "c.jsonl"
    f.write_text("\n".join(rows) + "\n")
    before = {s.prompt: s.sample_id for s in read_corpus([f], str)[0]}
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "a new first line"}]}) + "\n\n" + "\n".join(rows) + "\n")
    after = {s.prompt: s.sample_id for s in read_corpus([f], str)[0]}
    assert all(after[p] == sid for p, sid in before.items()) and len(after) == 4


def test_batches_of_like_lengths_keep_each_samples_statistics_in_its_row(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Samples are batched by length; every statistic must still land on its own sample, as one at a time."""
    import numpy as np

    from reap_swap.paths import example_corpus_files
    from reap_swap.planning.observations import load_observations
    from reap_swap.planning.observe import observe

    for name, batch in (("one", 1), ("five", 5)):
        observe(tiny_model_dir, example_corpus_files(), tmp_path / name, max_samples=12, max_tokens=1024, batch_size=batch, progress=False)
    a, b = load_observations(tmp_path / "one"), load_observations(tmp_path / "five")
    tokens = a.sample_tokens.tolist()
    assert len(set(tokens)) > 3 and tokens != sorted(tokens)  # lengths differ and are not already in order
    assert a.sample_ids == b.sample_ids
    for obs in (a, b):  # each row routed exactly its own sample's tokens, top-k times in every layer
        assert (obs.sample_freq.sum(-1) == obs.sample_tokens[:, None] * obs.top_k).all()
    np.testing.assert_allclose(a.sample_mass, b.sample_mass, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(a.sample_saliency, b.sample_saliency, rtol=1e-4, atol=1e-5)
    assert (a.sample_freq == b.sample_freq).all() and (a.coact == b.coact).all()
