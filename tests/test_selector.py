"""The label selector grammar: what each requirement matches, and errors that show it."""

from __future__ import annotations

import pytest

from dxpool.errors import InvalidArgument
from dxpool.selector import Operator, Requirement, parse_selector

LABELS = {"team": "ml", "tier": "prod", "gpu": ""}


@pytest.mark.parametrize(
    ("text", "matches"),
    [
        ("", True),
        ("   ", True),
        ("team=ml", True),
        ("team==ml", True),
        ("team = ml", True),
        ("team=infra", False),
        ("team!=infra", True),
        ("team!=ml", False),
        ("owner!=bob", True),  # a missing label is not equal to anything
        ("team", True),
        ("owner", False),
        ("!owner", True),
        ("!team", False),
        ("gpu=", True),  # set, to the empty value
        ("team=ml,tier=prod", True),
        ("team=ml,tier=dev", False),
        ("team=ml, tier!=dev, !owner, gpu", True),
        ("team in (ml,infra)", True),
        ("team in (infra)", False),
        ("tier in ( dev , prod )", True),
        ("owner in (bob)", False),  # a missing label is in no set
        ("team notin (infra,dev)", True),
        ("team notin (ml)", False),
        ("owner notin (bob)", True),  # ... and not in any
        ("team in (ml,infra),tier notin (dev),!owner", True),
        ("team in (ml,infra),tier notin (prod)", False),
    ],
)
def test_requirements_all_must_hold(text: str, matches: bool) -> None:
    assert parse_selector(text).matches(LABELS) is matches


def test_a_set_keeps_its_values_apart_from_the_requirements() -> None:
    assert parse_selector("env in (prod, staging),team=ml").requirements == (
        Requirement("env", Operator.IN, values=frozenset({"prod", "staging"})),
        Requirement("team", Operator.EQUALS, "ml"),
    )
    assert parse_selector("env notin (dev)").requirements == (
        Requirement("env", Operator.NOT_IN, values=frozenset({"dev"})),
    )


def test_parsed_requirements() -> None:
    assert parse_selector("a=1,b!=2,c,!d").requirements == (
        Requirement("a", Operator.EQUALS, "1"),
        Requirement("b", Operator.NOT_EQUALS, "2"),
        Requirement("c", Operator.EXISTS),
        Requirement("d", Operator.NOT_EXISTS),
    )
    assert not parse_selector("")
    assert parse_selector("a")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("=ml", "the key is empty"),
        ("team=ml,,tier=prod", "a requirement is empty"),
        ("team=ml,", "a requirement is empty"),
        ("!", "the key is empty"),
        ("team=a=b", "the value 'a=b'"),
        ("te am=ml", "contains"),
        ("!!team", "contains"),
        ("x" * 5000, "give at most 4096"),
        ("a=" + "=" * 3000, "the value '" + "=" * 80 + "...'"),
        ("team in ()", "the set names no value"),
        ("team in (ml,)", "a value of the set is empty"),
        ("team in (m=l)", "the value 'm=l'"),
        ("team in ml", "contains"),
        ("team in (ml", "a set is written KEY in (V1,V2)"),
        ("in (ml)", "a set is written KEY in (V1,V2)"),
    ],
)
def test_a_bad_selector_says_what_and_shows_the_grammar(text: str, says: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        parse_selector(text)
    assert says in raised.value.message
    assert raised.value.reason == "INVALID_SELECTOR"
    assert len(raised.value.message) < 600
    if len(text) < 100:
        assert repr(text) in raised.value.message
        assert "KEY=VALUE, KEY!=VALUE, KEY in (V1,V2), KEY notin (V1,V2)" in raised.value.message
