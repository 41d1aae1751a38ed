"""Pod-scale projection: a script's training step traced at its real size without allocating, partitioned
by XLA's SPMD partitioner for a TPU slice, and costed with a per-generation model (docs/projection.md)."""
