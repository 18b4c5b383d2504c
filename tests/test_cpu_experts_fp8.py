"""FP8 experts on the CPU expert path (issue 27): the scales' layouts, the native kernel's e4m3
decode and block scales against the dequantize-then-matmul reference, the team's job. Fast, CPU."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from reap_swap.server_ext.cpu_experts import kernel as K
from reap_swap.server_ext.cpu_experts.cpu_path import CpuPathConfigError, check_expert_weights
from reap_swap.server_ext.cpu_experts.quant import ExpertQuant, MatrixScales, expert_quant
from reap_swap.server_ext.cpu_experts.step import BankRows, CpuStep

FP8 = torch.float8_e4m3fn
native = pytest.mark.skipif(K.native_library() is None, reason=f"native CPU kernel unavailable: {K.native_error()}")


def _fp8_rows(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Every e4m3fn byte but the NaNs (0x7f, 0xff): subnormals, zeros of both signs, 448."""
    b = torch.randint(0, 256, shape, generator=g, dtype=torch.int32)
    b = torch.where((b & 0x7F) == 0x7F, b - 1, b)
    return b.to(torch.uint8).view(FP8)


def _scales(rows: int, n: int, k: int, layout: str, g: torch.Generator, block: tuple[int, int]) -> torch.Tensor:
    if layout == "tensor":
        shape: tuple[int, ...] = (rows,)
    elif layout == "shard":
        shape = (rows, 2)
    else:
        shape = (rows, -(-n // block[0]), -(-k // block[1]))
    return torch.rand(shape, generator=g) * 2e-3 / max(n, k) ** 0.5 + 1e-4


def _fp8_layer(e: int, h: int, i: int, layout: str, block: tuple[int, int] = (32, 48), seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13, w2 = _fp8_rows((e, 2 * i, h), g), _fp8_rows((e, h, i), g)
    s13 = _scales(e, 2 * i, h, layout, g, block)
    s2 = _scales(e, h, i, "tensor" if layout == "shard" else layout, g, block)
    name = "weight_scale_inv" if layout == "block" else "weight_scale"
    quant = expert_quant(w13, w2, {f"w13_{name}": s13, f"w2_{name}": s2}, block if layout == "block" else None)
    return w13, w2, quant, g


def _assert_bf16_close(a: torch.Tensor, b: torch.Tensor) -> None:
    scale = b.float().abs().max().clamp(min=1e-6)
    assert float((a.float() - b.float()).abs().max()) <= 2**-6 * float(scale)


def test_dequantize_is_the_e4m3fn_value_times_its_blocks_scale():
    w = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).view(1, 16, 16)
    s = torch.tensor([[[2.0, 0.5], [4.0, 0.25]]])  # [1, 2, 2]: blocks of [8, 8]
    q = ExpertQuant(MatrixScales(s, 8, 8), MatrixScales(s, 8, 8))
    want = w[0].float() * torch.tensor([[2.0] * 8 + [0.5] * 8] * 8 + [[4.0] * 8 + [0.25] * 8] * 8)
    assert torch.allclose(q.dequantize("w13", w, 0), want, rtol=0, atol=0, equal_nan=True)  # 0x7f / 0xff: NaN


@pytest.mark.parametrize("layout", ["tensor", "shard", "block"])
def test_scale_layouts_are_read_per_bank_row(layout):
    w13, w2, q, _ = _fp8_layer(3, 96, 64, layout, block=(32, 32))
    assert q.w13.scales.dtype == torch.float32 and q.w13.scales.device.type == "cpu" and q.w13.scales.is_contiguous()
    n13 = {"tensor": (1, 1), "shard": (2, 1), "block": (4, 3)}[layout]
    assert tuple(q.w13.scales.shape) == (3, *n13)
    if layout == "shard":  # gate rows take the first scale, up rows the second
        d = q.dequantize("w13", w13, 1)
        assert torch.equal(d[:64], w13[1, :64].float() * q.w13.scales[1, 0, 0])
        assert torch.equal(d[64:], w13[1, 64:].float() * q.w13.scales[1, 1, 0])


def test_scale_layouts_that_do_not_fit_are_refused():
    g = torch.Generator().manual_seed(1)
    w13, w2 = _fp8_rows((2, 64, 48), g), _fp8_rows((2, 48, 32), g)
    ok = torch.ones(2)
    with pytest.raises(ValueError, match="w2"):
        expert_quant(w13, w2, {"w13_weight_scale": ok})
    with pytest.raises(ValueError, match="does not fit"):
        expert_quant(w13, w2, {"w13_weight_scale_inv": torch.ones(2, 3, 2), "w2_weight_scale_inv": torch.ones(2, 1, 1)}, (32, 32))
    with pytest.raises(ValueError, match="rows"):
        expert_quant(w13, w2, {"w13_weight_scale": torch.ones(3), "w2_weight_scale": ok})
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        expert_quant(w13.view(torch.uint8), w2, {"w13_weight_scale": ok, "w2_weight_scale": ok})
    with pytest.raises(ValueError, match="scales"):  # fp8 rows given to the kernel without scales
        K.check_bank_dtypes(w13, w2, None)


# (128, 128) blocks over 224 columns: the last block's 96 take one 64-byte bf16 chunk and two 16-byte ones
@pytest.mark.parametrize("layout,h,i,block", [("tensor", 64, 48, None), ("shard", 96, 40, None), ("block", 200, 72, (32, 48)),
                                              ("block", 256, 128, (128, 128)), ("block", 224, 96, (128, 128))])
@pytest.mark.parametrize("t", [1, 3, 9])
def test_every_backend_matches_the_dequantized_reference(layout, h, i, block, t):
    e, k = 6, 3
    w13, w2, q, g = _fp8_layer(e, h, i, layout, block or (32, 48), seed=t)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    mask = torch.rand(t, k, generator=g) < 0.8
    mask[0, 0] = True
    batch = K.group_pairs(ids, w, mask)
    ref = K.CpuExperts("torch", K.CpuThreads(1)).run(x, w13, w2, batch, quant=q)
    for p, e_ in ((p, e_) for lo, hi, e_ in zip(batch.offsets[:-1].tolist(), batch.offsets[1:].tolist(), batch.experts.tolist())
                  for p in range(lo, hi)):  # the reference is the per-pair formula on the dequantized rows
        xt = x[int(batch.tokens[p])].float()
        hh = (xt @ q.dequantize("w13", w13, e_).t()).to(torch.bfloat16)
        want = ((K.silu_and_mul_bf16(hh).float() @ q.dequantize("w2", w2, e_).t()) * batch.weights[p]).to(torch.bfloat16)
        _assert_bf16_close(ref[p], want)  # the batched matmul sums in another order than the per-pair one
    assert float(ref.float().abs().max()) > 0
    if K.native_library() is not None:
        got = K.CpuExperts("native", K.CpuThreads(2)).run(x, w13, w2, batch, quant=q)
        _assert_bf16_close(got, ref)


@native
def test_a_wrong_decode_or_scale_would_be_caught():
    """The tolerance above is far tighter than a decode error: the same rows read as if per-tensor
    scales were all 1 (scales ignored) or the bytes read as int8 differ by orders of magnitude."""
    w13, w2, q, g = _fp8_layer(4, 64, 32, "block", (32, 32), seed=5)
    x = torch.randn(2, 64, generator=g).to(torch.bfloat16)
    batch = K.group_pairs(torch.tensor([[0, 1], [2, 3]]), torch.full((2, 2), 0.5), torch.ones(2, 2, dtype=torch.bool))
    got = K.CpuExperts("native", K.CpuThreads(1)).run(x, w13, w2, batch, quant=q)
    ones = ExpertQuant(MatrixScales(torch.ones_like(q.w13.scales), 32, 32), MatrixScales(torch.ones_like(q.w2.scales), 32, 32))
    wrong = K.CpuExperts("torch", K.CpuThreads(1)).run(x, w13, w2, batch, quant=ones)
    assert float((got.float() - wrong.float()).abs().max()) > 10 * float(got.float().abs().max())


@native
@pytest.mark.parametrize("layout,bk", [("tensor", None), ("block", 32), ("block", 128)])  # blocks of 128: the bf16 chunks' block sums
@pytest.mark.parametrize("k0", [5, 130])  # in the vector loop, in the scalar tail
@pytest.mark.parametrize("t", [1, 4])
def test_every_byte_decodes_exactly(layout, bk, k0, t):
    """Each output reads one weight: x is one-hot at column k0, every gate row holds 1.0 there, up row n
    holds byte n, and w2's row m of expert e picks activation m + 128 e. So out[e, m] = bf16(bf16(silu(1))
    * fp8(byte)) exactly, for all 256 bytes (NaN's two read as 480), in every decode path: with AVX512-BF16
    and VBMI, blocks of 32 columns take the 16-byte fp32 chunks, blocks of 128 the 64-byte bf16 chunks."""
    h, i = 136, 256
    one = torch.tensor(1.0).to(FP8).view(torch.uint8)
    w13 = torch.zeros(2, 2 * i, h, dtype=torch.uint8)
    w13[:, :i, k0] = one
    w13[:, i:, k0] = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    w2 = torch.zeros(2, h, i, dtype=torch.uint8)
    for e in range(2):
        w2[e, torch.arange(128), torch.arange(128) + 128 * e] = one
    w13, w2 = w13.view(FP8), w2.view(FP8)
    name = "weight_scale_inv" if layout == "block" else "weight_scale"
    scales = ({"w13_weight_scale_inv": torch.ones(2, 2 * i // bk, -(-h // bk)), "w2_weight_scale_inv": torch.ones(2, -(-h // bk), i // bk)}
              if layout == "block" else {f"w13_{name}": torch.ones(2), f"w2_{name}": torch.ones(2)})
    q = expert_quant(w13, w2, scales, (bk, bk) if layout == "block" else None)
    x = torch.zeros(t, h, dtype=torch.bfloat16)
    x[:, k0] = 1.0
    batch = K.group_pairs(torch.tensor([[0, 1]] * t), torch.ones(t, 2), torch.ones(t, 2, dtype=torch.bool))
    got = K.CpuExperts("native", K.CpuThreads(2)).run(x, w13, w2, batch, quant=q)
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    values[values.isnan()] = torch.where(torch.arange(256)[values.isnan()] < 128, 480.0, -480.0)
    silu1 = torch.nn.functional.silu(torch.tensor(1.0)).to(torch.bfloat16).float()
    want = (silu1 * values).to(torch.bfloat16)
    for p in range(batch.num_pairs):  # group order: expert 0's pairs, then expert 1's
        e = int(batch.experts[0 if p < t else 1])
        assert torch.equal(got[p, :128], want[128 * e: 128 * (e + 1)]), (p, e)


@native
@pytest.mark.parametrize("layout", ["tensor", "shard", "block"])
def test_subnormal_and_small_weights_decode_exactly(layout):
    """Rows of subnormals only (e = 0: m 2^-9 for m = 1..7, zeros of both signs): a decode that got any of
    them wrong would be off by a large share of the output (checked: one wrong table entry fails this)."""
    e, h, i, t, k = 4, 96, 64, 3, 2
    g = torch.Generator().manual_seed(7)
    w13, w2, q, _ = _fp8_layer(e, h, i, layout, (32, 32))
    q = ExpertQuant(MatrixScales(torch.ones_like(q.w13.scales), q.w13.bn, q.w13.bk),  # unit scales: outputs far from fp32's underflow
                    MatrixScales(torch.ones_like(q.w2.scales) * 64, q.w2.bn, q.w2.bk))
    small = lambda shape: (torch.randint(0, 8, shape, generator=g) | (torch.randint(0, 2, shape, generator=g) << 7)).to(torch.uint8).view(FP8)  # noqa: E731
    w13, w2 = small(tuple(w13.shape)), small(tuple(w2.shape))
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    batch = K.group_pairs(torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.full((t, k), 0.5), torch.ones(t, k, dtype=torch.bool))
    ref = K.CpuExperts("torch", K.CpuThreads(1)).run(x, w13, w2, batch, quant=q)
    got = K.CpuExperts("native", K.CpuThreads(2)).run(x, w13, w2, batch, quant=q)
    assert float(ref.float().abs().max()) > 0
    _assert_bf16_close(got, ref)


@native
@pytest.mark.parametrize("layout", ["tensor", "block"])
def test_the_teams_step_computes_fp8_host_rows(layout):
    e, h, i, k, offset, t = 12, 128, 64, 4, 5, 3
    w13, w2, q, g = _fp8_layer(offset + e, h, i, layout, (32, 32), seed=11)
    bank = BankRows(w13, w2, offset, e, q)
    assert bank.expert_bytes == 3 * h * i  # one byte a weight: what the link and the CPU move per expert
    step = CpuStep(bank, max_tokens=8, top_k=k, threads=K.CpuThreads(2))
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    mask = torch.rand(t, k, generator=g) < 0.6
    mask[0, 0] = True
    step.stage(x, ids, w, mask)
    step.run(t)
    batch = K.group_pairs(ids.long(), w, mask, row_of_expert=torch.arange(e) + offset)
    want = K.per_k_outputs(K.CpuExperts("torch", K.CpuThreads(1)).run(x, w13, w2, batch, quant=q), batch, t, k)
    got = step.out[:t]
    scale = want.float().abs().max().clamp(min=1e-6)
    assert float((got[mask].float() - want[mask].float()).abs().max()) <= 2**-6 * float(scale)
    assert step.stats()["bytes"] == len(set(ids[mask].tolist())) * bank.expert_bytes


def test_bank_rows_refuse_fp8_without_scales():
    g = torch.Generator().manual_seed(2)
    w13, w2 = _fp8_rows((3, 64, 48), g), _fp8_rows((3, 48, 32), g)
    with pytest.raises(ValueError, match="scales"):
        BankRows(w13, w2, 0, 3)


def test_load_check_takes_fp8_with_scales_and_refuses_what_the_kernel_cannot_read():
    g = torch.Generator().manual_seed(3)
    w13, w2 = _fp8_rows((3, 64, 48), g), _fp8_rows((3, 48, 32), g)
    s = torch.ones(3)
    check_expert_weights(0, {"w13_weight": w13, "w2_weight": w2, "w13_weight_scale": s, "w2_weight_scale": s,
                             "w13_input_scale": s, "w2_input_scale": s}, "fp8")
    with pytest.raises(CpuPathConfigError, match="--cpu-experts"):  # no scales: it would compute garbage
        check_expert_weights(0, {"w13_weight": w13, "w2_weight": w2}, "fp8")
    with pytest.raises(CpuPathConfigError, match="weight_zero_point"):  # zero points: not an FP8 scheme it reads
        check_expert_weights(0, {"w13_weight": w13, "w2_weight": w2, "w13_weight_scale": s, "w2_weight_scale": s,
                                 "w13_weight_zero_point": s}, "fp8")
    with pytest.raises(CpuPathConfigError, match="int32"):  # packed 4-bit
        check_expert_weights(0, {"w13_weight": torch.zeros(3, 8, 6, dtype=torch.int32), "w2_weight": w2,
                                 "w13_weight_scale": s, "w2_weight_scale": s}, "compressed-tensors")


@pytest.mark.parametrize("march", ["sapphirerapids", "cooperlake", "skylake-avx512"])
def test_every_vector_path_builds_without_warnings(march: str) -> None:
    """The kernel's AVX-512 paths run only on hosts that have them (the device hosts; this CI box may not): bf16 + VBMI
    (FP8's 64-byte decode, per-tensor and blocks), bf16 without VBMI, plain AVX-512. A path that stopped building would
    make the native tests skip there, not fail, so each must build here, warning-free."""
    cc = shutil.which("gcc")
    if cc is None:
        pytest.skip("no gcc")
    r = subprocess.run([cc, "-fsyntax-only", "-Wall", "-Werror", f"-march={march}", "-fopenmp", "-std=gnu11", str(K._SRC)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
