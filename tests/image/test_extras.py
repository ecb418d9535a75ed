"""One extra names what a pod needs: the image installs it, and the test set-up (the README's
second command, which CI runs) installs it with the test tooling."""

from __future__ import annotations

from kvferry_testing.image_files import (
    CI_RUN,
    README,
    dockerfile_extras,
    extras_closure,
    pip_install_extras,
    shell_blocks,
)

IMAGE_EXTRA = "image"
# What the pods' commands need: `kvferry serve` and `kvferry router` (serve), moving KV
# blocks between engine pods (kvtransfer), `kvferry operator` (operator).
POD_EXTRAS = {"serve", "kvtransfer", "operator"}
# Only tests use these; an image that carries them is larger and no better.
TEST_TOOLING = {"pytest", "pytest-asyncio", "hypothesis", "kmock", "kubernetes-validate",
                "matplotlib"}
# What the README's first command installs: serving (`kvferry up` included), nothing else.
SERVING_EXTRAS = {"serve", "kvtransfer"}


def test_the_dockerfile_installs_the_image_extra() -> None:
    assert dockerfile_extras() == {IMAGE_EXTRA}


def test_the_image_extra_holds_what_every_pod_command_needs() -> None:
    missing = extras_closure(POD_EXTRAS) - extras_closure({IMAGE_EXTRA})
    assert missing == set()
    assert {"fastapi", "uvicorn", "pyzmq", "redis", "aiohttp", "nixl-cu12", "kopf"} <= \
        extras_closure(dockerfile_extras())


def test_the_image_extra_holds_no_test_tooling() -> None:
    assert extras_closure({IMAGE_EXTRA}) & TEST_TOOLING == set()
    # The test set-up installs the image's environment and the tooling on top.
    assert extras_closure({IMAGE_EXTRA}) <= extras_closure({"test"})


def _project_installs(text: str) -> list[set[str]]:
    return [extras for line in text.splitlines() for extras in pip_install_extras(line)]


def test_every_project_install_in_the_readme_and_ci_is_the_serving_or_the_test_set() -> None:
    blocks = "\n".join(shell_blocks(README.read_text()))
    installs = {"README": _project_installs(blocks),
                ".ci/run": _project_installs(CI_RUN.read_text())}
    assert installs["README"] and installs[".ci/run"]
    wrong = {where: extras for where, found in installs.items() for extras in found
             if extras not in (SERVING_EXTRAS, {"test"})}
    assert wrong == {}
