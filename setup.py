"""Maps kvferry's top-level folders to the subpackages of one `kvferry` distribution.

`engine/` is `kvferry.engine`, `kvtransfer/` is `kvferry.kvtransfer`, `router/` is
`kvferry.router` and `operator/` is `kvferry.operator`; `kvferry/` holds the package root
(the offline API re-exports and the command line). Folders that do not exist yet are skipped.
"""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
SUBPACKAGES = {
    "kvferry": "kvferry",
    "kvferry.engine": "engine",
    "kvferry.kvtransfer": "kvtransfer",
    "kvferry.router": "router",
    "kvferry.operator": "operator",
}


def _packages() -> tuple[list[str], dict[str, str]]:
    packages: list[str] = []
    package_dir: dict[str, str] = {}
    for name, folder in SUBPACKAGES.items():
        if not (ROOT / folder / "__init__.py").exists():
            continue
        package_dir[name] = folder
        packages.append(name)
        packages += [f"{name}.{sub}" for sub in find_packages(folder)]
    return packages, package_dir


# Files loaded at run time that are not Python modules: without these patterns they are in
# the source tree (and an editable install) but not in the wheel the image installs. Kernel
# sources are compiled where they run (the CPU decode kernel on first use), so every C and
# CUDA source under engine/ ships.
PACKAGE_DATA = {
    "kvferry": ["py.typed"],
    "kvferry.engine": ["**/*.c", "**/*.h", "**/*.cu", "**/*.cuh"],
    "kvferry.operator": ["crds/*.yaml"],
}

packages, package_dir = _packages()
setup(
    packages=packages,
    package_dir=package_dir,
    package_data=PACKAGE_DATA,
    include_package_data=True,
)
