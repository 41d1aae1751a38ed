"""Verification: statistics on interleaved pairs, the verdict on a plan, the ablation of a verified plan."""
