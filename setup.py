"""Package discovery for the remapped top-level folders.

pyproject.toml maps each top-level folder onto a subpackage of ``dxpool`` (for example
``broker/`` installs as ``dxpool.broker``). setuptools' automatic discovery cannot follow
such a mapping, so every package below each mapped folder is listed here.
"""

from setuptools import find_packages, setup

ROOTS = {
    "dxpool": "dxpool",
    "dxpool.api": "proto/python",
    "dxpool.broker": "broker",
    "dxpool.hostagent": "hostagent",
    "dxpool.fabric": "fabric",
    "dxpool.cli": "cli",
}


def _packages() -> list[str]:
    found: list[str] = []
    for package, folder in ROOTS.items():
        found.append(package)
        found.extend(f"{package}.{sub}" for sub in find_packages(folder))
    return found


setup(
    packages=_packages(),
    package_data={
        "dxpool": ["py.typed"],
        "dxpool.api": ["py.typed", "v1/*.pyi"],
        "dxpool.fabric": ["examples/*.yaml"],
    },
)
