"""Hypothesis strategies for protobuf messages, built from their descriptors.

Every field of every request message is covered without naming it here, so a field
added to a ``.proto`` file is fuzzed from the next run on. Values mix what passes
validation (plausible names, ids and models, so requests reach the deep paths) with what
should not: any Unicode text including C0/C1 controls, format characters and trailing
newlines; digits that are not ASCII; huge strings; integers at the bounds of their
type; enum numbers no enum defines; long repeated fields and maps.

:func:`requests` draws two kinds of message, half each: a message generated field by
field from scratch, and a known-good baseline request with one field, at any depth,
replaced by a generated value (so each field's validation is probed on its own).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

MAX_DEPTH = 3
F = FieldDescriptor

# Values that pass validation somewhere, so generated requests get past the first check.
PLAUSIBLE = (
    "",
    "box1",
    "box2",
    "h1",
    "n1",
    "r1",
    "H100",
    "A100",
    "boxes/box1",
    "boxes/box2",
    "boxes/nope",
    "boxes/box1/gpus/0",
    "boxes/box1/gpus/7",
    "boxes/box2/gpus/1",
    "hosts/h1",
    "hosts/nope",
    "nodes/n1",
    "nodes/nope",
    "s1",
    "p1",
    "r1",
    "ml",
    "maintenance",
    "10de:2330",
    "127.0.0.1:9000",
    "djE6Ym94MQ==",  # a page token: base64 of "v1:box1"
)
# Near misses: each is a plausible value with one thing wrong.
NEAR_MISSES = (
    "boxes/box1\n",
    "box1\n",
    "hosts/h1\n",
    "nodes/n1\n",
    "r1\n",
    "H100\n",
    "boxes/box1/gpus/\u00b3",
    "boxes/box1/gpus/\u00b2",
    "boxes/box1/gpus/\u0663",
    "boxes/box1/gpus/" + "9" * 5000,
    "boxes/box1/gpus/-1",
    "boxes/box1/gpus/4096",
    "boxes/box1/gpus/ 1",
    "boxes/Box1",
    "boxes/box1/",
    "hosts/",
    "nodes/../n1",
    "ml\u0085",
    "ml\u009b[31m",
    "ml\u202e",
    "ml\u2028",
    "ml\t",
    "ml\x00",
    "ml\x7f",
    "\u200b",
    "\u00a0",
    "H100:4",
    "djE6",
    "not-a-token",
)
UNUSUAL_CHARS = "\n\r\t\x00\x1b\x7f\x85\x9b\xa0\u00b3\u0663\u200b\u202e\u2028\ufeff\U0001f600"

_INT_RANGES = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1),
    F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1),
    F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1),
    F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1),
    F.TYPE_FIXED64: (0, 2**64 - 1),
}
# Limits the broker documents (dxpool.limits), and one either side of each.
_EDGES = (0, 1, 2, 8, 31, 32, 33, 63, 64, 65, 100, 999, 1000, 1001, 4095, 4096, 81920)
_EDGES_64 = (16 * 1024 * 1024, 16 * 1024 * 1024 + 1, 10**10, 10**10 + 1)


def texts() -> st.SearchStrategy[str]:
    """Any string field's value: plausible, a near miss, arbitrary or huge."""
    plausible = st.sampled_from(PLAUSIBLE)
    return st.one_of(
        plausible,
        plausible,
        st.sampled_from(NEAR_MISSES),
        st.tuples(plausible, st.sampled_from(UNUSUAL_CHARS)).map("".join),
        st.text(st.characters(codec="utf-8"), max_size=40),
        st.tuples(st.sampled_from("a9-\u00b3\u0085\n"), st.integers(257, 70_000)).map(
            lambda pair: pair[0] * pair[1]
        ),
    )


def integers(field: FieldDescriptor) -> st.SearchStrategy[int]:
    low, high = _INT_RANGES[field.type]
    edges = [v for v in (*_EDGES, *_EDGES_64) if low <= v <= high]
    edges += [-v for v in edges if low <= -v]
    return st.one_of(
        st.sampled_from(edges),
        st.integers(-3, 70).filter(lambda v: low <= v <= high),
        st.sampled_from((low, high, low + 1, high - 1)),
        st.integers(low, high),
    )


def enums(field: FieldDescriptor) -> st.SearchStrategy[int]:
    known = [value.number for value in field.enum_type.values]
    return st.one_of(
        st.sampled_from(known),
        st.sampled_from((max(known) + 1, -1, 2**31 - 1, -(2**31))),
        st.integers(-(2**31), 2**31 - 1),
    )


