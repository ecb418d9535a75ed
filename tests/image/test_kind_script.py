"""e2e/kind.sh builds the image the pods run and loads it into the cluster before using it."""

from __future__ import annotations

import re
import subprocess

from kvferry.operator.images import DEFAULT_IMAGE
from kvferry_testing.image_files import DEMO_SERVICE, KIND_SCRIPT
from kvferry_testing.image_pods import pods, rendered


def script_image() -> str:
    (image,) = re.findall(r"^IMAGE=(\S+)$", KIND_SCRIPT.read_text(), flags=re.MULTILINE)
    return image


def test_the_script_is_valid_bash() -> None:
    done = subprocess.run(["bash", "-n", str(KIND_SCRIPT)], capture_output=True, text=True,
                          timeout=30, check=False)
    assert done.returncode == 0, done.stderr


def test_the_demo_pods_run_the_image_the_script_builds() -> None:
    assert script_image() == DEFAULT_IMAGE
    images = {pod.name: pod.container["image"] for pod in pods(rendered(DEMO_SERVICE)).values()}
    assert set(images.values()) == {script_image()}, images


def test_the_image_is_built_and_loaded_before_the_chart_and_the_service() -> None:
    lines = [line.strip() for line in KIND_SCRIPT.read_text().splitlines()]
    steps = ['docker build -t "$IMAGE" .', 'kind create cluster', 'kind load docker-image "$IMAGE"',
             '"$HELM" install kvferry charts/kvferry', "kubectl apply -f examples/demo.yaml",
             "kubectl port-forward svc/demo-router", 'curl -sf "http://127.0.0.1:$PORT/v1/completions"']
    positions = [next((i for i, line in enumerate(lines) if line.startswith(step)), None)
                 for step in steps]
    assert None not in positions, dict(zip(steps, positions))
    assert positions == sorted(positions), dict(zip(steps, positions))
    assert DEMO_SERVICE.relative_to(KIND_SCRIPT.parents[1]).as_posix() == "examples/demo.yaml"
