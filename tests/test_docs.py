"""The project's documentation holds: its example runs, its configuration reference names
every key with its default, its architecture page reaches every module, its links resolve."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def python_blocks(page: Path) -> list[str]:
    """The code of a Markdown page's ```python blocks."""
    return re.findall(r"^```python\n(.*?)^```$", page.read_text(), flags=re.S | re.M)


def test_the_api_example_runs(tmp_path: Path):
    (example,) = python_blocks(DOCS / "api.md")
    script = tmp_path / "example.py"
    script.write_text(example)
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the example's files go where the test's do
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert re.search(r"^8 steps, eval AUC 0\.\d+ \(oracle 0\.\d+\)$", done.stdout, flags=re.M), done.stdout
    assert re.search(r"^t_user \w+ on ranks \(", done.stdout, flags=re.M), done.stdout


def test_import_neorec_imports_nothing_heavy():
    """The API is imported on first use: ``import neorec`` (the CLI's first step) stays fast."""
    code = "import sys, neorec; print(sorted(m for m in ('torch', 'numba', 'pyarrow', 'grpc') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_command_line_s_parser_imports_neither_torch_nor_numba():
    """``neorec --help``, ``neorec status`` (a probe) and every refusal of bad arguments build
    the parser first: its defaults come from light modules."""
    code = ("import sys; from neorec.orchestration.cli import _parser; _parser(); "
            "print(sorted(m for m in ('torch', 'numba') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_every_public_name_is_documented_and_resolves():
    import neorec

    page = (DOCS / "api.md").read_text()
    for name in neorec.__all__:
        assert f"`{name}`" in page, f"docs/api.md does not document neorec.{name}"
        assert getattr(neorec, name) is not None


def _config_rows(page: str, section: str) -> dict[str, str]:
    """Key → default cell of the table of ``section`` in docs/configuration.md."""
    block = re.search(rf"<!-- config:{section} -->\n(.*?)<!-- /config:{section} -->", page, flags=re.S)
    assert block, f"docs/configuration.md has no table of [{section}]"
    rows = re.findall(r"^\| `([^`]+)` \| [^|]+ \| `([^`]*)` \|", block.group(1), flags=re.M)
    return dict(rows)


def test_the_configuration_page_names_every_key_with_its_default():
    import tomllib

    from neorec.trainer.config import TrainConfig

    page = (DOCS / "configuration.md").read_text()
    for section, defaults in TrainConfig().to_dict().items():
        rows = _config_rows(page, section)
        assert sorted(rows) == sorted(defaults), f"[{section}]: the page's keys differ from the config's " \
                                                 f"(python scripts/config_reference.py rewrites the tables)"
        for key, default in defaults.items():
            assert tomllib.loads(f"v = {rows[key]}")["v"] == default, f"{section}.{key}: the page says {rows[key]}"


PACKAGE_FOLDERS = ("common", "protos", "ingest", "trainer", "embedding_store", "orchestration", "benchmarks", "neorec",
                   "configs")


def _links(page: Path) -> list[str]:
    """The targets of a Markdown page's inline links."""
    return re.findall(r"\]\(([^)\s]+)\)", page.read_text())


def test_the_architecture_page_links_every_module():
    """A reader finds any part of the code from the architecture page in one hop."""
    page = DOCS / "architecture.md"
    linked = {(page.parent / target).resolve() for target in _links(page) if not target.startswith(("http", "#"))}
    modules = [p for folder in PACKAGE_FOLDERS for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts
               and (p.name != "__init__.py" or folder in ("benchmarks", "neorec", "configs"))]
    assert len(modules) > 100
    unlisted = sorted(str(p.relative_to(ROOT)) for p in modules if p.resolve() not in linked)
    assert unlisted == [], "modules the architecture page does not link (add a row to docs/architecture.md)"


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


# pages written alongside these; a link to one of them is checked once it exists
PAGES_IN_PROGRESS = {"guarantees.md", "multinode.md", "continuous.md", "dynamic-tables.md"}


def test_the_links_of_the_readme_and_docs_resolve():
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    broken = []
    for page in pages:
        for target in _links(page):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                if not (resolved.parent == DOCS and resolved.name in PAGES_IN_PROGRESS):
                    broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []
