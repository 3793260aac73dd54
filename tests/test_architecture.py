"""The import rules of docs/architecture.md, checked on the source (every import, also the
ones inside functions): a module map is only worth what keeps it true."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "zmqsync"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """Every module `name` imports, relative imports made absolute."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            # `from . import _config` imports a module too
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _matching(prefixes: tuple[str, ...]) -> list[str]:
    return sorted(m for m in MODULES if any(m == p or m.startswith(p + ".") for p in prefixes))


def _violations(modules: list[str], forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for module in modules:
        for imported in sorted(_imports(module)):
            if any(imported == f or imported.startswith(f + ".") for f in forbidden):
                bad.append(f"{module} imports {imported}")
    return bad


IO = ("zmq", "socket", "threading", "time", "os", "subprocess", "select", "mmap", "asyncio")
# The roles: publisher and subscriber, their state objects, buffers, the protocol.
CORE = (
    "zmqsync._ack_reader",
    "zmqsync._admission",
    "zmqsync._apply",
    "zmqsync._buffers",
    "zmqsync._checks",
    "zmqsync._checksum",
    "zmqsync._config",
    "zmqsync._connections",
    "zmqsync._copy",
    "zmqsync._deadline",
    "zmqsync._errors",
    "zmqsync._fast_frames",
    "zmqsync._flat",
    "zmqsync._follow",
    "zmqsync._handshake_queue",
    "zmqsync._histogram",
    "zmqsync._home",
    "zmqsync._layout",
    "zmqsync._lifecycle",
    "zmqsync._link",
    "zmqsync._native_lib",
    "zmqsync._protocol",
    "zmqsync._publisher",
    "zmqsync._publisher_agent",
    "zmqsync._acks",
    "zmqsync._announcer",
    "zmqsync._source",
    "zmqsync._unchanged",
    "zmqsync._write_modes",
    "zmqsync._writes",
    "zmqsync._overlap",
    "zmqsync._places",
    "zmqsync._publisher_role",
    "zmqsync._reference_follower",
    "zmqsync._registry",
    "zmqsync._security",
    "zmqsync._slots",
    "zmqsync._sockets",
    "zmqsync._subscriber",
    "zmqsync._subscriber_agent",
    "zmqsync._text",
    "zmqsync._worker_state",
)
RULES = {
    "the protocol does no I/O, and knows no tensors": (
        ("zmqsync._protocol", "zmqsync._checks", "zmqsync._fast_frames"),
        (*IO, "torch"),
    ),
    "the state objects take messages and a clock: no I/O, no clock, no tensors": (
        (
            "zmqsync._registry",
            "zmqsync._publisher_role",
            "zmqsync._link",
            "zmqsync._admission",
            "zmqsync._handshake_queue",
            "zmqsync._worker_state",
            "zmqsync._histogram",
        ),
        (*[m for m in IO if m != "os"], "torch"),
    ),
    "buffers, layout and copies never import zmq": (
        ("zmqsync._buffers", "zmqsync._layout", "zmqsync._copy", "zmqsync._slots",
         "zmqsync._apply", "zmqsync._flat", "zmqsync._home", "zmqsync._places"),
        ("zmq",),
    ),
    "write modes reach the sockets only through the Announcer and the AckWait": (
        ("zmqsync._write_modes", "zmqsync._writes", "zmqsync._source", "zmqsync._unchanged"),
        ("zmq", "zmqsync._publisher_agent", "zmqsync._publisher"),
    ),
    "the roles never import the command line, the sniffer, the demo or the benchmarks": (
        CORE,
        ("zmqsync.cli", "zmqsync._cli", "zmqsync._inspect_view", "zmqsync._sniff",
         "zmqsync._demo", "zmqsync._worker",
         "zmqsync.metrics", "zmqsync._bus_sample", "zmqsync._top_view"),
    ),
    "the core never imports relays, integrations, or what only the CLI and extras use": (
        CORE,
        ("zmqsync.relay", "zmqsync.integrations", "rich", "matplotlib", "torchrl",
         "prometheus_client"),
    ),
}  # fmt: skip

# Imports that only the named modules may make (an extra's library, and what wraps it):
# prometheus_client is the metrics extra, imported where metrics are made and nowhere
# else, so `import zmqsync` and every other command work without it.
ONLY_IMPORTED_BY = {
    "prometheus_client": ("zmqsync.metrics", "zmqsync._cli.metrics"),
    "zmqsync.metrics": ("zmqsync._cli.metrics",),
    # the test helpers are the users' (a pytest plugin): off the library's import path
    "pytest": ("zmqsync.testing",),
    "zmqsync.testing": (),
}


def test_every_module_named_in_the_rules_exists():
    for _, (modules, _forbidden) in RULES.items():
        for prefix in modules:
            assert _matching((prefix,)), f"{prefix} is gone: update the rules and the docs"


@pytest.mark.parametrize("rule", list(RULES))
def test_import_rule(rule):
    modules, forbidden = RULES[rule]
    assert _violations(_matching(modules), forbidden) == [], rule


@pytest.mark.parametrize("imported", list(ONLY_IMPORTED_BY))
def test_imported_only_where_allowed(imported):
    others = [m for m in MODULES if m not in ONLY_IMPORTED_BY[imported] and m != imported]
    assert _violations(sorted(others), (imported,)) == [], f"only {ONLY_IMPORTED_BY[imported]}"
    for module in ONLY_IMPORTED_BY[imported]:  # the allowed ones still exist and do
        assert _violations([module], (imported,)), f"{module} no longer imports {imported}"


def test_the_rules_catch_what_they_forbid():
    # the checker itself: inspect's view does import rich, and the publisher does import zmq
    assert _violations(["zmqsync._inspect_view"], ("rich",))
    assert _violations(["zmqsync._publisher_agent"], ("zmq",))


# --- size ---------------------------------------------------------------------------------

MAX_LINES = 800  # per package module: one that grows past it holds more than one concern
# Modules over the limit (none today), each with its line count when it was listed, while
# it is being split. A count here may only go down (lower it as a split lands, drop the
# entry when the file is under the limit): the file fails the test if it grows past it.
OVER_THE_LIMIT: dict[str, int] = {}


def _sources() -> dict[str, int]:
    """Every Python and C source of the package, by path, with its line count."""
    paths = [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.c"), *PACKAGE.rglob("*.h")]
    root = PACKAGE.parent
    return {p.relative_to(root).as_posix(): len(p.read_text().splitlines()) for p in paths}


def test_no_module_grows_past_the_size_limit():
    sizes = _sources()
    too_long = {
        path: f"{lines} lines (limit {OVER_THE_LIMIT.get(path, MAX_LINES)})"
        for path, lines in sorted(sizes.items())
        if lines > OVER_THE_LIMIT.get(path, MAX_LINES)
    }
    assert too_long == {}, "split these modules (or shrink them) below the limit"


def test_the_allowlist_only_names_modules_still_over_the_limit():
    sizes = _sources()
    done = {path: sizes.get(path) for path in OVER_THE_LIMIT if sizes.get(path, 0) <= MAX_LINES}
    assert done == {}, "these are under the limit now: drop them from OVER_THE_LIMIT"


# --- measurement and import cycles --------------------------------------------------------

# What measures zmqsync lives in a checkout's tools/bench/ (`python -m tools.bench`), not in
# the wheel: the package keeps one small quick check, `zmqsync bench`. Rules as data:
# the modules of the package that measure (by name: *bench*), the lines they may hold
# together, and what no package module may import.
MEASUREMENT = {
    "modules": ("zmqsync._cli.bench",),
    "max_lines": 400,
    "never_imported": ("tools",),
}


def test_no_measurement_code_in_the_package_beyond_the_quick_check():
    named = sorted(m for m in MODULES if "bench" in m.rsplit(".", 1)[-1])
    assert named == sorted(MEASUREMENT["modules"]), "the harness belongs in tools/bench/"
    lines = sum(len(MODULES[m].read_text().splitlines()) for m in MEASUREMENT["modules"])
    assert lines <= MEASUREMENT["max_lines"], f"{lines} lines of measurement in the package"
    assert _violations(sorted(MODULES), MEASUREMENT["never_imported"]) == []


# Import cycles: none among the edges that run when a module is imported (`from .x import`
# and `from . import x` at module level, in top-level `try`/`if` blocks; not inside
# functions, not under `if TYPE_CHECKING:`). Cycles allowed, per scope, each a sorted tuple
# of modules: none, and the list may only shrink.
CYCLES_ALLOWED: dict[str, tuple[tuple[str, ...], ...]] = {"zmqsync": ()}


def _import_time_statements(body: list[ast.stmt]) -> list[ast.stmt]:
    out: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                out += _import_time_statements(node.body) + _import_time_statements(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                out += _import_time_statements(block)
        else:
            out.append(node)
    return out


def _relative_edges(name: str) -> set[str]:
    """The package modules `name` imports relatively, at import time."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in _import_time_statements(ast.parse(path.read_text()).body):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                found.add(sub if sub in MODULES else module)
    return {m for m in found if m in MODULES and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[tuple[str, ...]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


@pytest.mark.parametrize("scope", list(CYCLES_ALLOWED))
def test_no_import_cycle(scope):
    graph = {m: _relative_edges(m) for m in _matching((scope,))}
    assert _cycles(graph) == list(CYCLES_ALLOWED[scope]), "break the cycle (an import moves)"


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [("a", "b", "c")]
    assert _relative_edges("zmqsync._publisher")  # it does import its siblings
