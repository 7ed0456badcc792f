"""DeepSpeed's ``deepspeed.runtime.pipe`` path: the names of ``shardspeed.pipe``.

Its submodules (``module``, ``topology``, ``schedule``, ``engine``) are the very module objects of
``shardspeed.pipe`` (each file here replaces itself in ``sys.modules``), so classes keep one identity whichever path
imported them (``from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology`` as Megatron-DeepSpeed
writes it).
"""

from shardspeed.pipe import *  # noqa: F403
from shardspeed.pipe import __all__  # noqa: F401
