"""Run a script with activation checkpointing on each of its repeated blocks, for a projection to trace.

`python checkpointed.py SCRIPT ARGS...` (or `run_path` of this file, as the projection's recorder runs a script):
the first module called that holds the largest `nn.ModuleList` of identical blocks (record.repeated_blocks, the
list the projection scales by) gets each block's forward wrapped in `torch.utils.checkpoint` (non-reentrant, as
Hugging Face's `gradient_checkpointing_enable` does), so that backward recomputes a block from its input instead
of reading what its forward saved. The tuner ranks checkpointing on and off by projection without the user
editing the script.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys

GIVE_UP_CALLS = 1000  # module calls looked at before a script with no repeated blocks is left as it is


def checkpoint_blocks(root) -> int:
    """Wrap the forward of each block of `root`'s repeated blocks in activation checkpointing; how many."""
    import torch.utils.checkpoint

    from tpu_agent.projection.record import repeated_blocks

    found = repeated_blocks([root])
    if found is None:
        return 0
    for block in found[0]:
        inner = block.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            return torch.utils.checkpoint.checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward
    return len(found[0])


def main(argv: list[str]) -> None:
    import torch

    if not argv:
        raise SystemExit("usage: checkpointed.py SCRIPT [ARGS...]")
    done = {"hook": None, "calls": 0}

    def on_call(module, _inputs):
        done["calls"] += 1
        if checkpoint_blocks(module) or done["calls"] > GIVE_UP_CALLS:  # the model's blocks, or no blocks at all
            done["hook"].remove()

    done["hook"] = torch.nn.modules.module.register_module_forward_pre_hook(on_call)
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # the script's folder, not ours, as `python SCRIPT`
    try:
        runpy.run_path(argv[0], run_name="__main__")
    finally:
        done["hook"].remove()


if __name__ == "__main__":
    main(sys.argv[1:])
