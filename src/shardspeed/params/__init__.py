"""Facts about parameters that the engine needs and ``nn.Parameter`` must not carry: the parameter-spec registry
(``spec.py``: global name and shape, partition dim, which axes hold replicas)."""

from shardspeed.params.spec import Box, ParamSpec, ParamSpecs, Segment, SpecProvider, TiedCopyProvider, shard_bounds

__all__ = ["Box", "ParamSpec", "ParamSpecs", "Segment", "SpecProvider", "TiedCopyProvider", "shard_bounds"]
