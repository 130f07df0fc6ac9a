"""Structured output: a completion held to a format (a JSON schema, any JSON object, a regex, one
of a list of strings) by masking, before every sampling step, the tokens that would break it.

The grammar library is llguidance (docs/structured-output.md says why): a format becomes a Lark
grammar over the completion's bytes, compiled once per format and tokenizer (`Grammars`), and
each row that generates under it walks a copy of its matcher (`Matcher`), which writes the
allowed tokens of the next step as a bitmask (int32 words, bit t % 32 of word t // 32 for token
t). The stop ids (end of turn) are allowed only where the format is complete; where nothing can
follow, they are all that is allowed, so the row ends on the device as any row does.

A JSON format is held to what jsonschema checks, where llguidance alone is looser: llguidance
compiles a narrower schema than the request's (`_strict`: objects with listed properties
closed, exact dates and times, property counts it can hold), and each walk reads its JSON as it
goes, masking the tokens that would repeat a member name (`_Names`). docs/structured-output.md
says what a completion is held to.

GPT-OSS chats in Harmony put the format in the final channel: the completion may reason in an
analysis message first, free text, then must open `<|channel|>final<|message|>`, hold the format
there and end on `<|return|>`.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import re
import urllib.parse
from typing import Any

import llguidance
import numpy as np

# JSON without optional whitespace: ", " and ": " between items, nothing else, so a completion
# cannot spend its tokens on blank space (a random model does).
_JSON_OPTIONS = {"whitespace_flexible": False}
GRAMMAR_CACHE = 1024  # compiled formats kept per tokenizer, least recently used out first


@dataclasses.dataclass(frozen=True)
class Format:
    """A request's format: kind (json_schema | json_object | regex | choice) and its spec, the
    canonical JSON text of the schema, the regex or the choice list: the cache key."""

    kind: str
    spec: str
    field: str = dataclasses.field(compare=False)  # the request field it came from, for errors

    def lark(self) -> str:
        """The grammar's rule `body`: the completion's text under this format."""
        if self.kind in ("json_schema", "json_object"):
            schema = json.loads(self.spec) if self.kind == "json_schema" else {"type": "object"}
            if not isinstance(schema, dict):
                raise ValueError(f"{self.field}: a JSON schema is an object, not {_kind_of(schema)}")
            schema = _strict(schema, self.field)
            # the request's own x-guidance options apply first, the whitespace rule over them
            schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), **_JSON_OPTIONS}}
            return "body: %json " + json.dumps(schema, ensure_ascii=False)
        if self.kind == "regex":
            return "body: /" + llguidance.regex_to_lark(json.loads(self.spec)) + "/"
        choices = json.loads(self.spec)
        return "body: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _kind_of(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(v), "a number")


def _canonical(v: Any) -> str:
    """Compact JSON in the order given: a schema's properties are generated in its order."""
    return json.dumps(v, separators=(",", ":"), ensure_ascii=False)


FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice")


def parse_format(d: dict) -> Format | None:
    """The format a request line asks for, None for none; a ValueError naming the field when it
    is malformed. OpenAI's response_format ({"type": "text" | "json_object" | "json_schema",
    "json_schema": {"name", "schema", "strict"}}) or vLLM's guided_json, guided_regex,
    guided_choice; at most one of them."""
    given = [k for k in FIELDS if d.get(k) is not None]
    if len(given) > 1:
        raise ValueError(f"give at most one of {', '.join(FIELDS)} (got {', '.join(given)})")
    if not given:
        return None
    key = given[0]
    v = d[key]
    if key == "response_format":
        if not isinstance(v, dict) or v.get("type") not in ("text", "json_object", "json_schema"):
            raise ValueError(f"response_format={_short(v)}: give {{\"type\": \"json_schema\", "
                             "\"json_schema\": {\"name\", \"schema\"}}, {\"type\": \"json_object\"} "
                             "or {\"type\": \"text\"}")
        if v["type"] == "text":
            return None
        if v["type"] == "json_object":
            return Format("json_object", "", key)
        js = v.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise ValueError("response_format.json_schema: give {\"name\": ..., \"schema\": {...}}")
        # OpenAI's schema is optional (any JSON object then); strict is always honoured here
        return Format("json_schema", _canonical(js.get("schema", {"type": "object"})),
                      "response_format.json_schema.schema")
    if key == "guided_json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"guided_json is not valid JSON: {e.msg} (column {e.colno})") from e
        if not isinstance(v, dict):
            raise ValueError(f"guided_json={_short(v)}: give a JSON schema (an object)")
        return Format("json_schema", _canonical(v), key)
    if key == "guided_regex":
        if not isinstance(v, str) or not v:
            raise ValueError(f"guided_regex={_short(v)}: give a non-empty regular expression")
        return Format("regex", json.dumps(v), key)
    if not (isinstance(v, list) and v and all(isinstance(c, str) and c for c in v)):
        raise ValueError(f"guided_choice={_short(v)}: give a non-empty list of non-empty strings")
    return Format("choice", json.dumps(list(dict.fromkeys(v)), ensure_ascii=False), key)


