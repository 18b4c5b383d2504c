"""A random-weight GGUF of a benchmark shape, for llama.cpp's ``llama-bench`` (issue 28).

Why: llama.cpp has no dummy loader, so comparing it with our arms on the same expert bytes needs a
real GGUF of the ``30b-a3b-24l`` shape (24 layers x 128 experts, top-8, H=2048, I=768, bf16: 9 MiB
an expert, as ours). That file is ~29 GiB, too big to travel to the device machine, so it is
written there, streaming: a header built with ``gguf`` (the gguf-py of the pinned llama.cpp
commit, shipped in the same tarball), then each tensor's bytes taken from one seeded random block,
never a whole tensor in memory. Values only need to be finite and small (speed does not depend on
them): bf16 weights ~ N(0, 0.02), f32 norms = 1.

The plan (names, shapes, types, metadata) is pure and tested; the names and keys follow llama.cpp's
``qwen3moe`` architecture (src/models/qwen3moe.cpp, gguf-py constants MODEL_ARCH.QWEN3MOE):
shapes are numpy order (ggml's ``ne`` reversed), e.g. ``blk.N.ffn_gate_exps`` is
(experts, moe_intermediate, hidden) = ggml {hidden, I, experts}.

    python -m reap_swap.benchmarks.peers_gguf --out /tmp/peers/30b-a3b-24l-bf16.gguf
    python -m reap_swap.benchmarks.peers_gguf --out tiny.gguf --layers 2 --experts 16   # CPU check

The tokenizer is ``tokenizer.ggml.model = "none"`` with ``qwen3moe.vocab_size`` dummy tokens
(llama-bench only draws random token ids below the vocabulary size); the size is the committed
small_moe tokenizer's, as benchmarks/shapes.py uses for vLLM's dummy model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .shapes import SHAPES, MoeShape

ARCH = "qwen3moe"
BF16, F32 = "BF16", "F32"
_ITEM = {BF16: 2, F32: 4}
ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT
EXPERT_SUFFIXES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy order: ggml ne reversed
    dtype: str  # BF16 or F32
    kind: str  # "weight" (random) or "norm" (ones)

    @property
    def nbytes(self) -> int:
        n = _ITEM[self.dtype]
        for d in self.shape:
            n *= d
        return n


def bundled_vocab_size() -> int:
    """The committed small_moe tokenizer's vocabulary size (what shapes.write_model_dir uses)."""
    tok = Path(__file__).resolve().parents[1] / "models" / "small_moe" / "tokenizer.json"
    return len(json.loads(tok.read_text())["model"]["vocab"])


def tensor_plan(shape: MoeShape, vocab: int) -> list[TensorSpec]:
    """Every tensor llama.cpp's qwen3moe loader asks for, in file order."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out = [TensorSpec("token_embd.weight", (vocab, h), BF16, "weight")]
    for i in range(shape.layers):
        b = f"blk.{i}."
        out += [
            TensorSpec(b + "attn_norm.weight", (h,), F32, "norm"),
            TensorSpec(b + "attn_q.weight", (q, h), BF16, "weight"),
            TensorSpec(b + "attn_k.weight", (kv, h), BF16, "weight"),
            TensorSpec(b + "attn_v.weight", (kv, h), BF16, "weight"),
            TensorSpec(b + "attn_output.weight", (h, q), BF16, "weight"),
            TensorSpec(b + "attn_q_norm.weight", (shape.head_dim,), F32, "norm"),
            TensorSpec(b + "attn_k_norm.weight", (shape.head_dim,), F32, "norm"),
            TensorSpec(b + "ffn_norm.weight", (h,), F32, "norm"),
            TensorSpec(b + "ffn_gate_inp.weight", (shape.experts, h), F32, "weight"),
            TensorSpec(b + "ffn_gate_exps.weight", (shape.experts, shape.moe_intermediate, h), BF16, "weight"),
            TensorSpec(b + "ffn_up_exps.weight", (shape.experts, shape.moe_intermediate, h), BF16, "weight"),
            TensorSpec(b + "ffn_down_exps.weight", (shape.experts, h, shape.moe_intermediate), BF16, "weight"),
        ]
    out += [
        TensorSpec("output_norm.weight", (h,), F32, "norm"),
        TensorSpec("output.weight", (vocab, h), BF16, "weight"),
    ]
    return out


def metadata(shape: MoeShape, vocab: int, context: int = 4096) -> dict[str, Any]:
    """The GGUF key/values (besides general.architecture, which the writer adds)."""
    a = ARCH
    return {
        "general.name": f"reap-swap {shape.name} random bf16",
        "general.file_type": 32,  # LLAMA_FTYPE_MOSTLY_BF16
        f"{a}.context_length": context,
        f"{a}.embedding_length": shape.hidden,
        f"{a}.block_count": shape.layers,
        f"{a}.feed_forward_length": shape.moe_intermediate * shape.top_k,
        f"{a}.expert_feed_forward_length": shape.moe_intermediate,
        f"{a}.attention.head_count": shape.heads,
        f"{a}.attention.head_count_kv": shape.kv_heads,
        f"{a}.attention.key_length": shape.head_dim,
        f"{a}.attention.value_length": shape.head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{a}.rope.freq_base": 1000000.0,
        f"{a}.expert_count": shape.experts,
        f"{a}.expert_used_count": shape.top_k,
        f"{a}.vocab_size": vocab,
        "tokenizer.ggml.model": "none",
    }


def expert_bytes(plan: list[TensorSpec]) -> int:
    return sum(t.nbytes for t in plan if t.name.split(".")[-2] in EXPERT_SUFFIXES)


def shape_from_args(name: str, layers: int = 0, experts: int = 0) -> MoeShape:
    """``name``'s shape, with fewer layers / experts for a CPU check (top-k capped at experts)."""
    s = SHAPES[name]
    changes: dict[str, Any] = {}
    if layers:
        changes["layers"] = layers
    if experts:
        changes["experts"] = experts
        changes["top_k"] = min(s.top_k, experts)
    if changes:
        changes["name"] = f"{s.name}-{layers or s.layers}l-{experts or s.experts}e"
    return dataclasses.replace(s, dtype_bytes=2, **changes)


