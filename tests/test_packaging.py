"""What the project claims about itself holds: the Python floor it states is the one it runs on."""

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_python_floor_is_stated_alike_and_met():
    floor = re.fullmatch(r">=(\d+)\.(\d+)", tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
                         ["requires-python"])
    assert floor, "requires-python must state a floor, e.g. >=3.11"
    major, minor = int(floor.group(1)), int(floor.group(2))
    assert (major, minor) >= (3, 11), "the config loader needs tomllib, new in Python 3.11"
    assert sys.version_info[:2] >= (major, minor)
    assert f"Python {major}.{minor}+" in (ROOT / "README.md").read_text()
