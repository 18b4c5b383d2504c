"""vLLM glue for ``TraceReplay`` (benchmark only): every MoE layer routes as a recorded trace says.

Install in the arm process before ``LLM()`` is built, with the engine in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``)::

    routing = trace_routing_vllm.install(traces.load(path))
    llm = LLM(...)
    routing.assign("bench-0", 3)   # optional; unknown requests take trace requests round-robin

Three class-level patches, all in place before the model is built or compiled
(hooks added after start-up never fire in compiled or captured code):

* ``FusedMoERouter.select_experts`` (the only definition in vLLM 0.26 and 0.32;
  every router class inherits it) runs the original, so the gate's cost stays,
  then returns the trace's (weights, ids) in the original's dtypes when the
  router was tagged with a MoE layer index; untagged routers are stock.
* ``load_model`` of the V1 GPU and CPU model runners: after loading, tag each
  MoE layer's router in model order, build the device tables, and wrap the
  runner's ``_prepare_inputs``.
* ``_prepare_inputs`` (called right after ``_update_states`` in 0.26 and 0.32,
  with the persistent batch in this step's order): stage the step's trace rows.

Ids are logical: reap-swap's ``forward_modular`` remaps them to bank rows as it
does a real router's; ``cpu_offload_gb`` changes where weights live, not routing.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable, Sequence

import numpy as np
import torch

from reap_swap.planning.traces import RoutingTrace

from .llm_probe import layer_index
from .trace_routing import TraceReplay

logger = logging.getLogger("reap_swap.benchmarks.trace_routing")

LAYER_ATTR = "reap_trace_layer"
REPLAY_ATTR = "reap_trace_replay"
_PATCHED = "_reap_trace_patched"


class TraceRouting:
    """Handle the arm keeps: the trace, and the replay once the model is loaded."""

    def __init__(self, trace: RoutingTrace, layers: Sequence[int] | None = None, read_tags: bool = False,
                 announce: Callable[[dict[str, Any]], None] | None = None):
        self.trace = trace
        self.layers = None if layers is None else list(layers)
        self.read_tags = read_tags
        self.announce = announce  # told ``describe()`` once the replay is attached (a served arm's proof in its log)
        self.replay: TraceReplay | None = None
        self.moe_layer_names: list[str] = []
        self._pending: list[tuple[str, int | str]] = []

    def assign(self, request_id: str, trace_request: int | str) -> None:
        """Request ``request_id`` (and vLLM's ``-<8 hex>`` decoration of it) replays ``trace_request``."""
        if self.replay is None:
            self._pending.append((request_id, trace_request))
        else:
            self.replay.assign(request_id, trace_request)

    def describe(self) -> dict[str, Any]:
        r = self.replay
        return {
            "attached": r is not None,
            "moe_layers": len(self.moe_layer_names),
            "trace_requests": self.trace.num_requests,
            "trace_rows": int(self.trace.offsets[-1]),
            "table_mib": r.table_bytes / 2**20 if r else None,
            "steps_staged": r.steps_staged if r else 0,
            "device": str(r.device) if r else None,
        }

    def attach(self, runner: Any) -> None:
        """Tag the loaded model's routers, build the tables on its device, hook input preparation."""
        if getattr(runner, "_reap_trace_attached", False):
            return
        from vllm.model_executor.layers.fused_moe.router.fused_moe_router import FusedMoERouter

        batch = getattr(runner, "input_batch", None)
        if not hasattr(runner, "_prepare_inputs") or not hasattr(batch, "num_computed_tokens_cpu"):
            raise RuntimeError(f"trace routing needs the V1 model runner, not {type(runner).__module__}; set VLLM_USE_V2_MODEL_RUNNER=0")
        model = runner.get_model()
        moe = [(n, m) for n, m in model.named_modules() if isinstance(getattr(m, "router", None), FusedMoERouter)]
        moe.sort(key=lambda nm: (layer_index(nm[0]) is None, layer_index(nm[0]) or 0))
        if not moe:
            raise RuntimeError("trace routing: the model has no MoE layer with a router")
        routers = [m.router for _, m in moe]
        for name, m in moe:
            if getattr(m.router, "eplb_state", None) is not None:
                raise RuntimeError(f"trace routing: {name} uses EPLB (physical ids); not supported")
            if getattr(m, "is_monolithic", False):  # the kernel routes from the logits; select_experts never runs
                raise RuntimeError(f"trace routing: {name} runs a monolithic MoE kernel; choose a modular backend")
        first = routers[0]
        max_tokens = max(int(runner.max_num_tokens), int(getattr(runner.compilation_config, "max_cudagraph_capture_size", 0) or 0))
        replay = TraceReplay(
            self.trace, len(routers), int(first.global_num_experts), int(first.top_k), max_tokens, runner.device, self.layers,
            read_tags=self.read_tags,
        )
        for i, r in enumerate(routers):
            if (int(r.top_k), int(r.global_num_experts)) != (replay.top_k, replay.num_experts):
                raise RuntimeError(f"trace routing: MoE layer {i} routes top-{r.top_k} of {r.global_num_experts}")
            _patch_select_experts(_defining_class(type(r)))
            setattr(r, LAYER_ATTR, i)
            setattr(r, REPLAY_ATTR, replay)
        self.moe_layer_names = [n for n, _ in moe]
        self.replay = replay
        for rid, tr in self._pending:
            replay.assign(rid, tr)
        self._pending.clear()
        _wrap_prepare_inputs(runner, replay)
        runner._reap_trace_attached = True
        logger.info(
            "trace routing: %d MoE layers replay %d trace requests (%d rows, %.1f MiB of tables on %s)",
            len(routers), replay.num_requests, int(replay.offsets[-1]), replay.table_bytes / 2**20, replay.device,
        )
        if self.announce is not None:
            self.announce(self.describe())


_ACTIVE: TraceRouting | None = None


def active() -> TraceRouting | None:
    return _ACTIVE


def install(trace: RoutingTrace, layers: Sequence[int] | None = None, read_tags: bool = False,
            announce: Callable[[dict[str, Any]], None] | None = None) -> TraceRouting:
    """Patch vLLM's classes (idempotent) and make ``trace`` the routing of the next model loaded here
    (``read_tags``: request ids naming a trace request replay it, see ``trace_routing.TRACE_TAG``)."""
    global _ACTIVE
    from vllm.model_executor.layers.fused_moe.router.fused_moe_router import FusedMoERouter

    trace.validate()
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # already the default for Qwen3-MoE in 0.26 and on CPU
    _patch_select_experts(FusedMoERouter)
    for cls in _runner_classes():
        _patch_load_model(cls)
    _ACTIVE = TraceRouting(trace, layers, read_tags, announce)
    return _ACTIVE


def uninstall() -> None:
    """Models loaded from now on route stock (already tagged routers keep replaying)."""
    global _ACTIVE
    _ACTIVE = None


def _runner_classes() -> list[type]:
    """V1 runners get the hook; Model Runner V2 (CUDA) is patched too, so that loading under it fails loudly."""
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if current_platform.is_cpu():  # the CPU runner's module patches CPU kernels in at import: CPU only
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        return [GPUModelRunner, CPUModelRunner]
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2
    except Exception:  # pragma: no cover - absent or unimportable in this build
        return [GPUModelRunner]
    return [GPUModelRunner, GPUModelRunnerV2]


def _defining_class(cls: type) -> type:
    """The class whose ``select_experts`` a router of type ``cls`` runs (a subclass may override it)."""
    return next(c for c in cls.__mro__ if "select_experts" in c.__dict__)


def _patch_select_experts(cls: type) -> None:
    original = cls.__dict__["select_experts"]
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def select_experts(
        self: Any,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        topk_indices_dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        topk_weights, topk_ids = original(self, hidden_states, router_logits, topk_indices_dtype, **kwargs)
        replay = getattr(self, REPLAY_ATTR, None)
        layer = getattr(self, LAYER_ATTR, None)
        if replay is None or layer is None:
            return topk_weights, topk_ids
        weights, ids = replay.route(layer, topk_ids.shape[0])
        return weights.to(topk_weights.dtype), ids.to(topk_ids.dtype)

    setattr(select_experts, _PATCHED, True)
    cls.select_experts = select_experts  # type: ignore[attr-defined]


def _patch_load_model(cls: type) -> None:
    original = cls.__dict__.get("load_model")
    if original is None or getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        if _ACTIVE is not None:
            _ACTIVE.attach(self)
        return out

    setattr(load_model, _PATCHED, True)
    cls.load_model = load_model  # type: ignore[attr-defined]


def step_entries(runner: Any, num_scheduled_tokens: Any) -> list[tuple[str, int, int]]:
    """(request, tokens computed, tokens scheduled) per request, in the order rows are fed to the model."""
    batch = runner.input_batch
    n = int(batch.num_reqs)
    ids = list(batch.req_ids)[:n]
    computed = np.asarray(batch.num_computed_tokens_cpu)[:n]
    counts = np.asarray(num_scheduled_tokens)[:n]
    return [(str(r), int(c), int(k)) for r, c, k in zip(ids, computed, counts)]


def _wrap_prepare_inputs(runner: Any, replay: TraceReplay) -> None:
    original: Callable[..., Any] = runner._prepare_inputs

    @functools.wraps(original)
    def _prepare_inputs(scheduler_output: Any, num_scheduled_tokens: Any, *args: Any, **kwargs: Any) -> Any:
        replay.step(step_entries(runner, num_scheduled_tokens))
        finished = getattr(scheduler_output, "finished_req_ids", None)
        if finished:
            replay.forget(list(finished))
        return original(scheduler_output, num_scheduled_tokens, *args, **kwargs)

    runner._prepare_inputs = _prepare_inputs
