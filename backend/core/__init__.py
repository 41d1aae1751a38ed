"""The device's core: its state, its arrays and tensors, host transfers, the op registry and the deferred graph."""
