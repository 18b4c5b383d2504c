"""Router trajectories of the CPU sibling's shape under several router settings (CPU, one thread, minutes).

Why: the v2 sibling (4 layers, hidden 64, 128 experts top-8) trained on the GPU with learned128 v2's
router (per-layer aux 0.002, depth 0.1, stickiness 0.5) ended with router entropy at its random init's.
This trains the sibling shape from the same seed with each setting for the same steps and batches, and
every ``--eval-every`` steps measures on a fixed held-out batch (all domains), per layer: the mean token
router entropy (bits, what tests/test_learned128_cpu.py checks), the experts needed for 90 % of the top-k
gate mass (norm_topk_prob weights, as ``reap-swap locality``), top-k reuse at the next token and within 8.

    python models/train/sibling_router_probe.py --data /tmp/moe_data.npz --steps 300 --out /tmp/probe.json \
        --arm v1= --arm "v2=--aux-coef 0.002 --aux-per-layer --aux-depth-ratio 0.1 --stick-coef 0.5"

Each arm's value is train_moe.py router flags (aux, per-layer, depth ratio, stick, stick on top-k, stick warm-up, z-loss,
router init). A CPU run sees a few hundred small batches, not the GPU's 665 x 65 k tokens: compare trends.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_moe  # noqa: E402
from moe_io import build_config_dict, load_packed  # noqa: E402

SIB = {"num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 2,
       "num_key_value_heads": 1, "head_dim": 32, "moe_intermediate_size": 24}


@torch.no_grad()
def router_stats(model, batch: torch.Tensor, n_exp: int, top_k: int) -> dict:
    """Per layer on ``batch`` [B, S]: mean token entropy (bits), experts for 90 % of top-k gate mass, reuse."""
    model.eval()
    out = model(input_ids=batch, output_router_logits=True, use_cache=False)
    model.train()
    res = {"entropy_bits": [], "mass90": [], "reuse_next": [], "reuse_8": []}
    b, s = batch.shape
    for t in train_moe._router_layers(out.router_logits):
        p = torch.softmax(t.float().reshape(b, s, n_exp), dim=-1)
        res["entropy_bits"].append(float(-(p * torch.log2(p.clamp_min(1e-12))).sum(-1).mean()))
        w, ids = torch.topk(p, top_k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        mass = torch.zeros(n_exp).index_add_(0, ids.reshape(-1), w.reshape(-1)).sort(descending=True).values
        res["mass90"].append(int(torch.searchsorted(mass.cumsum(0), 0.9 * float(mass.sum()) * (1 - 1e-9))) + 1)
        onehot = torch.zeros(b, s, n_exp, dtype=torch.bool).scatter_(-1, ids, True)
        res["reuse_next"].append(float((onehot[:, 1:] & onehot[:, :-1]).sum(-1).float().mean() / top_k))
        seen = torch.zeros(b, s - 8, n_exp, dtype=torch.bool)
        for d in range(1, 9):
            seen |= onehot[:, 8 - d:s - d]
        res["reuse_8"].append(float((onehot[:, 8:] & seen).sum(-1).float().mean() / top_k))
    return {k: [round(v, 4) for v in vals] for k, vals in res.items()}


def run_arm(name: str, flags: str, arrays: dict, meta: dict, args) -> dict:
    targs = train_moe.parse_args(["--data", "x", "--out", "x", "--lr", str(args.lr), "--warmup-steps", str(args.warmup),
                                  *shlex.split(flags)])
    torch.manual_seed(args.seed)
    import transformers

    cfg_dict = build_config_dict(meta, args.seq_len, targs.aux_coef, dict(SIB))
    config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "torch_dtype")})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if targs.router_init_std is not None:
        train_moe.init_routers(model, targs.router_init_std)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": targs.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    train = torch.from_numpy(arrays["train"].astype(np.int64))
    gen = torch.Generator().manual_seed(args.seed)  # the same batches for every arm
    span = torch.arange(args.seq_len + 1)
    held = torch.from_numpy(np.stack([arrays[f"heldout__{d}"][i * args.seq_len:(i + 1) * args.seq_len].astype(np.int64)
                                      for d in meta["domains"] for i in range(args.held_windows)]))
    traj, t0 = [], time.time()
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            st = router_stats(model, held, config.num_experts, config.num_experts_per_tok)
            traj.append({"step": step, **st})
            print(f"{name:>10} step {step:4d} H {st['entropy_bits']} m90 {st['mass90']} reuse {st['reuse_next']} "
                  f"w8 {st['reuse_8']} ({time.time() - t0:.0f}s)", flush=True)
        if step == args.steps:
            break
        lr = train_moe.lr_at(step, args.steps, targs)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, train.numel() - args.seq_len - 1, (args.batch_size,), generator=gen)
        batch = train[starts[:, None] + span]
        lm, aux, z, stick = train_moe.lm_aux_z(model, batch[:, :-1], batch[:, 1:], config, targs.aux_per_layer,
                                               z=bool(targs.router_z_coef), depth_ratio=targs.aux_depth_ratio,
                                               stick=bool(targs.stick_coef), stick_topk=targs.stick_topk)
        loss = lm + targs.aux_coef * aux + targs.router_z_coef * z + train_moe.stick_weight(step, targs) * stick
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), targs.grad_clip)
        opt.step()
        if step % args.eval_every == 0:
            traj[-1].update(lm_loss=round(lm.item(), 4), aux=round(aux.item(), 4), stick=round(stick.item(), 4))
    with torch.no_grad():
        ho = held[:, :-1], held[:, 1:]
        lm_final = float(train_moe.lm_aux_z(model, ho[0], ho[1], config)[0])
    return {"flags": flags, "trajectory": traj, "heldout_lm_loss": round(lm_final, 4), "seconds": round(time.time() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--arm", action="append", required=True, metavar="NAME=FLAGS")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--held-windows", type=int, default=2, help="held-out windows of --seq-len per domain")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    arrays, meta = load_packed(args.data)
    results = json.loads(args.out.read_text()) if args.out.is_file() else {}
    results.setdefault("setup", {k: str(v) for k, v in vars(args).items() if k != "arm"} | {"shape": SIB})
    for spec in args.arm:
        name, flags = spec.split("=", 1)
        results.setdefault("arms", {})[name] = run_arm(name, flags, arrays, meta, args)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
