"""tpu-agent: make a PyTorch training script fast on TPUs without rewriting it."""

__version__ = "0.1.0"
