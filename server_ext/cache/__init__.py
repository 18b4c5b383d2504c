"""The online expert cache inside the forward: the admission/eviction policy, the promotion copies
and their Triton programs (fixed-shape, graph-capturable, sync-free).
Called by ``layer`` (per step) and ``worker_ext`` (status, adoption); never imports ``control``."""
