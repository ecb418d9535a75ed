"""The README lists every `kvferry:` metric a pod exports, with its labels, and every
value of the failures' `reason` label."""

from __future__ import annotations

import re
from pathlib import Path

from kvferry.engine.server.metrics import EngineMetrics
from kvferry.kvtransfer.metrics import FailureReason
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

README = (Path(__file__).resolve().parents[3] / "README.md").read_text()


def exported_kvferry_families() -> dict[str, set[str]]:
    """Family name (as sampled, with _total) -> its label names, of a pod with KV transfer."""
    metrics = EngineMetrics("m", 16, 100, True, kv_transfer_enabled=True)
    text = generate_latest(metrics.registry).decode()
    families: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name.startswith("kvferry:") and not name.endswith(("_bucket", "_count", "_sum",
                                                                   "_created")):
                families.setdefault(name, set()).update(sample.labels)
    return families


def test_every_kvferry_metric_of_a_pod_is_in_the_readme_with_its_labels() -> None:
    families = exported_kvferry_families()
    assert "kvferry:kv_transfer_failures_total" in families
    for name, labels in families.items():
        extra = sorted(labels - {"model_name"})
        listed = f"`{name}{{{','.join(extra)}}}`" if extra else f"`{name}`"
        assert listed in README, f"README does not list {listed}"
    assert "Every `kvferry:` metric is\nlabelled `model_name`" in README


def test_the_readme_names_every_failure_reason() -> None:
    start = "the failures' `reason` is one of"
    paragraph = README[README.index(start) + len(start):]
    paragraph = paragraph[:paragraph.index("\n\n")]
    listed = set(re.findall(r"`([a-z_]+)`", paragraph))
    assert listed == {reason.value for reason in FailureReason}
