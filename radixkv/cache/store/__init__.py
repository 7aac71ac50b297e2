"""The KV store tier under the radix tree (torch-free): block values keyed by chained hash,
a ``host`` and a ``mooncake`` backend, asynchronous loads and writes (see ``tier.py``)."""