def _block(nbytes: int, seed: int) -> tuple[memoryview, memoryview]:
    """Seeded random bytes to slice tensors from: bf16 (N(0, 0.02), truncated from f32) and f32,
    each ``2 * nbytes`` long so that any slice of up to ``nbytes`` from an offset below ``nbytes`` fits."""
    import numpy as np

    rng = np.random.default_rng(seed)
    f = rng.standard_normal(nbytes // 2, dtype=np.float32) * np.float32(0.02)
    bf = (f.view(np.uint32) >> 16).astype(np.uint16)
    return memoryview(np.concatenate([bf, bf]).tobytes()), memoryview(f.tobytes())


def write_gguf(path: Path, shape: MoeShape, vocab: int, seed: int = 0, block_mib: int = 64) -> dict[str, Any]:
    """Write the GGUF, streaming. Returns a summary (bytes, seconds, GB/s)."""
    import gguf  # the pinned llama.cpp's gguf-py (PYTHONPATH) or PyPI gguf
    import numpy as np

    plan = tensor_plan(shape, vocab)
    w = gguf.GGUFWriter(str(path), ARCH)
    for key, val in metadata(shape, vocab).items():
        if isinstance(val, str):
            w.add_string(key, val)
        elif isinstance(val, float):
            w.add_float32(key, val)
        else:
            w.add_uint32(key, val)
    qt = {BF16: gguf.GGMLQuantizationType.BF16, F32: gguf.GGMLQuantizationType.F32}
    npt = {BF16: np.uint16, F32: np.float32}
    for t in plan:
        w.add_tensor_info(t.name, t.shape, np.dtype(npt[t.dtype]), t.nbytes, raw_dtype=qt[t.dtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    assert w.fout is not None and len(w.fout) == 1
    fout = w.fout[0]
    blk = block_mib * 2**20
    rand_bf, rand_f = _block(blk, seed)
    ones = memoryview(np.ones(max(shape.hidden, shape.head_dim), dtype=np.float32).tobytes())
    t0 = time.perf_counter()
    written = 0
    for i, t in enumerate(plan):
        pad = -fout.tell() % ALIGNMENT
        if pad:
            fout.write(b"\0" * pad)
        if t.kind == "norm":
            fout.write(ones[: t.nbytes])
        else:
            src = rand_bf if t.dtype == BF16 else rand_f
            left, off = t.nbytes, (i * 4096 * 2) % blk  # even offset: whole bf16 values
            while left:
                n = min(left, blk)
                fout.write(src[off : off + n])
                left -= n
        written += t.nbytes
    pad = -fout.tell() % ALIGNMENT
    if pad:
        fout.write(b"\0" * pad)
    fout.flush()
    w.close()
    secs = time.perf_counter() - t0
    return {
        "path": str(path),
        "shape": dataclasses.asdict(shape),
        "vocab": vocab,
        "tensors": len(plan),
        "tensor_bytes": written,
        "expert_bytes": expert_bytes(plan),
        "file_bytes": path.stat().st_size,
        "write_s": secs,
        "write_GBps": written / secs / 1e9 if secs > 0 else None,
        "seed": seed,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="GGUF file to write")
    ap.add_argument("--shape", default="30b-a3b-24l", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=0, help="fewer layers (CPU check); default: the shape's")
    ap.add_argument("--experts", type=int, default=0, help="fewer experts (CPU check); default: the shape's")
    ap.add_argument("--vocab", type=int, default=0, help="default: the bundled small_moe tokenizer's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plan-only", action="store_true", help="print the plan's totals, write nothing")
    args = ap.parse_args(argv)
    shape = shape_from_args(args.shape, args.layers, args.experts)
    vocab = args.vocab or bundled_vocab_size()
    if args.plan_only:
        plan = tensor_plan(shape, vocab)
        print(json.dumps({"tensors": len(plan), "tensor_bytes": sum(t.nbytes for t in plan), "expert_bytes": expert_bytes(plan)}))
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = write_gguf(out, shape, vocab, args.seed)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
