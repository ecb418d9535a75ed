"""What the container image is made of, read from the files that define it.

The `Dockerfile`, `.dockerignore`, the README and `.ci/run` are parsed here (never copied
into the tests), so a test that compares them with the package cannot drift from them.
`build_context` copies the tree the way `docker build` sees it, and `build_wheel` builds
the wheel the image installs from that copy.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
README = ROOT / "README.md"
CI_RUN = ROOT / ".ci" / "run"
PYPROJECT = ROOT / "pyproject.toml"
KIND_SCRIPT = ROOT / "e2e" / "kind.sh"
DEMO_SERVICE = ROOT / "examples" / "demo.yaml"

# The torch build that lies on the development and CI machines; an unpinned torch would
# pull a multi-gigabyte CUDA build from the index.
TORCH_PIN = "torch==2.13.0"
WHEEL_BUILD_TIMEOUT_S = 300
VENV_INSTALL_TIMEOUT_S = 900
RUNTIME_FILES_SCRIPT = Path(__file__).with_name("runtime_files.py")
# What kvferry.engine.attention.cpu_kernels logs when it compiles and loads the kernel,
# and when it cannot (then decode attention quietly takes the slow path).
KERNEL_BUILT = "built the CPU paged decode kernel"
KERNEL_UNAVAILABLE = "CPU decode kernel unavailable"


# --- Dockerfile ---------------------------------------------------------------------------


def _logical_lines(text: str) -> list[str]:
    """Instructions with their `\\` continuations joined and comment lines dropped."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # Docker drops comment lines inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    if pending:
        lines.append(pending.strip())
    return lines


def final_stage() -> list[str]:
    """The instructions of the Dockerfile's last stage: the image that is shipped."""
    lines = _logical_lines(DOCKERFILE.read_text())
    starts = [i for i, line in enumerate(lines) if line.split()[0].upper() == "FROM"]
    if not starts:
        raise AssertionError(f"{DOCKERFILE} has no FROM")
    return lines[starts[-1]:]


def dockerfile_env() -> dict[str, str]:
    """The ENV of the shipped stage (`ENV K=V ...`, also the legacy `ENV K V`)."""
    env: dict[str, str] = {}
    for line in final_stage():
        keyword, _, rest = line.partition(" ")
        if keyword.upper() != "ENV":
            continue
        rest = rest.strip()
        if "=" not in rest.split()[0]:
            name, _, value = rest.partition(" ")
            env[name] = value.strip().strip('"')
            continue
        for match in re.finditer(r'(\w+)=("[^"]*"|\S*)', rest):
            env[match.group(1)] = match.group(2).strip('"')
    return env


def dockerfile_user() -> int:
    """The uid the image creates (`useradd --uid N`) and runs as (`USER N`)."""
    stage = final_stage()
    useradd = re.compile(r"useradd\b.*?--uid[= ](\d+)")
    created = [int(m.group(1)) for line in stage for m in useradd.finditer(line)]
    users = [line.split()[1] for line in stage if line.split()[0].upper() == "USER"]
    if len(created) != 1 or not users or users[-1] != str(created[0]):
        raise AssertionError(f"the image should create one user by uid and run as it: "
                             f"useradd uids {created}, USER {users}")
    return created[0]


# A requirement naming the project with extras: `.[a,b]`, `kvferry[a]`,
# `"$(ls .../kvferry-*.whl)[a]"`.
_PROJECT_WITH_EXTRAS = re.compile(r"""(?:kvferry[^\s"'\[]*|(?<![\w/])\.)\[([\w,\s-]+)\]""")


def pip_install_extras(command: str) -> list[set[str]]:
    """The extras of every `pip install` of the project in a shell command line."""
    found = []
    for install in re.split(r"&&|;|\|\|", command):
        if re.search(r"\bpip3?\s+install\b", install):
            found += [{e.strip() for e in m.group(1).split(",")}
                      for m in _PROJECT_WITH_EXTRAS.finditer(install)]
    return found


def dockerfile_extras() -> set[str]:
    """The extras the image installs the project with (the Dockerfile must name one set)."""
    runs = [line for line in final_stage() if line.split()[0].upper() == "RUN"]
    found = [extras for line in runs for extras in pip_install_extras(line)]
    if len(found) != 1:
        raise AssertionError(f"the Dockerfile should install the project once, with extras; "
                             f"found {found}")
    return found[0]


# --- pyproject ------------------------------------------------------------------------------


def optional_dependencies() -> dict[str, list[str]]:
    return tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]


def requirement_name(requirement: str) -> str:
    """The distribution a requirement names, normalized (`Foo_Bar[x]>=1` -> `foo-bar`)."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement.strip())
    if name is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[._-]+", "-", name.group(0)).lower()


def extras_closure(extras: set[str]) -> set[str]:
    """Every distribution the extras name, following `kvferry[...]` references."""
    declared = optional_dependencies()
    names: set[str] = set()
    seen: set[str] = set()
    todo = list(extras)
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        if extra not in declared:
            raise AssertionError(f"extra {extra!r} is not declared in {PYPROJECT}")
        seen.add(extra)
        for requirement in declared[extra]:
            own = re.fullmatch(r"kvferry\[([\w,\s-]+)\]", requirement.strip())
            if own:
                todo += [e.strip() for e in own.group(1).split(",")]
            else:
                names.add(requirement_name(requirement))
    return names


# --- the build context and the wheel ----------------------------------------------------------


def _dockerignore_pattern(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regex over a slash-separated path in the context.

    Docker's rules: `*` and `?` stay inside one path segment, `**` spans any number of
    segments, and a pattern that matches a directory excludes everything below it.
    """
    out = ""
    i = 0
    pattern = pattern.strip("/")
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + "(?:/.*)?")


def dockerignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    """(excludes, pattern) per .dockerignore line, in order; a `!` line re-includes."""
    rules = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            negated = line.startswith("!")
            rules.append((not negated, _dockerignore_pattern(line.lstrip("!"))))
    return rules


def is_ignored(relative: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    ignored = False
    for excludes, pattern in rules:
        if pattern.fullmatch(relative):
            ignored = excludes
    return ignored


def build_context(dest: Path) -> Path:
    """Copies the tree into `dest` as `docker build .` sends it (symlinks kept as links)."""
    rules = dockerignore_rules()
    for dirpath, dirnames, filenames in os.walk(ROOT):
        base = Path(dirpath).relative_to(ROOT)
        dirnames[:] = [d for d in dirnames if not is_ignored((base / d).as_posix(), rules)]
        (dest / base).mkdir(parents=True, exist_ok=True)
        for name in [*filenames, *(d for d in dirnames if (Path(dirpath) / d).is_symlink())]:
            relative = (base / name).as_posix()
            if is_ignored(relative, rules):
                continue
            source = Path(dirpath) / name
            if source.is_symlink():
                (dest / relative).symlink_to(os.readlink(source))
            else:
                shutil.copy2(source, dest / relative)
        dirnames[:] = [d for d in dirnames if not (Path(dirpath) / d).is_symlink()]
    return dest


def build_wheel(context: Path, out_dir: Path) -> Path:
    """`pip wheel --no-deps .` in the build context; the path of the kvferry wheel."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # Never run `python -m` from a tree with kvferry's top-level `operator/` folder in the
    # working directory: it would shadow the standard library's `operator`.
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", str(context), "-w", str(out_dir)],
        cwd=out_dir, capture_output=True, text=True, timeout=WHEEL_BUILD_TIMEOUT_S,
    )
    if done.returncode != 0:
        raise AssertionError(f"pip wheel failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    (wheel,) = out_dir.glob("kvferry-*.whl")
    return wheel


def create_venv(venv: Path, wheel: Path, extras: set[str]) -> Path:
    """A fresh virtual environment with `wheel[extras]` installed; its bin directory.

    torch is pinned by a constraint (the local CPU build), as the image pins its own
    build by installing torch from its index before the project.
    """
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120,
                   cwd=venv.parent)
    constraints = venv / "constraints.txt"
    constraints.write_text(TORCH_PIN + "\n")
    requirement = f"{wheel}[{','.join(sorted(extras))}]"
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-c", str(constraints),
         requirement],
        capture_output=True, text=True, timeout=VENV_INSTALL_TIMEOUT_S, cwd=venv,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    if done.returncode != 0:
        raise AssertionError(f"pip install {requirement} failed ({done.returncode}):\n"
                             f"{done.stdout}\n{done.stderr}")
    return venv / "bin"


def runtime_files(python: str | Path) -> dict[str, Any]:
    """runtime_files.py's report, run by `python` (the interpreter of the environment to inspect).

    It runs from this folder, never from the repository root, so an installed package is not
    shadowed by the source tree.
    """
    done = subprocess.run([str(python), str(RUNTIME_FILES_SCRIPT)], capture_output=True,
                          text=True, timeout=300, cwd=RUNTIME_FILES_SCRIPT.parent)
    if done.returncode != 0:
        raise AssertionError(f"{RUNTIME_FILES_SCRIPT.name} failed under {python}:\n{done.stderr}")
    return json.loads(done.stdout)


# --- README and CI ----------------------------------------------------------------------------


def shell_blocks(markdown: str) -> list[str]:
    """The bodies of the ```bash blocks of a Markdown text."""
    return re.findall(r"```(?:bash|sh|shell)\n(.*?)```", markdown, flags=re.DOTALL)


def readme_commands() -> tuple[str, str]:
    """The README's two set-up commands, from its Quick start: the first (serve the demo)
    and the second (install the test extras and helm, run the tests)."""
    quick_start = README.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = [block.strip() for block in shell_blocks(quick_start)]
    if len(blocks) < 2 or any("\n" in block for block in blocks[:2]):
        raise AssertionError(f"the Quick start should open with two one-line commands: {blocks}")
    return blocks[0], blocks[1]


def script_commands(text: str) -> list[str]:
    """The command lines of a shell script: no blank lines, comments or `set`/`cd`/`export`
    preparation."""
    lines = [line.strip() for line in text.splitlines()]
    return [line for line in lines
            if line and not line.startswith(("#", "set ", "cd ", "export "))]


def clone_tree(dest: Path) -> Path:
    """The files a fresh clone of this checkout holds (tracked ones, and new ones git does not
    ignore), copied into `dest`."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    for relative in filter(None, listed.decode().split("\0")):
        source = ROOT / relative
        if not source.exists():  # deleted in the work tree, not yet in the index
            continue
        (dest / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, dest / relative, follow_symlinks=False)
    return dest
