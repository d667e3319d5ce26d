"""The house in layers: every import of the package sources points down, and none closes a circle.

Layers, top to bottom (DESIGN.md, "Layers and a request's life"):

    bench/ (the lab)  >  kvmesh/ (the app)  >  gateway/, prefill_svc/, decode_svc/  >  runtime/
    >  engine/  >  kvstore/, kernels/, protos/  >  the namespace root

The namespace root is the one module named ``kvmesh`` (kvmesh/__init__.py): Python imports it
before any ``kvmesh.<package>``, so every layer may import it (``from kvmesh import
cache_root``), and it imports no other kvmesh module.

Every folder is a sub-package of the one namespace (`gateway/` installs as `kvmesh.gateway`,
`protos/kvmesh` as `kvmesh.protos`; pyproject's package-dir), and modules are named so here.

The walk reads every ``import`` and ``from ... import`` statement of every source file with
``ast``, function-local and ``TYPE_CHECKING`` imports included, so a cycle cannot hide behind
an import written inside a function. A module may import its own folder or any folder of a
lower layer. The three services are one layer and never import each other; the bottom
folders may not import each other either (kvstore, kernels and protos are independent).
Inside a folder, a sub-package (``kvmesh.engine.ep``, ``kvmesh.kernels.moe``) counts as one module: it
may import its folder's modules, but none that imports it back, directly or through others.

bench/, the lab (benchmarks, simulators, the fuzzer, profilers), may import anything and
nothing imports it; the product folders hold no module of the lab's kinds.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# folder -> layer (higher imports lower)
LAYERS = {
    "bench": 6,
    "kvmesh": 5,
    "gateway": 4,
    "prefill_svc": 4,
    "decode_svc": 4,
    "runtime": 3,
    "engine": 2,
    "kvstore": 1,
    "kernels": 1,
    "protos": 1,
}
# the namespace root (kvmesh/__init__.py), a layer below every folder
NAMESPACE = "kvmesh"
NAMESPACE_LAYER = "namespace"
# folder -> where its modules live on disk (protos/ holds the kvmesh/v1 package tree)
SOURCE_DIRS = {"protos": "protos/kvmesh"}


def package_of(folder: str) -> str:
    """The import name of a layer folder: ``kvmesh`` for the app, ``kvmesh.<folder>`` for the rest."""
    return "kvmesh" if folder == "kvmesh" else f"kvmesh.{folder}"


def _module_name(folder: str, path: Path) -> str:
    parts = list(path.relative_to(ROOT / SOURCE_DIRS.get(folder, folder)).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([package_of(folder), *parts])


def _sources() -> dict[str, Path]:
    modules = {}
    for folder in LAYERS:
        for path in sorted((ROOT / SOURCE_DIRS.get(folder, folder)).rglob("*.py")):
            modules[_module_name(folder, path)] = path
    return modules


def _resolve(target: str, modules: dict[str, Path]) -> str | None:
    """The longest known module that ``target`` names (``a.b.c`` may be the name ``c`` in ``a.b``)."""
    while target:
        if target in modules:
            return target
        if "." not in target:
            return None
        target = target.rsplit(".", 1)[0]
    return None


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (every import statement, at any depth)."""
    modules = _sources()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            for target in targets:
                found = _resolve(target, modules)
                if found is not None and found != name:
                    graph[name].add(found)
    return graph


def _folder(module: str) -> str:
    """The layer folder of a module name: ``kvmesh.engine.ep.runner`` -> ``engine``, ``kvmesh.cli`` -> ``kvmesh``,
    and ``kvmesh`` itself (the namespace root) -> ``namespace``."""
    if module == NAMESPACE:
        return NAMESPACE_LAYER
    parts = module.split(".")
    if parts[0] == "kvmesh" and len(parts) > 1 and parts[1] in LAYERS and parts[1] != "kvmesh":
        return parts[1]
    return parts[0]


def _layer(folder: str) -> int:
    """A folder's layer; the namespace root is 0, below every folder."""
    return 0 if folder == NAMESPACE_LAYER else LAYERS[folder]


