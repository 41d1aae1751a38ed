"""Runs a public script unmodified, as `python SCRIPT ARGS` would run it (sys.argv, sys.path[0], `__main__`), with
at most two things done first, each asked for on the command line:

    python public_launch.py [--seed N] [--cuda-on-cpu] SCRIPT [ARGS...]

`--seed N` seeds torch's CPU generator: for a script that draws its data and its model unseeded (the DDP
tutorial's `MyTrainDataset` is `torch.rand` at import time), so that two runs of it can be compared at all.

`--cuda-on-cpu` is the CPU reference for a script that only runs on CUDA (plain PyTorch, the tool off): every
device a torch call names as "cuda" / "cuda:N" / an integer index is the CPU, "nccl" is gloo,
`torch.cuda.set_device` does nothing, `pin_memory()` returns the tensor, `DDP(device_ids=...)` is given none (a
CPU module takes none), CUDA autocast is CPU autocast with the same dtype, and `torch.load(map_location="cuda:N")`
loads onto the CPU. What the script computes is left as written.
"""

from __future__ import annotations

import functools
import runpy
import sys
from pathlib import Path


def _cpu(value):
    import torch

    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("cpu")
    if isinstance(value, str) and value.split(":")[0] == "cuda":
        return "cpu"
    if isinstance(value, int) and not isinstance(value, bool):
        return "cpu"
    return value


def _cuda_on_cpu() -> None:
    import torch
    import torch.distributed as dist
    from torch.overrides import TorchFunctionMode

    to_methods = {torch.Tensor.to, torch._C._nn._parse_to}
    new_device = torch.device

    class CudaAsCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is new_device and args and args[0] != "cpu" and str(args[0]).split(":")[0] == "cuda":
                args = ("cpu",)
            elif func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
                return args[0]
            elif func in to_methods:
                first = 1 if func is torch.Tensor.to else 0
                if len(args) > first:
                    args = (*args[:first], _cpu(args[first]), *args[first + 1:])
            if "device" in kwargs:
                kwargs["device"] = _cpu(kwargs["device"])
            return func(*args, **kwargs)

    torch.cuda.set_device = lambda device: None
    init = dist.init_process_group

    @functools.wraps(init)
    def init_process_group(backend=None, *args, **kwargs):
        return init("gloo" if str(backend).lower() == "nccl" else backend, *args, **kwargs)

    dist.init_process_group = init_process_group
    ddp = torch.nn.parallel.DistributedDataParallel
    ddp_init = ddp.__init__
    ddp.__init__ = functools.wraps(ddp_init)(
        lambda self, module, device_ids=None, *args, **kwargs: ddp_init(self, module, None, *args, **kwargs))
    autocast_init = torch.amp.autocast.__init__

    @functools.wraps(autocast_init)
    def autocast(self, device_type, *args, **kwargs):
        autocast_init(self, "cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    torch.amp.autocast.__init__ = autocast
    load = torch.load
    torch.load = functools.wraps(load)(
        lambda *args, map_location=None, **kwargs: load(*args, map_location=_cpu(map_location), **kwargs))
    CudaAsCpu().__enter__()  # for the whole run


def main(argv: list[str]) -> None:
    seed, cuda_on_cpu = None, False
    while argv and argv[0].startswith("--"):
        flag = argv.pop(0)
        if flag == "--seed":
            seed = int(argv.pop(0))
        elif flag == "--cuda-on-cpu":
            cuda_on_cpu = True
        else:
            raise SystemExit(f"public_launch: unknown option {flag}")
    script = Path(argv[0]).resolve()
    if cuda_on_cpu:
        _cuda_on_cpu()
    if seed is not None:
        import torch

        torch.manual_seed(seed)
    sys.argv = [str(script), *argv[1:]]
    sys.path[0] = str(script.parent)
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
