"""vLLM glue: the routed-experts layer with an expert-granular slot bank.

Registered with ``RoutedExperts.register_oot`` when a worker imports the
worker extension, i.e. before the model is built, so every MoE layer vLLM
constructs is this class. After the quant method has put the weights in
their runtime format, the layer turns its per-expert parameters into an
``ExpertBank`` (slot rows + host rows). Its forward pass is tensor-only, so
it runs under torch.compile and CUDA graphs:

1. one kernel maps logical expert ids to physical bank rows and writes each
   routed pair (hit or miss, gate weight) to this layer's rows of the routing
   arena, which the worker accumulates per request after the step;
2. with the CPU expert path on (``REAP_CPU_EXPERTS``) and a decode-sized step,
   the split (``cpu_experts/``) gives the CPU its share of the misses and posts it
   to the CPU team; with the online cache on too, the CPU takes the coldest
   misses (lowest cache score) -- one decision per miss;
3. with the online cache on (``REAP_ONLINE_CACHE``), the promotion step
   (``online_cache.py``): scores, up to C host -> slot copies from the link's
   share of the misses, table update, and the step's ids remapped once more
   from the updated table (the CPU's pairs to the filler row);
3b. with prefill staging on (``REAP_PREFILL_STAGING_ROWS``) and a step of at least its
   token threshold, the pairs still reading host rows: the most-routed missed experts
   are copied once into the bank's staging rows and their pairs remapped there
   (``prefill_staging.py``), so the fused kernel reads them from HBM;
4. the stock fused-MoE path runs unchanged on the remapped ids; the CPU's
   outputs are merged before its ``moe_sum``.

Hits and misses are captured in step 1, as routed, before any promotion.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

from . import config as reap_config
from .step.arena import arena_for
from .bank.bank import ComplementSpec, ExpertBank, PlainBacking
from .step import logical_experts
from .cpu_experts.cpu_path import CpuPathConfigError, CpuPathSettings, LayerCpuPath, check_expert_weights
from .cpu_experts.rates import measure_cpu_GBps, measure_link_GBps
from .cache.online_cache import CacheParams, LayerCache
from .cache.prefill_staging import StagingParams, stage_step
from .step.routing_kernels import remap_and_capture

logger = logging.getLogger("reap_swap.server_ext")

# Per-expert parameters that are shared, not per expert (mirrors vLLM's EPLB list).
_NON_EXPERT_PARAMS = {"e_score_correction_bias", "w13_input_scale", "w2_input_scale", "hash_indices_table"}

# Registry: (link GB/s, CPU GB/s) measured once per device by the first layer with the CPU path.
_MEASURED_RATES: dict[str, tuple[float, float]] = {}


def _layer_index(layer_name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return int(extract_layer_index(layer_name))


def local_ranks() -> tuple[int, int]:
    """(local rank, ranks on this host) of this worker, for the CPU expert team's cores: torchrun's
    ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` when both are set, else vLLM's world group (its
    ``local_rank`` and world size over node count; vLLM's multiprocessing workers set no env)."""
    import os

    rank, world = os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE")
    if rank is not None and world is not None:
        return int(rank), int(world)
    try:
        from vllm.distributed import parallel_state as ps

        group = ps.get_world_group()
        nodes = max(1, int(getattr(ps, "_NODE_COUNT", None) or 1))
        return int(group.local_rank), max(1, int(group.world_size) // nodes)
    except (AssertionError, AttributeError, ImportError):  # no distributed state: one process
        return 0, 1


_KERNEL_QC_OPERANDS = ("w1_scale", "w2_scale", "w1_bias", "w2_bias", "w1_zp", "w2_zp")
_KERNEL_EXPERTS_OPERANDS = ("w13_g_idx", "w2_g_idx", "w13_g_idx_sort_indices", "w2_g_idx_sort_indices", "w1_scale", "w2_scale",
                            "w1_zp", "w2_zp", "w1_bias", "w2_bias")


def kernel_operand_problem(layer_id: int, quant_method: Any, bank: ExpertBank) -> str | None:
    """Why the fused kernel of ``quant_method`` cannot run on ``bank``'s physical rows, or None.

    Pure over duck-typed objects (the unit tests pass stand-ins): a monolithic kernel routes inside
    itself, so the layer's remapped ids never reach it; a per-expert tensor the kernel's quant config or
    experts object holds that is not one of the bank's tensors has ``num_experts`` rows, not the bank's,
    and would be read past its end at host-row ids."""
    name = type(quant_method).__name__
    kernel = getattr(quant_method, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    try:
        monolithic = bool(getattr(quant_method, "is_monolithic", False))
    except Exception:  # a property that needs state this quant method lacks: judged by its kernel below
        monolithic = False
    if not monolithic and experts is not None:
        flag = getattr(experts, "is_monolithic", None)
        try:
            monolithic = bool(flag() if callable(flag) else flag)
        except Exception:
            monolithic = False
    if monolithic:
        return (f"layer {layer_id}: {name} runs a monolithic fused-MoE kernel ({type(experts).__name__ if experts is not None else 'no modular experts'}) "
                f"that routes inside the kernel; expert residency remaps the router's ids before vLLM's modular kernel and cannot serve it "
                f"(serve without residency, or pick a modular MoE backend)")
    ours = {p.data.data_ptr() for p in bank.params.values()}
    for owner, attrs in ((getattr(quant_method, "moe_quant_config", None), _KERNEL_QC_OPERANDS), (experts, _KERNEL_EXPERTS_OPERANDS)):
        if owner is None:
            continue
        for attr in attrs:
            try:
                t = getattr(owner, attr)
            except (AssertionError, AttributeError):  # not a plain tensor in this config
                continue
            if (isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == bank.num_experts and t.numel() > 0
                    and t.data_ptr() not in ours):
                return (f"layer {layer_id}: {name}'s kernel holds its own per-expert {attr} {tuple(t.shape)}, not the bank's; "
                        f"expert residency cannot remap it (serve without residency)")
    return None


def make_backing(device: torch.device) -> Any:
    if device.type == "cuda":
        from .bank.cuda_vmm import VmmBacking

        return VmmBacking(device)
    return PlainBacking(device)


@RoutedExperts.register_oot
class ResidentRoutedExperts(RoutedExperts):
    """RoutedExperts whose experts live in a slot bank (resident) or host bank (the rest)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.reap_bank: ExpertBank | None = None
        self.reap_bank_rows: list[torch.Tensor] = []
        self.reap_cache: LayerCache | None = None
        self.reap_cpu_path: LayerCpuPath | None = None
        self.reap_staging: StagingParams | None = None
        """Prefill staging settings when on (the bank has that many staging rows)."""
        self.reap_complement_fallback: str | None = None
        """Why RAM-complement mode was asked for but the full-copy bank was built instead."""
        self.reap_layer_id = _layer_index(self.layer_name)
        cfg = reap_config.from_env()
        self.reap_slots = cfg.slots_for(self.reap_layer_id, self.global_num_experts) if cfg.enabled else 0
        if not cfg.enabled:
            return
        if self.use_ep or self.local_num_experts != self.global_num_experts:
            raise reap_config.ResidencyConfigError("expert-granular residency does not support expert parallelism")
        vllm_config = get_current_vllm_config()
        sched = vllm_config.scheduler_config
        self.reap_max_tokens = int(sched.max_num_batched_tokens)
        self.reap_quantization: str | None = getattr(vllm_config.model_config, "quantization", None)
        num_layers = getattr(vllm_config.model_config.hf_text_config, "num_hidden_layers", None)
        if not isinstance(num_layers, int) or num_layers <= self.reap_layer_id:
            raise reap_config.ResidencyConfigError(f"cannot size the routing arena: num_hidden_layers={num_layers!r}")
        # One slot per schedulable request plus a few for requests whose sums are being read back.
        cap = cfg.cache_cap if cfg.online_cache else 0
        stage = min(cfg.staging_rows, self.global_num_experts)
        arena = arena_for(vllm_config, num_layers, self.reap_max_tokens, int(self.top_k), self.global_num_experts, int(sched.max_num_seqs) + 8, cap,
                          stage)
        arena.check_layer(self.reap_layer_id, int(self.top_k), self.global_num_experts, cap, stage)
        if stage:
            self.reap_staging = StagingParams(stage, cfg.staging_min_step_tokens, cfg.staging_min_expert_tokens)
        self.reap_arena = arena
        self.reap_codes = arena.codes[self.reap_layer_id]
        self.reap_weights = arena.weights[self.reap_layer_id]
        self.reap_host_offset = self.global_num_experts
        self.register_buffer("reap_phys_map", torch.arange(self.global_num_experts, dtype=torch.int32), persistent=False)
        hook = self.quant_method.process_weights_after_loading

        def process_then_build(layer: torch.nn.Module) -> None:
            hook(layer)
            if layer is self:
                self.reap_build_bank()

        # Instance-level: only this layer's own quant method object is wrapped.
        self.quant_method.process_weights_after_loading = process_then_build  # type: ignore[method-assign]

    def reap_expert_params(self) -> dict[str, torch.nn.Parameter]:
        return {
            name: p
            for name, p in self.named_parameters(recurse=False)
            if name not in _NON_EXPERT_PARAMS and p.dim() >= 1 and p.shape[0] == self.local_num_experts
        }

    def reap_build_bank(self) -> None:
        if self.reap_bank is not None:
            return
        cfg = reap_config.from_env()
        params = self.reap_expert_params()
        device = next(iter(params.values())).device
        start = cfg.start_resident(self.reap_layer_id, self.global_num_experts, self.reap_slots)
        backing = make_backing(device)
        staging = self.reap_staging.rows if self.reap_staging is not None else 0
        cpu_settings = CpuPathSettings.from_env()
        if cpu_settings.enabled:
            check_expert_weights(self.reap_layer_id, params, self.reap_quantization)  # before the device check: it names the real obstacle
            self._check_cpu_path_allowed(cfg, device)
            backing.grant_host_access()  # the CPU reads the host rows in place
        bank: ExpertBank | None = None
        if cfg.ram_complement and self.reap_slots > 0:  # no slots: nothing to complement
            spec = ComplementSpec(min(cfg.complement_spares, self.reap_slots), start)
            try:
                bank = ExpertBank(self.reap_layer_id, params, self.reap_phys_map, self.reap_slots, backing, spec, staging_rows=staging)
            except RuntimeError as exc:  # pinning / mapping failed: nothing was changed, use the copy path
                self.reap_complement_fallback = f"{type(exc).__name__}: {exc}"
                logger.warning("reap-swap layer %d: RAM-complement bank not built (%s); using the full host copy",
                               self.reap_layer_id, self.reap_complement_fallback)
        if bank is None:
            bank = ExpertBank(self.reap_layer_id, params, self.reap_phys_map, self.reap_slots, backing, staging_rows=staging)
        self.reap_bank = bank
        self.reap_bank_rows = [p.data for n, p in bank.params.items() if bank.row_bytes[n] > 0]
        """Every per-expert parameter's bank tensor, bound once here (the bank never rebinds them): the
        promotion step's copy list, not rebuilt per layer step. Zero-byte rows (GPTQ-Marlin's ``[E, 0]``
        g_idx without act order) have nothing to copy and are left out (a Triton grid of zero chunks)."""
        self._check_kernel_operands()
        self.reap_host_offset = self.reap_bank.table.host_row_offset
        stats = self.reap_bank.swap(start)
        if cfg.online_cache and self.reap_slots > 0:
            params = CacheParams(cfg.cache_cap, cfg.cache_decay, cfg.cache_hysteresis, cfg.cache_prior_weight, cfg.cache_fused)
            bank = self.reap_bank
            comp = bank.complement
            self.reap_cache = LayerCache(bank.num_experts, bank.num_slots, bank.table.host_row_offset, bank.phys_map, params,
                                         host_rows=comp.rows.num_rows if comp is not None else None)
            self.reap_cache.install(bank.table.owners(), prior=start, protected=cfg.core(self.reap_layer_id),
                                    row_owners=comp.rows.owners() if comp is not None else None)
        if cpu_settings.enabled:
            self.reap_cpu_path = self._build_cpu_path(cpu_settings, device)
        if device.type == "cuda":
            # The fused kernels size their expert histograms from this count; their tile
            # config and path still follow the logical count (logical_experts.py).
            self.global_num_experts = self.reap_bank.physical_rows
            logical_experts.register(self.reap_bank.physical_rows, self.reap_bank.num_experts)
            logical_experts.install()
        logger.debug(
            "reap-swap layer %d: %d slots (%d rows, %.3f GiB) + %d host rows (%.3f GiB, %s%s), %d resident at start",
            self.reap_layer_id,
            self.reap_slots,
            self.reap_bank.table.host_row_offset,
            self.reap_bank.slot_bytes / 2**30,
            self.reap_bank.host_rows,
            self.reap_bank.host_bytes / 2**30,
            self.reap_bank.backing.name,
            ", RAM complement" if self.reap_bank.complement else "",
            len(self.reap_bank.resident()),
        )

    def _check_kernel_operands(self) -> None:
        """The fused kernel reads scales and biases at the physical row ids, so the tensors its quant
        config holds must be the bank's (vLLM keeps the Parameter objects whose ``.data`` the bank
        rebinds). A per-expert copy taken earlier would be read past its end: refused at load. The same
        holds for what the experts object keeps (Marlin's act-order ``g_idx`` / sort indices, when a vLLM
        passes them at kernel build). A monolithic kernel (routing inside the kernel: FlashInfer TRT-LLM
        MXINT4 / FP8 / NVFP4 on Blackwell) never sees the remapped ids: refused, naming it."""
        bank = self.reap_bank
        if bank is None:
            return
        refuse = kernel_operand_problem(self.reap_layer_id, self.quant_method, bank)
        if refuse:
            raise reap_config.ResidencyConfigError(refuse)

    def _check_cpu_path_allowed(self, cfg: reap_config.ResidencyConfig, device: torch.device) -> None:
        if device.type != "cuda":
            raise CpuPathConfigError("REAP_CPU_EXPERTS needs a CUDA device (on a CPU-only server the CPU computes every expert already)")
        if self.reap_slots < 1:
            raise CpuPathConfigError("REAP_CPU_EXPERTS needs at least one resident slot per layer")

    def _build_cpu_path(self, settings: CpuPathSettings, device: torch.device) -> LayerCpuPath:
        from .cpu_experts.cuda_host import MappedStaging
        from .cpu_experts.kernel import CpuThreads
        from .cpu_experts.step import BankRows

        bank = self.reap_bank
        assert bank is not None
        experts = getattr(getattr(self.quant_method, "moe_kernel", None), "fused_experts", None)
        if not callable(getattr(experts, "moe_sum", None)):
            raise CpuPathConfigError(
                f"REAP_CPU_EXPERTS needs vLLM's modular fused-MoE kernel (its moe_sum step); layer {self.reap_layer_id} runs {type(experts).__name__}")
        if type(experts).__name__.startswith("FlashInfer"):  # its moe_sum only raises: the k-sum happens inside its kernel
            raise CpuPathConfigError(
                f"REAP_CPU_EXPERTS merges the CPU's outputs in the fused kernel's moe_sum step; layer {self.reap_layer_id} runs "
                f"{type(experts).__name__}, which sums inside its kernel (and keeps w13 as up, gate). Serve with vLLM's Triton "
                f"experts (e.g. VLLM_USE_FLASHINFER_MOE_FP8=0) or without --cpu-experts")
        backend = str(getattr(self.quant_method, "fp8_backend", "") or "")
        if backend and "TRITON" not in backend.upper():  # other FP8 backends repack w13 (FlashInfer: up before gate) or their scales
            raise CpuPathConfigError(
                f"REAP_CPU_EXPERTS computes FP8 experts laid out as vLLM's Triton backend keeps them; layer {self.reap_layer_id} "
                f"uses {backend}. Serve with the Triton FP8 MoE backend (e.g. VLLM_USE_FLASHINFER_MOE_FP8=0) or without --cpu-experts")
        activation = getattr(getattr(self, "activation", None), "value", getattr(self, "activation", "silu"))
        unsupported = [why for why, bad in (
            (f"activation {activation!r} (the CPU kernel computes SiLU-and-mul)", str(activation).lower() != "silu"),
            ("expert biases", getattr(self, "w13_bias", None) is not None or getattr(self, "w2_bias", None) is not None),
            ("routing weights applied to the input", bool(getattr(self, "apply_router_weight_on_input", False))),
        ) if bad]
        if unsupported:
            raise CpuPathConfigError(f"REAP_CPU_EXPERTS: layer {self.reap_layer_id} has {', '.join(unsupported)}, which the CPU expert kernel does not compute")
        w13, w2 = (bank.params[n].data for n in ("w13_weight", "w2_weight"))
        # the CPU reads the host rows the routing table points at (RAM complement: fewer rows than experts)
        rows = BankRows(w13, w2, bank.table.host_row_offset, bank.host_rows, self._cpu_quant(w13, w2))
        # A padding row of the slot region (zeros) if there is one, else slot 0: HBM either way.
        filler = bank.num_slots if bank.table.host_row_offset > bank.num_slots else 0
        rank, world = local_ranks()
        key = str(device)
        rates = _MEASURED_RATES.get(key)
        probe_cost = settings.cost(rates[0] if rates else 50.0, rates[1] if rates else 50.0, top_k=int(self.top_k))
        path = LayerCpuPath(rows, int(self.top_k), filler, settings, probe_cost, CpuThreads.from_env(local_rank=rank, local_world=world), device,
                            MappedStaging(device), num_experts=bank.num_experts)
        if rates is None:
            rates = (measure_link_GBps(w13[bank.table.host_row_offset:]), measure_cpu_GBps(path))
            _MEASURED_RATES[key] = rates
            logger.info("reap-swap CPU expert path: link %.1f GB/s, CPU %.1f GB/s measured", *rates)
        path.cost = settings.cost(*rates, top_k=int(self.top_k))
        path.measured = {"link_GBps": rates[0], "cpu_GBps": rates[1]}

        orig_moe_sum = experts.moe_sum

        def moe_sum(input: torch.Tensor, output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            return orig_moe_sum(path.merge(input), output, *args, **kwargs)

        experts.moe_sum = moe_sum  # instance-level: this layer's kernel object only
        return path

    def _cpu_quant(self, w13: torch.Tensor, w2: torch.Tensor) -> Any:
        """FP8 experts: the host copy of their weight scales (``cpu_experts.quant``); None for bf16.

        The copy is right only while each host row keeps its expert: the RAM complement's exchanges
        rewrite host rows (and their side rows, on the device) as the set rotates, so FP8 with the
        complement is refused rather than computed with another expert's scales."""
        from .cpu_experts.quant import FP8_DTYPES, expert_quant

        bank = self.reap_bank
        assert bank is not None
        if w13.dtype not in FP8_DTYPES:
            return None
        if bank.complement is not None:
            raise CpuPathConfigError(
                f"--cpu-experts with FP8 experts cannot run beside --ram-complement (layer {self.reap_layer_id}): the CPU reads "
                f"each host row's scales from a host copy, and the complement's exchanges move experts between host rows. "
                f"Serve without one of the two")
        # the block the scales were laid out with: vLLM may fit the checkpoint's block to a TP split (moe_block_shape)
        block = getattr(self.quant_method, "moe_block_shape", None) or getattr(getattr(self.quant_method, "quant_config", None),
                                                                             "weight_block_size", None)
        try:
            return expert_quant(w13, w2, {n: p.data for n, p in bank.params.items()}, block)
        except ValueError as exc:
            raise CpuPathConfigError(f"--cpu-experts: layer {self.reap_layer_id}'s FP8 experts: {exc}") from exc

    def _stage(self, topk_ids: torch.Tensor, phys: torch.Tensor) -> torch.Tensor:
        """Prefill staging of a large step (after the cache's promotions, which stay as they are): the
        pairs that still read host rows, for the most-routed missed experts, remapped to staging rows
        their bytes were copied into once. Small steps and staging off: ``phys`` unchanged."""
        params, bank = self.reap_staging, self.reap_bank
        if params is None or bank is None or not params.applies(int(topk_ids.shape[0])):
            return phys
        return stage_step(topk_ids, phys, self.reap_phys_map, self.reap_host_offset, bank.staging_offset, self.reap_bank_rows, params,
                          self.reap_arena.valid_rows, self.reap_arena.stage_rows[self.reap_layer_id, : params.rows])

    def forward_modular(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: Any = None,
        shared_experts_input: torch.Tensor | None = None,
    ) -> Any:
        if self.reap_bank is not None:
            if topk_ids.shape[0] > self.reap_max_tokens:
                raise RuntimeError(f"{topk_ids.shape[0]} tokens in one step exceed max_num_batched_tokens={self.reap_max_tokens}")
            phys = remap_and_capture(
                topk_ids, topk_weights, self.reap_phys_map, self.reap_host_offset, self.reap_codes, self.reap_weights
            )
            cache, cpu, arena = self.reap_cache, self.reap_cpu_path, self.reap_arena
            if cpu is not None and cpu.takes(int(topk_ids.shape[0])):
                # One decision per miss (composed mode): the split runs first and gives the CPU the coldest
                # misses (lowest cache score); the cache then promotes only from the link's share, whose bytes
                # cross the link anyway, and the CPU's pairs read the filler row.
                gpu_ids = cpu.before_experts(x, topk_ids, topk_weights, phys, self.reap_host_offset, arena.valid_rows,
                                             priority=cache.score if cache is not None else None)
                if cache is not None:
                    gpu_ids = cache.step(topk_ids, self.reap_bank_rows, arena.valid_rows, arena.promo_rows[self.reap_layer_id, : cache.cap],
                                         cpu_pairs=cpu.pending_pairs, filler=cpu.filler_row)
                phys = self._stage(topk_ids, gpu_ids)
                try:
                    out = super().forward_modular(x=x, topk_weights=topk_weights, topk_ids=phys, shared_experts=shared_experts,
                                                  shared_experts_input=shared_experts_input)
                finally:
                    merged = cpu.abandon()
                if not merged:
                    raise RuntimeError(f"layer {self.reap_layer_id}: vLLM's moe_sum was not called, the CPU experts' outputs would be lost")
                return out
            if cache is not None and topk_ids.shape[0] > 0:
                phys = cache.step(topk_ids, self.reap_bank_rows, arena.valid_rows, arena.promo_rows[self.reap_layer_id, : cache.cap])
            topk_ids = self._stage(topk_ids, phys)
        return super().forward_modular(
            x=x,
            topk_weights=topk_weights,
            topk_ids=topk_ids,
            shared_experts=shared_experts,
            shared_experts_input=shared_experts_input,
        )
