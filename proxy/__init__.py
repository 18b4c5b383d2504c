"""OpenAI-compatible routing proxy: embed -> classify -> swap -> forward (streaming) -> misses."""
