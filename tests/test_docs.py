"""The project's documentation holds: its example runs, its configuration reference names
every key with its default, its architecture page reaches every module, its links resolve."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", page.read_text(), flags=re.S | re.M)


def test_the_api_example_runs(tmp_path: Path):
    (example,) = _python_blocks(DOCS / "api.md")
    script = tmp_path / "example.py"
    script.write_text(example)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert re.search(r"^8 steps, eval AUC 0\.\d+ \(oracle 0\.\d+\)$", done.stdout, flags=re.M), done.stdout
    assert re.search(r"^t_user \w+ on ranks \(", done.stdout, flags=re.M), done.stdout


def test_import_neorec_imports_nothing_heavy():
    """The API is imported on first use: ``import neorec`` (the CLI's first step) stays fast."""
    code = "import sys, neorec; print(sorted(m for m in ('torch', 'numba', 'pyarrow', 'grpc') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_every_public_name_is_documented_and_resolves():
    import neorec

    page = (DOCS / "api.md").read_text()
    for name in neorec.__all__:
        assert f"`{name}`" in page, f"docs/api.md does not document neorec.{name}"
        assert getattr(neorec, name) is not None
