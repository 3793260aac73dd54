"""The import rules of docs/architecture.md, checked on the source (every import, also the
ones inside functions): a module map is only worth what keeps it true."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
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


# --- whole import chains -------------------------------------------------------------------

# Modules whose whole import chain stays clear of some libraries: every package module they
# import, what those import in turn (inside functions too), and the `__init__` of each
# subpackage on the way, which Python runs first (`_buffers/__init__` loads torch). The
# package's own `__init__` is left out: it is the public surface and loads torch for every
# `import zmqsync`; these rules say what a module itself needs.
CHAINS_FREE_OF = {
    "the state objects and the protocol load no tensors, through nothing they import": (
        (
            "zmqsync._publisher_role",
            "zmqsync._registry",
            "zmqsync._registration",
            "zmqsync._link",
            "zmqsync._admission",
            "zmqsync._handshake_queue",
            "zmqsync._worker_state",
            "zmqsync._histogram",
            "zmqsync._protocol",
            "zmqsync._checks",
            "zmqsync._fast_frames",
        ),
        ("torch", "tensordict", "numpy"),
    ),
}


def _loaded_by(imported: str) -> list[str]:
    """The package modules that `imported` runs: each subpackage on its path (the root
    package aside, see above), then the module itself."""
    parts = imported.split(".")
    if parts[0] != PACKAGE.name:
        return []
    names = (".".join(parts[:i]) for i in range(2, len(parts) + 1))
    return [n for n in names if n in MODULES]


def _chain(name: str) -> dict[str, str]:
    """Every package module that importing `name` runs, each with the one that pulled it
    in ("" for `name` and the subpackages above it)."""
    seen = dict.fromkeys(_loaded_by(name), "")
    todo = list(seen)
    while todo:
        module = todo.pop()
        for imported in sorted(_imports(module)):
            for loaded in _loaded_by(imported):
                if loaded not in seen:
                    seen[loaded] = module
                    todo.append(loaded)
    return seen


def _chain_violations(name: str, forbidden: tuple[str, ...]) -> list[str]:
    """How `name` comes to import something `forbidden`: one line per import, with the
    chain of modules that leads there."""
    chain = _chain(name)

    def path(module: str) -> str:
        steps = [module]
        while chain[steps[-1]]:
            steps.append(chain[steps[-1]])
        return " -> ".join(reversed(steps))

    return [
        f"{path(module)} imports {imported}"
        for module in sorted(chain)
        for imported in sorted(_imports(module))
        if any(imported == f or imported.startswith(f + ".") for f in forbidden)
    ]


@pytest.mark.parametrize("rule", list(CHAINS_FREE_OF))
def test_whole_import_chains_stay_clear(rule):
    modules, forbidden = CHAINS_FREE_OF[rule]
    assert [v for m in modules for v in _chain_violations(m, forbidden)] == [], rule


@pytest.mark.parametrize("module", [m for modules, _ in CHAINS_FREE_OF.values() for m in modules])
def test_whole_import_chains_stay_clear_when_imported(module):
    """The same, as Python runs it: the package's `__init__` replaced by an empty package
    of the same path, so that only the module's own chain is imported."""
    forbidden = next(f for modules, f in CHAINS_FREE_OF.values() if module in modules)
    code = (
        "import importlib, sys, types\n"
        f"root = types.ModuleType({PACKAGE.name!r})\n"
        f"root.__path__ = [{str(PACKAGE)!r}]\n"
        f"sys.modules[{PACKAGE.name!r}] = root\n"
        f"importlib.import_module({module!r})\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(forbidden)!r}))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", f"{module} loads {run.stdout.strip()}"


def test_the_chains_are_followed_through_subpackages():
    # the checker itself: the buffers' transport rules load no torch, but their package does
    assert "torch" not in {i.split(".")[0] for i in _imports("zmqsync._buffers.transport")}
    found = _chain_violations("zmqsync._buffers.transport", ("torch",))
    assert found and all(v.startswith("zmqsync._buffers -> ") for v in found), found
    assert _chain("zmqsync._publisher_role")["zmqsync._registration"] == "zmqsync._publisher_role"


# --- the publisher role's seam ------------------------------------------------------------

ROLE_NAMES = ("role", "_role")  # how the package names the publisher's role, wherever held
# What of the role only the named modules touch. Its registry: a publish, the agent and
# the publisher ask the role, by what they need (a free slot, who acked, ...). Its
# counters: bumped only by its methods (`count`, `timed_out`, `published`, ...); anyone
# may read them.
ROLE_SEAM = {
    "registry": ("any use", ("zmqsync._publisher_role", "zmqsync._registry")),
    "counters": ("a change", ("zmqsync._publisher_role",)),
}
_CHANGES = ("update", "clear", "pop", "popitem", "setdefault", "subtract", "__setitem__")


def _of_role(node: ast.AST, attr: str) -> bool:
    """Whether `node` is `<...>.role.<attr>` (or `role.<attr>`, `self._role.<attr>`)."""
    if not (isinstance(node, ast.Attribute) and node.attr == attr):
        return False
    held = node.value
    return (isinstance(held, ast.Name) and held.id in ROLE_NAMES) or (
        isinstance(held, ast.Attribute) and held.attr in ROLE_NAMES
    )


def _seam_crossings(source: str) -> list[str]:
    """Every line of `source` that uses what `ROLE_SEAM` keeps to the role's modules."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        for attr, (what, _) in ROLE_SEAM.items():
            if what == "any use":
                hit = _of_role(node, attr)
            elif isinstance(node, ast.Subscript):  # counters[k] += 1, = v, del
                hit = _of_role(node.value, attr) and not isinstance(node.ctx, ast.Load)
            else:  # counters.update(...)
                hit = (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in _CHANGES
                    and _of_role(node.func.value, attr)
                )
            if hit:
                found.append((node.lineno, f"line {node.lineno}: {what} of the role's {attr}"))
    return [line for _, line in sorted(found)]


@pytest.mark.parametrize("attr", list(ROLE_SEAM))
def test_only_the_role_reaches_its_registry_and_bumps_its_counters(attr):
    allowed = ROLE_SEAM[attr][1]
    bad = [
        f"{module} {line}"
        for module, path in sorted(MODULES.items())
        if module not in allowed
        for line in _seam_crossings(path.read_text())
        if line.endswith(f" {attr}")
    ]
    assert bad == [], f"ask the role (zmqsync/_publisher_role.py) instead: {allowed}"
    for module in allowed:
        assert module in MODULES, f"{module} is gone: update ROLE_SEAM"


def test_the_seam_check_catches_what_it_forbids():
    # the checker itself, on what the publish path used to do
    crossings = _seam_crossings(
        "self._registry = shared.role.registry\n"
        "role.registry.record(1, 0)\n"
        'self._shared.role.counters["timeouts"] += 1\n'
        "self.role.counters.update(acks=1)\n"
        "counts = dict(self._role.counters)\n"  # a read: allowed
        'self.counters["acks"] += 1\n'  # an object's own counters: allowed
    )
    assert crossings == [
        "line 1: any use of the role's registry",
        "line 2: any use of the role's registry",
        "line 3: a change of the role's counters",
        "line 4: a change of the role's counters",
    ]


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


# --- constructor size --------------------------------------------------------------------

# The most parameters each public constructor takes: options that belong together go
# into one small frozen object holding only those that apply (`writes=Copy(...)`,
# `security=Security(...)`, a relay's `tree=Branch(...)`), instead of a long flat list.
MAX_PARAMETERS = [
    ("Publisher", 10),
    ("Relay", 10),
    ("RelayRoot", 10),
    ("Subscriber", 8),
]


@pytest.mark.parametrize(("cls", "limit"), MAX_PARAMETERS)
def test_public_constructors_stay_small(cls, limit):
    import zmqsync  # here: the import rules above need only the source

    params = inspect.signature(getattr(zmqsync, cls)).parameters
    assert len(params) <= limit, f"{cls} takes {len(params)} parameters: {list(params)}"


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


# The harness (tools/bench) has no import cycle either, counting every import: inside
# functions, under `if TYPE_CHECKING:` (a type hint that goes both ways is a cycle too),
# and the bare `from roles import ...` of the scripts its role processes run by path.
HARNESS = PACKAGE.parent / "tools" / "bench"


def _harness_graph() -> dict[str, set[str]]:
    modules = {}
    for path in HARNESS.rglob("*.py"):
        parts = ("tools", *path.relative_to(HARNESS.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join([*parts, *([module] if module else [])])
                names = [module, *(f"{module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for imported in names:
                for candidate in (imported, f"tools.bench.{imported}", f"{package}.{imported}"):
                    if candidate in modules:
                        found.add(candidate)
                        break
        graph[name] = found - {name}
    return graph


def test_the_harness_has_no_import_cycle():
    graph = _harness_graph()
    assert "tools.bench.grid.results" in graph["tools.bench.grid.report"]  # edges are seen
    assert "tools.bench.roles" in graph["tools.bench.fixed.rounds"]  # by-path ones too
    assert _cycles(graph) == [], "break the cycle (an import moves)"


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [("a", "b", "c")]
    assert _relative_edges("zmqsync._publisher")  # it does import its siblings


# Whom a peer trusts is `security=Security(...)`'s, on every public class alike.
LOOSE_SECURITY = ("curve", "insecure", "tap", "publisher_uid", "group", "max_workers")


@pytest.mark.parametrize("cls", [entry[0] for entry in MAX_PARAMETERS])
def test_no_public_class_takes_a_loose_security_knob(cls):
    import zmqsync

    params = set(inspect.signature(getattr(zmqsync, cls)).parameters)
    assert "security" in params
    assert not params & set(LOOSE_SECURITY), f"{cls}: use security=Security(...)"


# tools/bench is on sys.path of the harness's processes (and of a test process that
# imported a scenario, whose children inherit it): a script there named like an
# installed package hides it (tools/bench/vllm.py once made torchrl's collectors import
# it as vllm and crash at start).
SHADOWED = ("vllm", "torch", "torchrl", "tensordict", "zmq", "msgpack", "rich", "matplotlib")


def test_no_harness_module_is_named_like_a_package():
    names = {p.stem for p in HARNESS.rglob("*.py")} | {
        p.name for p in HARNESS.iterdir() if p.is_dir()
    }
    assert not names & set(SHADOWED), sorted(names & set(SHADOWED))