def upward_arrows(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    bad = []
    for src, targets in graph.items():
        for dst in targets:
            a, b = _folder(src), _folder(dst)
            if a != b and _layer(a) <= _layer(b):
                bad.append((src, dst))
    return sorted(bad)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def contract(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """``graph`` with the modules of ``package`` (``kvmesh.engine.ep`` and those below it) as one node."""

    def node(module: str) -> str:
        return package if module == package or module.startswith(package + ".") else module

    out: dict[str, set[str]] = {}
    for src, targets in graph.items():
        out.setdefault(node(src), set()).update(node(dst) for dst in targets if node(dst) != node(src))
    return out


def sub_packages(graph: dict[str, set[str]]) -> list[str]:
    """The packages below the layer folders (``kvmesh.engine.ep``, ``kvmesh.kernels.moe``, ...)."""
    modules = _sources()
    tops = {package_of(folder) for folder in LAYERS}
    return sorted(m for m in graph if m not in tops and m in modules and modules[m].name == "__init__.py")


def sub_package_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Circles through a sub-package taken whole: ``kvmesh.engine.ep.a -> kvmesh.engine.x -> kvmesh.engine.ep.b``."""
    return [c for package in sub_packages(graph) for c in cycles(contract(graph, package))]


# the lab's module names, which no product folder may hold (scripts/ included)
LAB_PREFIXES = ("bench_", "profile_", "fuzz", "routesim", "sglang_router")
LAB_SUFFIXES = ("_report", "_plots")


def lab_modules_in_the_product() -> list[str]:
    found = []
    for folder in [*(f for f in LAYERS if f != "bench"), "scripts"]:
        for path in sorted((ROOT / folder).rglob("*.py")):
            stem = path.stem
            if stem == "bench" or stem.startswith(LAB_PREFIXES) or stem.endswith(LAB_SUFFIXES):
                found.append(str(path.relative_to(ROOT)))
    return found


def test_every_layer_folder_exists():
    for folder in LAYERS:
        assert (ROOT / SOURCE_DIRS.get(folder, folder) / "__init__.py").exists(), f"{folder}/ is not a package"


def test_no_import_points_up():
    bad = upward_arrows(import_graph())
    assert not bad, "imports that point up or sideways:\n" + "\n".join(f"  {a} -> {b}" for a, b in bad)


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in found)


def test_no_cycle_through_a_sub_package():
    found = sub_package_cycles(import_graph())
    assert not found, "import cycles through a sub-package:\n" + "\n".join("  " + " -> ".join(c) for c in found)


def test_the_namespace_root_imports_no_kvmesh_module():
    """kvmesh/__init__.py runs before every kvmesh module: an import there would load its
    target (and whatever that loads) in every process, and would close a circle with any
    module below it."""
    assert import_graph()[NAMESPACE] == set()


def test_nothing_imports_the_lab():
    bad = sorted((src, dst) for src, targets in import_graph().items() for dst in targets if _folder(dst) == "bench")
    bad = [(src, dst) for src, dst in bad if _folder(src) != "bench"]
    assert not bad, "product modules that import bench/:\n" + "\n".join(f"  {a} -> {b}" for a, b in bad)


def test_the_product_folders_hold_no_lab_module():
    found = lab_modules_in_the_product()
    assert not found, f"benchmarks, simulators, fuzzers or profilers outside bench/: {found}"


@pytest.mark.parametrize(
    "graph, expect_up, expect_cycles",
    [
        ({"kvmesh.engine.a": {"kvmesh.b"}, "kvmesh.b": set()}, [("kvmesh.engine.a", "kvmesh.b")], []),
        (
            {"kvmesh.gateway.a": {"kvmesh.decode_svc.b"}, "kvmesh.decode_svc.b": set()},
            [("kvmesh.gateway.a", "kvmesh.decode_svc.b")],
            [],
        ),
        (
            {"kvmesh.engine.a": {"kvmesh.engine.b"}, "kvmesh.engine.b": {"kvmesh.engine.a"}},
            [],
            [["kvmesh.engine.a", "kvmesh.engine.b"]],
        ),
        ({"kvmesh.a": {"kvmesh.engine.b"}, "kvmesh.engine.b": set()}, [], []),
        # every layer may import the namespace root; the root imports no layer
        ({"kvmesh.kernels.a": {"kvmesh"}, "kvmesh.gateway.b": {"kvmesh"}, "kvmesh": set()}, [], []),
        ({"kvmesh": {"kvmesh.engine.b"}, "kvmesh.engine.b": set()}, [("kvmesh", "kvmesh.engine.b")], []),
        ({"kvmesh.a": {"kvmesh.bench.b"}, "kvmesh.bench.b": set()}, [("kvmesh.a", "kvmesh.bench.b")], []),
        (
            {"kvmesh.bench.a": {"kvmesh.b", "kvmesh.engine.c"}, "kvmesh.b": set(), "kvmesh.engine.c": set()},
            [],
            [],
        ),
    ],
)
def test_the_checker_catches_what_it_claims(graph, expect_up, expect_cycles):
    assert upward_arrows(graph) == expect_up
    assert cycles(graph) == expect_cycles


def test_a_sub_package_importing_back_up_is_a_cycle(tmp_path, monkeypatch):
    # engine.models.report -> engine.tiny -> engine.models.weights: no module-level circle,
    # but engine.models, taken whole, imports a module that imports it back
    (tmp_path / "engine" / "models").mkdir(parents=True)
    for name, text in {
        "engine/__init__.py": "",
        "engine/tiny.py": "from kvmesh.engine.models import weights\n",
        "engine/forward.py": "",
        "engine/models/__init__.py": "",
        "engine/models/weights.py": "from kvmesh.engine import forward\n",  # a leaf below: fine
        "engine/models/report.py": "from kvmesh.engine import tiny\n",
    }.items():
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    monkeypatch.setattr(__import__(__name__, fromlist=["LAYERS"]), "LAYERS", {"engine": 2})
    graph = import_graph()
    assert cycles(graph) == []
    assert sub_package_cycles(graph) == [["kvmesh.engine.models", "kvmesh.engine.tiny"]]
    (tmp_path / "engine/models/report.py").unlink()
    assert sub_package_cycles(import_graph()) == []


def test_lab_module_names_are_caught(tmp_path, monkeypatch):
    for name in ("kernels/bench_x.py", "engine/models/v4_state_report.py", "kvmesh/routesim.py", "kvmesh/cli.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "profile_decode.py").write_text("")  # where it belongs
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    assert lab_modules_in_the_product() == [
        "kvmesh/routesim.py",
        "engine/models/v4_state_report.py",
        "kernels/bench_x.py",
    ]


def test_function_local_imports_are_walked(tmp_path, monkeypatch):
    pkg = tmp_path / "engine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from kvmesh.engine import b\n    return b\n")
    (pkg / "b.py").write_text("import kvmesh.engine.a\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    monkeypatch.setattr(__import__(__name__, fromlist=["LAYERS"]), "LAYERS", {"engine": 2})
    assert cycles(import_graph()) == [["kvmesh.engine.a", "kvmesh.engine.b"]]


def test_the_gateway_and_the_runtime_import_without_torch():
    """The gateway's domain types (sampling parameters, model config, finish reasons) are
    torch-free, and so is what a gateway does before it serves (resolve the default model, load
    its config and tokenizer, build its prompts), so a gateway process never loads the model
    stack: importing torch took ~3 s of each gateway's start (AMD EPYC Zen 3, 2 cores)."""
    import subprocess
    import sys

    code = (
        "import sys; import kvmesh.gateway.main, kvmesh.gateway.servicer, kvmesh.runtime.service, kvmesh.runtime.wire, "
        "kvmesh.engine.config, kvmesh.engine.sampling_params, kvmesh.engine.outcomes, kvmesh.engine.loader, "
        "kvmesh.engine.checkpoint; "
        "from kvmesh.cli import build_parser; build_parser(); "  # `kvmesh serve gateway` parses its flags
        "from kvmesh.engine.loader import resolve_model, load_config; "
        "from kvmesh.engine.checkpoint import load_tokenizer; "
        "from kvmesh.gateway.requests import PromptBuilder; "
        "files = resolve_model(None); load_config(files); "  # gateway.main.serve's first steps
        "PromptBuilder(load_tokenizer(files), files.name, 2048, 16, 64).tokenize(b'', [('user', 'hi')], False); "
        "print(sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "torch" not in out.stdout, out.stdout
