"""The device in PyTorch: its registration, `torch.tpu`, autoload, autocast, pinned memory, checkpoints."""
