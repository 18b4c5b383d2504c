"""Predicts each layer's per-expert gate mass for a prompt (model tokens + their routing, sklearn), so the plan's slots get the experts the request will use."""
