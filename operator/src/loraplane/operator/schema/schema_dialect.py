"""One walk over a pydantic model's JSON Schema, for the dialects our generated files speak.

Pydantic writes JSON Schema draft 2020-12 with ``$ref`` into ``$defs`` and ``anyOf`` for
optional and union fields. The CRDs (``crdgen``) need a structural OpenAPI v3.0 schema and the
chart (``chart_values``) needs draft-07 for Helm; both inline every reference so the files read
top-down, and both turn ``const`` into a one-value ``enum``. What differs (how a union becomes
one node, which keywords are dropped or rewritten, the final touch) is a dialect's methods, so
the walk itself is written once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

Node = dict[str, Any]


class SchemaDialect:
    drop: frozenset[str] = frozenset({"title", "$defs"})  # keywords the dialect leaves out
    drop_additional: tuple[bool, ...] = (True,)  # boolean additionalProperties values left out

    def translate(self, model: type[BaseModel]) -> Node:
        """The model's validation schema (by alias) in this dialect."""
        raw = model.model_json_schema(by_alias=True, mode="validation")
        return self._walk(raw, raw.get("$defs", {}))

    def _walk(self, node: Node, defs: dict[str, Node]) -> Node:
        def convert(child: Node) -> Node:
            return self._walk(child, defs)

        if "$ref" in node:
            target = defs[node["$ref"].rsplit("/", 1)[-1]]
            return convert({**target, **{k: v for k, v in node.items() if k != "$ref"}})
        if "anyOf" in node:
            return self.any_of(node["anyOf"], {k: v for k, v in node.items() if k != "anyOf"}, convert)
        out: Node = {}
        for key, value in node.items():
            if key in self.drop or (key == "additionalProperties" and isinstance(value, bool) and value in self.drop_additional):
                continue
            if key == "properties":
                out[key] = {name: convert(v) for name, v in value.items()}
            elif key in ("items", "additionalProperties") and isinstance(value, dict):
                out[key] = convert(value)
            elif key == "const":
                out["enum"] = [value]
            else:
                out.update(self.keyword(key, value))
        return self.finish(out)

    def any_of(self, variants: list[Node], rest: Node, convert: Callable[[Node], Node]) -> Node:
        """A union's variants (and the node's other keywords, ``rest``) as one node."""
        raise NotImplementedError

    def keyword(self, key: str, value: Any) -> Node:
        """One keyword as this dialect writes it."""
        return {key: value}

    def finish(self, node: Node) -> Node:
        """A converted node's last touch (its children are done)."""
        return node
