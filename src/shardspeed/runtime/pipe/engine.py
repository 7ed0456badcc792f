"""``deepspeed.runtime.pipe.engine``: the module object of ``shardspeed.pipe.engine`` (one class identity)."""

import sys

from shardspeed.pipe import engine as _target

sys.modules[__name__] = _target
