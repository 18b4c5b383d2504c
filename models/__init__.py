"""MoE model families, the HF MoE reader, and the small test models built or trained locally."""
