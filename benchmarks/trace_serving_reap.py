"""``reap-swap serve``'s worker extension plus the trace replay (benchmark only; see ``trace_serving``).

A module of its own so that stock arms never import the residency layer (importing
``server_ext`` registers it with vLLM).
"""

from __future__ import annotations

from reap_swap.server_ext.swap_repair import RepairingWorkerExtension

from . import trace_serving  # noqa: F401  (importing it installs the replay from the environment)


class ReapTraceExtension(RepairingWorkerExtension):
    """The residency RPCs of ``reap-swap serve``, unchanged; the replay comes with this module's import."""
