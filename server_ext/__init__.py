"""vLLM extension: expert-granular GPU residency, swaps, router-miss accounting, control plane.

Pure logic (``slots``, ``active_set``, ``misses``, ``config``, ``control_plane``) imports no vLLM;
``layer``, ``worker_ext``, ``http`` and ``launcher`` are the vLLM glue.
"""
