from __future__ import annotations

import pytest

from dxpool.errors import InvalidArgument
from dxpool.request import (
    GpuSpec,
    format_duration_ns,
    normalize_model_set,
    parse_duration_ns,
    parse_gpus,
    parse_memory_mib,
    parse_spread,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("H100:4", GpuSpec("H100", 4)),
        ("A100", GpuSpec("A100", 1)),
        ("8", GpuSpec("", 8)),
        ("*:2", GpuSpec("", 2)),
        ("A100-80GB:64", GpuSpec("A100-80GB", 64)),
    ],
)
def test_gpu_grammar(text: str, expected: GpuSpec) -> None:
    assert parse_gpus(text) == expected


def test_string_mapping_and_typed_forms_agree() -> None:
    assert parse_gpus("H100:4") == parse_gpus({"model": "H100", "count": 4}) == GpuSpec("H100", 4)


@pytest.mark.parametrize("text", [":4", "H100:", "H100:x", "H100:1:2", "", "H 100:2"])
def test_gpu_grammar_errors_show_the_grammar(text: str) -> None:
    with pytest.raises(InvalidArgument) as error:
        parse_gpus(text)
    assert "MODEL:COUNT" in str(error.value) or "invalid GPU model" in str(error.value)


@pytest.mark.parametrize("text", ["H100:0", "H100:-1", "H100:65"])
def test_gpu_counts_out_of_range(text: str) -> None:
    with pytest.raises(InvalidArgument, match="1 to 64"):
        parse_gpus(text)


def test_unknown_mapping_field() -> None:
    with pytest.raises(InvalidArgument, match="unknown GPU request field"):
        parse_gpus({"modle": "H100"})


def test_spec_is_immutable() -> None:
    spec = GpuSpec("H100", 2)
    with pytest.raises(AttributeError):
        spec.count = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "ns"),
    [
        ("4us", 4000),
        ("1.5ms", 1_500_000),
        ("800ns", 800),
        ("2s", 2 * 10**9),
        ("5m", 300 * 10**9),
        ("1.5h", 5400 * 10**9),
        ("1m30s", 90 * 10**9),  # Go's form, as etcd and Kubernetes take it
        ("1h15m", 4500 * 10**9),
        ("2m0.5s", 120_500_000_000),
        ("1s500ms", 1_500_000_000),
    ],
)
def test_durations(text: str, ns: int) -> None:
    assert parse_duration_ns(text) == ns


