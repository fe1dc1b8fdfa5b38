"""Work around a defect of python3-etcd3 0.13.

``etcd3/watch.py`` calls ``six.itervalues`` when a watch stream ends but never imports
``six``; the watcher thread then dies with a NameError and the watch callbacks never
learn that their watch broke (so a cache would silently stop updating). Giving the module
the one function it uses restores the documented behaviour: every callback receives the
error. Importing this module is idempotent.
"""

from __future__ import annotations

import types

import etcd3.watch


def _itervalues(mapping: dict[object, object]) -> object:
    return iter(mapping.values())


if not hasattr(etcd3.watch, "six"):
    etcd3.watch.six = types.SimpleNamespace(itervalues=_itervalues)
