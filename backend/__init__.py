"""The bundled `tpu` device: PyTorch's PrivateUse1 backend executing on JAX/XLA."""
