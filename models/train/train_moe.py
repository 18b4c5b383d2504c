"""Train a small Qwen3-MoE on the packed mixed-domain corpus, in one timed GPU run.

Why: REAP-swap needs an MoE whose routing was *learned* (experts specialise by
token type and domain), not a random-router toy. This script builds
``Qwen3MoeForCausalLM`` from an explicit config, trains it for a wall-clock
budget (or a step count), evaluates per-domain held-out perplexity and saves
a checkpoint HF transformers (4.x or 5.x) and vLLM both load.

Needs only torch, numpy, transformers, safetensors, tokenizers (python 3.12).

    python models/train/train_moe.py --data .moe-data/moe_data.npz.xz --out runs/moe-trained --minutes 7
    python models/train/train_moe.py --data ... --out /tmp/x --device cpu --steps 3 --batch-size 4 --seq-len 128
"""

from __future__ import annotations

import time

T_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_dense import patch_dense_moe, unpatch_dense_moe  # noqa: E402
from moe_io import (  # noqa: E402
    build_config_dict,
    count_params,
    load_packed,
    save_checkpoint,
)


def log(msg: str) -> None:
    print(f"[{time.time() - T_START:7.1f}s] {msg}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="moe_data.npz.xz (or .npz) from build_corpus.py")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=7.0, help="wall-clock budget for the whole script")
    ap.add_argument("--reserve-s", type=float, default=45.0, help="seconds kept for final eval + save")
    ap.add_argument("--steps", type=int, default=0, help="fixed step count (overrides the time budget)")
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=256, help="sequences per step (256 x 512 = 131k tokens)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--aux-coef", type=float, default=0.01, help="router_aux_loss_coef")
    ap.add_argument("--aux-per-layer", action="store_true",
                    help="balance each MoE layer on its own (the mean of per-layer Switch losses); HF's loss concatenates "
                         "all layers' logits first, so one layer's busy expert e can be offset by another layer's idle e")
    ap.add_argument("--aux-depth-ratio", type=float, default=1.0,
                    help="with --aux-per-layer: the last layer's balance weight over the first's, geometric in depth and "
                         "normalised to mean 1 (< 1 balances early layers harder than late ones, as the published models route)")
    ap.add_argument("--stick-coef", type=float, default=0.0,
                    help="router stickiness: weight of the mean total-variation distance between consecutive tokens' router "
                         "distributions (per layer, within a sequence); > 0 makes neighbouring tokens share experts")
    ap.add_argument("--stick-topk", action="store_true",
                    help="with --stick-coef: measure the distance on each token's top-k gate weights (renormalised, as "
                         "norm_topk_prob routes) instead of the full softmax; the full-softmax distance is smallest for flat "
                         "router distributions, so it also shrinks the router logits")
    ap.add_argument("--stick-warmup-steps", type=int, default=0,
                    help="with --stick-coef: no stickiness for this many steps, so the routers commit before the loss that "
                         "pulls neighbouring tokens' router distributions together (and toward flat ones) starts")
    ap.add_argument("--router-z-coef", type=float, default=0.0,
                    help="router z-loss coefficient (ST-MoE: mean logsumexp(router logits)^2); keeps router logits small")
    ap.add_argument("--router-init-std", type=float, default=None,
                    help="re-initialise every router weight from N(0, std) (0: zeros, uniform routing at the start); "
                         "default: the model's initializer_range")
    ap.add_argument("--ckpt", type=Path, default=None,
                    help="training checkpoint file (model + optimiser + step + schedule), written every --ckpt-every-s")
    ap.add_argument("--ckpt-every-s", type=float, default=60.0)
    ap.add_argument("--resume", action="store_true",
                    help="continue from --ckpt if it exists (same schedule, shrunk to fit this run's time budget)")
    ap.add_argument("--pick-impl-steps", type=int, default=0,
                    help="time this many steps each of the dense path and HF grouped_mm, keep the faster (0: off; time-budget runs only)")
    ap.add_argument("--moe-impl", default="auto", choices=["auto", "dense", "hf"],
                    help="dense: all-expert GEMMs (moe_dense.py); hf: transformers' own MoE forward; "
                         "auto: dense on CUDA (big GEMMs, no host syncs), hf on CPU (fewer FLOPs)")
    ap.add_argument("--experts-impl", default=None,
                    help="with --moe-impl hf on transformers 5.x: eager|grouped_mm|batched_mm")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (off by default)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="override a config key")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-windows", type=int, default=256, help="max held-out windows per domain (final eval)")
    ap.add_argument("--eval-every", type=int, default=500, help="quick held-out eval every N steps (0: off)")
    ap.add_argument("--calib-steps", type=int, default=30, help="steps timed to size the cosine schedule")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def lr_at(step: int, total: int, args: argparse.Namespace) -> float:
    """Linear warmup then cosine to ``min_lr_ratio * lr`` at ``total``."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    frac = min(1.0, (step - args.warmup_steps) / max(1, total - args.warmup_steps))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def lm_aux_z(model, x: torch.Tensor, y: torch.Tensor, cfg, per_layer: bool = False, z: bool = True,
             depth_ratio: float = 1.0, stick: bool = False, stick_topk: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Next-token CE, the Switch-style router balance loss (HF's own when it returns it, or per layer, optionally
    graded in depth), the router z-loss and the stickiness loss (each of the last two zero, not computed, when off:
    training without them does not pay for them every step)."""
    out = model(input_ids=x, output_router_logits=True, use_cache=False)
    logits = out.logits
    lm = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
    aux = getattr(out, "aux_loss", None)
    if per_layer:
        aux = per_layer_balance_loss(out.router_logits, cfg.num_experts, cfg.num_experts_per_tok, depth_ratio)
    elif aux is None or not torch.is_tensor(aux):
        aux = balance_loss(out.router_logits, cfg.num_experts, cfg.num_experts_per_tok)
    zero = torch.zeros((), device=lm.device)
    z_loss = router_z_loss(out.router_logits, cfg.num_experts) if z else zero
    stick_loss = router_stick_loss(out.router_logits, cfg.num_experts, x.shape[0],
                                   cfg.num_experts_per_tok if stick_topk else 0) if stick else zero
    return lm, aux.float(), z_loss, stick_loss


