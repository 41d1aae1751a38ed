"""An op's program cache tells Python scalars apart by type: 6, 6.0 and True are equal as dict keys but make
different tensors (`torch.arange(6.0)` after `torch.arange(6)` came back int64 on tpu)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("make, values", [
    (lambda d, v: torch.arange(v, device=d), (6, 6.0, 6)),
    (lambda d, v: torch.full((2,), v, device=d), (6, 6.0, True, 6, True, 6.0)),
    (lambda d, v: torch.ones(2, dtype=torch.int32, device=d) * v, (6, 6.0, True, 6)),
], ids=["arange", "full", "mul"])
def test_equal_scalars_of_other_types_make_the_cpus_dtypes(make, values):
    for value in values:  # each after the others: a program cached for one must not serve another
        cpu, tpu = make("cpu", value), make("tpu", value)
        assert tpu.dtype == cpu.dtype, (value, tpu.dtype, cpu.dtype)
        torch.testing.assert_close(tpu.cpu(), cpu, rtol=0, atol=0)
