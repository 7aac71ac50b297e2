"""The KV store tier under the radix tree (torch-free): block values keyed by chained hash,
a ``host``, a ``disk`` and a ``mooncake`` backend and a host+disk stack, asynchronous loads and
writes (see ``tier.py``)."""
