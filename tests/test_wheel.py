"""The wheel a user installs: what it holds, and that it works with no source tree in sight,
from a project of the user's own whose ``trainer.py``, ``protos/`` and ``benchmarks/`` would
collide with generic top-level names."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import shutil
import site
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.test_docs import python_blocks

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIRS: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]


def _package_folders() -> dict[str, Path]:
    """Every package under the ``package-dir`` folders (import name → folder): each folder
    holding Python files, whether or not it has an ``__init__.py``."""
    found = {}
    for name, folder in PACKAGE_DIRS.items():
        base = ROOT / folder
        for directory in [base, *(p for p in base.rglob("*") if p.is_dir())]:
            relative = directory.relative_to(base)
            if "__pycache__" in relative.parts or not any(directory.glob("*.py")):
                continue
            if name == "neorec" and relative.parts:
                continue  # the neorec/ folder itself holds no subpackages
            found[".".join([name, *relative.parts])] = directory
    return found


def test_the_packages_list_covers_every_package_folder():
    """A new subpackage left out of ``packages`` would be silently missing from the wheel."""
    folders = _package_folders()
    missing_init = sorted(str(d.relative_to(ROOT)) for d in folders.values() if not (d / "__init__.py").is_file())
    assert not missing_init, f"package folders without __init__.py: {missing_init}"
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    assert sorted(set(folders) - listed) == [], "packages missing from pyproject.toml's [tool.setuptools] packages"
    assert sorted(listed - set(folders)) == [], "packages listed in pyproject.toml that have no folder"


def _build_wheel(out: Path) -> Path:
    """Build the wheel from a copy of the source (the build writes into its tree)."""
    source = out / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for folder in set(PACKAGE_DIRS.values()):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    setuptools_major = int(importlib.metadata.version("setuptools").split(".")[0])
    # pyproject asks for setuptools>=77; with it here the build needs no network
    isolation = ["--no-build-isolation", "--no-index"] if setuptools_major >= 77 else []
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", *isolation, "-w", str(out),
                    "--disable-pip-version-check", "-q"], check=True, timeout=300)
    (wheel,) = out.glob("neorec-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_wheel(tmp_path_factory.mktemp("wheel"))


def _imports_of(source: str, package: str) -> set[str]:
    """Modules of ``package`` that ``source`` imports (absolute imports, at any depth)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n.startswith(package + ".")}


def test_the_wheel_holds_the_packages_and_no_tests(wheel: Path):
    names = zipfile.ZipFile(wheel).namelist()
    modules = {n for n in names if n.endswith(".py")}
    assert not [n for n in names if "tests" in n.split("/") or Path(n).name.startswith(("test_", "conftest"))]
    for package, folder in _package_folders().items():
        inside = package.replace(".", "/")
        for path in folder.glob("*.py"):
            assert f"{inside}/{path.name}" in modules, f"{folder.relative_to(ROOT) / path.name} is not in the wheel"
    shipped_configs = {f"neorec/configs/{p.name}" for p in (ROOT / "configs").glob("*.toml")}
    assert shipped_configs and shipped_configs <= set(names), "the configs the benchmarks and docs name"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "neorec = neorec.orchestration.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_the_wheel_holds_no_benchmark_code_that_neorec_bench_does_not_run(wheel: Path):
    """Every module of ``neorec.benchmarks`` in the wheel is reached from ``run_benchmark``
    (the ``neorec bench`` command) through its imports."""
    archive = zipfile.ZipFile(wheel)
    shipped = {n[: -len(".py")].replace("/", ".") for n in archive.namelist()
               if n.startswith("neorec/benchmarks/") and n.endswith(".py")}
    reached, frontier = set(), ["neorec.benchmarks.__init__"]
    while frontier:
        module = frontier.pop()
        if module in reached or module not in shipped:
            continue
        reached.add(module)
        source = archive.read(module.replace(".", "/") + ".py").decode()
        frontier.extend(_imports_of(source, "neorec.benchmarks"))
    assert sorted(shipped - reached) == [], "benchmark modules no `neorec bench` command runs"


