"""Which optional parts of the install are present, answered without importing them."""

from __future__ import annotations

import pytest

from dxpool import extras


def test_an_installed_extra_misses_nothing() -> None:
    # The development install carries every extra.
    assert extras.missing_modules("server", "agent") == []


def test_missing_modules_are_named_once_and_sorted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        extras,
        "EXTRA_MODULES",
        {
            "server": ("zz_dxpool_absent", "etcd3", "aa_dxpool_absent"),
            "agent": ("zz_dxpool_absent",),
        },
    )
    assert extras.missing_modules("server", "agent") == ["aa_dxpool_absent", "zz_dxpool_absent"]


def test_an_unknown_extra_is_a_key_error() -> None:
    with pytest.raises(KeyError):
        extras.missing_modules("gpu")


def test_install_hint_names_every_extra() -> None:
    assert extras.install_hint("server") == "pip install 'dxpool[server]'"
    assert extras.install_hint("server", "agent") == "pip install 'dxpool[server,agent]'"
