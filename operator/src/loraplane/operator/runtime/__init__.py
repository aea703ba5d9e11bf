"""The operator at run time: kopf's handlers (``handlers``, ``webhook``) and the flows they call
(an adapter from manifest to Ready: ``adapter_flow``; a BaseModel's periodic sync: ``base_sync``,
``node_cache_sync``), the pure decisions they act on (``decisions``, ``conditions``,
``admission``), and its reads and writes of the cluster (``cluster``)."""
