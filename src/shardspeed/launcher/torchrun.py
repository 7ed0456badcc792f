"""The ``torch.distributed.run`` (torchrun) command line for one node.

Every launch — single node or one per node of a multi-node job — is one torchrun agent with a static
rendezvous: ``--master_addr/--master_port`` name node 0's TCP store, and ``--nnodes/--node_rank`` place this
node. Static rendezvous (torchrun's default backend) needs no extra service and matches DeepSpeed's fixed host
list; the agents exchange their local world sizes through the store, so nodes with different slot counts get
contiguous global ranks (node 0's ranks first). ``--max_restarts 0``: a failed rank fails the job, as in
DeepSpeed.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

TORCHRUN_MODULE = "torch.distributed.run"
DEFAULT_MASTER_PORT = 29500


def torchrun_args(
    *,
    nnodes: int,
    node_rank: int,
    nproc_per_node: int,
    master_addr: str,
    master_port: int,
    script: str,
    script_args: Sequence[str],
) -> list[str]:
    """torchrun's arguments (what follows ``python -m torch.distributed.run``), script and its args last.

    The script's arguments are appended untouched: torchrun hands everything after the script path to it.
    """
    # torchrun would read a script path that starts with "-" as one of its own options.
    script_path = f"./{script}" if script.startswith("-") else script
    return [
        f"--nnodes={nnodes}",
        f"--node_rank={node_rank}",
        f"--nproc_per_node={nproc_per_node}",
        f"--master_addr={master_addr}",
        f"--master_port={master_port}",
        "--max_restarts=0",
        script_path,
        *script_args,
    ]


def torchrun_command(torchrun_arguments: Sequence[str], python: str = sys.executable) -> list[str]:
    """Full argv running torchrun under ``python`` (the launcher's own interpreter by default)."""
    return [python, "-m", TORCHRUN_MODULE, *torchrun_arguments]
