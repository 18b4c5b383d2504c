"""REAP observation over a calibration corpus, and plans (core + slices) under a VRAM budget."""
