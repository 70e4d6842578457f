"""The package's layers point one way: server -> engine -> executor -> worker -> models ->
attention -> layers -> kernels, with the plain data (config, requests, outputs) at the bottom.
Every import in the source is read (function-level and TYPE_CHECKING ones too) and checked
against the table below; no two modules import each other, directly or around a loop."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# each piece of the package -> the other pieces it may import
ALLOWED: dict[str, set[str]] = {
    "kernels": set(),
    "errors": set(),
    "debugging": set(),
    "sampling_params": {"errors"},
    "outputs": set(),
    "model_files": set(),
    "config": {"model_files"},
    "request": {"sampling_params"},
    "distributed": set(),
    "layers": {"kernels", "distributed"},
    "attention": {"layers", "kernels"},
    "sample": {"kernels", "sampling_params", "outputs"},
    "structured_output": {"sample", "sampling_params", "errors", "request"},
    "models": {"attention", "layers", "distributed", "config", "model_files"},
    "core": {"config", "request", "sampling_params", "outputs"},
    "spec_decode": {
        "core",
        "sample",
        "models",
        "attention",
        "config",
        "request",
        "outputs",
        "sampling_params",
    },
    "worker": {
        "distributed",
        "core",
        "models",
        "attention",
        "layers",
        "sample",
        "config",
        "outputs",
        "sampling_params",
        "structured_output",
        "spec_decode",
    },
    "executor": {"worker", "distributed", "core", "config"},
    "engine": {
        "executor",
        "core",
        "config",
        "request",
        "outputs",
        "sampling_params",
        "errors",
        "debugging",
        "structured_output",
        "spec_decode",
    },
    "server": {
        "engine",
        "config",
        "outputs",
        "sampling_params",
        "model_files",
        "errors",
        "debugging",
        "structured_output",
        "spec_decode",
    },
}
ENTRY_POINTS = {"asyncllm", "cli", "serve"}  # may import anything


def source_modules() -> dict[str, Path]:
    """Dotted module name -> file, for asyncllm and kernels."""
    modules = {}
    for package in ("asyncllm", "kernels"):
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def imported_modules(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules a file imports; `from pkg import name` counts pkg.name when that is
    a module, else pkg."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [n if n in modules else node.module for n in names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def piece(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "kernels":
        return "kernels"
    return parts[1] if len(parts) > 1 else "asyncllm"


def import_graph() -> dict[str, set[str]]:
    modules = source_modules()
    return {
        name: imported_modules(path, modules) - {name} for name, path in sorted(modules.items())
    }


def test_every_piece_of_the_package_is_in_the_table() -> None:
    pieces = {piece(m) for m in source_modules()}
    assert pieces - ENTRY_POINTS == set(ALLOWED)


def test_imports_point_down_the_layers() -> None:
    wrong = []
    for module, targets in import_graph().items():
        source = piece(module)
        if source in ENTRY_POINTS:
            continue
        for target in targets:
            if piece(target) != source and piece(target) not in ALLOWED[source]:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_no_module_imports_itself_around_a_loop() -> None:
    graph = import_graph()
    state: dict[str, str] = {}  # module -> "open" while on the path, "done" after

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                loop = path[path.index(target) :] + [target]
                pytest.fail("import cycle: " + " -> ".join(loop))
            if target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in graph:
        if module not in state:
            visit(module, [module])
