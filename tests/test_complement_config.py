"""RAM-complement settings: environment, ``reap-swap serve`` flags, process memory readout."""

from __future__ import annotations

from pathlib import Path

import pytest

from reap_swap.server_ext import config as reap_config
from reap_swap.server_ext.bank.host_memory import process_memory
from reap_swap.server_ext.launcher import build_parser, plan_env


def test_env_defaults_and_parsing() -> None:
    off = reap_config.from_env({})
    assert not off.ram_complement and off.complement_spares == reap_config.DEFAULT_SPARES
    on = reap_config.from_env({"REAP_RAM_COMPLEMENT": "1", "REAP_COMPLEMENT_SPARES": "2"})
    assert on.ram_complement and on.complement_spares == 2
    with pytest.raises(reap_config.ResidencyConfigError, match="REAP_COMPLEMENT_SPARES"):
        reap_config.from_env({"REAP_COMPLEMENT_SPARES": "0"})
    with pytest.raises(reap_config.ResidencyConfigError, match="REAP_RAM_COMPLEMENT"):
        reap_config.from_env({"REAP_RAM_COMPLEMENT": "maybe"})


def _env(model: Path, *flags: str) -> dict[str, str]:
    args, _ = build_parser().parse_known_args(["--model", str(model), "--resident-experts-per-layer", "8", *flags])
    return plan_env(args)


def test_serve_flags_become_env(tiny_model_dir: Path) -> None:
    assert "REAP_RAM_COMPLEMENT" not in _env(tiny_model_dir)
    env = _env(tiny_model_dir, "--ram-complement", "--complement-spares", "3")
    assert env["REAP_RAM_COMPLEMENT"] == "1" and env["REAP_COMPLEMENT_SPARES"] == "3"
    with pytest.raises(ValueError, match="needs --ram-complement"):
        _env(tiny_model_dir, "--complement-spares", "3")
    with pytest.raises(ValueError, match=">= 1"):
        _env(tiny_model_dir, "--ram-complement", "--complement-spares", "0")


def test_process_memory_reads_peak_and_current(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmHWM:\t 2097152 kB\nVmRSS:\t 1048576 kB\n")
    assert process_memory(str(status)) == {"peak_rss_gib": 2.0, "rss_gib": 1.0}
    assert process_memory(str(tmp_path / "missing")) == {"peak_rss_gib": None, "rss_gib": None}
    live = process_memory()
    assert live["peak_rss_gib"] is not None and live["peak_rss_gib"] >= live["rss_gib"] > 0
