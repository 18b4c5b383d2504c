"""vLLM extension: expert-granular GPU residency, swaps, router-miss accounting, control plane.

Five rooms, each a package: ``bank`` (storage), ``step`` (per-forward kernels and books), ``cache``
(the online expert cache), ``cpu_experts`` (the CPU expert path), ``control`` (HTTP control plane,
no torch). At this level sits the vLLM glue that ties them together: ``layer`` (the routed-experts
layer), ``worker_ext`` and ``swap_repair`` (the worker extension), ``launcher`` (``reap-swap
serve``) and ``config`` (settings from the environment, shared by every room).
"""
