"""The bundled `tpu` device: PyTorch's PrivateUse1 backend executing on JAX/XLA."""

from .core.jax_setup import configure_environment

configure_environment()  # XLA reads its flags when JAX first starts a backend: set them first