def stick_weight(step: int, args: argparse.Namespace) -> float:
    """The stickiness loss's weight at ``step`` (0-based): 0 during --stick-warmup-steps, then --stick-coef."""
    return 0.0 if step < getattr(args, "stick_warmup_steps", 0) else args.stick_coef


def lm_and_aux(model, x: torch.Tensor, y: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token CE and the router balance loss (kept for callers of the old pair)."""
    lm, aux, _, _ = lm_aux_z(model, x, y, cfg)
    return lm, aux


def _router_layers(router_logits) -> list[torch.Tensor]:
    """Each MoE layer's router logits (tuple, list, stacked [layers, tokens, E] tensor or one tensor)."""
    parts = router_logits if isinstance(router_logits, (list, tuple)) else list(router_logits.unbind(0)) \
        if torch.is_tensor(router_logits) and router_logits.ndim == 3 else [router_logits]
    return [t for t in parts if torch.is_tensor(t)]


def depth_weights(n_layers: int, ratio: float) -> torch.Tensor:
    """Per-layer weights geometric in depth, last / first = ``ratio``, mean 1 (all ones at ratio 1)."""
    if n_layers <= 1 or ratio == 1.0:
        return torch.ones(max(1, n_layers))
    w = torch.tensor([ratio ** (i / (n_layers - 1)) for i in range(n_layers)], dtype=torch.float32)
    return w / w.mean()


def per_layer_balance_loss(router_logits, n_exp: int, top_k: int, depth_ratio: float = 1.0) -> torch.Tensor:
    """Weighted mean over MoE layers of each layer's own Switch loss (balanced = top_k, as HF's concatenated one);
    ``depth_ratio`` < 1 weighs the early layers' balance more than the late layers'."""
    losses = torch.stack([balance_loss([t], n_exp, top_k) for t in _router_layers(router_logits)])
    return (losses * depth_weights(losses.numel(), depth_ratio).to(losses.device)).mean()


def router_stick_loss(router_logits, n_exp: int, batch: int, top_k: int = 0) -> torch.Tensor:
    """Mean over layers and adjacent token pairs (within a sequence) of the total-variation distance between
    their router distributions, in [0, 1]: the published models reuse ~45 % of their experts at the next
    token; a small model learns token-identity routing that reuses far fewer, and this pulls it toward
    routing that follows the context.

    ``top_k`` > 0: the distributions are each token's top-k gate weights renormalised (zero elsewhere), the
    gate mass the experts really get; the distance is then 1 - the mass both tokens put on shared experts,
    which flat router logits do not lower (the full-softmax distance is smallest for flat distributions, and
    a small model's router then goes flat: its top-k picks stop following the balance loss)."""
    losses = []
    for t in _router_layers(router_logits):
        p = torch.softmax(t.float().reshape(batch, -1, n_exp), dim=-1)
        if top_k > 0:
            w, ids = torch.topk(p, top_k, dim=-1)
            p = torch.zeros_like(p).scatter(-1, ids, w / w.sum(-1, keepdim=True))
        losses.append(0.5 * (p[:, 1:] - p[:, :-1]).abs().sum(-1).mean())
    return torch.stack(losses).mean()


def _router_logit_rows(router_logits, n_exp: int) -> torch.Tensor:
    """Every layer's router logits as one [layers * tokens, E] float tensor (tuple, list or stacked tensor)."""
    parts = router_logits if isinstance(router_logits, (list, tuple)) else [router_logits]
    return torch.cat([t.reshape(-1, n_exp).float() for t in parts if torch.is_tensor(t)], dim=0)


def router_z_loss(router_logits, n_exp: int) -> torch.Tensor:
    """ST-MoE's z-loss, mean over tokens and layers of logsumexp(logits)^2: penalises large router logits,
    which makes routing softer and more stable without forcing balance."""
    if router_logits is None:
        return torch.zeros(())
    return torch.logsumexp(_router_logit_rows(router_logits, n_exp), dim=-1).pow(2).mean()


def init_routers(model: torch.nn.Module, std: float) -> int:
    """Re-initialise each MoE block's router weight from N(0, std) (zeros if std == 0); returns routers touched.

    Why: the router's starting scale decides how soon routing commits: zeros start uniform and let
    the experts specialise from the data, a large std starts from a random token-identity routing.
    """
    n = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if module.__class__.__name__.endswith("SparseMoeBlock") and hasattr(module, "gate"):
                w = module.gate.weight
                if std > 0:
                    w.normal_(0.0, std)
                else:
                    w.zero_()
                n += 1
    return n


def balance_loss(router_logits, n_exp: int, top_k: int) -> torch.Tensor:
    """Qwen3-MoE/Switch aux loss: E * sum_e (fraction routed to e) * (mean prob of e)."""
    logits = torch.cat([t.reshape(-1, n_exp).float() for t in router_logits], dim=0)
    probs = torch.softmax(logits, dim=-1)
    _, ids = torch.topk(probs, top_k, dim=-1)
    frac = torch.bincount(ids.reshape(-1), minlength=n_exp).float() / logits.shape[0]
    return n_exp * torch.sum(frac * probs.mean(0))


@torch.no_grad()
def evaluate(model, arrays: dict[str, np.ndarray], domains: list[str], args, device, amp,
             max_windows: int | None = None) -> dict:
    """Held-out loss/perplexity per domain over non-overlapping seq_len windows."""
    model.eval()
    res: dict[str, dict] = {}
    for dom in domains + ["all"]:
        arr = arrays["heldout" if dom == "all" else f"heldout__{dom}"].astype(np.int64)
        cap = max_windows or args.eval_windows
        n_win = min(cap * (2 if dom == "all" else 1), (arr.size - 1) // args.seq_len)
        if n_win <= 0:
            continue
        total, count = 0.0, 0
        bs = max(1, min(64, args.batch_size))
        for i in range(0, n_win, bs):
            idx = np.arange(i, min(n_win, i + bs))[:, None] * args.seq_len + np.arange(args.seq_len + 1)
            batch = torch.from_numpy(arr[idx]).to(device)
            with amp():
                logits = model(input_ids=batch[:, :-1], use_cache=False).logits
            flat = logits.float().reshape(-1, logits.shape[-1])
            loss = F.cross_entropy(flat, batch[:, 1:].reshape(-1), reduction="sum")
            total += loss.item()
            count += batch[:, 1:].numel()
        res[dom] = {"loss": total / count, "ppl": math.exp(min(50.0, total / count)), "tokens": count}
    model.train()
    return res


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("high")
    import transformers
    from transformers import AutoModelForCausalLM

    arrays, meta = load_packed(args.data)
    domains = list(meta["domains"])
    log(f"data {args.data}: {meta['train_tokens']:,} train tokens, vocab {meta['vocab_size']}, "
        f"domains {domains}; torch {torch.__version__}, transformers {transformers.__version__}, {device}")
    overrides = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    cfg_dict = build_config_dict(meta, args.seq_len, args.aux_coef, overrides)
    config = transformers.AutoConfig.for_model(
        **{k: v for k, v in cfg_dict.items() if k not in ("architectures", "torch_dtype")}
    )
    if args.moe_impl == "auto":
        args.moe_impl = "dense" if device.type == "cuda" else "hf"
    kw = {"attn_implementation": "sdpa"}
    if args.moe_impl == "hf" and args.experts_impl:
        kw["experts_implementation"] = args.experts_impl
    model = AutoModelForCausalLM.from_config(config, **kw).to(device)
    if args.router_init_std is not None:
        log(f"routers re-initialised from N(0, {args.router_init_std}): {init_routers(model, args.router_init_std)} blocks")
    n_total, n_active = count_params(model, cfg_dict)
    log(f"model: {n_total/1e6:.2f}M params ({n_active/1e6:.2f}M active/token), bf16 ~{2*n_total/1e6:.1f} MB")
    if args.moe_impl == "dense":
        log(f"dense MoE forward patched into {patch_dense_moe(model)} blocks")
    fwd_model = torch.compile(model) if args.compile else model

    train = torch.from_numpy(arrays["train"].astype(np.int32)).to(device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    span = torch.arange(args.seq_len + 1, device=device)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if device.type == "cuda" else {}),
    )
    use_amp = device.type == "cuda"

    def amp():
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_amp)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    args.out.mkdir(parents=True, exist_ok=True)
    deadline = T_START + args.minutes * 60 - args.reserve_s
    total_steps = args.steps if args.steps > 0 else 10**9
    start_step, planned_total, start_tokens = 0, 0, 0
    if args.resume and args.ckpt is not None and args.ckpt.is_file():
        state = torch.load(args.ckpt, map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"].cpu() if device.type == "cuda" else state["gen"])
        start_step, planned_total = int(state["step"]), int(state["total_steps"])
        args.batch_size = int(state.get("batch_size", args.batch_size))
        # tokens trained before the cut (a checkpoint without them: all its steps at its batch size)
        start_tokens = int(state.get("tokens", start_step * args.batch_size * args.seq_len))
        total_steps = args.steps if args.steps > 0 else planned_total
        log(f"resumed {args.ckpt} at step {start_step} of a {planned_total}-step schedule")
    tokens_per_step = args.batch_size * args.seq_len
    log_fh = open(args.out / "train_log.jsonl", "a" if start_step else "w")
    log(f"training: {tokens_per_step:,} tokens/step, "
        + (f"{args.steps} steps" if args.steps else f"until {args.minutes} min minus {args.reserve_s:.0f}s reserve"))
    model.train()
    t_calib, error = None, None
    last_ckpt = time.time()

    def tokens_done(step: int) -> int:
        """Tokens trained by ``step``: the resumed run's, then this run's steps at the batch size now in force
        (the batch halves on out-of-memory before the first step, so one size covers this run's steps)."""
        return start_tokens + (step - start_step) * args.batch_size * args.seq_len

    def save_training_state(step: int, total: int) -> None:
        """Atomic checkpoint (model, optimiser, data RNG, step, schedule) so a cut run can be continued."""
        if args.ckpt is None:
            return
        args.ckpt.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.ckpt.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(), "step": step,
                    "total_steps": total, "batch_size": args.batch_size, "tokens": tokens_done(step), "cfg": cfg_dict}, tmp)
        tmp.replace(args.ckpt)

    log_state = {"t": time.time(), "step": 0}

    def log_step(step: int, lr: float, lm, aux, loss, gnorm, stick) -> None:
        now = time.time()
        rec = {"step": step, "lr": lr, "lm_loss": lm.item(), "aux_loss": aux.item(), "loss": loss.item(),
               **({"stick_loss": stick.item()} if args.stick_coef else {}),
               "grad_norm": float(gnorm), "elapsed_s": round(now - T_START, 2),
               "tok_per_s": round((step - log_state["step"]) * args.batch_size * args.seq_len
                                  / max(1e-9, now - log_state["t"]))}
        log_state.update(t=now, step=step)
        log_fh.write(json.dumps(rec) + "\n")
        log_fh.flush()
        log(f"step {step:6d} lr {lr:.2e} lm {rec['lm_loss']:.4f} aux {rec['aux_loss']:.4f} "
            f"gnorm {rec['grad_norm']:.2f} {rec['tok_per_s']/1e6:.2f}M tok/s")

    def train_step(lr: float, step: int = 10**9):
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, train.numel() - args.seq_len - 1, (args.batch_size,), device=device, generator=gen)
        batch = train[starts[:, None] + span].long()
        with amp():
            lm, aux, z, stick = lm_aux_z(fwd_model, batch[:, :-1], batch[:, 1:], config, args.aux_per_layer,
                                         z=bool(args.router_z_coef), depth_ratio=args.aux_depth_ratio,
                                         stick=bool(args.stick_coef), stick_topk=args.stick_topk)
            loss = lm + args.aux_coef * aux + args.router_z_coef * z.to(lm.device) + stick_weight(step, args) * stick.to(lm.device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        return lm, aux, loss, gnorm, stick

    # A one-shot GPU run must not die on its first step: drop torch.compile, then fall back to
    # HF's MoE forward if the dense path fails, and halve the batch on out-of-memory.
    for _attempt in range(5):
        try:
            lm, aux, loss, gnorm, stick = train_step(lr_at(start_step, total_steps, args), start_step)
            sync()
            break
        except Exception as exc:  # noqa: BLE001
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            oom = isinstance(exc, torch.cuda.OutOfMemoryError)
            if args.compile and not oom:
                log(f"compiled step failed ({exc!r}); running eager")
                args.compile, fwd_model = False, model
            elif args.moe_impl == "hf" and args.experts_impl and device.type == "cuda" and not oom:
                log(f"HF {args.experts_impl} step failed ({exc!r}); falling back to the dense path ({patch_dense_moe(model)} blocks)")
                args.moe_impl, args.experts_impl = "dense", None
            elif args.moe_impl == "dense" and not oom:
                log(f"dense MoE step failed ({exc!r}); falling back to HF forward ({unpatch_dense_moe(model)} blocks)")
                args.moe_impl = "hf"
            elif oom and args.batch_size > 8:
                args.batch_size //= 2
                tokens_per_step = args.batch_size * args.seq_len
                log(f"out of memory; batch size -> {args.batch_size}")
            else:
                raise
    else:
        raise RuntimeError("first training step failed repeatedly")
    log_step(start_step + 1, lr_at(start_step, total_steps, args), lm, aux, loss, gnorm, stick)
    step = start_step + 1
    impl_trial: dict[str, float] = {}

    def set_impl(name: str) -> None:
        """Switch the MoE forward between the dense patch and HF's grouped_mm experts (same parameters)."""
        patched = any("forward" in m.__dict__ and hasattr(m, "_dense_top_k") for m in model.modules())
        if name == "dense":
            if not patched:
                patch_dense_moe(model)
            args.moe_impl, args.experts_impl = "dense", None
            return
        if patched:
            unpatch_dense_moe(model)
        args.moe_impl, args.experts_impl = "hf", "grouped_mm"  # the state says unpatched even if the setter fails
        setter = getattr(model, "set_experts_implementation", None)
        if callable(setter):
            setter("grouped_mm")
        else:
            model.config._experts_implementation = "grouped_mm"

    def pick_impl(step: int) -> int:
        """Time --pick-impl-steps real training steps with each MoE forward and keep the faster; returns steps run.

        Why: on a 128-expert model the dense path computes E/top_k = 16x the routed expert FLOPs but runs
        as two big GEMMs; grouped_mm computes only the routed ones. Which wins depends on the shapes and
        the torch/GPU build, so it is measured, not guessed. A failing candidate is dropped.
        """
        n, done = args.pick_impl_steps, 0
        order = [args.moe_impl if args.moe_impl == "dense" else "grouped_mm"]
        order.append("grouped_mm" if order[0] == "dense" else "dense")
        for name in order:
            try:
                set_impl(name)
                train_step(lr_at(step + done, total_steps, args), step + done)  # warm-up of this path (autotune, allocator)
                done += 1
                sync()
                t0 = time.time()
                for _ in range(n):
                    train_step(lr_at(step + done, total_steps, args), step + done)
                    done += 1
                sync()
                impl_trial[name] = round((time.time() - t0) / n * 1000, 2)
            except Exception as exc:  # noqa: BLE001 - a candidate that fails is not used
                opt.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                impl_trial[name + "_error"] = -1.0
                log(f"MoE forward {name} failed in the trial ({exc!r})")
        timed = {k: v for k, v in impl_trial.items() if not k.endswith("_error")}
        best = min(timed, key=timed.get) if timed else "dense"
        set_impl(best)
        log(f"MoE forward trial (ms/step): {timed} -> {best}")
        return done

    if args.pick_impl_steps > 0 and args.steps <= 0:
        step += pick_impl(step)
    calib_at = step + 4
    while step < total_steps:
        if args.steps <= 0 and time.time() >= deadline:
            log(f"time budget reached at step {step}")
            break
        lr = lr_at(step, total_steps if args.steps > 0 or t_calib is not None or start_step else 10**9, args)
        try:
            lm, aux, loss, gnorm, stick = train_step(lr, step)
        except Exception as exc:  # noqa: BLE001 - keep what was trained: evaluate and save anyway
            error = repr(exc)
            log(f"training stopped by {error}")
            break
        step += 1
        if args.steps <= 0 and step == calib_at:
            sync()
            t_calib = (time.time(), step)
        if args.steps <= 0 and t_calib is not None and step == calib_at + args.calib_steps:
            sync()
            per_step = (time.time() - t_calib[0]) / (step - t_calib[1])
            fit = step + max(1, int((deadline - time.time()) / per_step * 0.98))
            total_steps = min(planned_total, fit) if planned_total else fit
            log(f"calibrated: {per_step*1000:.1f} ms/step, {tokens_per_step/per_step/1e6:.2f}M tok/s "
                f"-> schedule of {total_steps} steps ({total_steps*tokens_per_step/1e6:.0f}M tokens)")
        if args.ckpt is not None and time.time() - last_ckpt >= args.ckpt_every_s and step < total_steps:
            save_training_state(step, total_steps)
            last_ckpt = time.time()
        if args.eval_every and step % args.eval_every == 0 and step < total_steps:
            quick = evaluate(model, arrays, domains, args, device, amp, max_windows=16)
            rec = {"step": step, "eval_loss": {d: round(r["loss"], 4) for d, r in quick.items()}}
            log_fh.write(json.dumps(rec) + "\n")
            log(f"eval@{step}: " + " ".join(f"{d}={r['loss']:.3f}" for d, r in quick.items()))
            if args.steps <= 0 and t_calib is not None:  # re-size the schedule to the time really left
                per_step = (time.time() - t_calib[0]) / (step - t_calib[1])
                fit = step + max(1, int((deadline - time.time()) / per_step * 0.98))
                total_steps = min(planned_total, fit) if planned_total else fit
        if step % args.log_every == 0 or step == total_steps:
            log_step(step, lr, lm, aux, loss, gnorm, stick)
    sync()
    if args.ckpt is not None and (step < total_steps or error is not None):  # cut short: keep what a resume needs
        save_training_state(step, total_steps)
    train_s = time.time() - T_START
    log(f"trained {step} steps, {tokens_done(step) / 1e6:.1f}M tokens")
    ev = evaluate(model, arrays, domains, args, device, amp)
    for dom, r in ev.items():
        log(f"eval {dom:13s} loss {r['loss']:.4f} ppl {r['ppl']:.2f} ({r['tokens']} tokens)")
    result = {
        "steps": step, "tokens_seen": tokens_done(step), "train_seconds": round(train_s, 1),
        "params": n_total, "active_params": n_active, "eval": ev, "args": {k: str(v) for k, v in vars(args).items()},
        "torch": torch.__version__, "transformers": transformers.__version__, "device": str(device),
        "moe_impl": args.moe_impl, "experts_impl": args.experts_impl, "batch_size": args.batch_size, "error": error,
        "resumed_from_step": start_step, "schedule_steps": total_steps, "finished": step >= total_steps and error is None,
        "impl_trial_ms_per_step": impl_trial,
    }
    (args.out / "eval.json").write_text(json.dumps(result, indent=1) + "\n")
    log_fh.close()
    info = save_checkpoint(model, cfg_dict, arrays, args.out)
    log(f"saved {args.out}: model.safetensors {info['safetensors_bytes']/1e6:.2f} MB ({info['layout']}); "
        f"total {time.time() - T_START:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
