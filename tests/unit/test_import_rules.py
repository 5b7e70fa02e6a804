"""The import rules of the design, enforced by parsing every module's imports."""

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "kestrel"
CORE = {"config", "sampling_params", "request", "outputs", "kv_spec"}

# Which kestrel modules each part may import (prefix match on the dotted name below `kestrel.`).
ALLOWED: dict[str, set[str]] = {
    "core": CORE,
    "engine": CORE | {"engine"},
    "kernels": {"kernels"},
    "ops": {"kernels"},
    "quant": {"quant", "kernels", "ops", "config"},
    "model": {"model", "quant", "ops", "config", "kv_spec", "distributed.parallel"},
    "loader": {"loader", "model", "quant", "config", "distributed.parallel"},
    "sample": {"sample", "sampling_params", "outputs"},
    "structured": {"structured", "engine.contracts"} | CORE,
    "worker": {"worker", "model", "loader", "sample", "ops", "engine.contracts", "distributed.parallel"} | CORE,
    # Process groups and collectives (distributed.parallel) are used by the layers; the worker process and the
    # executors run model runners and speak the engine's contracts.
    "distributed": {"distributed", "worker", "engine.contracts"} | CORE,
    "bench": {"bench", "kernels", "ops", "quant", "model", "loader", "worker", "sample", "engine", "tiny",
              "structured", "distributed"} | CORE,
    # The chat fine-tune (tiny/finetune.py) encodes prompts as the chat entrypoint does and scores its result
    # through the public API and the ppl bench: a training tool on top of the engine, never imported by it.
    "tiny": {"tiny", "loader", "config", "bench.ppl", "entrypoints.chat", "LLM", "SamplingParams"} | CORE,
    "entrypoints": {""},  # everything
}
# Parts that must stay pure Python: standard library only outside kestrel.
STDLIB_ONLY = {"core", "engine"}


def part_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    if len(rel.parts) == 1:
        stem = rel.stem
        return "core" if stem in CORE else stem
    return rel.parts[0]


def imports_of(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            if node.module == "kestrel":
                names.extend(f"kestrel.{alias.name}" for alias in node.names)
    return names


def allowed(part: str, target: str) -> bool:
    return any(target == p or target.startswith(p + ".") or p == "" for p in ALLOWED[part])


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


def test_rule_checker_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nfrom kestrel.worker import model_runner\n")
    names = imports_of(bad)
    assert "torch" in names and not allowed("engine", "worker.model_runner")
