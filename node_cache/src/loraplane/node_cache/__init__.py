"""The node cache: adapter folders (and a base from object storage) kept on a node's local disk,
content-addressed and bounded, shared by every serving pod on the node.

- ``store``: the content-addressed, bounded, crash-safe folder store (``DiskCache``).
- ``fetch``: a source's files into the store, or a verified hit (one implementation, used by a
  serving process that owns its cache and by the node agent that owns a node's).
- ``base_copy``: a whole base checkpoint copied once per node, verified, published atomically.
- ``models``: the agent's HTTP bodies, shared by its server and its two clients.
- ``agent``, ``app``: the node agent (``loraplane node-agent``): the store's only writer on a node.
- ``client``: the serving pods' and the operator's side of the agent's API.

Torch-free (an import-linter contract): the agent runs without the engine, the operator talks to it.
"""
