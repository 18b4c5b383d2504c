"""The example corpora (realistic and template) and their generators, shipped so the demo and tests run anywhere."""
