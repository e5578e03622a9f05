"""Launches real mesh processes on 127.0.0.1 for tests, the demo and the benchmarks alike."""

from meshlaunch.mesh import (
    HEARTBEAT,
    LEASE,
    MODEL,
    Mesh,
    PoolProcs,
    RouterProc,
    generate_cli,
    local_mesh,
    route,
)
from meshlaunch.process import (
    LaunchError,
    LaunchTimeout,
    Proc,
    ProcessDied,
    ProcessGroup,
    command,
    free_port,
    process_group,
    wait_healthy,
    wait_until,
)

__all__ = [
    "HEARTBEAT",
    "LEASE",
    "MODEL",
    "LaunchError",
    "LaunchTimeout",
    "Mesh",
    "PoolProcs",
    "Proc",
    "ProcessDied",
    "ProcessGroup",
    "RouterProc",
    "command",
    "free_port",
    "generate_cli",
    "local_mesh",
    "process_group",
    "route",
    "wait_healthy",
    "wait_until",
]