def _short(v: Any, limit: int = 60) -> str:
    text = json.dumps(v, ensure_ascii=False) if not isinstance(v, str) else repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- the schema llguidance compiles: the request's, held to what jsonschema checks ---------------

# String formats whose llguidance regex is looser than jsonschema's FormatChecker (Feb 29 in any
# year, year 0000, second 60), as the exact regex: real dates of years 0001-9999 (leap years
# divisible by 4, not by 100 unless by 400), RFC 3339 times without leap seconds.
_YEAR = r"(?:[0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})"
_LEAP = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = (r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
              r"|02-(?:0[1-9]|1[0-9]|2[0-8]))")
_DATE = rf"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP}-02-29)"
_TIME = (r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?"
         r"(?:[zZ]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])")
FORMAT_PATTERNS = {"date": f"^{_DATE}$", "time": f"^{_TIME}$", "date-time": f"^{_DATE}[tT]{_TIME}$"}

# Keywords whose value is a subschema, a list of them, or a map of names to them; not `not` and
# `if`, where a narrower subschema would widen the whole (llguidance refuses both).
_ONE = ("additionalProperties", "items", "additionalItems", "contains", "then", "else",
        "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_KEYS = ("properties", "patternProperties", "additionalProperties")  # what admits an object's keys
_APPLICATORS = ("allOf", "anyOf", "oneOf", "$ref", "not", "if", "dependentSchemas", "dependencies")


def _nodes(node: Any, path: tuple = ()):
    """(path from the root, schema) of every schema object in node, node first."""
    if not isinstance(node, dict):
        return
    yield path, node
    for k, v in node.items():
        if k in _MAP and isinstance(v, dict):
            for name, sub in v.items():
                yield from _nodes(sub, (*path, k, name))
        elif k in _LIST and isinstance(v, list):
            for i, sub in enumerate(v):
                yield from _nodes(sub, (*path, k, i))
        elif k in _ONE:
            yield from _nodes(v, (*path, k))


def _resolve(root: dict, ref: Any) -> tuple[tuple, Any] | None:
    """(path, schema) of a local $ref ("#" or "#/a/b"), None for any other."""
    if not isinstance(ref, str) or ref != "#" and not ref.startswith("#/"):
        return None
    path, node = (), root
    for part in ref.split("/")[1:]:
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            part = int(part)
        elif not isinstance(node, dict) or part not in node:
            return None
        path, node = (*path, part), node[part]
    return path, node


def _parts(root: dict, node: dict) -> list:
    """The schemas that meet node's own keywords where it applies: its allOf, anyOf and oneOf
    members and its $ref's target."""
    found = [m for k in ("allOf", "anyOf", "oneOf") if isinstance(node.get(k), list) for m in node[k]]
    return found + [(_resolve(root, node.get("$ref")) or ((), None))[1]]


def _listed(root: dict, node: Any, seen: tuple = ()) -> list[str] | None:
    """The names node and its parts list (properties, required), or None where one of them
    admits other keys too (patternProperties, additionalProperties other than false)."""
    if not isinstance(node, dict) or id(node) in seen:
        return []
    if "patternProperties" in node or node.get("additionalProperties", False) is not False:
        return None
    names = list(node["properties"]) if isinstance(node.get("properties"), dict) else []
    names += _required(node)
    for part in _parts(root, node):
        more = _listed(root, part, (*seen, id(node)))
        if more is None:
            return None
        names += more
    return list(dict.fromkeys(names))


def _composed(root: dict) -> tuple[set[tuple], list[tuple[tuple, dict]]]:
    """Where an object's keys add up from several schemas: (the paths of every schema that
    takes part, (path, schema) of each where they meet). They meet where more than one of a
    schema's own keywords, allOf members, $ref, anyOf and oneOf admits keys; none of them may
    be closed alone, as it would refuse the keys the others admit."""
    def adds_keys(node, seen=()) -> bool:
        if not isinstance(node, dict) or id(node) in seen:
            return False
        seen = (*seen, id(node))
        return any(k in node for k in _KEYS) or any(adds_keys(m, seen) for m in _parts(root, node))

    taking_part: set[tuple] = set()

    def mark(path, node):
        if path in taking_part or not isinstance(node, dict):
            return
        taking_part.add(path)
        for k in ("allOf", "anyOf", "oneOf"):
            for i, m in enumerate(node.get(k) if isinstance(node.get(k), list) else ()):
                mark((*path, k, i), m)
        if (target := _resolve(root, node.get("$ref"))) is not None:
            mark(*target)

    meeting = []
    for path, node in _nodes(root):
        own = any(k in node for k in _KEYS)
        allof = node["allOf"] if isinstance(node.get("allOf"), list) else []
        either = [any(map(adds_keys, node[k])) for k in ("anyOf", "oneOf")
                  if isinstance(node.get(k), list)]
        if own + sum(map(adds_keys, allof)) + adds_keys(_parts(root, node)[-1]) + sum(either) > 1:
            meeting.append((path, node))
            mark(path, node)
    return taking_part, meeting


def _required(node: dict) -> list[str]:
    required = node.get("required")
    return [k for k in required if isinstance(k, str)] if isinstance(required, list) else []


def _close(node: dict, names: list[str]) -> None:
    """additionalProperties: false, with every name listed in properties (any value where the
    schema gives none), so that each of them stays possible."""
    props = node.setdefault("properties", {})
    for k in names:
        props.setdefault(k, True)
    node["additionalProperties"] = False


# what has a say on an object's keys beyond its properties
_OPEN = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def _strict(schema: dict, field: str) -> dict:
    """The schema as llguidance is given it (changed in place), narrower than the request's where
    needed so that every completion validates under the request's schema with jsonschema's
    format checker, and no wider:

    - an object schema with `properties` and no say on other keys (additionalProperties,
      patternProperties) is closed, as OpenAI's strict mode does; where schemas meet in an
      intersection (`_composed`), the one where they meet is closed to the names they all list
      (and left open where one of them admits other keys);
    - `format` date, time and date-time become their exact `pattern` (FORMAT_PATTERNS);
    - `uniqueItems: false`, which asks nothing, is dropped;
    - a closed object's `minProperties` and `maxProperties` become a `required` list and a set
      of properties (`_count_properties`)."""
    taking_part, meeting = _composed(schema)
    for path, node in meeting:
        if not any(k in node for k in _OPEN) and (names := _listed(schema, node)) is not None:
            _close(node, names)
    for path, node in list(_nodes(schema)):
        if node.get("uniqueItems") is False:
            del node["uniqueItems"]
        if isinstance(fmt := node.get("format"), str) and fmt in FORMAT_PATTERNS:
            del node["format"]
            if "pattern" in node:  # both hold: the format's pattern as a member of an allOf
                node["allOf"] = [*(node.get("allOf") or []), {"pattern": FORMAT_PATTERNS[fmt]}]
            else:
                node["pattern"] = FORMAT_PATTERNS[fmt]
        if not isinstance(node.get("properties"), dict) or path in taking_part:
            continue
        if not any(k in node for k in _OPEN):
            _close(node, _required(node))
        if (node.get("additionalProperties") is False and "patternProperties" not in node
                and not any(k in node for k in _APPLICATORS)):
            _count_properties(node, path, field)
    return schema


def _count_properties(node: dict, path: tuple, field: str) -> None:
    """A closed object's minProperties and maxProperties (llguidance bounds only the keys beyond
    `properties`), as what they leave possible: a bound its required and listed properties
    already keep is dropped; a lower one above them makes the first optional properties (in the
    schema's order) required, an upper one below them drops the last optional ones; one that no
    object can meet is a ValueError."""
    lo, hi = node.get("minProperties"), node.get("maxProperties")
    props, required = node["properties"], node.get("required", [])
    if lo is None and hi is None or not isinstance(required, list) or not all(
            isinstance(k, str) and k in props for k in required) or not all(
            v is None or type(v) is int and v >= 0 for v in (lo, hi)):
        return  # llguidance's own checks and messages
    required = list(dict.fromkeys(required))
    where = " at /" + "/".join(map(str, path)) if path else ""
    if lo is not None and lo > len(props):
        raise ValueError(f"{field}: minProperties {lo}{where} is more than the object's "
                         f"{_properties(len(props))}")
    if hi is not None and hi < len(required):
        raise ValueError(f"{field}: maxProperties {hi}{where} is less than the object's "
                         f"{_properties(len(required))} required")
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"{field}: minProperties {lo}{where} is more than maxProperties {hi}")
    optional = [k for k in props if k not in required]
    if lo is not None and lo > len(required):
        required, optional = required + optional[: lo - len(required)], optional[lo - len(required):]
    if hi is not None:
        for k in optional[max(hi - len(required), 0):]:
            del props[k]
    node.pop("minProperties", None)
    node.pop("maxProperties", None)
    if required:
        node["required"] = required


