"""A package uses another's public names only: no import of another subpackage's ``_private``
module, and the benchmarks import no private module of elastictrain at all."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imported_modules(path: Path) -> list[str]:
    """Every module ``path`` imports, as dotted names (``from a import b`` gives ``a.b``: b may be
    a module)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return found


def _private_part(module: str) -> tuple[str, str] | None:
    """For ``elastictrain.<pkg>._private...``: (pkg, the private name); else None."""
    parts = module.split(".")
    if (len(parts) >= 3 and parts[0] == "elastictrain" and not parts[1].startswith("_")
            and parts[2].startswith("_") and not parts[2].startswith("__")):  # __main__ is not private
        return parts[1], parts[2]
    return None


def test_no_package_imports_another_packages_private_module() -> None:
    crossings = []
    for path in sorted((ROOT / "elastictrain").rglob("*.py")):
        own = path.relative_to(ROOT / "elastictrain").parts
        own_package = own[0] if len(own) > 1 else None
        for module in _imported_modules(path):
            private = _private_part(module)
            if private is not None and private[0] != own_package:
                crossings.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not crossings, "\n".join(crossings)


def test_benchmarks_import_public_names_only() -> None:
    private = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for module in _imported_modules(path):
            if module.startswith("elastictrain") and any(p.startswith("_") and not p.startswith("__")
                                                         for p in module.split(".")[1:]):
                private.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not private, "\n".join(private)
