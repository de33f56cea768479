"""The package is layered one way, and the runtime imports without the compiler.

- every module is in one layer of ``LAYERS``; a module imports only from its own or
  lower layers: written imports at module level, inside functions and under
  ``if TYPE_CHECKING:`` all count (a lazy import is still an import);
- transitively too: following every import, and the package ``__init__`` each import of
  a submodule runs, no module reaches a higher layer; the runtime reaches no pass but
  the values the passes make; the import graph has no cycle;
- the runtime is in rooms (``fxpipe/runtime/__init__.py``): each of its modules is in one
  room, named in that room's ``__init__`` docstring (its map), and a room imports only
  from itself and the rooms below it, directly or through any chain;
- in a fresh interpreter every module imports, lowest layer first, and importing the
  runtime (or ``fxpipe`` itself) loads none of the compiler, while the public names
  still resolve on first use.
"""

from __future__ import annotations

import ast
import functools
import json
import pathlib
import subprocess
import sys
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Lowest first. A name is one module; "pkg.*" is a package and everything in it.
LAYERS: list[tuple[str, ...]] = [
    ("fxpipe.errors",),
    # leaves: plain data and tools (they import fxpipe.errors at most)
    ("fxpipe.ops", "fxpipe.verbose", "fxpipe.losses", "fxpipe.tiling", "fxpipe.live_bytes",
     "fxpipe.units", "fxpipe.stage_plan", "fxpipe.attention", "fxpipe.quant",
     "fxpipe.sequence_kv"),
    ("fxpipe.config",),
    # the values the passes make and the runtime reads
    ("fxpipe.passes", "fxpipe.passes.layer_graph", "fxpipe.passes.actions",
     "fxpipe.passes.program_text", "fxpipe.passes.dependencies", "fxpipe.passes.program",
     "fxpipe.passes.stage"),
    # Programs from stage ranges, the stage memory model and the planner's cost vectors
    # and makespan estimate (arithmetic on cost vectors)
    ("fxpipe.passes.schedule", "fxpipe.passes.stage_memory", "fxpipe.passes.chain_costs"),
    ("fxpipe.sim.*",),
    ("fxpipe.runtime.*",),
    ("fxpipe.optim", "fxpipe.optim_step", "fxpipe.generation"),
    # the compiler, in pass order: capture, partition, costs, lowering
    ("fxpipe.passes.capture_dtypes",),   # a capture in param_dtype
    ("fxpipe.passes.capture_cache", "fxpipe.passes.blocks"),   # captures remembered
    ("fxpipe.passes.capture_messages",),  # what capture tells the user
    ("fxpipe.passes.capture", "fxpipe.passes.from_dynamo", "fxpipe.passes.buffer_dtypes"),
    ("fxpipe.passes.loss", "fxpipe.passes.tiling",   # rewrites of the captured graph
     "fxpipe.passes.token_means"),
    ("fxpipe.passes.partition", "fxpipe.passes.grad_flow"),
    ("fxpipe.passes.cost_cache", "fxpipe.passes.costs", "fxpipe.passes.layer_times"),
    ("fxpipe.passes.recompute", "fxpipe.passes.lower"),
    ("fxpipe.passes.executable",),
    # planning above memory: the estimate, the algorithm, what users call
    ("fxpipe.memory_prediction", "fxpipe.sequence_plan"),
    ("fxpipe.passes.packing",),    # the planner's exact packing
    ("fxpipe.passes.planner",),
    ("fxpipe.plan",),
    ("fxpipe.kv_placement",),      # a generation's KV cache, from predictions (and a plan)
    ("fxpipe.graph_cache",),                         # the graphs a pipe compiled
    ("fxpipe.inspecting", "fxpipe.checkpointing",    # PipelineModule's bases, and what it
     "fxpipe.generating", "fxpipe.call_checks",       # checks of a call
     "fxpipe.sequence_chunks"),
    ("fxpipe.api",),
    ("fxpipe.backend",),
    ("fxpipe",),
    ("fxpipe.demo", "fxpipe.check.*",   # programs built on the package (the GPU kit)
     "fxpipe.roundpipe.*", "fxpipe.integrations.*"),   # and its front doors for other APIs
]
# The runtime's rooms, lowest first (fxpipe/runtime/__init__.py says what each holds).
ROOMS = ["devices", "host", "stages", "issue"]
# what the runtime may take from the passes: the values they make, not the passes
VALUE_TYPES = {"fxpipe.passes", "fxpipe.passes.layer_graph", "fxpipe.passes.actions",
               "fxpipe.passes.program_text", "fxpipe.passes.dependencies",
               "fxpipe.passes.program", "fxpipe.passes.stage"}
