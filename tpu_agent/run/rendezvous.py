"""torchrun's variables for a job of one rank, where no launcher set them: a torch.distributed script's
`init_process_group()` (env://) then finds a group of one rank, as under `torchrun --nproc-per-node 1`."""

from __future__ import annotations

import socket

RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def one_rank_variables(env: dict[str, str]) -> dict[str, str]:
    """The variables to add to `env`; none where a launcher set any of them (its own stay as they are)."""
    if any(name in env for name in RENDEZVOUS):
        return {}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}


def one_rank(env: dict[str, str]) -> dict[str, str]:
    """`env` with torchrun's variables for a job of one rank added where none is set."""
    added = one_rank_variables(env)
    return {**env, **added} if added else env
