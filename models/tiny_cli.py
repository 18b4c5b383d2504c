"""``reap-swap tiny-model OUT_DIR``: write the deterministic tiny test model."""

from __future__ import annotations

import argparse
from pathlib import Path

from reap_swap.cli import HelpFormatter

from .tiny import TinySpec, build_tiny_model


def main(argv: list[str]) -> int:
    d = TinySpec()
    p = argparse.ArgumentParser(prog="reap-swap tiny-model", description="Write a deterministic random-weight tiny Qwen3-MoE.", formatter_class=HelpFormatter)
    p.add_argument("out_dir", type=Path, help="folder to write the model into (created; an existing tiny model there is rewritten)")
    p.add_argument("--layers", type=int, default=d.layers, help="MoE decoder layers")
    p.add_argument("--experts", type=int, default=d.experts, help="routed experts per layer")
    p.add_argument("--top-k", type=int, default=d.top_k, help="experts per token")
    p.add_argument("--hidden", type=int, default=d.hidden, help="hidden size (multiple of 32)")
    p.add_argument("--moe-intermediate", type=int, default=d.moe_intermediate, help="each expert's FFN width")
    p.add_argument("--heads", type=int, default=d.heads, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=d.kv_heads, help="key/value heads (grouped-query attention)")
    p.add_argument("--vocab", type=int, default=d.vocab, help="BPE vocabulary size")
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16"], help="weight dtype")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the random weights (same seed, same model)")
    a = p.parse_args(argv)
    spec = TinySpec(
        layers=a.layers, experts=a.experts, top_k=a.top_k, hidden=a.hidden, moe_intermediate=a.moe_intermediate,
        heads=a.heads, kv_heads=a.kv_heads, vocab=a.vocab, seed=a.seed, dtype=a.dtype,
    )
    try:
        spec.validate()
    except ValueError as exc:
        p.error(str(exc))
    if a.out_dir.exists() and any(a.out_dir.iterdir()) and not (a.out_dir / "reap_tiny_model.json").exists():
        p.error(f"{a.out_dir} exists and is not a tiny model written by reap-swap; refusing to overwrite")
    manifest = build_tiny_model(a.out_dir, spec)
    size = sum(f.stat().st_size for f in a.out_dir.iterdir() if f.is_file())
    print(
        f"wrote tiny Qwen3-MoE to {a.out_dir} ({size / 1e6:.1f} MB): {spec.layers} MoE layers x "
        f"{spec.experts} experts, top-{spec.top_k}, hidden {spec.hidden}, seed {spec.seed}; "
        f"weights sha256 {manifest['files']['model.safetensors'][:16]}"
    )
    return 0
