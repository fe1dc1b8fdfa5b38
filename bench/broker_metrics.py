"""The broker's Prometheus samples, read from its metrics port, for the benchmarks."""

from __future__ import annotations

from urllib.request import urlopen

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def broker_samples(metrics_port: int, timeout_s: float = 10.0) -> list[Sample]:
    """Every sample the broker serving metrics on ``127.0.0.1:metrics_port`` exposes now."""
    with urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=timeout_s) as response:
        text = response.read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]
