"""Communication compression ([Note: 1-bit compression] in compression/signs.py): sign packing and error-fed
1-bit compression (pure), the compressed all-reduce / reduce-scatter over a mesh axis (compression/collective.py),
their one-process references (compression/reference.py), and the optimizers that use them."""

from shardspeed.compression.collective import CompressedAllReduce, CompressedReduceScatter
from shardspeed.compression.signs import pack_signs, unpack_signs

__all__ = ["CompressedAllReduce", "CompressedReduceScatter", "pack_signs", "unpack_signs"]
