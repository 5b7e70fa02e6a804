"""The import rules of the design, enforced by parsing every module's imports.

- Which kestrel part may import which (`ALLOWED`), and the parts that stay pure Python.
- The workshop stays outside the runtime: no runtime module imports `kestrel.bench` or the top-level `training`
  package, and only the entry points themselves and bench import `kestrel.entrypoints`.
- No import cycle among the modules of `kestrel` and `training`.
- Nothing outside `kestrel/model/` imports a model family module.

Imports are read from the source (`ast`), at module level and inside functions alike, plus the names handed to
`importlib.import_module` as literals or f-strings with a literal prefix.
"""

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kestrel"
TRAINING = ROOT / "training"
CORE = {"config", "sampling_params", "pooling_params", "request", "outputs", "inputs", "init_configs", "kv_spec",
        "fork_server"}

# Which kestrel modules each part may import (prefix match on the dotted name below `kestrel.`).
ALLOWED: dict[str, set[str]] = {
    "core": CORE,
    "engine": CORE | {"engine"},
    "kernels": {"kernels"},
    "ops": {"kernels"},
    "quant": {"quant", "kernels", "ops", "config"},
    "model": {"model", "quant", "ops", "config", "kv_spec", "distributed.parallel"},
    "loader": {"loader", "model", "quant", "config", "init_configs", "distributed.parallel"},
    "sample": {"sample", "sampling_params", "outputs"},
    "structured": {"structured", "engine.contracts"} | CORE,
    # quant.scheme: the checkpoint names of FP8 KV scales, which the worker reads when it builds the cache.
    "worker": {"worker", "model", "loader", "quant.scheme", "sample", "ops", "engine.contracts",
               "distributed.parallel"} | CORE,
    # Process groups and collectives, used by the layers, the loader and the worker.
    "distributed": {"distributed"} | CORE,
    # The worker process and the executors run model runners and speak the engine's contracts.
    "executor": {"executor", "worker", "distributed.parallel", "engine.contracts"} | CORE,
    # Benches drive the engine core, not the entry points; `host-step --split` drives an engine core process through
    # the server's client of it, as `kestrel serve --engine-core-process` does; `compression` measures the prompt
    # compressor the server runs; `multimodal` expands its image prompts with the server's media processor.
    "bench": {"bench", "kernels", "ops", "quant", "model", "loader", "worker", "sample", "engine", "tiny",
              "structured", "distributed", "executor", "entrypoints.core_client", "entrypoints.prompt_compression",
              "entrypoints.compression_plan", "entrypoints.media"} | CORE,
    # Where the bundled model lives and the stdlib corpus (quantize's calibration set, the ppl bench's text); its
    # training is the top-level `training` package.
    "tiny": {"tiny"} | CORE,
    "entrypoints": {""},  # everything
}
# Parts that must stay pure Python: standard library only outside kestrel.
STDLIB_ONLY = {"core", "engine"}

# The command line loads the suites of `kestrel bench <suite>` by name (importlib): the one door from the runtime
# into bench.
BENCH_LOADERS = {"kestrel.entrypoints.cli"}

# The modules of kestrel/model/ that every family shares. Every other module there is a model family (one
# architecture's decoder or draft head): only kestrel/model/ imports it, the rest of the package reads the
# model's declarations. A shared module added to kestrel/model/ is named here (`P.*`: package P and all in it).
MODEL_SHARED = {"kestrel.model", "kestrel.model.registry", "kestrel.model.base", "kestrel.model.attn_metadata",
                "kestrel.model.arch", "kestrel.model.loading", "kestrel.model.expert_load", "kestrel.model.layers.*"}
# Family imports outside kestrel/model/ allowed (importer, family module): none.
EXPECTED_FAMILY_IMPORTS: set[tuple[str, str]] = set()

# Import cycles allowed, each as the sorted tuple of its modules: none.
EXPECTED_CYCLES: set[tuple[str, ...]] = set()


def part_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    if len(rel.parts) == 1:
        stem = rel.stem
        return "core" if stem in CORE else stem
    return rel.parts[0]


def _dynamic_import_name(node: ast.Call) -> str | None:
    """The module an `importlib.import_module(...)` call names: a literal, or `PREFIX.*` for an f-string whose
    literal part is `PREFIX.` (any module of that package)."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name != "import_module" or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        prefix = str(arg.values[0].value)
        if prefix.endswith("."):
            return prefix + "*"
    return None


def imported_names(source: str) -> list[tuple[str, int]]:
    """(dotted name, line) of every import: `import a.b` gives a.b; `from a import b, c` gives a.b and a.c (a
    submodule or a name defined in `a`); `import_module(...)` gives its literal name or `PREFIX.*`."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.extend((f"{node.module}.{alias.name}", node.lineno) for alias in node.names)
        elif isinstance(node, ast.Call) and (name := _dynamic_import_name(node)) is not None:
            names.append((name, node.lineno))
    return names


