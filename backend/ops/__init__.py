"""Op lowerings, one small JAX function per aten op, grouped by family."""

from . import elementwise, factory, nn, random, reduction, shape  # noqa: F401
