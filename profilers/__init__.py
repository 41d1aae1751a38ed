"""Profilers: step timing, XLA cost and memory, HLO analysis, TPU cost model."""
