"""Build-time generators, run by ``loraplane crds``: the CRDs from the typed models in ``api``
(``crdgen``), their reference page (``crd_docs``), and the chart's ``values.schema.json`` from its
typed values (``chart_values``), each through one walk over a model's JSON Schema
(``schema_dialect``). Nothing at run time imports them."""
