"""One seam for torch internals: no private torch name outside ``runtime/torch_compat.py``.

Every private torch module, function or class zeroc uses (``torch._dynamo``,
``torch.utils._pytree``, ``torch._C._set_grad_enabled``, ...) is imported once, in
``zeroc.runtime.torch_compat``, and every other module imports it from there; a torch
upgrade that moves one of them then breaks one file. This test reads every module of the
four packages with ``ast`` and names, file:line, each private torch name used outside the
seam:

- ``import torch._x`` / ``from torch._x import y`` / ``from torch.a._b import y`` and
  ``from torch.a import _y``;
- an attribute chain through torch modules with a component that starts with ``_``
  (``torch._dynamo.reset``, ``dist.distributed_c10d._world``), following the module
  aliases the file binds (``import torch.distributed as dist``) and ``getattr`` with a
  constant name.

Allowed: dunder names (``torch.__version__``), the operator namespaces under ``torch.ops``
(an operator's registered name, like ``torch.ops._c10d_functional``, is not a Python API),
and private attributes of torch objects that are not modules (``tensor._local_tensor``,
``torch.Tensor._make_subclass``): the chain stops being checked at its first non-module.
"""

from __future__ import annotations

import ast
import importlib
import os
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("compiler", "passes", "codegen", "runtime")
SEAM = os.path.join("runtime", "torch_compat")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module(dotted: str) -> types.ModuleType | None:
    """The module ``dotted`` names, or None where it is not a module (or not importable)."""
    try:
        return importlib.import_module(dotted)
    except Exception:  # anything that fails to import is not a module here
        return None


def _member(module: types.ModuleType, dotted: str, name: str) -> object:
    """``module.name``, importing ``dotted.name`` as a submodule where it is not loaded yet."""
    if hasattr(module, name):
        return getattr(module, name, None)
    return _module(f"{dotted}.{name}")


def _walk_chain(dotted: str, names: list[str]) -> str | None:
    """The first private component of ``dotted`` + ``names`` reached through modules only."""
    module = _module(dotted)
    for name in names:
        if module is None or dotted == "torch.ops":
            return None
        if _private(name):
            return f"{dotted}.{name}"
        member = _member(module, dotted, name)
        dotted = f"{dotted}.{name}"
        module = member if isinstance(member, types.ModuleType) else None
    return None


def _chain(node: ast.expr) -> tuple[str, list[str]] | None:
    """``a.b.c`` as (``a``, [``b``, ``c``]); None for a chain that does not start at a name."""
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return node.id, names[::-1]
    return None


def _aliases(tree: ast.Module) -> dict[str, str]:
    """The names the file binds to torch modules, anywhere in it: name -> dotted module."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "torch":
                    continue
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:
                    aliases["torch"] = "torch"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}"
                if isinstance(_module(dotted), types.ModuleType):
                    aliases[alias.asname or alias.name] = dotted
    return aliases


def private_uses(path: str) -> list[str]:
    """Every private torch name ``path`` uses, as ``file:line: name``."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    rel = os.path.relpath(path, ROOT)
    aliases = _aliases(tree)
    found: list[tuple[int, str]] = []
    inner: set[int] = set()  # attribute nodes inside a longer chain: checked with it
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torch.") and any(
                        _private(p) for p in alias.name.split(".")):
                    found.append((node.lineno, alias.name))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            if any(_private(p) for p in node.module.split(".")):
                found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}")
                      for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            if isinstance(node.value, ast.Attribute):
                sub: ast.expr = node.value
                while isinstance(sub, ast.Attribute):
                    inner.add(id(sub))
                    sub = sub.value
            chain = _chain(node)
            if chain and chain[0] in aliases:
                name = _walk_chain(aliases[chain[0]], chain[1])
                if name:
                    found.append((node.lineno, name))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            chain = _chain(node.args[0])
            if chain and chain[0] in aliases:
                name = _walk_chain(aliases[chain[0]], [*chain[1], node.args[1].value])
                if name:
                    found.append((node.lineno, name))
    return [f"{rel}:{line}: {name}" for line, name in sorted(set(found))]


def package_files() -> list[str]:
    """Every ``.py`` file of the four packages outside the seam."""
    files = []
    for package in PACKAGES:
        for dirpath, _, names in os.walk(os.path.join(ROOT, package)):
            files += [os.path.join(dirpath, n) for n in names if n.endswith(".py")]
    return sorted(f for f in files if not _in_seam(os.path.relpath(f, ROOT)))


def _in_seam(rel: str) -> bool:
    return rel == SEAM + ".py" or rel.startswith(SEAM + os.sep)


def test_scanner_finds_private_torch_names(tmp_path) -> None:
    """Each form the rule names is found, and the allowed forms are not."""
    source = tmp_path / "sample.py"
    source.write_text(
        "import torch\n"
        "import torch.distributed as dist\n"
        "import torch._dynamo\n"
        "from torch.utils._pytree import tree_leaves\n"
        "from torch.utils import _pytree\n"
        "from torch.nn.utils import clip_grad\n"
        "torch._dynamo.reset()\n"
        "x = torch._C._set_grad_enabled\n"
        "y = dist.distributed_c10d._world\n"
        "z = getattr(dist, '_functional_collectives', None)\n"
        "w = clip_grad._get_total_norm\n"
        "ok = (torch.__version__, torch.ops._c10d_functional, torch.Tensor._make_subclass,\n"
        "      torch.nn.functional.linear, tree_leaves)\n")
    uses = [u.split(":", 1)[1] for u in private_uses(str(source))]
    assert uses == ["3: torch._dynamo", "4: torch.utils._pytree", "5: torch.utils._pytree",
                    "7: torch._dynamo", "8: torch._C",
                    "9: torch.distributed.distributed_c10d._world",
                    "10: torch.distributed._functional_collectives",
                    "11: torch.nn.utils.clip_grad._get_total_norm"]


def test_private_torch_names_only_in_the_seam() -> None:
    """No module outside ``runtime/torch_compat.py`` uses a private torch name."""
    uses = [use for path in package_files() for use in private_uses(path)]
    assert not uses, ("private torch names outside the seam (import them from "
                      "zeroc.runtime.torch_compat):\n" + "\n".join(uses))
