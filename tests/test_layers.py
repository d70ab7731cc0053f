"""The package's imports run one way: each module imports only from its own
layer or below (per the table here), and no set of modules imports itself in a
circle. The graph is built from the source with ``ast``, function-level
imports included, so a lazy import that reaches up cannot hide."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# module-name prefix -> layer, bottom (0) to top; the longest matching prefix wins
LAYERS = {
    "sparse24._version": 0, "sparse24._checks": 0, "sparse24._progress": 0, "sparse24.autotune_configs": 0,
    "sparse24._rollback": 0, "sparse24._linears": 0,              # shared checks, progress, undo, data, layer kinds
    "sparse24.format": 1, "sparse24.decode_format": 1, "sparse24.quant": 1, "sparse24.interop": 1,  # layouts, INT8
    "sparse24.masks": 2,                                                              # mask methods
    "sparse24.kernels": 3,                                                            # Triton only
    "sparse24.ops": 4,                                                                # launch, op, configs
    "sparse24.nn": 5,                                                                 # modules
    "sparse24.api": 6, "sparse24.recipes": 6, "sparse24.learn": 6,                    # whole models
    "sparse24.evaluate": 6,                                                           # fidelity, bits/char
    "sparse24.hf": 6, "sparse24.lora": 6,                 # transformers save/load, PEFT LoRA (api -> hf -> lora)
    "sparse24.tools": 7,                                                              # tuning, bench, plot, cli
    "sparse24": 8, "sparse24.__main__": 8,                                            # the facade
}


def _sources() -> dict[str, Path]:
    """Module name -> file, as the installed package lays them out (kernels/ and
    autotune_configs/ become sparse24.kernels and sparse24.autotune_configs)."""
    out = {}
    for base, prefix in ((ROOT / "sparse24", "sparse24"), (ROOT / "kernels", "sparse24.kernels"),
                         (ROOT / "autotune_configs", "sparse24.autotune_configs")):
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = path
    return out


def _layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len, default=None)
    assert best is not None, f"{module} is in no layer: add it to the table in {__file__}"
    return LAYERS[best]


def _imports(module: str, path: Path, modules: dict) -> set[str]:
    """The sparse24 modules ``module`` imports anywhere in its source."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            # `from pkg import sub` imports the submodule where one exists
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:  # `import a.b.c` of a non-module attribute: its module
                name = name.rpartition(".")[0]
            if name and name.split(".")[0] == "sparse24" and name != module:
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _sources()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def test_every_import_points_down():
    graph = _graph()
    up = [f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
          for m, targets in graph.items() for t in sorted(targets) if _layer(t) > _layer(m)]
    assert not up, "imports that reach up a layer:\n" + "\n".join(up)


def test_no_import_cycle():
    graph = _graph()
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == "open":
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("bad,expected", [
    ({"sparse24.format": "from .masks import mask_nm"}, "sparse24.format (layer 1) imports sparse24.masks (layer 2)"),
    ({"sparse24.ops.config_store": "def f():\n    from ..tools.tuning import tune_key"},
     "sparse24.ops.config_store (layer 4) imports sparse24.tools.tuning (layer 7)"),
])
def test_the_check_sees_a_lazy_upward_import(tmp_path, monkeypatch, bad, expected):
    """The checks above can fail: plant an upward import (module level or inside a function)."""
    (module, code), = bad.items()
    modules = _sources()
    fake = tmp_path / "fake.py"
    fake.write_text(modules[module].read_text() + "\n\n" + code + "\n")
    found = _imports(module, fake, modules)
    target = expected.split(" imports ")[1].split(" ")[0]
    assert target in found and _layer(target) > _layer(module)


def test_test_modules_have_unique_basenames():
    """pytest imports test modules by basename (rootdir-relative, no packages): two files of one name in
    different folders fail the collection of the whole suite ("import file mismatch")."""
    seen = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert not {k: v for k, v in seen.items() if len(v) > 1 and k != "__init__.py"}
