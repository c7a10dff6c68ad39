"""Launching ranks by hand on this host, as torchrun would: their environment and a free port."""

from __future__ import annotations

import os
import socket


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment torchrun would give one rank of a single-node gloo job on 127.0.0.1."""
    return dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        PYTHONUNBUFFERED="1",
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