# what importing the runtime must not load (nor importing fxpipe)
COMPILER = ("fxpipe.passes.capture", "fxpipe.passes.capture_dtypes", "fxpipe.passes.buffer_dtypes",
            "fxpipe.passes.capture_cache", "fxpipe.passes.capture_messages",
            "fxpipe.passes.loss",
            "fxpipe.passes.tiling",
            "fxpipe.passes.token_means",
            "fxpipe.passes.partition", "fxpipe.passes.cost_cache", "fxpipe.passes.costs",
            "fxpipe.passes.layer_times",
            "fxpipe.passes.packing", "fxpipe.passes.planner", "fxpipe.passes.lower", "fxpipe.passes.executable",
            "fxpipe.memory_prediction", "fxpipe.plan", "fxpipe.graph_cache", "fxpipe.api")


def _layer(module: str) -> int:
    for i, names in enumerate(LAYERS):
        for n in names:
            if module == n or (n.endswith(".*") and (module == n[:-2] or
                                                    module.startswith(n[:-1]))):
                return i
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for f in sorted((ROOT / "fxpipe").rglob("*.py")):
        parts = f.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


MODULES = _modules()


def _is_module(name: str) -> bool:
    return name in MODULES


def _imports(path: pathlib.Path) -> Iterator[tuple[int, str, str]]:
    """``(line, module, how)`` of every fxpipe import the file writes: ``how`` is
    ``""`` (module level), ``"in a function"`` or ``"under TYPE_CHECKING"``."""
    def visit(node: ast.AST, how: str) -> Iterator[tuple[int, str, str]]:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            how = "under TYPE_CHECKING"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and not how:
            how = "in a function"
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, how
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                # `from fxpipe.runtime import unfilled` imports the module fxpipe.runtime.stages.unfilled
                sub = f"{node.module}.{a.name}"
                yield node.lineno, sub if _is_module(sub) else node.module, how
        elif (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module")
              and node.args and isinstance(node.args[0], ast.Constant)):
            yield node.lineno, str(node.args[0].value), how   # importlib.import_module("...")
        for child in ast.iter_child_nodes(node):
            yield from visit(child, how)
    for line, module, how in visit(ast.parse(path.read_text()), ""):
        if module == "fxpipe" or module.startswith("fxpipe."):
            yield line, module, how


def _parents(module: str) -> list[str]:
    """The packages importing ``module`` runs first, below the root ``fxpipe`` (which
    everything runs; what it loads is checked in a fresh interpreter below)."""
    parts = module.split(".")
    return [".".join(parts[:k]) for k in range(2, len(parts))]


@functools.cache
def _graph() -> dict[str, set[str]]:
    """module -> the modules importing it loads: what it imports (at any level) and
    those modules' packages. (A module's own packages are its importers' edges: they
    run before it, and a package's ``__init__`` importing its modules is no cycle.)"""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        edges = set()
        for _, imported, _ in _imports(path):
            edges.add(imported)
            edges.update(p for p in _parents(imported) if not module.startswith(p + "."))
        edges.discard(module)
        graph[module] = edges
    return graph


def _reach(start: str) -> dict[str, str]:
    """Every module ``start`` loads, transitively, with the module that imports it
    (to print the chain)."""
    seen = {start: ""}
    todo = [start]
    while todo:
        module = todo.pop()
        for nxt in _graph().get(module, ()):
            if nxt not in seen and nxt != "fxpipe":
                seen[nxt] = module
                todo.append(nxt)
    return seen


def _chain(seen: dict[str, str], end: str) -> str:
    chain = [end]
    while seen[chain[-1]]:
        chain.append(seen[chain[-1]])
    return " -> ".join(reversed(chain))


def test_every_module_is_in_one_layer():
    for module in MODULES:
        _layer(module)
    listed = [n for names in LAYERS for n in names]
    assert len(listed) == len(set(listed))
    stale = [n for n in listed if not n.endswith(".*") and n not in MODULES]
    assert not stale, f"LAYERS names modules that do not exist: {stale}"


MAX_LINES = 600   # a module a reader can hold; past it, split by concern