def single(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    """One value of ``field``'s type (a message for message fields)."""
    if field.type == F.TYPE_STRING:
        return texts()
    if field.type == F.TYPE_BYTES:
        return st.binary(max_size=64)
    if field.type == F.TYPE_BOOL:
        return st.booleans()
    if field.type in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return st.floats(width=32 if field.type == F.TYPE_FLOAT else 64)
    if field.type == F.TYPE_ENUM:
        return enums(field)
    if field.type in (F.TYPE_MESSAGE, F.TYPE_GROUP):
        return messages(field.message_type, depth + 1)
    return integers(field)


def values(field: FieldDescriptor, depth: int = 0) -> st.SearchStrategy[Any]:
    """A value for ``field`` as a whole: a list for repeated fields, a dict for maps.

    Long lists and maps (past the broker's limits) repeat one generated element, so
    they cost one draw, not seventy.
    """
    if _is_map(field):
        key_field = field.message_type.fields_by_name["key"]
        value_field = field.message_type.fields_by_name["value"]
        keys, items = single(key_field, depth), single(value_field, depth)
        return st.one_of(
            st.dictionaries(keys, items, max_size=4),
            st.dictionaries(keys, items, max_size=4),
            st.tuples(items, st.integers(30, 40)).map(
                lambda pair: {_key(key_field, i): pair[0] for i in range(pair[1])}
            ),
        )
    if _is_repeated(field):
        item = single(field, depth)
        return st.one_of(
            st.lists(item, max_size=4),
            st.lists(item, max_size=4),
            st.tuples(item, st.integers(62, 70)).map(lambda pair: [pair[0]] * pair[1]),
        )
    return single(field, depth)


def _key(field: FieldDescriptor, index: int) -> Any:
    """The ``index``-th distinct key of a map whose keys are ``field``'s type."""
    if field.type == F.TYPE_STRING:
        return f"k{index}"
    if field.type == F.TYPE_BOOL:
        return bool(index % 2)
    return index


def messages(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """A message of ``descriptor``'s type with any subset of its fields set."""
    if depth > MAX_DEPTH:
        return st.builds(message_class(descriptor))
    optional = {field.name: values(field, depth) for field in descriptor.fields}
    return st.fixed_dictionaries({}, optional=optional).map(
        lambda fields: build(descriptor, fields)
    )


def requests(descriptor: Descriptor, baseline: Message | None = None) -> st.SearchStrategy[Message]:
    """Requests of ``descriptor``'s type: from scratch, or ``baseline`` with one field
    (at any depth) replaced."""
    scratch = messages(descriptor)
    if baseline is None:
        return scratch
    paths = field_paths(descriptor)
    if not paths:  # a message without fields: only the empty message and unknown bytes
        return st.one_of(scratch, st.just(baseline))
    mutated = st.sampled_from(paths).flatmap(
        lambda path: values(path[-1], len(path) - 1).map(
            lambda value: with_field(baseline, path, value)
        )
    )
    return st.one_of(scratch, mutated, st.just(baseline))


def field_paths(
    descriptor: Descriptor, prefix: tuple[FieldDescriptor, ...] = ()
) -> list[tuple[FieldDescriptor, ...]]:
    """Every field reachable from ``descriptor`` through singular message fields."""
    paths = []
    for field in descriptor.fields:
        path = (*prefix, field)
        paths.append(path)
        is_message = field.type == F.TYPE_MESSAGE and not _is_repeated(field)
        if is_message and len(path) <= MAX_DEPTH:
            paths.extend(field_paths(field.message_type, path))
    return paths


def with_field(baseline: Message, path: tuple[FieldDescriptor, ...], value: Any) -> Message:
    """A copy of ``baseline`` with the field at ``path`` set to ``value``."""
    copy = type(baseline)()
    copy.CopyFrom(baseline)
    target = copy
    for field in path[:-1]:
        target = getattr(target, field.name)
    _assign(target, path[-1], value)
    return copy


def build(descriptor: Descriptor, fields: dict[str, Any]) -> Message:
    message = message_class(descriptor)()
    for name, value in fields.items():
        _assign(message, descriptor.fields_by_name[name], value)
    return message


def message_class(descriptor: Descriptor) -> Callable[[], Message]:
    return message_factory.GetMessageClass(descriptor)


def _assign(message: Message, field: FieldDescriptor, value: Any) -> None:
    if _is_map(field):
        container = getattr(message, field.name)
        container.clear()
        if field.message_type.fields_by_name["value"].type == F.TYPE_MESSAGE:
            for key, item in value.items():
                container[key].CopyFrom(item)
        else:
            container.update(value)
    elif _is_repeated(field):
        container = getattr(message, field.name)
        del container[:]
        if field.type == F.TYPE_MESSAGE:
            for item in value:
                container.add().CopyFrom(item)
        else:
            container.extend(value)
    elif field.type == F.TYPE_MESSAGE:
        getattr(message, field.name).CopyFrom(value)
    else:
        setattr(message, field.name, value)


def _is_repeated(field: FieldDescriptor) -> bool:
    return bool(field.is_repeated) if hasattr(field, "is_repeated") else field.label == 3


def _is_map(field: FieldDescriptor) -> bool:
    return (
        _is_repeated(field)
        and field.type == F.TYPE_MESSAGE
        and field.message_type.GetOptions().map_entry
    )
