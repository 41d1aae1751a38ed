"""Op lowerings, one small JAX function per aten op, grouped by family."""

from . import elementwise, factory, gather_scatter, random, reduction, shape, statistics  # noqa: F401
from . import fft, linalg, special  # noqa: F401
from . import bessel, ldl  # noqa: F401  (after special and linalg, whose helpers they reuse)
from . import convolution, distance, embedding, grouped_mm, indexing, losses, matmul, normalization  # noqa: F401
from . import amp, attention, optim, pad, pooling, sampling  # noqa: F401
from . import recurrent, transformer  # noqa: F401  (after attention, whose RNG key helpers recurrent reuses)
from . import collectives  # noqa: F401
from . import prims  # noqa: F401  (after the aten lowerings it reuses)
from . import foreach  # noqa: E402,F401  (last: it maps the per-tensor lowerings above)