def _properties(n: int) -> str:
    return f"{n} propert{'y' if n == 1 else 'ies'}"


class Matcher:
    """One row's walk through a format: `mask` the next step's allowed tokens, `take` the token
    sampled. `complete`: the text so far satisfies the format. Under a JSON format, `names`
    keeps each object's member names unique, which llguidance leaves to chance where keys are
    not fixed (additionalProperties, patternProperties, json_object)."""

    def __init__(self, matcher, names: _Names | None = None):
        self._m, self._names = matcher, names

    def mask(self, out: np.ndarray) -> None:
        """Writes the allowed tokens into out (int32 [ceil(V / 32)])."""
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        if self._names is not None:
            self._names.forbid_repeats(out, self._m)

    def take(self, token: int) -> bool:
        """Advances by the token; False (and an error state) when the format forbids it."""
        if self._names is not None and not self._names.take(int(token)):
            return False
        return self._m.consume_token(int(token))

    @property
    def complete(self) -> bool:
        return self._m.is_accepting()


class _Vocab:
    """A tokenizer's tokens as bytes, for `_Names`: each id's bytes (a special token's are its
    name); the tokens with a `"` or `,` byte, the only ones that can close a key or commit an
    object to one more member; the ids of each byte string."""

    def __init__(self, ll, stop_ids):
        self.ll, self.stop_ids = ll, stop_ids
        self.bytes = [ll.decode_bytes([i]) for i in range(ll.vocab_size)]
        self.ids: dict[bytes, list[int]] = {}  # special tokens too: no mask allows them in JSON
        for i, b in enumerate(self.bytes):
            self.ids.setdefault(b, []).append(i)
        self.longest = max(map(len, self.ids), default=1)
        self.marked = np.array(sorted(i for b, ids in self.ids.items() if b'"' in b or b"," in b
                                      for i in ids), np.int64)
        marked = [self.bytes[i] for i in self.marked]
        self.quoted = np.array([b'"' in b for b in marked])
        # read inside a string (no escape pending): ends it, if at all, with nothing after that
        # could open a key or commit an object to another member; and one that opens a string so
        self.inert = np.array([_inert(b) for b in marked])
        self.opens_inert = np.array([b[:1] == b'"' and _inert(b[1:]) for b in marked])


