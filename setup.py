"""Package discovery for the remapped top-level folders, and the .proto files.

pyproject.toml maps each top-level folder onto a subpackage of ``dxpool`` (for example
``broker/`` installs as ``dxpool.broker``). setuptools' automatic discovery cannot follow
such a mapping, so every package below each mapped folder is listed here.

The API's .proto sources (``proto/dxpool/v1/*.proto``) ship in the wheel under
``dxpool/api/proto/``, laid out as their imports name them (``dxpool/v1/...``), so that
directory is the include root for generating clients in other languages.
"""

import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

PROTO_SOURCES = Path("proto")
PROTO_TARGET = Path("dxpool", "api", "proto")

ROOTS = {
    "dxpool": "dxpool",
    "dxpool.api": "proto/python",
    "dxpool.broker": "broker",
    "dxpool.hostagent": "hostagent",
    "dxpool.fabric": "fabric",
    "dxpool.cli": "cli",
}


# Folders of data files only (no __init__.py) that ship inside a package; listed as
# packages of their own so setuptools installs them without warning that they are missing.
DATA_PACKAGES = ["dxpool.fabric.examples"]


def _packages() -> list[str]:
    found: list[str] = []
    for package, folder in ROOTS.items():
        found.append(package)
        found.extend(f"{package}.{sub}" for sub in find_packages(folder))
    return found + DATA_PACKAGES


class BuildWithProtos(build_py):
    """``build_py`` that also copies the .proto sources into the built package."""

    def run(self) -> None:
        super().run()
        for source in sorted(PROTO_SOURCES.glob("dxpool/**/*.proto")):
            target = Path(self.build_lib) / PROTO_TARGET / source.relative_to(PROTO_SOURCES)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)


setup(
    cmdclass={"build_py": BuildWithProtos},
    packages=_packages(),
    package_data={
        "dxpool": ["py.typed"],
        "dxpool.api": ["py.typed", "v1/*.pyi"],
        "dxpool.fabric.examples": ["*.yaml"],
    },
)