def imports_of(path: Path) -> list[str]:
    """The imported names as the `ALLOWED` table reads them: `from a import b` gives a (and kestrel.b for
    `from kestrel import b`, the root's own modules and exports)."""
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            if node.module == "kestrel":
                names.extend(f"kestrel.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and (name := _dynamic_import_name(node)) is not None:
            names.append(name)
    return names


def allowed(part: str, target: str) -> bool:
    return any(target == p or target.startswith(p + ".") or p == "" for p in ALLOWED[part])


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    """Every module of the kestrel and training packages by dotted name."""
    return {module_name(p): p for top in (PACKAGE, TRAINING) for p in sorted(top.rglob("*.py"))}


def resolve(name: str, known: Iterable[str]) -> set[str]:
    """The known modules an imported name stands for: the module itself, else its parent (a name defined in a
    package or module); `PREFIX.*` stands for the package and every module under it; unknown names for none."""
    known = set(known)
    if name.endswith(".*"):
        package = name[:-2]
        return {m for m in known if m == package or m.startswith(package + ".")}
    while name:
        if name in known:
            return {name}
        name = name.rpartition(".")[0]
    return set()


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (module level, inside functions and under TYPE_CHECKING alike).

    A function-level import counts: it hides a dependency from import time but not from the design, and the
    executor circle is one. Two kinds of edge are left out: the implicit import of a module's parent package
    (a package's `__init__` importing its own modules is how a package presents itself), and the lazy public
    export in `kestrel/__init__.py` (`kestrel.LLM` resolved on first use)."""
    graph = {}
    for name, path in modules.items():
        targets = set()
        if name != "kestrel":
            for imported, _ in imported_names(path.read_text()):
                targets |= resolve(imported, modules)
        graph[name] = targets - {name}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan), each as a sorted tuple."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = set()

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.add(tuple(sorted(component)))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for node in sorted(graph):
            if node not in index:
                visit(node)
    finally:
        sys.setrecursionlimit(limit)
    return cycles


def in_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def is_shared_model_module(name: str) -> bool:
    return any(in_package(name, shared[:-2]) if shared.endswith(".*") else name == shared for shared in MODEL_SHARED)


def family_modules(modules: Iterable[str]) -> set[str]:
    return {m for m in modules if in_package(m, "kestrel.model") and not is_shared_model_module(m)}


def family_imports(graph: dict[str, set[str]], families: set[str]) -> set[tuple[str, str]]:
    """(importer, family module) for every import of a family from outside kestrel/model/."""
    return {(importer, target) for importer, targets in graph.items() if not in_package(importer, "kestrel.model")
            for target in targets & families}


def test_import_rules():
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "__init__.py":
            continue  # the public API re-exports lazily
        part = part_of(path)
        if part not in ALLOWED:
            violations.append(f"{path.relative_to(PACKAGE)}: part {part!r} has no import rule; add one")
            continue
        for name in imports_of(path):
            top = name.split(".")[0]
            if top == "kestrel":
                target = name[len("kestrel."):]
                if target and not allowed(part, target):
                    violations.append(f"{path.relative_to(PACKAGE)} imports kestrel.{target}")
            elif part in STDLIB_ONLY and top not in sys.stdlib_module_names and top != "__future__":
                violations.append(f"{path.relative_to(PACKAGE)} imports {name} (must stay pure Python)")
    assert not violations, "import rule violations:\n" + "\n".join(violations)


def test_the_runtime_never_imports_the_workshop():
    """No kestrel module imports the training package; none outside bench imports kestrel.bench (the command
    line's suite loader aside)."""
    modules = project_modules()
    violations = []
    for name, path in modules.items():
        if not in_package(name, "kestrel"):
            continue
        may_import_bench = in_package(name, "kestrel.bench") or name in BENCH_LOADERS
        for imported, line in imported_names(path.read_text()):
            if in_package(imported, "training") or (in_package(imported, "kestrel.bench") and not may_import_bench):
                violations.append(f"{path.relative_to(ROOT)}:{line} imports {imported}")
    assert not violations, "the runtime imports the workshop:\n" + "\n".join(violations)


def test_only_the_top_imports_entrypoints():
    """kestrel.entrypoints is imported by itself, by bench and by the public API's lazy export alone."""
    modules = project_modules()
    violations = []
    for name, path in modules.items():
        if name == "kestrel" or not in_package(name, "kestrel"):
            continue
        if in_package(name, "kestrel.entrypoints") or in_package(name, "kestrel.bench"):
            continue
        for imported, line in imported_names(path.read_text()):
            if in_package(imported, "kestrel.entrypoints"):
                violations.append(f"{path.relative_to(ROOT)}:{line} imports {imported}")
    assert not violations, "imports of kestrel.entrypoints from below:\n" + "\n".join(violations)


def test_no_import_cycle():
    cycles = find_cycles(import_graph(project_modules()))
    new = sorted(cycles - EXPECTED_CYCLES)
    gone = sorted(EXPECTED_CYCLES - cycles)
    assert not new, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in new)
    assert not gone, ("expected cycles that no longer exist (delete them from EXPECTED_CYCLES):\n"
                      + "\n".join(" <-> ".join(c) for c in gone))


def test_nothing_outside_model_imports_a_family():
    modules = project_modules()
    families = family_modules(modules)
    found = family_imports(import_graph(modules), families)
    new = sorted(found - EXPECTED_FAMILY_IMPORTS)
    gone = sorted(EXPECTED_FAMILY_IMPORTS - found)
    assert not new, ("model family modules imported outside kestrel/model/ (read the model's declarations, or "
                     "name a shared module in MODEL_SHARED):\n" + "\n".join(f"{a} imports {b}" for a, b in new))
    assert not gone, ("expected family imports that no longer exist (delete them from EXPECTED_FAMILY_IMPORTS):\n"
                      + "\n".join(f"{a} imports {b}" for a, b in gone))


def test_the_registry_serves_family_modules():
    """The model modules the registry imports are families, so MODEL_SHARED hides none of them."""
    modules = project_modules()
    # The registry names each family by "module:Class" and imports it on first use.
    literals = [node.value for node in ast.walk(ast.parse((PACKAGE / "model" / "registry.py").read_text()))
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and ":" in node.value]
    served = {text.split(":")[0] for text in literals if in_package(text.split(":")[0], "kestrel.model")}
    assert served, "kestrel/model/registry.py names no model module: teach this test the registry's form"
    assert served <= family_modules(modules), f"registry modules counted as shared: {served - family_modules(modules)}"


def test_rule_checker_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nfrom kestrel.worker import model_runner\n\n\ndef load(name):\n"
                   "    import importlib\n    return importlib.import_module(f'kestrel.bench.{name}')\n")
    names = imports_of(bad)
    assert "torch" in names and not allowed("engine", "worker.model_runner")
    assert "kestrel.bench.*" in names and not allowed("worker", "bench.*")
    known = {"kestrel.worker", "kestrel.worker.model_runner", "kestrel.bench", "kestrel.bench.ppl"}
    targets = set().union(*(resolve(name, known) for name, _ in imported_names(bad.read_text())))
    assert targets == {"kestrel.worker.model_runner", "kestrel.bench", "kestrel.bench.ppl"}


def test_cycle_finder_catches_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert find_cycles(graph) == {("a", "b", "c")}
    assert find_cycles({"a": {"b"}, "b": set()}) == set()


def test_family_rule_catches_an_import():
    families = family_modules({"kestrel.model", "kestrel.model.registry", "kestrel.model.layers.linear",
                               "kestrel.model.llama", "kestrel.model.gemma"})
    assert families == {"kestrel.model.llama", "kestrel.model.gemma"}
    graph = {"kestrel.worker.model_runner": {"kestrel.model.gemma", "kestrel.model.registry"},
             "kestrel.model.registry": {"kestrel.model.gemma"}}
    assert family_imports(graph, families) == {("kestrel.worker.model_runner", "kestrel.model.gemma")}


SERVER_ONLY_PACKAGES = ("pydantic", "fastapi", "starlette", "uvicorn", "python_multipart", "multipart", "soundfile")


def test_offline_paths_import_without_the_server_packages():
    """A GPU host may carry torch and transformers alone: `LLM`, the engine and the benches must import without the
    server's packages (a test run there once failed to collect because `LLM` reached pydantic)."""
    import subprocess

    blocker = (
        "import importlib, importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        f"        if name.split('.')[0] in {SERVER_ONLY_PACKAGES!r}:\n"
        "            raise ModuleNotFoundError(f'no module named {name!r} (blocked)')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from kestrel import LLM, SamplingParams\n"
        "for m in ('kestrel.entrypoints.llm', 'kestrel.bench.latency', 'kestrel.bench.throughput',\n"
        "          'kestrel.bench.multimodal', 'kestrel.bench.sparse_attention', 'kestrel.bench.compression'):\n"
        "    importlib.import_module(m)\n"
    )
    done = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
