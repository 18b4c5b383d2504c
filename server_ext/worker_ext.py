"""Worker extension (``--worker-extension-cls``): residency RPCs inside each vLLM worker.

vLLM imports this module in every worker before it builds the model, which
registers ``ResidentRoutedExperts``; the methods below become callable
through ``collective_rpc`` and run between forward steps. ``reap_install``
(called once by the control plane at server start-up) finds the layers'
expert banks and wraps this worker's model-runner ``execute_model`` on the
instance, so that after every real step the captured routing is added to the
per-request sums on the device (``accounting.py``), without waiting for it.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import torch

from . import config as reap_config
from .step.accounting import RoutingAccounting
from .bank.bank import ExpertBank, SwapStats
from .step.capture import batch_layout
from .cpu_experts.cpu_path import COUNTERS as CPU_PATH_COUNTERS, LayerCpuPath, summarize as cpu_path_summary
from .cpu_experts.rates import CpuRateCheck, describe as describe_rerating
from .bank.exchange import ExchangeCounters
from .bank.host_memory import process_memory
from .bank.host_rows import HostRegions
from .layer import ResidentRoutedExperts
from .step.misses import MissLedger
from .cache.online_cache import LayerCache, check_bijection

logger = logging.getLogger("reap_swap.server_ext")


class WorkerResidency:
    """All expert banks of one worker plus its router-miss accounting and ledger."""

    def __init__(self, layers: list[ResidentRoutedExperts], ledger_size: int, accounting: bool = True):
        self.layers = sorted(layers, key=lambda m: m.reap_layer_id)
        self.banks: dict[int, ExpertBank] = {m.reap_layer_id: m.reap_bank for m in self.layers if m.reap_bank}
        first = next(iter(self.banks.values()))
        self.num_experts = first.num_experts
        self.ledger = MissLedger(list(self.banks), self.num_experts, ledger_size, first.link_bytes)
        self.device = first.phys_map.device
        self.caches: dict[int, LayerCache] = {m.reap_layer_id: m.reap_cache for m in self.layers if m.reap_cache is not None}
        self.cpu_paths: dict[int, LayerCpuPath] = {m.reap_layer_id: m.reap_cpu_path for m in self.layers if m.reap_cpu_path is not None}
        self.cfg = reap_config.from_env()
        self.arena = self.layers[0].reap_arena
        # The step's real row count (the rest of a captured graph's rows is padding): for the online
        # cache's scores and the CPU expert path's split.
        self.staging = any(m.reap_staging is not None for m in self.layers)
        uses_valid = bool(self.caches) or bool(self.cpu_paths) or self.staging
        self._valid = _ValidRows(self.arena.valid_rows) if uses_valid else None
        if self.caches:  # vLLM's warm-up and graph-capture runs promoted on dummy routing: back to the start-up set
            self.reset_caches({i: self.cfg.start_resident(i, self.num_experts, b.num_slots) for i, b in self.banks.items()}, counters=True)
            for b in self.banks.values():  # exchange counters then cover serving only, as the caches' own counters do
                if b.complement is not None:
                    b.complement.counters = ExchangeCounters()
        self.accounting = RoutingAccounting(self.layers[0].reap_arena, list(self.banks), self.ledger)
        if self.staging:  # vLLM's warm-up runs staged dummy steps: book none of them
            self.arena.stage_rows.fill_(-1)
        self.accounting.enabled = accounting
        self.steps_attributed = 0
        self.steps_unattributed = 0
        self.cpu_timeout_steps = 0
        # the CPU's rate re-derived from the team's counters while serving (rates.py); None: no CPU path or a rate the user set
        self.cpu_rates = CpuRateCheck.for_paths(list(self.cpu_paths.values()))
        self.reads: dict[str, int] = {"reap_state": 0, "reap_router_misses": 0}
        """Report reads this worker served, by RPC: what ``/metrics``' single read is checked against."""
        self.regions = host_regions(self.banks)
        self.memory_at_install = process_memory()  # its peak includes building the banks

    def complement(self) -> dict[str, Any]:
        """RAM-complement mode: spare pools, exchange counters, layers that fell back to the copy path."""
        banks = [b for b in self.banks.values() if b.complement is not None]
        if banks and self.caches:
            self.sync_tables()  # the online caches' exchanges since the last read-back
        total = ExchangeCounters()
        for b in banks:
            total.add(b.counters)
        full_copy = sum(b.num_experts * b.expert_bytes for b in self.banks.values())
        return {
            "enabled": bool(banks),
            "layers": len(banks),
            "spare_rows": sum(b.complement.rows.spare_count for b in banks if b.complement),
            "reserved_spares_by_block_bytes": {str(k): v for k, v in self.regions.spares_by_size().items()},
            "spare_gib": self.regions.spare_bytes() / 2**30,
            "host_bank_gib": sum(b.host_bytes for b in self.banks.values()) / 2**30,
            "host_bank_gib_if_full_copy": full_copy / 2**30,
            "counters": total.as_dict(),
            "fallbacks": {f"layer_{m.reap_layer_id}": m.reap_complement_fallback for m in self.layers if m.reap_complement_fallback},
        }

    def sync_tables(self) -> None:
        """Read the online caches' slot owners back into the banks' tables (lazily: before a swap or
        a report, never per step); refuses an owner list that disagrees with the device's routing table."""
        for layer, cache in self.caches.items():
            bank = self.banks[layer]
            owners = cache.read_owners()
            rows = cache.read_row_owners() if cache.complement else None
            problems = check_bijection(owners, [int(x) for x in bank.phys_map.cpu().tolist()], bank.table.host_row_offset, rows)
            if problems:
                raise RuntimeError(f"layer {layer}: online cache state is inconsistent: {problems[:3]}")
            bank.table.assign(owners)
            if rows is not None and bank.complement is not None:
                c = cache.counters()
                bank.complement.adopt_rows(rows, c["evictions"], c["promotions"])

    def reset_caches(self, target: dict[int, tuple[int, ...]], counters: bool = False) -> None:
        """Make ``target`` resident (bank swaps) and restart those layers' caches with it as the prior."""
        self.sync_tables()
        for layer, ids in sorted(target.items()):
            if layer in self.caches:
                self.banks[layer].swap(tuple(ids))
        self._install_priors(target, counters)

    def _install_priors(self, target: dict[int, tuple[int, ...]], counters: bool = False) -> None:
        for layer, ids in target.items():
            cache = self.caches.get(layer)
            if cache is not None:
                comp = self.banks[layer].complement
                cache.install(self.banks[layer].table.owners(), prior=tuple(ids), protected=self.cfg.core(layer),
                              row_owners=comp.rows.owners() if comp is not None else None)
                if counters:
                    cache.reset_counters()
                    if comp is not None:
                        comp.cache_counters_reset()

    def online_cache(self) -> dict[str, Any]:
        """Policy, knobs and device counters of the online cache (read back now: reports only)."""
        if not self.caches:
            return {"enabled": False}
        per_layer = {f"layer_{i}": c.counters() for i, c in self.caches.items()}
        promotions = sum(v["promotions"] for v in per_layer.values())
        any_cache = next(iter(self.caches.values()))
        p = any_cache.params
        return {
            "enabled": True,
            "policy": self.cfg.online_cache,
            "cap": p.cap,
            "decay": p.decay,
            "hysteresis": p.hysteresis,
            "prior_weight": p.prior_weight,
            "step": "one Triton program per layer" if any_cache.fused else "torch ops",
            "prior": "a swap's set enters the scores at prior_weight / (1 - decay); the plan core is protected",
            "layers": len(self.caches),
            "promotions": promotions,
            "evictions": sum(v["evictions"] for v in per_layer.values()),
            "promotion_link_bytes": promotions * next(iter(self.banks.values())).link_bytes,
            "by_layer": per_layer,
        }

    def before_step(self, scheduler_output: Any) -> None:
        """Tell the caches how many token rows of the next forward are real (the rest is graph padding)."""
        if self._valid is not None:
            n = getattr(scheduler_output, "total_num_scheduled_tokens", None)
            self._valid.set(int(n) if isinstance(n, int) and n > 0 else self.arena.max_tokens)

    def problems(self) -> dict[str, list[str]]:
        """Layers whose bookkeeping is broken (``ExpertBank.check``; no bytes compared), by layer."""
        out = {f"layer_{i}": b.check() for i, b in self.banks.items()}
        return {k: v for k, v in out.items() if v}

    def repair(self) -> dict[str, list[str]]:
        """Repair every layer with problems (lost spares back to the pool, routing table re-published),
        hand the online caches the repaired owners; the problems left, by layer."""
        broken = [i for i, b in self.banks.items() if b.check()]
        for i in broken:
            self.banks[i].repair()
        if broken:
            self._install_priors({i: self.banks[i].resident() for i in broken if i in self.caches})
        return self.problems()

    def resident_sets(self) -> dict[str, list[int]]:
        self.sync_tables()
        return {f"layer_{i}": list(b.resident()) for i, b in self.banks.items()}

    def memory(self) -> dict[str, Any]:
        """What residency costs, by kind of memory (vLLM's "Model loading took" omits the VMM bank)."""
        slot = sum(b.slot_bytes for b in self.banks.values())
        host = sum(b.host_bytes for b in self.banks.values())
        on_cuda = self.device.type == "cuda"
        return {
            "slot_bank_gib": slot / 2**30,
            "slot_bank_memory": "device (CUDA VMM, counted by vLLM's memory profile)" if on_cuda else "host RAM",
            "host_bank_gib": host / 2**30,
            # CUDA: every layer maps the same staging region (cuda_vmm.py); CPU: each layer has its own
            "prefill_staging_gib": (max((b.staging_bytes for b in self.banks.values()), default=0) if on_cuda
                                    else sum(b.staging_bytes for b in self.banks.values())) / 2**30,
            "host_bank_memory": "pinned host (CUDA VMM, mapped for the GPU)" if on_cuda else "host RAM",
            "routing_arena_mib": self.layers[0].reap_arena.nbytes / 2**20,
            "accounting_pinned_mib": self.accounting.pinned_bytes / 2**20,
            "request_slots": self.layers[0].reap_arena.request_slots,
            "host_bank_mode": "RAM complement" if any(b.complement for b in self.banks.values()) else "full copy",
            "process": process_memory(),
            "process_at_install": self.memory_at_install,
        }

    def describe(self) -> dict[str, Any]:
        any_bank = next(iter(self.banks.values()))
        return {
            "layers": list(self.banks),
            "num_experts": self.num_experts,
            "slots": {f"layer_{i}": b.num_slots for i, b in self.banks.items()},
            "expert_bytes": any_bank.expert_bytes,
            "backing": any_bank.backing.name,
            "device": str(self.device),
            "memory": self.memory(),
            "accounting": self.accounting.enabled,
            "miss_ledger": self.ledger.stats(),
            "resident": self.resident_sets(),
            "complement": self.complement(),
            "online_cache": self.online_cache(),
            "cpu_path": self.cpu_path(),
            "mode": self.mode(),
        }

    def cpu_path(self) -> dict[str, Any]:
        """The CPU expert path's device counters summed over layers (a read-back: reports only);
        ``wait_timeouts``: CPU pairs the merge gave up waiting for and recomputed on the device."""
        if not self.cpu_paths:
            return {"enabled": False}
        totals = torch.stack([p.counters for p in self.cpu_paths.values()]).sum(0).tolist()  # one read-back, not one per layer
        first = next(iter(self.cpu_paths.values()))
        cost = first.cost
        return {"enabled": True, "layers": len(self.cpu_paths), **dict(zip(CPU_PATH_COUNTERS, totals)),
                # what the split decides by: rates measured at start-up unless the user set them, the CPU's re-rated while serving
                "measured": dict(first.measured),
                "rate_updates": list(first.rate_updates),  # the CPU GB/s the split took while serving, newest last
                "rerating": describe_rerating(self.cpu_rates, True),
                "cost_model": {"link_GBps": cost.link_GBps, "cpu_GBps": cost.cpu_GBps, "max_tokens": cost.max_tokens,
                               "max_step_tokens": cost.step_tokens, "pair_budget": cost.pair_budget},
                "composed_with_online_cache": bool(self.caches)}

    def mode(self) -> str:
        """The forward's residency mode, in words (``/reap/status``)."""
        if self.caches and self.cpu_paths:
            return ("fast: the CPU split runs first and takes the coldest misses by the online cache's scores; "
                    "the cache promotes from the link's share")
        if self.cpu_paths:
            return "CPU expert path over the static set"
        if self.caches:
            return "online cache"
        return "static set (swaps between requests)"

    def check_cpu_timeouts(self) -> list[int]:
        """Layers whose merge gave up waiting for the CPU team since the last check (mapped flags, no
        sync); logged as errors: those pairs were recomputed on the device, never merged stale."""
        layers = [i for i, p in self.cpu_paths.items() if p.take_timeout_flag()]
        if layers:
            self.cpu_timeout_steps += 1
        n = self.cpu_timeout_steps
        if layers and n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th ... step with timeouts: loud, not a flood
            logger.error("reap-swap CPU expert path: the CPU team did not finish a step in time in layers %s; those pairs were "
                         "recomputed on the GPU from the host rows (reap_swap_cpu_path_wait_timeouts in /metrics). The team is "
                         "stalled or starved: check REAP_CPU_EXPERT_CPUS (cores shared with vLLM or another rank?) and host load "
                         "(%d steps with timeouts so far)", layers, n)
        return layers

    def after_step(self, runner: Any, scheduler_output: Any) -> None:
        try:
            self.check_cpu_timeouts()
            acct = self.accounting
            finished = getattr(scheduler_output, "finished_req_ids", None)
            if acct.enabled:
                layout = batch_layout(runner, scheduler_output)
                if layout is None:
                    self.steps_unattributed += 1
                elif layout.total:
                    acct.record_step(layout)
                    self.steps_attributed += 1
            if self.staging:  # a layer writes its staged experts only in staged steps: the next step starts from none
                self.arena.stage_rows.fill_(-1)
            if finished:
                acct.finish(finished)
            acct.poll()
        finally:  # last, and whatever the accounting did: it guards itself (rates.CpuRateCheck)
            if self.cpu_rates is not None:
                self.cpu_rates.after_step()

    def flush(self) -> None:
        """Book every request's sums so far into the ledger (blocks; for reports only)."""
        self.accounting.flush()

    def flush_request(self, client_id: str) -> int:
        """Book one client's sums so far (blocks on its copies only; ``/router_misses/{id}``)."""
        return self.accounting.flush_request(client_id)

    def swap(self, target: dict[str, list[int]]) -> dict[str, Any]:
        wanted: dict[int, tuple[int, ...]] = {}
        for key, ids in target.items():
            layer = int(str(key).removeprefix("layer_"))
            if layer not in self.banks:
                raise ValueError(f"layer {layer} has no expert bank on this worker")
            wanted[layer] = tuple(int(e) for e in ids)
        self.sync_tables()  # the online caches moved experts since the last swap
        for layer, ids in wanted.items():  # validate every layer before touching any
            self.banks[layer].table.plan(ids)
        total = SwapStats()
        t0 = time.perf_counter()
        done = 0
        try:
            for layer, ids in sorted(wanted.items()):
                total.add(self.banks[layer].swap(ids))
                done += 1
        finally:
            if done < len(wanted) and self.caches:
                # Failed part-way: each cache must take the owners its table (and routing map) hold
                # now, or it would promote into slots it believes free.
                self._install_priors({i: tuple(e for e in self.banks[i].table.owners() if e >= 0) for i in self.caches})
        self._install_priors(wanted)
        return {
            "experts_loaded": total.experts_loaded,
            "experts_evicted": total.experts_evicted,
            "bytes_copied": total.bytes_copied,
            "copy_ms": total.copy_s * 1e3,
            "publish_ms": total.publish_s * 1e3,
            "total_ms": (time.perf_counter() - t0) * 1e3,
            "layers_changed": total.layers_changed,
            "resident": self.resident_sets(),
            "problems": self.problems(),
            "complement": self.complement(),
            "online_cache": self.online_cache(),
        }


