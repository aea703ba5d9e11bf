"""The objects a BaseModel owns, built as plain manifests from its spec: the serving Deployment,
its Service and engine config (``base_model``), the router (``router``), the node cache
(``node_cache``), and what they share (``names``, ``pod_security``, ``usage_wiring``). Pure
functions of the spec: the runtime applies them, the tests and the chart read them."""
