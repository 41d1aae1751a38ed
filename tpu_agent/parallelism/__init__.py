"""The tune's parallelism step: the parallelism plans a `tune --nproc N` measured (memory per rank, each action
alone against the baseline), and with `--target SLICE` the slice's plans ranked by projection. It sits above
search and verify (it reads their trials) and below the report; the projection engine it calls is
tpu_agent.projection."""