def test_no_module_is_over_600_lines():
    long = {m: n for m, path in _modules().items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by concern (each at most {MAX_LINES} lines): {long}"


def test_imports_go_one_way():
    bad = []
    for module, path in MODULES.items():
        for line, imported, how in _imports(path):
            where = f"{path.relative_to(ROOT)}:{line}: {module} imports {imported}" + \
                    (f" ({how})" if how else "")
            if _layer(imported) > _layer(module):
                bad.append(where)
            if (module.startswith("fxpipe.runtime.") and imported.startswith("fxpipe.passes")
                    and imported not in VALUE_TYPES):
                bad.append(f"{where}: the runtime imports a pass, not a value type")
    assert not bad, "\n".join(bad)


def test_no_module_reaches_a_higher_layer_through_any_chain():
    bad = []
    for module in MODULES:
        seen = _reach(module)
        for reached, importer in seen.items():   # where a chain first climbs above it
            if _layer(reached) > _layer(module) and _layer(importer or module) <= _layer(module):
                bad.append(_chain(seen, reached))
    assert not bad, "\n".join(sorted(bad))


def test_the_runtime_reaches_no_compiler_pass():
    bad = []
    for module in (m for m in MODULES if m.startswith("fxpipe.runtime")):
        seen = _reach(module)
        bad += [_chain(seen, m) for m in seen if m in COMPILER]
    assert not bad, "\n".join(sorted(bad))


def _room(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 4 or parts[:2] != ["fxpipe", "runtime"]:
        return None
    return ROOMS.index(parts[2])


def test_every_runtime_module_is_in_a_room_and_on_its_map():
    bad = []
    for module, path in MODULES.items():
        parts = module.split(".")
        if parts[:2] != ["fxpipe", "runtime"] or len(parts) == 2:
            continue
        if parts[2] not in ROOMS:
            bad.append(f"{module} is in no room: move it into one of fxpipe/runtime/{ROOMS}")
        elif len(parts) == 4:
            room_map = ast.get_docstring(ast.parse(MODULES[".".join(parts[:3])].read_text())) or ""
            if f"``{parts[3]}``" not in room_map:
                bad.append(f"{module} is not on its room's map (fxpipe/runtime/{parts[2]}/__init__.py)")
    assert not bad, "\n".join(bad)


def test_runtime_rooms_import_one_way():
    bad = []
    for module in MODULES:
        if (room := _room(module)) is None:
            continue
        seen = _reach(module)
        for reached in seen:
            if (other := _room(reached)) is not None and other > room:
                bad.append(f"room {ROOMS[room]} reaches room {ROOMS[other]}: {_chain(seen, reached)}")
    assert not bad, "\n".join(sorted(bad))


def test_the_import_graph_has_no_cycle():
    graph, state, stack = _graph(), {}, []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        stack.append(module)
        for nxt in sorted(graph.get(module, ())):
            if nxt == "fxpipe":
                continue
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[module] = "done"
        stack.pop()
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))


def _fresh(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_every_module_imports_in_layer_order_in_a_fresh_interpreter():
    """No import cycle at run time either: a fresh interpreter imports every module,
    lowest layer first. (Importing any ``fxpipe.x`` runs the package's ``__init__``
    first, so one fresh interpreter sees the order every user gets.)"""
    modules = sorted((m for m in MODULES if m not in ("fxpipe.demo", "fxpipe.check.__main__")),
                     key=_layer)
    script = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    run = _fresh(script, *modules)
    assert run.returncode == 0, run.stderr[-3000:]


LOADED = """
import json, sys
import {module}
print(json.dumps(sorted(m for m in sys.modules if m == "fxpipe" or m.startswith("fxpipe."))))
"""


def test_the_runtime_imports_without_the_compiler_in_a_fresh_interpreter():
    for module in ("fxpipe.runtime.issue.pipeline", "fxpipe.runtime.issue.executor", "fxpipe"):
        run = _fresh(LOADED.format(module=module))
        assert run.returncode == 0, run.stderr[-3000:]
        loaded = json.loads(run.stdout)
        assert module in loaded
        compiler = sorted(set(COMPILER) & set(loaded))
        assert not compiler, f"import {module} loads the compiler modules {compiler}"


PUBLIC = """
import sys
import fxpipe
import fxpipe.backend                      # the module: fxpipe.backend stays the function
assert callable(fxpipe.backend) and not isinstance(fxpipe.backend, type(sys)), fxpipe.backend
assert "fxpipe.api" not in sys.modules, "import fxpipe loaded fxpipe.api"
from fxpipe import ExecutePlan, PipelineModule, RunConfig, compile
import fxpipe.plan
assert fxpipe.ExecutePlan is ExecutePlan is fxpipe.plan.ExecutePlan
assert fxpipe.compile is compile and PipelineModule.__module__ == "fxpipe.api"
assert callable(fxpipe.plan.predict_memory) and callable(fxpipe.plan.max_sequence_length)
assert {"compile", "ExecutePlan", "PipelineModule", "plan", "sim"} <= set(dir(fxpipe))
assert isinstance(RunConfig(execute_plan=ExecutePlan.default(2, "train")), RunConfig)
from fxpipe import *                        # every name of __all__ resolves
assert fxpipe.sim.Timeline and fxpipe.optim.overlapped
try:
    fxpipe.no_such_name
except AttributeError as e:
    assert "no_such_name" in str(e)
else:
    raise AssertionError("fxpipe.no_such_name did not raise")
"""


def test_public_names_resolve_on_first_use_in_a_fresh_interpreter():
    run = _fresh(PUBLIC)
    assert run.returncode == 0, run.stderr[-3000:]
