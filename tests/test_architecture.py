"""The shape rules of the codebase: the core never imports Prefect; modules declare __all__."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import subprocess
import sys

import spikeops
from tests.conftest import ROOT


# The Prefect layers: folders of their own in the repository, installed under ``spikeops``
# (symbolic links in the checkout, ``spikeops.flows`` and so on in the wheel).
PREFECT_LAYERS = ("flows", "tasks", "deployments", "demo")


def _core_modules() -> list[str]:
    names = ["spikeops"]
    for module in pkgutil.walk_packages(spikeops.__path__, "spikeops."):
        if module.name.split(".")[1] not in PREFECT_LAYERS:
            names.append(module.name)
    return names


def test_the_prefect_layers_are_installed_under_spikeops():
    """``flows/`` and its siblings are importable as ``spikeops.flows``, from the same files,
    and nothing imports them by their bare names (an installed spikeops has no top-level
    ``tasks`` package, and one of the user's own would be taken instead)."""
    for layer in PREFECT_LAYERS:
        link = ROOT / "spikeops" / layer
        assert link.is_symlink() and link.resolve() == (ROOT / layer).resolve(), link
    for path in [*ROOT.glob("*/**/*.py")]:
        if path.relative_to(ROOT).parts[0] in (".venv", "build", ".git"):
            continue
        for name in _imports(path):
            assert name.split(".")[0] not in PREFECT_LAYERS, f"{path} imports {name}, not spikeops.{name}"


def test_core_never_imports_prefect():
    for path in (ROOT / "spikeops").rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(name.split(".")[0] == "prefect" for name in names), f"{path} imports prefect"


def test_importing_every_core_module_does_not_load_prefect():
    code = (
        "import importlib, sys, pkgutil, spikeops\n"
        f"layers = {PREFECT_LAYERS!r}\n"
        "for m in pkgutil.walk_packages(spikeops.__path__, 'spikeops.'):\n"
        "    if m.name != 'spikeops.__main__' and m.name.split('.')[1] not in layers:\n"
        "        importlib.import_module(m.name)\n"
        "print('prefect' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "False"


def test_public_modules_declare_all():
    for name in _core_modules():
        if name.endswith("__main__"):
            continue
        module = importlib.import_module(name)
        assert hasattr(module, "__all__"), f"{name} has no __all__"
        for exported in module.__all__:
            assert hasattr(module, exported), f"{name}.__all__ names missing {exported}"


def _imports(path) -> set[str]:
    """Every module a file imports, at any depth (lazy imports inside functions included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module or "")
    return names


def test_layers_import_downwards_only():
    """flows use tasks and the core; tasks use the core; neither knows what triggers them
    (deployments), and flows never depend on the simulator or the demo's driver."""
    forbidden = {"flows": ("spikeops.deployments", "spikeops.demo", "spikeops.sim"),
                 "tasks": ("spikeops.flows", "spikeops.deployments", "spikeops.demo")}
    for package, banned in forbidden.items():
        for path in (ROOT / package).rglob("*.py"):
            for name in _imports(path):
                assert not any(name == b or name.startswith(b + ".") for b in banned), f"{path} imports {name}"


def test_every_prefect_task_lives_in_tasks():
    """A reader looking for a stage finds its task under tasks/, by name."""
    for package in ("flows", "deployments", "spikeops"):
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    for decorator in node.decorator_list:
                        target = decorator.func if isinstance(decorator, ast.Call) else decorator
                        name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", "")
                        assert name != "task", f"{path}: task {node.name} outside tasks/"
