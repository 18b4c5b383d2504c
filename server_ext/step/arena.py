"""Device buffers shared by every banked MoE layer of one model: the routing capture rows
and the per-request accumulators.

The layers write their capture rows inside CUDA graphs, so the buffers must
exist, at fixed addresses, before vLLM captures the graphs: the first layer
built creates the arena and the others join it. That happens while vLLM
builds the model, so vLLM's memory profile sees these bytes. Keyed by the
vLLM config object, the one thing all layers of a model share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .routing_kernels import COMPONENTS


@dataclass
class RoutingArena:
    codes: torch.Tensor  # [arena layers, max_tokens, K] int32: expert id, or -1 - id when read from the host bank
    weights: torch.Tensor  # [arena layers, max_tokens, K] float32 gate weights
    acc: torch.Tensor  # [request slots, arena layers, COMPONENTS, experts] float32
    row_slot: torch.Tensor  # [max_tokens] int32: request slot of each token row of the last step
    valid_rows: torch.Tensor  # [1] int32: real token rows of the step being run (the rest is graph padding)
    promo_rows: torch.Tensor  # [arena layers, C] int32: online cache, first row routing each promotion of the step, -1: none
    promo_acc: torch.Tensor  # [request slots, arena layers] float32: online-cache promotions per request
    stage_rows: torch.Tensor  # [arena layers, P] int32: prefill staging, first row routing each staged expert of the step, -1: none
    stage_acc: torch.Tensor  # [request slots, arena layers] float32: prefill-staged experts per request

    @property
    def stage_cap(self) -> int:
        return int(self.stage_rows.shape[1])

    @property
    def promo_cap(self) -> int:
        return int(self.promo_rows.shape[1])

    @property
    def num_layers(self) -> int:
        return int(self.codes.shape[0])

    @property
    def max_tokens(self) -> int:
        return int(self.codes.shape[1])

    @property
    def request_slots(self) -> int:
        return int(self.acc.shape[0])

    @property
    def nbytes(self) -> int:
        parts = (self.codes, self.weights, self.acc, self.row_slot, self.valid_rows, self.promo_rows, self.promo_acc, self.stage_rows,
                 self.stage_acc)
        return sum(t.numel() * t.element_size() for t in parts)

    def check_layer(self, layer_id: int, top_k: int, num_experts: int, promo_cap: int = 0, stage_cap: int = 0) -> None:
        if not 0 <= layer_id < self.num_layers:
            raise ValueError(f"MoE layer {layer_id} is outside the routing arena's {self.num_layers} layers")
        if top_k != self.codes.shape[2] or num_experts != self.acc.shape[3]:
            raise ValueError(
                f"MoE layer {layer_id}: top-k {top_k} / {num_experts} experts differ from the model's "
                f"{self.codes.shape[2]} / {self.acc.shape[3]}; mixed MoE shapes are not supported"
            )
        if promo_cap > self.promo_cap:
            raise ValueError(f"MoE layer {layer_id}: online-cache cap {promo_cap} exceeds the arena's {self.promo_cap}")
        if stage_cap > self.stage_cap:
            raise ValueError(f"MoE layer {layer_id}: {stage_cap} prefill staging rows exceed the arena's {self.stage_cap}")


def new_arena(num_layers: int, max_tokens: int, top_k: int, num_experts: int, request_slots: int, device: torch.device | None = None,
              promo_cap: int = 0, stage_cap: int = 0) -> RoutingArena:
    return RoutingArena(
        codes=torch.zeros(num_layers, max_tokens, top_k, dtype=torch.int32, device=device),
        weights=torch.zeros(num_layers, max_tokens, top_k, dtype=torch.float32, device=device),
        acc=torch.zeros(request_slots, num_layers, COMPONENTS, num_experts, dtype=torch.float32, device=device),
        row_slot=torch.zeros(max_tokens, dtype=torch.int32, device=device),
        valid_rows=torch.full((1,), max_tokens, dtype=torch.int32, device=device),
        promo_rows=torch.full((num_layers, promo_cap), -1, dtype=torch.int32, device=device),
        promo_acc=torch.zeros(request_slots, num_layers if promo_cap else 0, dtype=torch.float32, device=device),
        stage_rows=torch.full((num_layers, stage_cap), -1, dtype=torch.int32, device=device),
        stage_acc=torch.zeros(request_slots, num_layers if stage_cap else 0, dtype=torch.float32, device=device),
    )


# Registry: one arena per model being built in this process (key: id of its vLLM config).
_ARENAS: dict[int, RoutingArena] = {}


def arena_for(owner: object, num_layers: int, max_tokens: int, top_k: int, num_experts: int, request_slots: int,
              promo_cap: int = 0, stage_cap: int = 0) -> RoutingArena:
    """The arena of ``owner``'s model, created (on torch's current default device) by the first layer."""
    arena = _ARENAS.get(id(owner))
    if arena is None:
        arena = _ARENAS[id(owner)] = new_arena(num_layers, max_tokens, top_k, num_experts, request_slots, promo_cap=promo_cap,
                                              stage_cap=stage_cap)
    return arena
