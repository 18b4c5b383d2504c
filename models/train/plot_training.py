"""Loss curves of a training run from its train_log.jsonl (written by train_moe.py).

    python models/train/plot_training.py models/small_moe/train_log.jsonl models/small_moe/loss.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(log: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    train = [r for r in rows if "lm_loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    ax[0].plot([r["step"] for r in train], [r["lm_loss"] for r in train], label="train LM loss")
    ax[0].plot([r["step"] for r in evals], [r["eval_loss"]["all"] for r in evals], "o-", label="held-out loss (quick eval)")
    ax[0].set_xlabel("step (131,072 tokens each)")
    ax[0].set_ylabel("cross-entropy (nats/token)")
    ax[0].set_yscale("log")
    ax[0].legend()
    ax[0].set_title("Language-model loss")
    ax[1].plot([r["step"] for r in train], [r["aux_loss"] for r in train], color="C2")
    ax[1].axhline(4.0, color="k", ls="--", lw=1, label="perfect balance (= top-k)")
    ax[1].set_xlabel("step")
    ax[1].set_ylabel("router aux loss")
    ax[1].set_title("Load-balancing loss")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
