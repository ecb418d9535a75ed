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


packages, package_dir = _packages()
setup(
    packages=packages,
    package_dir=package_dir,
    package_data={"kvferry": ["py.typed"], "kvferry.operator": ["crds/*.yaml"]},
    include_package_data=True,
)
