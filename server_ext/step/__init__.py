"""What runs in every forward step and the worker-side books it fills: the remap + capture kernels
(Triton and their torch twins), the routing arena, per-request accumulators, step layout, the stock
kernel choice, the miss ledger and request-id matching. Called by ``layer`` and ``worker_ext``; never imports ``control``."""