class _ValidRows:
    """Writes the step's real row count into the arena before the forward, without waiting (CUDA:
    from a pinned ring, like the accounting's row map; CPU: a plain store)."""

    def __init__(self, target: Any):
        import torch

        self.target = target
        self.cuda = target.is_cuda
        self._i = 0
        if self.cuda:
            self._stage = torch.zeros(_STAGE_RING, dtype=torch.int32, pin_memory=True)
            self._events = [torch.cuda.Event() for _ in range(_STAGE_RING)]

    def set(self, n: int) -> None:
        if not self.cuda:
            self.target.fill_(n)
            return
        i = self._i = (self._i + 1) % _STAGE_RING
        if not self._events[i].query():
            self._events[i].synchronize()
        self._stage[i] = n
        self.target.copy_(self._stage[i : i + 1], non_blocking=True)
        self._events[i].record()


_STAGE_RING = 8


def host_regions(banks: dict[int, ExpertBank]) -> HostRegions:
    """Register every complement bank's host rows (refusing overlaps), then freeze the pools."""
    regions = HostRegions()
    for layer, bank in banks.items():
        if bank.complement is None:
            continue
        spares = bank.host_rows - (bank.num_experts - bank.num_slots)  # rows beyond a full slot bank
        # The banked parameters only: side tensors (scales) have no host rows in host memory.
        regions.register(layer, bank.complement.rows.block, bank.host_spans(), spares)
    regions.freeze()
    return regions


