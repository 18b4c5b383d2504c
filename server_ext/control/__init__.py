"""The HTTP control plane and everything only it uses: the ASGI middleware, access rules, swap rate
limit, payload validation, cartridges, errors and metrics. Reaches the workers through RPCs only, so
nothing here imports torch (checked by ``tests/test_layout.py``); vLLM loads it through ``--middleware``."""
