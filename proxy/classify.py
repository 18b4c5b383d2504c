"""Prompt -> slice scores for the residency policy, within a time budget.

Embedding runs on one dedicated thread (OpenMP keeps one thread team per
calling thread; more threads oversubscribe a CPU shared with vLLM's busy
workers). A prompt gets at most ``budget_s`` of it, and at most
``max_queued`` prompts wait for it: past either bound the request uses the
training set's average wish (the prior), so a slow or backed-up classifier
delays nobody by more than the budget.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from reap_swap.plan import Plan

from .policy import Wish

MAX_QUEUED = 4


class Classifier:
    def __init__(self, plan: Plan, model: Any | None, budget_s: float = 0.5, max_queued: int = MAX_QUEUED):
        self.plan = plan
        self.model = model
        self.budget_s = budget_s
        self.max_queued = max_queued
        self.queued = 0
        self.timeouts = 0
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reap-classify")

    def prior_wish(self) -> Wish:
        """The training set's average wish (every slice equal without a classifier)."""
        prior = self.model.expert_prior if self.model is not None else None
        scores, experts = {}, {}
        for li, (layer, lp) in enumerate(sorted(self.plan.layers.items())):
            scores[layer] = [float(prior[li][list(s.experts)].sum()) if prior is not None else 1.0 for s in lp.slices]
            if prior is not None:
                experts[layer] = [float(x) for x in prior[li]]
        return Wish(scores, expert_scores=experts)

    def _done(self, loop: asyncio.AbstractEventLoop, _: Future[Any]) -> None:
        def dec() -> None:
            self.queued -= 1

        loop.call_soon_threadsafe(dec)

    async def select(self, text: str | None) -> tuple[Wish, dict[str, Any]]:
        info: dict[str, Any] = {"prompt_chars": len(text or ""), "classified": False}
        if not text or self.model is None:
            return self.prior_wish(), info
        if self.queued >= self.max_queued:
            info["classify_error"] = f"classifier busy ({self.queued} queued): prior used"
            return self.prior_wish(), info
        loop = asyncio.get_running_loop()
        self.queued += 1
        job = self.pool.submit(self.model.select, text)
        job.add_done_callback(lambda f: self._done(loop, f))
        try:
            sel = await asyncio.wait_for(asyncio.wrap_future(job), timeout=self.budget_s)
        except asyncio.TimeoutError:
            job.cancel()  # drops it if it has not started; a running one finishes in the background
            self.timeouts += 1
            info["classify_error"] = f"over the {self.budget_s:.2f}s budget: prior used"
            return self.prior_wish(), info
        except Exception as exc:  # noqa: BLE001 - fall back to the static choice
            info["classify_error"] = f"{type(exc).__name__}: {exc}"
            return self.prior_wish(), info
        info.update(classified=True, embed_ms=sel.embed_ms, predict_ms=sel.predict_ms,
                    chosen_slices={f"layer_{k}": v for k, v in sorted(sel.slices.items())},
                    slice_scores={f"layer_{k}": [round(x, 5) for x in v] for k, v in sorted(sel.scores.items())})
        return Wish(sel.scores, expert_scores=dict(getattr(sel, "expert_scores", {}) or {})), info

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
