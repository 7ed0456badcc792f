"""Collectives over explicit mesh axes, and the comms log."""

from shardspeed.comm.collectives import Collectives, Work
from shardspeed.comm.log import CommsLog

__all__ = ["Collectives", "CommsLog", "Work"]
