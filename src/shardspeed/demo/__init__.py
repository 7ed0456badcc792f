"""``python -m shardspeed.demo`` (``make demo``): a small GPT trained on the Python stdlib's own source.

``model`` (the GPT), ``corpus`` (stdlib bytes → fixed windows), ``train`` (the DeepSpeed-style loop),
``progress`` (bar, gathered statistics, summary) and ``__main__`` (arguments, self-relaunch under
torch.distributed.run).
"""
