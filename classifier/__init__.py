"""Predicts which specialist slices of a plan a prompt will need (sentence embedding + sklearn)."""