def _inert(token: bytes) -> bool:
    escaped = False
    for i, b in enumerate(token):
        if escaped:
            escaped = False
        elif b == 0x5C:
            escaped = True
        elif b == 0x22:
            return b'"' not in token[i + 1:] and b"," not in token[i + 1:]
    return True


def _ids(mask: np.ndarray) -> list[int]:
    """The ids a mask allows, in order (a mask is mostly zero words where it matters here)."""
    words = np.flatnonzero(mask)
    bits = np.unpackbits(mask[words].view(np.uint8), bitorder="little").reshape(-1, 32)
    return (words[:, None] * 32 + np.arange(32))[bits.astype(bool)].tolist()


def _allowed(words: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Which of the ids have their bit set in a mask (uint32 words)."""
    return (words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1 == 1


_SCALAR = frozenset(b"-0123456789tfn")  # the bytes a number, true, false or null begins with
# Where an object is, for its next byte outside strings: after `{` (a key or `}`), after a key
# (its value), after a value (`,` or `}`), after `,` (a key, which must not be a name it has).
_OPENED, _VALUE, _AFTER, _KEY = range(4)
_LOOKAHEAD = 256  # masks a dead-end search computes at most before it takes the token as live


class _Names:
    """The JSON text of a completion read byte by byte, enough to know the member names of each
    object open at its end. A key is a string where its object expects one, its name the string
    decoded (`"a"` and `"\\u0061"` are one name); a token that closes a key with a name its object
    has is refused (`take` False) and masked out, and so is one that leads only there: a `,` or
    a key's first bytes where every name the format allows from there is taken (`_live`, a
    search through the format's next tokens). opening: what a chat's start rule puts before the
    JSON (`_opening`; Harmony's `<|channel|>final<|message|>`), before which nothing is read."""

    def __init__(self, vocab: _Vocab, opening: tuple[tuple[bool, bytes], ...] = ()):
        self.vocab, self.opening = vocab, opening
        self.reading = not opening
        self.recent: list[tuple[bool, bytes]] = []  # before the body: the last items, as `_opening`'s
        # per open container: None for an array; for an object [its names (frozenset), where]
        self.stack: list[list | None] = []
        self.string = 0  # 0 outside a string, 1 in a value, 2 in a key
        self.escaped = False  # the string's last byte is an unescaped backslash
        self.key = bytearray()  # the key's bytes so far, escapes as written

    def copy(self) -> _Names:
        other = object.__new__(_Names)
        other.__dict__.update(self.__dict__)
        other.stack = [f if f is None else list(f) for f in self.stack]
        other.key = bytearray(self.key)
        return other

    def take(self, token: int) -> bool:
        data, special = self.vocab.bytes[token], self.vocab.ll.is_special_token(token)
        if not self.reading:
            self._watch(special, data)
            return True
        return special or self._feed(data)

    def _watch(self, special: bool, data: bytes) -> None:
        """Before the body: starts reading once the last tokens are the opening (a text between
        special tokens whole, the first one's end)."""
        items, n = self.recent, len(self.opening)
        if not special and items and not items[-1][0]:
            items[-1] = (False, items[-1][1] + data)
        else:
            items.append((special, data))
        if not special:  # a text's last bytes, and one more, tell it apart
            items[-1] = (False, items[-1][1][-max(len(b) + 1 for _, b in self.opening):])
        del items[:-n]
        self.reading = len(items) == n and all(
            a == b or i == 0 and not a[0] and not b[0] and a[1].endswith(b[1])
            for i, (a, b) in enumerate(zip(items, self.opening)))

    def _feed(self, data: bytes) -> bool:
        """Reads the bytes on; False where they close a key with a name its object has."""
        for b in data:
            if self.string:
                if self.escaped:
                    self.escaped = False
                elif b == 0x5C:  # backslash
                    self.escaped = True
                elif b == 0x22:  # the closing quote
                    if self.string == 2:
                        top, name = self.stack[-1], _decoded(self.key)
                        if name in top[0]:
                            return False
                        top[0], top[1] = top[0] | {name}, _VALUE
                    self.string = 0
                    continue
                if self.string == 2:
                    self.key.append(b)
                continue
            top = self.stack[-1] if self.stack else None  # None: not in an object
            if b == 0x22:
                if top is not None and top[1] != _VALUE:
                    self.string, self.key = 2, bytearray()
                else:
                    self.string = 1
                    if top is not None:
                        top[1] = _AFTER
            elif b in b"{[":
                if top is not None:
                    top[1] = _AFTER
                self.stack.append([frozenset(), _OPENED] if b == 0x7B else None)
            elif b in b"}]":
                if self.stack:
                    self.stack.pop()
            elif top is not None and top[1] == _VALUE and b in _SCALAR:
                top[1] = _AFTER
            elif top is not None and top[1] == _AFTER and b == 0x2C:  # a comma
                top[1] = _KEY
        return True

    def _prefix(self) -> str:
        """The key's name so far, less a trailing escape or character not yet whole."""
        for cut in range(min(len(self.key), 12) + 1):
            name = _decoded(self.key[: len(self.key) - cut])
            if isinstance(name, str):
                return name
        return ""

    def _risky(self) -> bool:
        """Here, some name the object has could be the only way on: in a key that is the start
        of one of its names, or after a `,`."""
        top = self.stack[-1] if self.stack else None
        if top is None or not top[0]:
            return False
        if self.string == 2:
            prefix = self._prefix()
            return any(name.startswith(prefix) for name in top[0] if isinstance(name, str))
        return self.string == 0 and top[1] == _KEY

    def _toward_names(self) -> list[int]:
        """In a key: the tokens that spell on toward one of its object's names, as JSON writes
        them (each character one way, but a control character's `\\n` or `\\u000a`)."""
        if self.string != 2:
            return []
        found = []
        for name in self.stack[-1][0]:
            if not isinstance(name, str):
                continue
            spelled = json.dumps(name, ensure_ascii=False)[1:-1].encode()
            if len(spelled) > len(self.key) and spelled.startswith(self.key):
                rest = spelled[len(self.key):]
                for n in range(1, min(len(rest), self.vocab.longest) + 1):
                    found += self.vocab.ids.get(rest[:n], ())
        return found

    def _live(self, matcher, budget: list[int]) -> bool:
        """Whether, from this risky state (and the format's matcher in it), the object can go
        on without repeating a name: a depth-first search through the tokens the format allows
        until a state that is not risky. Taken as live where the search runs past its budget of
        masks."""
        budget[0] -= 1
        if budget[0] < 0:
            return True
        mask = np.zeros((self.vocab.ll.vocab_size + 31) // 32, np.int32)
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        for t in _ids(mask):
            after = self.copy()
            if self.vocab.ll.is_special_token(t) or not after._feed(self.vocab.bytes[t]):
                continue
            if not after._risky():
                return True
            m = matcher.deep_copy()
            if m.consume_token(t) and after._live(m, budget):
                return True
        return False

    def forbid_repeats(self, out: np.ndarray, matcher) -> None:
        """Clears from the mask out (and the format's matcher in this state) the tokens that
        close a key with a name its object has, or lead only there; where none is left, allows
        the stop ids alone, so that the row ends flagged incomplete rather than on a token
        nothing allowed."""
        if not self.reading:
            return
        v, words = self.vocab, out.view(np.uint32)
        hit = _allowed(words, v.marked)
        top = self.stack[-1] if self.stack else None
        if self.string:  # a string ends only at a quote
            hit &= v.quoted
            if not self.escaped and (self.string == 1 or not top[0]):
                hit &= ~v.inert  # ending a value, or the first key of an object, harms nothing alone
        elif top is None or top[1] in (_VALUE, _OPENED):
            hit &= ~v.opens_inert  # nor does opening a value, or the first key
        candidates = set(v.marked[hit].tolist())
        if len(toward := np.array(self._toward_names(), np.int64)):
            candidates.update(toward[_allowed(words, toward)].tolist())
        refused, budget, live = [], [_LOOKAHEAD], {}
        for t in candidates:
            after = self.copy()
            if not after._feed(v.bytes[t]):
                refused.append(t)
            elif after._risky():
                # the same state after different tokens (`,` and `",` after a string) is searched once
                state = (len(after.stack), *after.stack[-1], after.string, bytes(after.key))
                if state not in live:
                    m = matcher.deep_copy()
                    live[state] = not m.consume_token(t) or after._live(m, budget)
                if not live[state]:
                    refused.append(t)
        for t in refused:
            words[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
        if refused and not words.any():
            for t in v.stop_ids:
                words[t >> 5] |= np.uint32(1 << (t & 31))


def _decoded(key: bytearray) -> str | bytes:
    """A key's name: its JSON string decoded; the bytes themselves where they are not one."""
    try:
        return key.decode() if 0x5C not in key else json.loads(b'"' + bytes(key) + b'"')
    except ValueError:  # UnicodeDecodeError and JSONDecodeError among them
        return bytes(key)


class Grammar:
    """A format compiled for one tokenizer: each `start()` a fresh walk of it. vocab: a JSON
    format's tokenizer (`_Names`); opening: what comes before the JSON (`_opening`)."""

    def __init__(self, matcher, vocab: _Vocab | None = None, opening: tuple = ()):
        self._template, self._vocab, self._opening = matcher, vocab, opening

    def start(self) -> Matcher:
        names = _Names(self._vocab, self._opening) if self._vocab is not None else None
        return Matcher(self._template.deep_copy(), names)


def _opening(start: str) -> tuple[tuple[bool, bytes], ...]:
    """What a start rule puts right before the format's `body`: the run of special tokens and
    string literals there, as (special, bytes) items, a text between specials joined (none for
    `start: body`). A body right after a literal (none of podrun's chats) would share a token
    with it, and is not found: its names are left to llguidance."""
    run = re.search(r'((?:\s*(?:<\|[^|>]*\|>|"(?:[^"\\]|\\.)*"))*)\s*body\s*$', start)
    items: list[tuple[bool, bytes]] = []
    for m in re.finditer(r'<\|[^|>]*\|>|"(?:[^"\\]|\\.)*"', run.group(1) if run else ""):
        if m.group().startswith("<|"):
            items.append((True, m.group().encode()))
        elif items and not items[-1][0]:
            items[-1] = (False, items[-1][1] + json.loads(m.group()).encode())
        else:
            items.append((False, json.loads(m.group()).encode()))
    return tuple(items)


class Grammars:
    """The formats of one tokenizer: its token bytes as llguidance sees them (built on first use,
    as a large vocabulary such as o200k takes seconds), and each format compiled once.

    tokenizer: runner.text.tokenizer.Tokenizer; vocab_size: the model's (ids past the
    tokenizer's are never allowed); stop_ids: the ids that end a completion, allowed once the
    format is complete; chat_start: the start rule over the format's `body` for a chat request
    (its chat format's grammar_start: Harmony's channels, module docstring)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids, chat_start: str = "start: body\n"):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_ids, self.chat_start = tuple(stop_ids), chat_start
        self._ll = self._vocab = None
        self._compiled: collections.OrderedDict[tuple[Format, str], Grammar] = collections.OrderedDict()

    def _lltokenizer(self):
        if self._ll is None:
            source = self.tokenizer.grammar_source()
            if not isinstance(source, str):
                source = llguidance.TokenizerWrapper(source)
            self._ll = llguidance.LLTokenizer(source, n_vocab=self.vocab_size,
                                              eos_token=list(self.stop_ids) or None)
        return self._ll

    def compile(self, fmt: Format, chat: bool = False) -> Grammar:
        """The format's grammar (cached); a ValueError naming the field and the library's
        complaint when it cannot be compiled. chat: a chat request (chat_start applies)."""
        key = (fmt, self.chat_start if chat else "start: body\n")
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key]
        grammar_text = key[1] + fmt.lark()
        matcher = llguidance.LLMatcher(self._lltokenizer(), llguidance.LLMatcher.grammar_from_lark(grammar_text),
                                       log_level=0)
        if matcher.is_error():
            raise ValueError(f"{fmt.field}: {_first_line(matcher.get_error())}")
        if fmt.kind in ("json_schema", "json_object") and self._vocab is None:
            self._vocab = _Vocab(self._lltokenizer(), self.stop_ids)
        grammar = self._compiled[key] = Grammar(
            matcher, self._vocab if fmt.kind in ("json_schema", "json_object") else None, _opening(key[1]))
        if len(self._compiled) > GRAMMAR_CACHE:
            self._compiled.popitem(last=False)
        return grammar


def _first_line(error: str) -> str:
    """llguidance's error without the grammar it appends (its first lines, up to the listing)."""
    lines = [x.strip() for x in error.splitlines() if x.strip()]
    kept = itertools.takewhile(lambda x: not (x[0].isdigit() and "|" in x) and x[0] != "<", lines)
    text = " ".join(list(kept) or lines[:1])
    return re.sub(r"^at \d+\(\d+\): ", "", text)  # where in podrun's grammar text: not the user's
