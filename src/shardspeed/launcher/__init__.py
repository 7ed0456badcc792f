"""The ``shardspeed`` launcher: DeepSpeed-style multi-node launching on torch.distributed.run, and the
subcommand registry behind the ``shardspeed`` command. Entry point: ``shardspeed.launcher.cli:main``.

Nothing is imported here on purpose: ``python -m shardspeed.launcher.cli`` must find ``cli`` not yet imported.
"""
