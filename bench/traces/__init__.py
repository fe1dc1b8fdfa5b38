"""Trace-driven placement benchmarks: dxpool's allocator against fixed GPU servers.

:mod:`.pool` holds a dxpool inventory in a real broker cache (fed as the broker feeds it,
with no etcd) and places nodes through the real placement index and pipeline;
:mod:`.servers` is the fixed-server baseline; :mod:`.allocator` is what both offer and
how a refusal is classified, plus gangs; :mod:`.data` reads the traces, :mod:`.pipelines`
names the placement pipelines compared, :mod:`.report` prints tables and draws plots.
:mod:`.openb` (static fill, Alibaba 2023) and :mod:`.philly` (dynamic replay, Philly)
are the benchmarks, run as ``python -m bench.traces.openb`` and
``python -m bench.traces.philly``.
"""
