"""torch.distributed on the `tpu` device: one process per rank joined into one JAX runtime (runtime.py), the
`tpu` process-group backend (process_group.py) whose collectives are XLA programs over the processes'
devices (collectives.py), and the functional collectives DTensor and FSDP2 call, as op lowerings
(ops/collectives.py)."""
