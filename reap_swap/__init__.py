"""REAP-swap: expert-granular GPU residency for MoE models served by vLLM."""

__version__ = "0.1.0"
