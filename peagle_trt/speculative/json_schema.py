"""What xgrammar would get wrong silently in a JSON schema, refused before it compiles.

xgrammar ignores some keywords (the output could break them) and compiles a `$ref` cycle with no
base case into a grammar no finite output satisfies (the request would run to max_tokens). So a
schema is refused (RequestError, a 400) when it
  - uses a keyword the grammar does not enforce (`UNSUPPORTED`), at any schema position; or what
    xgrammar 0.2.8 drops with a warning: an `allOf` of more than one schema (it compiles to any
    JSON value), `minLength` / `maxLength` beside `pattern` or `format` (the lengths are ignored);
  - has a `$ref` outside the document (only "#" and "#/..." pointers resolve) or to nothing;
  - admits no finite instance: every way through it returns to itself (a `$ref` to itself, or
    through required properties, non-empty arrays, allOf), found as a least fixpoint over its
    subschemas.
Tested by tests/speculative/test_grammar.py.
"""

from __future__ import annotations

from peagle_trt.errors import RequestError

UNSUPPORTED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "uniqueItems",
               "contains", "minContains", "maxContains", "unevaluatedProperties", "unevaluatedItems", "$dynamicRef",
               "$recursiveRef")
_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> subschema
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_ONE = ("items", "additionalProperties", "propertyNames", "additionalItems")


def check_schema(schema) -> None:
    """RequestError when `schema` (parsed JSON) uses what the grammar cannot enforce."""
    if schema is False:
        raise RequestError("the JSON schema is `false`: no output satisfies it")
    nodes = _subschemas(schema)
    for node in nodes:
        bad = [k for k in UNSUPPORTED if k in node]
        if bad:
            raise RequestError(f"the JSON schema uses {bad}, which structured output does not enforce; remove "
                               "them (or express the constraint with enum / anyOf / pattern)")
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            raise RequestError("the JSON schema has an allOf of several schemas, which structured output does not "
                               "enforce; merge them into one schema")
        lengths = [k for k in ("minLength", "maxLength") if k in node]
        if lengths and ("pattern" in node or "format" in node):
            raise RequestError(f"the JSON schema combines {lengths} with a pattern or format in one string, and "
                               "structured output would not enforce the lengths; put them in the pattern "
                               "(e.g. ^[a-z]{2,4}$)")
        ref = node.get("$ref")
        if ref is not None:
            _resolve(schema, ref)
    if not _finite(schema, nodes):
        raise RequestError("the JSON schema admits no finite JSON value: a self-referential $ref without a base "
                           "case (make the recursive property optional, or give it an anyOf with a plain type)")


def _children(node: dict) -> list:
    out = []
    for key in _MAPS:
        if isinstance(node.get(key), dict):
            out += node[key].values()
    for key in _LISTS:
        if isinstance(node.get(key), list):
            out += node[key]
    for key in _ONE:
        if isinstance(node.get(key), (dict, bool)):
            out.append(node[key])
    return out


def _subschemas(schema) -> list[dict]:
    """Every schema object inside `schema` (itself included), each once."""
    found, todo, seen = [], [schema], set()
    while todo:
        node = todo.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        found.append(node)
        todo += _children(node)
    return found


def _resolve(root, ref):
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        raise RequestError(f"$ref {ref!r}: only references inside the schema (\"#\" or \"#/...\") are supported; "
                           "inline the referenced schema")
    node = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise RequestError(f"$ref {ref!r} points to nothing in the schema")
    return node


def _finite(root, nodes: list[dict]) -> bool:
    """Whether `root` has a finite instance: the least fixpoint of `ok` (all false at first)."""
    ok: dict[int, bool] = {id(n): False for n in nodes}

    def val(s) -> bool:
        return s is not False if not isinstance(s, dict) else ok.get(id(s), True)

    def holds(n: dict) -> bool:
        if "$ref" in n and not val(_resolve(root, n["$ref"])):
            return False
        if isinstance(n.get("allOf"), list) and not all(val(s) for s in n["allOf"]):
            return False
        for key in ("anyOf", "oneOf"):
            if isinstance(n.get(key), list) and n[key] and not any(val(s) for s in n[key]):
                return False
        props = n.get("properties") if isinstance(n.get("properties"), dict) else {}
        if any(r in props and not val(props[r]) for r in n.get("required") or () if isinstance(r, str)):
            return False
        least, prefix, items = n.get("minItems") or 0, n.get("prefixItems") or [], n.get("items")
        if not all(val(s) for s in prefix[:least]):
            return False
        return not (least > len(prefix) and isinstance(items, (dict, bool)) and not val(items))

    changed = True
    while changed:
        changed = False
        for n in nodes:
            if not ok[id(n)] and holds(n):
                ok[id(n)] = changed = True
    return val(root)