USER_CONFIG = """\
[data]
path = "data"
[model]
max_table_rows = 2000
[train]
batch_size = 256
max_steps = 4
threads = 1
[run]
dir = "runs/wheel"
"""

USER_CHECK = """\
import sys
from pathlib import Path

import trainer, protos, benchmarks  # the user's own
assert (trainer.OWNER, protos.OWNER, benchmarks.OWNER) == ("user",) * 3

import neorec
from neorec import DLRM, FusedEmbeddingBagCollection, KeyedJaggedTensor, TrainConfig, plan_tables
import neorec.trainer

venv = Path(sys.argv[1]).resolve()
for module in (neorec, neorec.trainer, sys.modules[DLRM.__module__]):
    assert Path(module.__file__).resolve().is_relative_to(venv), module.__file__
for name in neorec.__all__:
    getattr(neorec, name)
assert TrainConfig.from_dict({}).train.batch_size > 0
print("public API ok:", len(neorec.__all__), "names")
"""


def _without_source_paths() -> dict[str, str]:
    """This process's environment without the variables that put a source tree on the path."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH")}


def _fresh_venv(directory: Path, wheel: Path) -> Path:
    """A virtualenv holding the wheel, which sees this interpreter's site-packages (torch and
    the other dependencies) through a ``.pth`` of plain paths: no source tree and no editable
    install of neorec (an editable install's finder is started by an ``import`` line in its
    own ``.pth``, which a plain path does not run)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(directory)], check=True, timeout=120)
    python = directory / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                    "--disable-pip-version-check", "-q", str(wheel)], check=True, timeout=300,
                   env=_without_source_paths())  # else pip finds the checkout's neorec "already installed"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True).stdout.strip()
    shared = [p for p in site.getsitepackages() if p in sys.path]  # (a .venv inside the checkout included)
    Path(purelib, "shared-dependencies.pth").write_text("".join(f"{p}\n" for p in shared))
    return directory


@pytest.mark.slow
def test_the_installed_wheel_runs_beside_a_users_own_trainer_protos_and_benchmarks(wheel: Path, tmp_path: Path):
    venv = _fresh_venv(tmp_path / "venv", wheel)
    project = tmp_path / "project"
    for path in ("trainer.py", "protos/__init__.py", "benchmarks/__init__.py"):
        (project / path).parent.mkdir(parents=True, exist_ok=True)
        (project / path).write_text('OWNER = "user"\n')
    (project / "config.toml").write_text(USER_CONFIG)
    (project / "check.py").write_text(USER_CHECK)
    env = _without_source_paths()
    python, neorec = str(venv / "bin" / "python"), str(venv / "bin" / "neorec")

    def run(*command: str) -> str:
        done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        return done.stdout + done.stderr

    path = json.loads(run(python, "-c", "import json, sys; print(json.dumps(sys.path))"))
    assert str(ROOT) not in path and str(ROOT.parent) not in path, path  # the source tree is not importable
    run(neorec, "data", "synth", "--profile", "criteo", "--rows", "3000", "--out", "data")
    # python -m puts the project first on sys.path: its trainer.py and protos/ are what a
    # top-level `import trainer` would find
    run(python, "-m", "neorec", "train", "config.toml")
    assert json.loads((project / "runs" / "wheel" / "summary.json").read_text())["steps"] == 4
    demo = run(python, "-c", "from neorec.configs import shipped; print(shipped('demo.toml'))").strip()
    assert Path(demo).is_relative_to(venv.resolve()) and "[model]" in Path(demo).read_text()  # the benchmarks' config
    assert "public API ok" in run(python, "check.py", str(venv))
    # and the library example of docs/api.md, as a user would run it
    (example,) = python_blocks(ROOT / "docs" / "api.md")
    (project / "example.py").write_text(example)
    env["TMPDIR"] = str(tmp_path)
    assert "8 steps, eval AUC" in run(python, "example.py")
