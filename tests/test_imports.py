"""The code's import arrows point one way: no module of podrun's is imported back, directly or
through others, by a module it imports (function-local imports counted too)."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("runner", "models", "sharding", "configs", "benchmarks")


def modules() -> dict[str, str]:
    out = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                    out[name] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the podrun modules it imports anywhere in its text (a package's own __init__,
    which Python imports on the way to a submodule, left out)."""
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in mods.items():
        deps = set()
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps.update(resolve(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.update(resolve(f"{node.module}.{a.name}") for a in node.names)
        graph[name] = {d for d in deps if d and d != name and not name.startswith(d + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_is_imported_back_by_what_it_imports():
    graph = import_graph()
    assert "runner.api.common" in graph and "runner.text.chat" in graph["runner.api.common"]
    assert cycles(graph) == []


def test_models_and_sharding_never_import_the_runner():
    graph = import_graph()
    assert not [(m, d) for m, deps in graph.items() if m.startswith(("models", "sharding"))
                for d in deps if d.startswith("runner")]


def test_kernels_are_chosen_by_the_backend_alone():
    """No model or engine module imports a platform's kernels: they ask the Backend
    (models/backend.py), which imports them. models/panels.py is the CPU kernel's weight format,
    and the tools measure the kernels themselves."""
    graph = import_graph()
    platform_kernels = {"models.kernels.cpu", "models.kernels.tpu", "models.kernels.gpu"}
    allowed = {"models.backend", "models.panels", *platform_kernels}
    importers = {m for m, deps in graph.items() if deps & platform_kernels
                 and m.startswith(("models", "runner", "sharding")) and not m.startswith("runner.tools")}
    assert "models.backend" in importers
    assert importers <= allowed, sorted(importers - allowed)


# What a function may import where it is used rather than at the top of its module: a dependency
# that is optional or costly to import for the rest, or one that changes the process as it loads.
LOCAL_IMPORTS = {
    "gguf": "1.2 s to import: only GGUF files need it",
    "torch": "optional: only reading a pytorch_model.bin needs it",
    "runner.tools.compile": "sets up libtpu's topologies as it loads: predicted plans only",
    "models.kernels.tpu": "loads Pallas' TPU backend (Mosaic): TPU meshes only",
    "models.kernels.gpu": "loads Pallas' Triton backend: NVIDIA GPUs only",
    "jax.experimental.pallas.ops.tpu.megablox.gmm": "TPU only, with kernels.pallas_moe",
}


def local_imports() -> list[tuple[str, int, str]]:
    """(module file, line, imported module) of every import inside a function of the package."""
    out = []
    for name, path in modules().items():
        if name.startswith("benchmarks"):
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, ast.Import):
                        out += [(path, node.lineno, a.name) for a in node.names]
                    elif isinstance(node, ast.ImportFrom):
                        out += [(path, node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def test_functions_import_only_optional_or_costly_dependencies():
    found = local_imports()
    assert all(os.path.exists(path) for path, _, _ in found)
    allowed = lambda m: any(m == k or m.startswith(k + ".") for k in LOCAL_IMPORTS)
    assert [(os.path.relpath(p, ROOT), line, m) for p, line, m in found if not allowed(m)] == []
    assert len(found) < 20, found
