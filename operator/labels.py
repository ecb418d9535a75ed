"""Names and labels of the children of an InferenceService (shared by render and status)."""

from __future__ import annotations

MANAGED_BY = "kvferry-operator"
SERVICE_LABEL = "kvferry.dev/service"
COMPONENT_LABEL = "kvferry.dev/component"

HTTP_PORT = 8000
NIXL_PORT = 5600
REDIS_PORT = 6379


def child_name(service: str, component: str) -> str:
    """Name of a child: `<service>-<component>` (e.g. `chat-decode`, `chat-router`)."""
    return f"{service}-{component}"


def selector_labels(service: str, component: str) -> dict[str, str]:
    """The immutable selector of one component's pods."""
    return {SERVICE_LABEL: service, COMPONENT_LABEL: component}


def labels(service: str, component: str) -> dict[str, str]:
    """Labels on every child object and pod of one component."""
    return {
        "app.kubernetes.io/name": "kvferry",
        "app.kubernetes.io/instance": service,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "kvferry",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        **selector_labels(service, component),
    }


def scrape_annotations() -> dict[str, str]:
    """Pod annotations that let Prometheus scrape `/metrics` on the HTTP port."""
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(HTTP_PORT),
        "prometheus.io/path": "/metrics",
    }
