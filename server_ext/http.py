"""The control middleware at its path from before the rooms (``server_ext/control/``), so a vLLM
command line with ``--middleware reap_swap.server_ext.http.ReapControlMiddleware`` keeps working."""

from .control.http import ReapControlMiddleware

__all__ = ["ReapControlMiddleware"]
