"""Structural checks on the ZeRO-3 hook path: no host syncs in the code that runs per unit.

On an accelerator ``.item()``, ``.tolist()``, ``.cpu()``, ``bool(tensor)``, ``torch.cuda.synchronize()``…
block the host until the device catches up; one per unit gather or reduce-scatter would keep the host from
running ahead (prefetching, launching). The modules below run per unit in forward/backward; only the
functions listed in ``ALLOWED`` may read the device (the batched unit-id check, at the step boundary).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

STAGE3 = Path(__file__).resolve().parents[2] / "src" / "shardspeed" / "zero" / "stage3"
HOOK_PATH = ["unit.py", "grads.py", "runtime.py", "prefetch.py", "id_check.py", "saved_views.py"]
SYNC_METHODS = {"item", "tolist", "cpu", "numpy", "synchronize", "nonzero", "is_nonzero", "any", "all"}
SYNC_BUILTINS = {"bool", "int", "float"}  # on a tensor each is a host read; the hook path needs none
ALLOWED = {("id_check.py", "verify")}  # the one batched host read, at the step boundary


def _host_reads(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found: list[str] = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Call) and (path.name, function) not in ALLOWED:
            callee = node.func
            if isinstance(callee, ast.Attribute) and callee.attr in SYNC_METHODS:
                found.append(f"{path.name}:{node.lineno} {function}(): .{callee.attr}()")
            elif isinstance(callee, ast.Name) and callee.id in SYNC_BUILTINS:
                found.append(f"{path.name}:{node.lineno} {function}(): {callee.id}(...)")
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "<module>")
    return found


@pytest.mark.parametrize("name", HOOK_PATH)
def test_no_host_sync_in_the_zero3_hook_path(name: str) -> None:
    path = STAGE3 / name
    if not path.exists():  # a module may be renamed by a later change; the others still count
        pytest.skip(f"{name} does not exist")
    assert _host_reads(path) == []


def test_the_checker_finds_host_reads(tmp_path: Path) -> None:
    sample = tmp_path / "unit.py"
    sample.write_text("def wait(ids):\n    return ids.tolist(), bool(ids), ids.sum().item()\n")
    assert len(_host_reads(sample)) == 3
