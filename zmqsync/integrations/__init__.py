"""Adapters to other libraries; each is imported by its path (``zmqsync.integrations.torchrl``)
and needs that library installed (``pip install 'zmqsync[torchrl]'``)."""
