"""Worker extension (``--worker-extension-cls``): residency RPCs inside each vLLM worker.

vLLM imports this module in every worker before it builds the model, which
registers ``ResidentRoutedExperts``; the methods below become callable
through ``collective_rpc`` and run between forward steps. ``reap_install``
(called once by the control plane at server start-up) finds the layers'
expert banks and wraps this worker's model-runner ``execute_model`` on the
instance, so that after every real step the captured routing is attributed
to the requests of that step.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from typing import Any

import torch

from . import config as reap_config
from .bank import ExpertBank, SwapStats
from .capture import StepLayout, attribute_step_device, batch_layout
from .layer import ResidentRoutedExperts
from .misses import MissLedger

logger = logging.getLogger("reap_swap.server_ext")


class WorkerResidency:
    """All expert banks of one worker plus its router-miss ledger."""

    def __init__(self, layers: list[ResidentRoutedExperts], ledger_size: int):
        self.layers = sorted(layers, key=lambda m: m.reap_layer_id)
        self.banks: dict[int, ExpertBank] = {m.reap_layer_id: m.reap_bank for m in self.layers if m.reap_bank}
        first = next(iter(self.banks.values()))
        self.num_experts = first.num_experts
        self.ledger = MissLedger(list(self.banks), self.num_experts, ledger_size)
        self.device = first.phys_map.device
        self._mask: torch.Tensor | None = None
        self.steps_attributed = 0
        self.steps_unattributed = 0
        # CUDA: a step's sums are copied to pinned host memory without a sync and booked
        # once their event has completed, so accounting never stalls the next step.
        self._pending: deque[tuple[StepLayout, dict[str, torch.Tensor], Any]] = deque()

    def resident_mask(self) -> torch.Tensor:
        if self._mask is None:
            self._mask = torch.stack([b.resident_mask() for b in self.banks.values()]).to(self.device)
        return self._mask

    def resident_sets(self) -> dict[str, list[int]]:
        return {f"layer_{i}": list(b.resident()) for i, b in self.banks.items()}

    def describe(self) -> dict[str, Any]:
        any_bank = next(iter(self.banks.values()))
        return {
            "layers": list(self.banks),
            "num_experts": self.num_experts,
            "slots": {f"layer_{i}": b.num_slots for i, b in self.banks.items()},
            "expert_bytes": any_bank.expert_bytes,
            "backing": any_bank.backing.name,
            "device": str(self.device),
            "resident": self.resident_sets(),
        }

    def after_step(self, runner: Any, scheduler_output: Any) -> None:
        layout = batch_layout(runner, scheduler_output)
        if layout is None or layout.total == 0:
            if layout is None:
                self.steps_unattributed += 1
            return
        sums = attribute_step_device(
            [m.reap_capture_ids for m in self.layers if m.reap_bank],
            [m.reap_capture_w for m in self.layers if m.reap_bank],
            self.resident_mask(),
            layout,
        )
        if self.device.type == "cuda":
            host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True).copy_(v, non_blocking=True) for k, v in sums.items()}
            event = torch.cuda.Event()
            event.record()
            self._pending.append((layout, host, event))
            self.flush(block=False)
        else:
            self._book(layout, sums)

    def _book(self, layout: StepLayout, sums: dict[str, torch.Tensor]) -> None:
        s = {k: v.numpy() for k, v in sums.items()}
        self.ledger.record_step(
            layout.request_ids, s["tokens"], s["observed"], s["inactive"], s["hits"], s["miss_hits"], s["expert_mass"]
        )
        self.steps_attributed += 1

    def flush(self, block: bool = True) -> None:
        """Book finished steps (all of them when ``block``)."""
        while self._pending and (block or self._pending[0][2].query()):
            layout, host, event = self._pending.popleft()
            event.synchronize()
            self._book(layout, host)

    def swap(self, target: dict[str, list[int]]) -> dict[str, Any]:
        wanted: dict[int, tuple[int, ...]] = {}
        for key, ids in target.items():
            layer = int(str(key).removeprefix("layer_"))
            if layer not in self.banks:
                raise ValueError(f"layer {layer} has no expert bank on this worker")
            wanted[layer] = tuple(int(e) for e in ids)
        for layer, ids in wanted.items():  # validate every layer before touching any
            self.banks[layer].table.plan(ids)
        total = SwapStats()
        t0 = time.perf_counter()
        for layer, ids in sorted(wanted.items()):
            total.add(self.banks[layer].swap(ids))
        self._mask = None
        return {
            "experts_loaded": total.experts_loaded,
            "experts_evicted": total.experts_evicted,
            "bytes_copied": total.bytes_copied,
            "copy_ms": total.copy_s * 1e3,
            "publish_ms": total.publish_s * 1e3,
            "total_ms": (time.perf_counter() - t0) * 1e3,
            "layers_changed": total.layers_changed,
            "resident": self.resident_sets(),
        }


def _wrap_execute_model(worker: Any, runtime: WorkerResidency) -> None:
    runner = worker.model_runner
    original = runner.execute_model

    @functools.wraps(original)
    def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(scheduler_output, *args, **kwargs)
        if not kwargs.get("dummy_run", False):
            try:
                runtime.after_step(runner, scheduler_output)
            except Exception:  # accounting must never break generation
                runtime.steps_unattributed += 1
                logger.exception("reap-swap: router-miss attribution failed for one step")
        return out

    runner.execute_model = execute_model


class ReapWorkerExtension:
    """Methods mixed into vLLM's worker class; names are prefixed to avoid clashes."""

    reap_runtime: WorkerResidency | None = None

    def reap_install(self) -> dict[str, Any]:
        if self.reap_runtime is None:
            model = self.model_runner.get_model()  # type: ignore[attr-defined]
            layers = [m for m in model.modules() if isinstance(m, ResidentRoutedExperts) and m.reap_bank is not None]
            if not layers:
                raise RuntimeError("no MoE layer has an expert bank: is REAP_PLAN_FILE or REAP_RESIDENT_EXPERTS_PER_LAYER set?")
            cfg = reap_config.from_env()
            self.reap_runtime = WorkerResidency(layers, cfg.ledger_size)
            _wrap_execute_model(self, self.reap_runtime)
            logger.info("reap-swap: residency installed on %d MoE layers", len(layers))
        return self.reap_runtime.describe()

    def _reap(self) -> WorkerResidency:
        if self.reap_runtime is None:
            raise RuntimeError("reap_install has not run on this worker")
        return self.reap_runtime

    def reap_state(self) -> dict[str, Any]:
        rt = self._reap()
        rt.flush()
        state = rt.describe()
        state["steps_attributed"] = rt.steps_attributed
        state["steps_unattributed"] = rt.steps_unattributed
        state["ledger_evicted"] = rt.ledger.evicted
        return state

    def reap_swap(self, target: dict[str, list[int]]) -> dict[str, Any]:
        return self._reap().swap(target)

    def reap_router_misses(self, client_id: str, reset: bool = False) -> dict[str, Any] | None:
        self._reap().flush()
        ledger = self._reap().ledger
        report = ledger.report(client_id)
        if report is not None and reset:
            ledger.reset(client_id)
        return report

    def reap_reset_router_stats(self) -> int:
        self._reap().flush()
        return self._reap().ledger.reset("__all__")

    def reap_verify(self) -> dict[str, list[int]]:
        """Resident experts whose slot bytes differ from their host copy (must be empty)."""
        return {f"layer_{i}": b.verify() for i, b in self._reap().banks.items()}
