"""Write the key tables of docs/configuration.md from the training config's dataclasses
(``trainer/config.py``): every section and key, its type, its default, the values it takes
and its docstring. Run it after changing the config:

    python scripts/config_reference.py           # rewrite the tables in docs/configuration.md
    python scripts/config_reference.py --check   # exit 1 when they are out of date

Each section's table lies between ``<!-- config:SECTION -->`` and ``<!-- /config:SECTION -->``
in the page; the prose around them is the page's own.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import sys
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"
sys.path.insert(0, str(ROOT))

from neorec.trainer import config as config_module  # noqa: E402
from neorec.trainer.config import TrainConfig  # noqa: E402


def _toml(value: Any) -> str:
    """``value`` as TOML writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return f"{value:.1f}"
    return repr(value)


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is list:
        return f"list of {_type_name(typing.get_args(hint)[0])}"
    if origin is dict:
        return f"table of {_type_name(typing.get_args(hint)[1])}"
    if dataclasses.is_dataclass(hint):
        return f"`{hint.__name__}`"
    return {bool: "bool", int: "integer", float: "number", str: "string"}.get(hint, str(hint))


def _markdown(text: str) -> str:
    """A docstring's reStructuredText markup as Markdown, safe in a table cell."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`").replace("|", "\\|")


def _field_docs(cls: type) -> dict[str, str]:
    """Field name → its attribute docstring (the string right after it), on one line."""
    tree = ast.parse(inspect.getsource(cls)).body[0]
    docs = {}
    for node, after in zip(tree.body, tree.body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _allowed_values(cls: type) -> dict[str, tuple[Any, ...]]:
    """Key → the values ``validate`` accepts, where it checks them against a named tuple
    (``_one_of("data.shuffle", self.shuffle, SHUFFLE_MODES)``, ``self.bits not in CHECKPOINT_BITS``)."""
    allowed = {}
    validate = getattr(cls, "validate", None)
    if validate is None:
        return allowed
    for node in ast.walk(ast.parse(inspect.cleandoc("\n" + inspect.getsource(validate)))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_one_of"
                and isinstance(node.args[0], ast.Constant)):
            values = eval(compile(ast.Expression(node.args[2]), "<config>", "eval"), vars(config_module))
            allowed[node.args[0].value.partition(".")[2]] = tuple(values)
        elif (isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.NotIn)
              and isinstance(node.left, ast.Attribute) and isinstance(node.comparators[0], ast.Name)):
            allowed[node.left.attr] = tuple(vars(config_module)[node.comparators[0].id])
    return allowed


def section_table(section: dataclasses.Field) -> str:
    """The Markdown table of one section of :class:`TrainConfig`."""
    cls = typing.get_type_hints(TrainConfig)[section.name]
    hints = typing.get_type_hints(cls)
    docs = _field_docs(cls)
    allowed = _allowed_values(cls)
    defaults = cls()
    lines = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        key = f.metadata.get("key", f.name)
        meaning = docs.get(f.name, "")
        if f.name in allowed or key in allowed:
            values = ", ".join(f"`{_toml(v)}`" for v in allowed.get(f.name, allowed.get(key, ())))
            meaning = f"{meaning} One of {values}.".strip()
        meaning = _markdown(meaning)
        lines.append(f"| `{key}` | {_type_name(hints[f.name])} | `{_toml(getattr(defaults, f.name))}` | {meaning} |")
    return "\n".join(lines)


def render(page: str) -> str:
    """``page`` with every section's table regenerated; a section without its markers is an error."""
    for section in dataclasses.fields(TrainConfig):
        pattern = re.compile(rf"(<!-- config:{section.name} -->\n).*?(<!-- /config:{section.name} -->)", re.S)
        if not pattern.search(page):
            raise SystemExit(f"{PAGE}: no <!-- config:{section.name} --> … <!-- /config:{section.name} --> block")
        page = pattern.sub(lambda m: m.group(1) + section_table(section) + "\n" + m.group(2), page)
    return page


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page's tables are out of date")
    args = parser.parse_args()
    current = PAGE.read_text()
    updated = render(current)
    if args.check:
        if updated != current:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run python scripts/config_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