@pytest.mark.parametrize("text", ["4", "4 parsecs", "-1us", "us", "30s1m", "1m1m", "1m 30s"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(InvalidArgument, match="unit"):
        parse_duration_ns(text)


def test_format_duration() -> None:
    assert format_duration_ns(4000) == "4us"
    assert format_duration_ns(1500) == "1.5us"
    assert format_duration_ns(999) == "999ns"
    assert format_duration_ns(30 * 24 * 3600 * 10**9) == "720h"  # not 2.592e+06s
    assert format_duration_ns(300 * 10**9) == "5m"


def test_memory() -> None:
    assert parse_memory_mib("80GiB") == 81920
    assert parse_memory_mib("512MiB") == 512
    with pytest.raises(InvalidArgument, match="GiB"):
        parse_memory_mib("lots")


@pytest.mark.parametrize(
    "text", ["H100:" + "9" * 5000, "0" * 5000, "H100:99999999999999999999", "H100:\u0663"]
)
def test_gpu_counts_of_any_length_are_invalid_argument(text: str) -> None:
    with pytest.raises(InvalidArgument) as error:
        parse_gpus(text)
    assert len(str(error.value)) < 400


@pytest.mark.parametrize("count", ["\u00b3", "\u0663", "9" * 5000, "1.5"])
def test_mapping_counts_are_ascii_integers(count: str) -> None:
    with pytest.raises(InvalidArgument, match="integer"):
        parse_gpus({"model": "H100", "count": count})


@pytest.mark.parametrize("text", ["1" * 400 + "s", "\u0663us", "4us\nx", "9999999999999s"])
def test_durations_are_bounded(text: str) -> None:
    with pytest.raises(InvalidArgument, match="duration"):
        parse_duration_ns(text)


def test_memory_is_bounded_to_16_tib() -> None:
    assert parse_memory_mib("16TiB") == 16 * 1024 * 1024
    with pytest.raises(InvalidArgument, match="16TiB"):
        parse_memory_mib("17TiB")
    with pytest.raises(InvalidArgument, match="memory size"):
        parse_memory_mib("1" * 400 + "GiB")
    with pytest.raises(InvalidArgument, match="16 TiB"):
        GpuSpec("H100", 1, min_memory_mib=2**63 - 1)


def test_models_must_match_whole() -> None:
    with pytest.raises(InvalidArgument, match="invalid GPU model"):
        GpuSpec("H100\n", 1)


# -- model sets --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "models"),
    [
        ("H100|A100:4", ("H100", "A100")),
        ("H100|A100", ("H100", "A100")),
        ("a100|H100|B200:2", ("a100", "H100", "B200")),
        ("H100:4", ("H100",)),
        ("*:4", ()),
    ],
)
def test_model_sets_keep_the_order_written(text: str, models: tuple[str, ...]) -> None:
    assert parse_gpus(text).models == models


@pytest.mark.parametrize(
    ("text", "models", "normalized"),
    [
        ("V100M16|V100M32|V100M32:1", ("V100M16", "V100M32"), "V100M16|V100M32"),
        ("H100|h100:2", ("H100",), "H100"),
        ("A|B|a|C|b:1", ("A", "B", "C"), "A|B|C"),
    ],
)
def test_a_model_named_twice_counts_once_where_first_written(
    text: str, models: tuple[str, ...], normalized: str
) -> None:
    spec = parse_gpus(text)
    assert spec.models == models
    assert normalize_model_set(spec.model) == normalized


def test_mixed_models_needs_two_distinct_models() -> None:
    with pytest.raises(InvalidArgument, match="mixed_models needs a model set"):
        GpuSpec("H100|h100", 2, mixed_models=True)


def test_a_model_set_in_every_form_means_the_same() -> None:
    typed = GpuSpec("H100|A100", 4, mixed_models=True)
    mapping = {"model": ["H100", "A100"], "count": 4, "mixed_models": True}
    assert parse_gpus(mapping) == typed
    assert parse_gpus({"model": "H100|A100", "count": 4, "mixed_models": True}) == typed
    assert str(parse_gpus("H100|A100:4")) == "H100|A100:4"


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("H100||A100", "invalid GPU model ''"),
        ("H100|", "invalid GPU model ''"),
        ("|".join(f"M{i}" for i in range(9)), "at most 8 models"),
        ("H100|A 100", "invalid GPU model 'A 100'"),
    ],
)
def test_bad_model_sets_say_what_to_write(model: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message) as error:
        GpuSpec(model, 1)
    assert error.value.reason == "INVALID_GPU_MODEL"


@pytest.mark.parametrize("text", ["H100||A100:4", "*|A100:2", "|A100:1"])
def test_malformed_set_strings_show_the_grammar(text: str) -> None:
    with pytest.raises(InvalidArgument, match=r"MODEL\|MODEL:COUNT"):
        parse_gpus(text)


@pytest.mark.parametrize("model", ["", "H100"])
def test_mixed_models_needs_a_set(model: str) -> None:
    with pytest.raises(InvalidArgument, match="mixed_models needs a model set"):
        GpuSpec(model, 2, mixed_models=True)


def test_mixed_models_must_be_a_boolean_in_a_mapping() -> None:
    with pytest.raises(InvalidArgument, match="true or false"):
        parse_gpus({"model": "H100|A100", "count": 2, "mixed_models": "yes"})


@pytest.mark.parametrize(("text", "limit"), [("boxes", 1), ("boxes:2", 2), (" boxes:64 ", 64)])
def test_spread_grammar(text: str, limit: int) -> None:
    assert parse_spread(text) == limit


@pytest.mark.parametrize("text", ["box", "boxes:", "boxes:x", "racks", "boxes:-1"])
def test_bad_spreads_show_the_grammar(text: str) -> None:
    with pytest.raises(InvalidArgument, match=r"expected boxes \(at most 1 GPU per box\)"):
        parse_spread(text)


@pytest.mark.parametrize("text", ["boxes:0", "boxes:65"])
def test_spreads_out_of_range(text: str) -> None:
    with pytest.raises(InvalidArgument, match="out of range") as error:
        parse_spread(text)
    assert error.value.reason == "INVALID_SPREAD"
