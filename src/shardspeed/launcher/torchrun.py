"""The ``torch.distributed.run`` (torchrun) command line for one node.

Every launch — single node or one per node of a multi-node job — is one torchrun agent. Two rendezvous kinds
(:class:`Rendezvous`):

- ``static`` (default, DeepSpeed's model): ``--master_addr/--master_port`` name node 0's TCP store and
  ``--nnodes/--node_rank`` place this node. No extra service, matches DeepSpeed's fixed host list; the agents
  exchange their local world sizes through the store, so nodes with different slot counts get contiguous global
  ranks (node 0's ranks first).
- ``c10d`` (torchrun's ``--rdzv_backend c10d --rdzv_endpoint host:port --rdzv_id ID``): the agents meet at a TCP
  store on ``host:port`` (the first agent on that host serves it, the others connect) and torchrun assigns the
  node ranks in arrival order — ``--node_rank`` is not passed. This is the kind under which elastic restarts of a
  multi-node job work: when one node's workers fail and restart, the other nodes' agents see the new round and
  restart theirs too.

``--max_restarts N`` (default 0: a failed rank fails the job, as in DeepSpeed): with N > 0 torchrun's elastic
agent answers a failed rank by stopping the node's whole worker group and starting it again, up to N times;
the script sees the attempt number in ``TORCHELASTIC_RESTART_COUNT`` and resumes from its last checkpoint.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

TORCHRUN_MODULE = "torch.distributed.run"
# torchrun plus failure records for ranks killed by a signal (see torchrun_agent.py), run by file path.
AGENT_SCRIPT = str(Path(__file__).resolve().with_name("torchrun_agent.py"))
DEFAULT_MASTER_PORT = 29500
RDZV_BACKENDS = ("static", "c10d")
DEFAULT_RDZV_ID = "shardspeed"


@dataclass(frozen=True, kw_only=True)
class Rendezvous:
    """How this node's torchrun meets the others (see the module docstring)."""

    backend: str = "static"
    """``static`` (``master_addr:master_port``, fixed node ranks) or ``c10d`` (``endpoint``, ranks by arrival)."""
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT
    endpoint: str | None = None
    """``host:port`` of the c10d store; default (c10d): ``master_addr:master_port``."""
    run_id: str = DEFAULT_RDZV_ID
    """torchrun's ``--rdzv_id``: agents with the same id (and endpoint) form one job."""

    def words(self, node_rank: int, nproc_per_node: int) -> list[str]:
        """torchrun's placement and rendezvous arguments for the node with ``node_rank`` (c10d assigns node
        ranks itself, so it is left out there)."""
        if self.backend == "static":
            return [
                f"--node_rank={node_rank}",
                f"--nproc_per_node={nproc_per_node}",
                f"--master_addr={self.master_addr}",
                f"--master_port={self.master_port}",
            ]
        endpoint = self.endpoint or f"{self.master_addr}:{self.master_port}"
        return [
            f"--nproc_per_node={nproc_per_node}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={endpoint}",
            f"--rdzv_id={self.run_id}",
        ]


def torchrun_args(
    *,
    nnodes: int,
    node_rank: int,
    nproc_per_node: int,
    rendezvous: Rendezvous,
    script: str,
    script_args: Sequence[str],
    max_restarts: int = 0,
) -> list[str]:
    """torchrun's arguments (what follows ``python -m torch.distributed.run``), script and its args last.

    The script's arguments are appended untouched: torchrun hands everything after the script path to it.
    """
    # torchrun would read a script path that starts with "-" as one of its own options.
    script_path = f"./{script}" if script.startswith("-") else script
    return [
        f"--nnodes={nnodes}",
        *rendezvous.words(node_rank, nproc_per_node),
        f"--max_restarts={max_restarts}",
        script_path,
        *script_args,
    ]


def torchrun_command(torchrun_arguments: Sequence[str], python: str = sys.executable) -> list[str]:
    """Full argv running torchrun (through ``torchrun_agent.py``) under ``python`` (the launcher's own
    interpreter by default)."""
    return [python, AGENT_SCRIPT, *torchrun_arguments]
