"""The .proto files in the wheel: the one build step pyproject.toml cannot declare.

The API's .proto sources (``proto/dxpool/v1/*.proto``) ship in the wheel under
``dxpool/api/proto/``, laid out as their imports name them (``dxpool/v1/...``), so that
directory is the include root for generating clients in other languages. Packages and
their data are found from pyproject.toml.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PROTO_SOURCES = Path("proto")
PROTO_TARGET = Path("dxpool", "api", "proto")


class BuildWithProtos(build_py):
    """``build_py`` that also copies the .proto sources into the built package."""

    def run(self) -> None:
        super().run()
        for source in sorted(PROTO_SOURCES.glob("dxpool/**/*.proto")):
            target = Path(self.build_lib) / PROTO_TARGET / source.relative_to(PROTO_SOURCES)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)


setup(cmdclass={"build_py": BuildWithProtos})
