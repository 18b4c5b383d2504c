"""scripts/locality_targets.py: issue 24's four targets read off a locality report."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from locality_targets import distance, targets_check  # noqa: E402


def _report(m90: tuple[float, float, float], reuse: float, within: float, experts: int = 128) -> dict:
    early, late, mean = m90
    return {"num_experts": experts, "early_late": {"mass_90_decode": {"early": early, "late": late, "all": mean},
                                                   "reuse_next_token": {"all": reuse}, "reuse_within_8": {"all": within}}}


def test_all_four_met_is_distance_zero() -> None:
    check = targets_check(_report((66.0, 58.0, 62.0), 0.45, 0.81))
    assert check["met_count"] == 4 and distance(check) == 0.0


def test_misses_are_counted_in_band_widths_and_counts_scale_to_128() -> None:
    v1 = targets_check(_report((34.0, 56.0, 46.5), 0.32, 0.76))  # learned128 v1's card figures
    assert v1["met"] == {"experts_for_90pct_mass": False, "reuse_next_token": False, "reuse_within_8": False, "late_more_concentrated": False}
    assert abs(distance(v1) - ((55 - 46.5) / 15 + 0.08 / 0.10 + 0.02 / 0.05 + 1.0)) < 1e-9
    small = targets_check(_report((16.0, 14.0, 15.0), 0.45, 0.8, experts=32))
    assert small["values"]["experts_for_90pct_mass"] == 60.0 and small["met_count"] == 4
