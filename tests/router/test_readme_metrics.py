"""The README lists every `kvferry:` metric the router exports, with its labels, and every
reason a registry value is rejected for."""

from __future__ import annotations

import re
from pathlib import Path

from kvferry.router.metrics import Labelled, RouterMetrics
from prometheus_client.metrics import MetricWrapperBase

from kvferry.protocol.record_auth import Rejection

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def listed_names() -> list[str]:
    """`name{labels}` as the README must list each router metric: counters with _total."""
    listed = []
    for value in vars(RouterMetrics()).values():
        metric = value.metric if isinstance(value, Labelled) else value
        if not isinstance(metric, MetricWrapperBase):
            continue  # the registry
        family = metric.describe()[0]
        name = family.name + ("_total" if family.type == "counter" else "")
        # prometheus_client keeps a metric's label names only on the metric itself.
        labels = sorted(metric._labelnames)
        listed.append(f"`{name}{{{','.join(labels)}}}`" if labels else f"`{name}`")
    return listed


def test_every_router_metric_is_in_the_readme_with_its_labels() -> None:
    listed = listed_names()
    assert len(listed) == 19 and "`kvferry:router_registry_rejected_total{reason}`" in listed
    for name in listed:
        assert name in README, f"README does not list {name}"


def test_the_readme_names_every_rejection_reason() -> None:
    start = "records and KV event batches ignored, by\nreason"
    paragraph = README[README.index(start) + len(start):]
    paragraph = paragraph[:paragraph.index("(")]
    assert set(re.findall(r"`([a-z_]+)`", paragraph)) == {r.value for r in Rejection}