def _wrap_execute_model(worker: Any, runtime: WorkerResidency) -> None:
    runner = worker.model_runner
    original = runner.execute_model

    @functools.wraps(original)
    def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("dummy_run", False):
            try:  # a wrong count only makes the cache treat rows as padding; ids stay correct
                runtime.before_step(scheduler_output)
            except Exception:
                logger.exception("reap-swap: could not set the step's row count for the online cache")
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
            self.reap_runtime = WorkerResidency(layers, cfg.ledger_size, cfg.accounting)
            _wrap_execute_model(self, self.reap_runtime)
            mem = self.reap_runtime.memory()
            logger.info(
                "reap-swap: residency on %d MoE layers; slot banks %.2f GiB (%s), host bank %.2f GiB (%s), "
                "routing arena %.1f MiB, accounting %s (%.1f MiB pinned)",
                len(layers),
                mem["slot_bank_gib"],
                mem["slot_bank_memory"],
                mem["host_bank_gib"],
                mem["host_bank_memory"],
                mem["routing_arena_mib"],
                "on" if cfg.accounting else "off",
                mem["accounting_pinned_mib"],
            )
            comp = self.reap_runtime.complement()
            if comp["enabled"]:
                sizes = self.reap_runtime.regions.spares_by_size()
                logger.info(
                    "reap-swap: RAM complement on %d layers: %d spare host rows in %d block sizes (largest %d bytes, "
                    "%.3f GiB %s); host bank %.3f GiB instead of %.3f GiB; exchanges rotate rows, no host memcpy",
                    comp["layers"], sum(sizes.values()), len(sizes), max(sizes), comp["spare_gib"],
                    "page-locked" if mem["host_bank_memory"].startswith("pinned") else "host RAM",
                    comp["host_bank_gib"], comp["host_bank_gib_if_full_copy"],
                )
            for layer, why in comp["fallbacks"].items():
                logger.warning("reap-swap: %s uses the full host copy: %s", layer, why)
        return self.reap_runtime.describe()

    def _reap(self) -> WorkerResidency:
        if self.reap_runtime is None:
            raise RuntimeError("reap_install has not run on this worker")
        return self.reap_runtime

    def reap_state(self) -> dict[str, Any]:
        rt = self._reap()
        rt.reads["reap_state"] += 1
        rt.flush()
        state = rt.describe()
        state["steps_attributed"] = rt.steps_attributed
        state["steps_unattributed"] = rt.steps_unattributed
        state["ledger_evicted"] = rt.ledger.evicted
        state["accounting_stats"] = {
            "steps_recorded": rt.accounting.steps_recorded,
            "steps_skipped": rt.accounting.steps_skipped,
            "drains": rt.accounting.drains,
            "live_request_slots": len(rt.accounting.slots),
        }
        return state

    def reap_swap(self, target: dict[str, list[int]]) -> dict[str, Any]:
        return self._reap().swap(target)

    def reap_router_misses(self, client_id: str, reset: bool = False) -> dict[str, Any] | None:
        self._reap().reads["reap_router_misses"] += 1
        self._reap().flush_request(client_id)  # that request's slots only: O(1) per report, not O(live requests)
        ledger = self._reap().ledger
        report = ledger.report(client_id)
        if report is not None and reset:
            ledger.reset(client_id)
        return report

    def reap_books(self) -> dict[str, Any]:
        """What this rank's books hold (miss-ledger entries and bytes) and the report reads it served;
        cheap (no flush, no device read), so ``/reap/status`` reads it on every call."""
        rt = self._reap()
        return {"miss_ledger": rt.ledger.stats(), "reads": dict(rt.reads)}

    def reap_reset_router_stats(self) -> int:
        rt = self._reap()
        rt.flush()
        return rt.ledger.reset("__all__")

    def reap_set_accounting(self, enabled: bool) -> bool:
        """Diagnosis switch: with accounting off, steps add nothing to the miss ledger."""
        rt = self._reap()
        rt.flush()
        rt.accounting.enabled = bool(enabled)
        return rt.accounting.enabled

    def reap_verify(self) -> dict[str, list[str]]:
        """Per layer, what is wrong (must be empty): resident experts whose slot bytes differ from
        their host copy, and the bookkeeping invariants (``ExpertBank.check``: host-row owners, the
        spare pool, routing-table damage)."""
        rt = self._reap()
        rt.sync_tables()
        return {f"layer_{i}": [f"expert {e}: slot bytes or host-row ownership wrong" for e in b.verify()] + b.check()
                for i, b in rt.banks.items()}

    def reap_cpu_path_stats(self, reset: bool = False) -> dict[str, Any]:
        """CPU expert path (REAP_CPU_EXPERTS): misses the CPU computed, its GB/s, the cost model."""
        rt = self._reap()
        paths = list(rt.cpu_paths.values())
        out = {**cpu_path_summary(paths), "rerating": describe_rerating(rt.cpu_rates, bool(paths))}
        if out.get("bad_id_layers"):  # the team cannot raise into the graph: it computed nothing for those steps
            logger.error("reap-swap CPU expert path: expert ids outside the layer's range in layers %s; their CPU outputs were not computed",
                         out["bad_id_layers"])
        if out.get("enabled") and not out.get("device_seq_in_step"):
            logger.error("reap-swap CPU expert path: the device's copy of the team's last posted step differs from the mailbox's; "
                         "something posted to the team outside CpuTeam.run, and CPU outputs may be stale")
        if reset:
            for p in paths:
                p.reset_stats()
            if rt.cpu_rates is not None:  # the team's counters start again: so does the re-rating's window
                rt.cpu_rates.restart()
        return out

    def reap_cache_view(self) -> dict[str, Any]:
        """This rank's resident sets and online-cache counters, read back from the device now."""
        rt = self._reap()
        return {"rank": int(getattr(self, "rank", 0) or 0), "resident": rt.resident_sets(), "online_cache": rt.online_cache(),
                "problems": rt.problems()}
