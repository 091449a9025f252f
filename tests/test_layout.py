"""The house rules of `polar_mitm/` (issue 22) and of the repository around it (issue 45), checked
by parsing every module's imports.

Imports point down the data path: no import cycles (deferred and type-only imports count: a cycle
tied by a function-level import is still two modules that cannot be read apart); the CLI reads
the store and never pulls in the proxy's live modules; `call/` and everything else below the
addons never import `addons/`; nothing but the CLI imports the CLI (the live proxy least of all);
the store and the upstream modules are floors that import nothing of the package above them;
`store/delta.py` imports nothing of it at all (examples/trainer_checks/train_check.py loads it by
path in a venv without polar-mitm). And the package is a house of floors (`FLOOR_ORDER`), every
import pointing down or level: the shared vocabulary (`core/`: the record, redaction, SSE framing,
the hot path's JSON) on the ground floor, the CLI at the top. Parsing, not importing, so the test
is fast and sees the lazy imports too.

The repository around the package keeps the same rules one level up (`REPO_ORDER`): no cycle
anywhere (the reference server, the benchmarks, the examples, the scripts and the tests included);
the product imports nothing beside it; the reference policy server (`reference/polar_reference`)
stands on the product alone, the benchmarks (`polar_bench`) on the product and the reference
server; and `scripts/` holds shell entry points only.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "polar_mitm"

# The proxy's live modules: what only a running proxy has (its addons, the calls in flight,
# the control plane, the rollouts being merged, the fidelity stage).
LIVE = (
    "polar_mitm.addons",
    "polar_mitm.call",
    "polar_mitm.control",
    "polar_mitm.trajectory.rollouts",
    "polar_mitm.tokens.fidelity",
)


# Packages imported by their own modules only: the CLI is the top floor (it reads the shards; the
# live proxy must not load it).
PRIVATE = ("polar_mitm.cli",)
# Floors: packages that import nothing of polar_mitm outside themselves (the package root, for its
# version, aside): the store is what every reader needs without the proxy, and an upstream module
# knows one server's wire, nothing of the proxy.
FLOORS = ("polar_mitm.store", "polar_mitm.upstream")
# The floors, lowest first: a module imports only modules on its own floor or below (no cycles
# within a floor either: see `cycles`). Each entry is a package or a module, and a module's floor
# is its longest entry; the package root ("polar_mitm", for its version) is matched alone.
FLOOR_ORDER: tuple[tuple[str, ...], ...] = (
    # import nothing of the package: the store floor (whose `delta` module is loaded by path, so
    # the record names the store's row key, not the other way round), one server's wire, the
    # output parsers, the bundled assets and the CA certificate
    (
        PACKAGE,
        "polar_mitm.store",
        "polar_mitm.upstream",
        "polar_mitm.output_parsers",
        "polar_mitm.assets",
        "polar_mitm.certs",
    ),
    ("polar_mitm.core",),  # the shared vocabulary: the call record, redaction, SSE, fast JSON
    ("polar_mitm.dialects",),  # one harness wire API each
    ("polar_mitm.tokens",),  # the tokenizer, drift, the fidelity checks
    ("polar_mitm.trajectory",),  # the merge, the rollouts, trace rows read back
    ("polar_mitm.call",),  # one call in flight: the gateway and the exchange
    (
        "polar_mitm.metrics",
        "polar_mitm.control",
        "polar_mitm.control_client",
        "polar_mitm.tokenizer_record",
    ),
    ("polar_mitm.export", "polar_mitm.nemo_gym"),
    ("polar_mitm.addons",),  # the mitmproxy addons, composed by addons/polar.py
    ("polar_mitm.cli",),  # the top floor
)
# Modules loaded by path where polar_mitm is not installed: no import of the package at all, and
# of other distributions only these (examples/trainer_checks/train_check.py's trainer venv has
# numpy, pyarrow).
STANDALONE = {"polar_mitm.store.delta": {"numpy", "pyarrow"}}


def modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Every module under `root/polar_mitm`: dotted name -> (file, is a package's __init__)."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def import_graph(
    root: Path, mods: dict[str, tuple[Path, bool]] | None = None
) -> dict[str, set[str]]:
    """Module -> the modules of `mods` (default: polar_mitm's) it imports (anywhere in the file;
    `from a import b` counts as importing `a.b` when that is a module). Parent packages a dotted
    import loads implicitly are not edges: every `__init__` would otherwise import its own
    children's users. A script (a name ``folder/stem``: see `repo_modules`) imports the scripts of
    its own folder by their bare names."""
    mods = modules(root) if mods is None else mods
    graph: dict[str, set[str]] = {}
    for name, (path, is_pkg) in mods.items():
        folder = name.rpartition("/")[0] + "/" if "/" in name else ""
        package = "" if folder else name if is_pkg else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods]
                edges.update(subs)
                if len(subs) < len(node.names):
                    edges.add(target)
        if folder:
            edges = {folder + e if folder + e in mods else e for e in edges}
        graph[name] = {e for e in edges if e in mods and e != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def reach(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module `start` imports, directly or not -> the module that imports it (for the message)."""
    seen: dict[str, str] = {}
    todo = [start]
    while todo:
        v = todo.pop()
        for w in sorted(graph[v]):
            if w not in seen and w != start:
                seen[w] = v
                todo.append(w)
    return seen


def under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def floor_of(module: str) -> int | None:
    """The index of `module`'s floor in `FLOOR_ORDER` (None: on no floor)."""
    best: tuple[int, int] | None = None  # (length of the entry, floor)
    for floor, entries in enumerate(FLOOR_ORDER):
        for entry in entries:
            hit = module == entry or (entry != PACKAGE and module.startswith(entry + "."))
            if hit and (best is None or len(entry) > best[0]):
                best = (len(entry), floor)
    return best[1] if best is not None else None


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module on a higher floor, and every module on no floor."""
    out = []
    for module in sorted(graph):
        mine = floor_of(module)
        if mine is None:
            out.append(f"{module} is on no floor: add it to FLOOR_ORDER")
            continue
        for target in sorted(graph[module]):
            theirs = floor_of(target)
            if theirs is not None and theirs > mine:
                out.append(
                    f"{module} imports {target}: an upward import (floor {mine} -> {theirs})"
                )
    return out


def violations(root: Path) -> list[str]:
    """Every broken house rule, one line each (empty when the tree keeps them all)."""
    graph = import_graph(root)
    out = [f"import cycle: {' <-> '.join(c)}" for c in cycles(graph)]
    out.extend(upward(graph))
    for module in sorted(graph):
        if under(module, ("polar_mitm.cli",)):
            rule, banned = "the CLI reads the store, never the proxy's live modules", LIVE
        elif not under(module, ("polar_mitm.addons",)):
            rule, banned = "only addons/ imports addons/", ("polar_mitm.addons",)
        else:
            continue
        for target, via in sorted(reach(graph, module).items()):
            if under(target, banned):
                out.append(f"{module} imports {target} (via {via}): {rule}")
    for module in sorted(graph):
        for target in sorted(graph[module]):
            owner = next((p for p in PRIVATE if under(target, (p,))), None)
            if owner is not None and not under(module, (owner,)):
                out.append(f"{module} imports {target}: only {owner} imports {owner}")
            floor = next((f for f in FLOORS if under(module, (f,))), None)
            if floor is not None and target != PACKAGE and not under(target, (floor,)):
                out.append(f"{module} imports {target}: {floor} is a floor")
    for module, allowed in STANDALONE.items():
        if module in graph:
            out.extend(f"{module} imports {m}: it is loaded by path" for m in sorted(graph[module]))
            foreign = third_party(root, module) - allowed
            out.extend(f"{module} imports {m}: it is loaded by path" for m in sorted(foreign))
    return out


def third_party(root: Path, module: str) -> set[str]:
    """The distributions a module imports: top-level names neither stdlib nor the package."""
    path = root / (module.replace(".", "/") + ".py")
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"__future__", PACKAGE}


def test_polar_mitm_keeps_the_house_rules() -> None:
    found = violations(ROOT)
    assert not found, "\n".join(found)


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / PACKAGE / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for d in [p for p in (tmp_path / PACKAGE).rglob("*") if p.is_dir()] + [tmp_path / PACKAGE]:
        (d / "__init__.py").touch()
    return tmp_path


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (  # a cycle tied by a deferred import
            {
                "store/writer.py": "from .recovery import scan\n",
                "store/recovery.py": "def recover():\n    from .writer import Store\n",
            },
            "import cycle: polar_mitm.store.recovery <-> polar_mitm.store.writer",
        ),
        (  # the CLI reaching a live module through a helper
            {
                "cli/app.py": "from polar_mitm.tokens import helper\n",
                "tokens/helper.py": "from ..call.exchange import Call\n",
                "call/exchange.py": "",
            },
            "polar_mitm.cli.app imports polar_mitm.call.exchange (via polar_mitm.tokens.helper)",
        ),
        (  # a call module importing an addon, by `import`
            {"call/exchange.py": "import polar_mitm.addons.capture\n", "addons/capture.py": ""},
            "polar_mitm.call.exchange imports polar_mitm.addons.capture",
        ),
        (  # `from package import module` is an edge to the module
            {"call/gateway.py": "from ..addons import store\n", "addons/store.py": ""},
            "polar_mitm.call.gateway imports polar_mitm.addons.store",
        ),
        (  # the live proxy's metrics borrowing a CLI helper
            {"metrics.py": "from .cli.summary import checked\n", "cli/summary.py": ""},
            "polar_mitm.metrics imports polar_mitm.cli.summary: only polar_mitm.cli imports",
        ),
        (  # the store reaching up into the proxy
            {"store/writer.py": "from ..tokens import count\n", "tokens/count.py": ""},
            "polar_mitm.store.writer imports polar_mitm.tokens.count: polar_mitm.store is a floor",
        ),
        (  # the shared vocabulary reaching up into a call in flight
            {"core/record.py": "from ..call.exchange import Call\n", "call/exchange.py": ""},
            "polar_mitm.core.record imports polar_mitm.call.exchange: an upward import",
        ),
        (  # a dialect borrowing from the merge, one floor up, by a deferred import
            {
                "dialects/openai_chat.py": "def f():\n    from ..trajectory import merge\n",
                "trajectory/merge.py": "",
            },
            "polar_mitm.dialects.openai_chat imports polar_mitm.trajectory.merge: an upward",
        ),
        (  # a new room nobody placed
            {"attic/box.py": ""},
            "polar_mitm.attic is on no floor",
        ),
        (  # the module the trainer venv loads by path, importing the package
            {"store/delta.py": "from . import schema\n", "store/schema.py": ""},
            "polar_mitm.store.delta imports polar_mitm.store.schema: it is loaded by path",
        ),
        (  # ... or a distribution that venv does not have
            {"store/delta.py": "import msgpack\n"},
            "polar_mitm.store.delta imports msgpack: it is loaded by path",
        ),
    ],
)
def test_a_planted_violation_is_found(tmp_path: Path, files: dict[str, str], expected: str) -> None:
    found = violations(_plant(tmp_path, files))
    assert any(line.startswith(expected) for line in found), found
    # and the same tree without the planted files keeps the rules
    assert violations(_plant(tmp_path / "clean", {"store/writer.py": ""})) == []


# -- the repository: no cycle anywhere, the product alone in its package -------------------------

# The repository's importable packages and the folder each is imported from. The reference policy
# server has its own pyproject in reference/ (installed by the test and demo set-up); the
# benchmarks run from a checkout (`python -m polar_bench`).
REPO_PACKAGES = {PACKAGE: ".", "polar_reference": "reference", "polar_bench": ".", "tests": "."}
# The packages lowest first: each imports only itself and those before it. Everything else (the
# tests, each folder of scripts: examples/..., addons/, the NeMo Gym entry points) stands above
# them all and is imported by nobody outside itself.
REPO_ORDER = (PACKAGE, "polar_reference", "polar_bench")
# Folders of shell entry points: no Python in them (a script's code lives in a package or in
# examples/).
SHELL_ONLY = ("scripts",)


def _skipped(rel: Path) -> bool:
    return any(p.startswith(".") or p in ("node_modules", "__pycache__") for p in rel.parts)


def repo_modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Every module of the repository: a package's by its dotted name (see `modules`), any other
    .py file, a script run by path, as ``folder/stem`` (its folder is on sys.path when it runs)."""
    out: dict[str, tuple[Path, bool]] = {}
    homes = []
    for name, home in REPO_PACKAGES.items():
        base = root / home
        homes.append(base / name)
        for path in sorted((base / name).rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if not _skipped(rel) and not any(path.is_relative_to(h) for h in homes):
            out[f"{rel.parent.as_posix()}/{rel.stem}"] = (path, False)
    return out


def part_of(module: str) -> str:
    """The part of the repository a module belongs to: its package, or its scripts' folder."""
    return module.rpartition("/")[0] + "/" if "/" in module else module.split(".")[0]


def repo_violations(root: Path) -> list[str]:
    """Every broken rule of the repository around the package, one line each."""
    graph = import_graph(root, repo_modules(root))
    out = [f"import cycle: {' <-> '.join(c)}" for c in cycles(graph)]
    rank = {name: i for i, name in enumerate(REPO_ORDER)}
    for module in sorted(graph):
        mine = part_of(module)
        for target in sorted(graph[module]):
            theirs = part_of(target)
            if theirs == mine:
                continue
            if theirs not in rank:
                out.append(f"{module} imports {target}: only {theirs} imports {theirs}")
            elif mine in rank and rank[theirs] > rank[mine]:
                out.append(f"{module} imports {target}: {mine} stands below {theirs}")
    for folder in SHELL_ONLY:
        for path in sorted((root / folder).glob("*.py")):
            out.append(f"{path.relative_to(root)}: {folder}/ holds shell entry points only")
    return out


def test_the_repository_keeps_the_house_rules() -> None:
    found = repo_violations(ROOT)
    assert not found, "\n".join(found)


def test_a_plain_install_packages_the_product_alone() -> None:
    """`pip install polar-mitm` finds polar_mitm's packages and nothing else: the reference server
    and the benchmarks cannot ride along in the wheel."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["packages"]["find"]["include"] == [f"{PACKAGE}*"]
    assert all(key.split(".")[0] == PACKAGE for key in config.get("package-data", {}))
    assert not (ROOT / PACKAGE / "policy_server").exists()


def _plant_repo(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (  # two benchmark scenarios that import each other (bench.py <-> bench_long.py was one)
            {
                "polar_bench/core.py": "from polar_bench.long import Session\n",
                "polar_bench/long.py": "def f():\n    from .core import Target\n",
            },
            "import cycle: polar_bench.core <-> polar_bench.long",
        ),
        (  # two scripts of one folder (train_check.py <-> verl_check.py was one)
            {
                "examples/checks/train_check.py": "def f():\n    import verl_check\n",
                "examples/checks/verl_check.py": "from train_check import stats\n",
            },
            "import cycle: examples/checks/train_check <-> examples/checks/verl_check",
        ),
        (  # the product borrowing from the reference server
            {
                "polar_mitm/tokens/render.py": "from polar_reference.render import Renderer\n",
                "reference/polar_reference/render.py": "",
            },
            "polar_mitm.tokens.render imports polar_reference.render: polar_mitm stands below",
        ),
        (  # the reference server borrowing from the benchmarks
            {
                "reference/polar_reference/server.py": "from polar_bench import core\n",
                "polar_bench/core.py": "",
            },
            "polar_reference.server imports polar_bench.core: polar_reference stands below",
        ),
        (  # a benchmark borrowing a test helper
            {
                "polar_bench/core.py": "from tests.helpers import procs\n",
                "tests/helpers/procs.py": "",
            },
            "polar_bench.core imports tests.helpers.procs: only tests imports tests",
        ),
        (  # Python back in scripts/
            {"scripts/bench.py": ""},
            "scripts/bench.py: scripts/ holds shell entry points only",
        ),
    ],
)
def test_a_planted_repository_violation_is_found(
    tmp_path: Path, files: dict[str, str], expected: str
) -> None:
    found = repo_violations(_plant_repo(tmp_path, files))
    assert any(line.startswith(expected) for line in found), found
    clean = {"polar_bench/core.py": "import polar_reference.server\n", "scripts/x.sh": ""}
    clean["reference/polar_reference/server.py"] = "from polar_mitm.core import sse\n"
    clean["polar_mitm/core/sse.py"] = ""
    assert repo_violations(_plant_repo(tmp_path / "clean", clean)) == []


# -- size: a module is read in one sitting --------------------------------------------------------

MAX_MODULE_LINES = 700


# The code held to the function-size rule: the product and the reference server. The module-size
# rule also covers the benchmarks and examples/.
SIZED = (PACKAGE, "reference/polar_reference")


def _sized_files(root: Path, folders: tuple[str, ...] = SIZED) -> list[Path]:
    return [p for folder in folders for p in sorted((root / folder).rglob("*.py"))]


def long_modules(root: Path) -> list[str]:
    """Every module of `SIZED`, polar_bench/ and examples/ longer than `MAX_MODULE_LINES`."""
    out = []
    for path in _sized_files(root, (*SIZED, "polar_bench", "examples")):
        n = len(path.read_text().splitlines())
        if n > MAX_MODULE_LINES:
            out.append(f"{path.relative_to(root)}: {n} lines (at most {MAX_MODULE_LINES})")
    return out


def test_no_module_is_over_700_lines() -> None:
    found = long_modules(ROOT)
    assert not found, "\n".join(found)


def test_a_planted_long_module_is_found(tmp_path: Path) -> None:
    root = _plant(tmp_path, {"call/exchange.py": "x = 1\n" * (MAX_MODULE_LINES + 1)})
    assert long_modules(root) == ["polar_mitm/call/exchange.py: 701 lines (at most 700)"]


# -- size: a function is read at a glance ---------------------------------------------------------

MAX_FUNCTION_LINES = 60
# Functions allowed past the limit, each with why it stays whole (or what splitting it waits for).
# An entry that no longer exists, or is back under the limit, fails the test: take it out.
LONG_FUNCTIONS = {
    "polar_mitm/store/writer.py:Store.__init__": "the Store's whole state, each field commented",
    "polar_mitm/store/writer.py:Store.close": "the shutdown order of the two threads, one sequence",
    "polar_mitm/store/recovery.py:scan_journal": "one pass over the segments, its cases in order",
    "reference/polar_reference/vllm_wire.py:VllmWire._stream": "test tool: vLLM's chunks in order",
    "reference/polar_reference/vllm_wire.py:VllmWire.parse_chat": "test tool: vLLM's checks in order",
    "reference/polar_reference/sglang_wire.py:SglangWire._stream": "test tool: SGLang's chunks",
    "reference/polar_reference/sglang_wire.py:SglangWire.chat_reply": "test tool: SGLang's reply",
    "reference/polar_reference/server.py:PolicyServer.play": "test tool: one scripted turn's knobs",
    "reference/polar_reference/completions.py:completion_plan": "test tool: the request's fields",
    "reference/polar_reference/cli.py:policy_server": "test tool: a click command's options",
    "polar_mitm/nemo_gym/agent.py:PolarMitmAgent._rollout": "one Gym rollout's steps, in order",
    "polar_mitm/dialects/openai_responses.py:OpenAIResponses.parse": "the request's fields in order",
    "polar_mitm/dialects/anthropic_messages.py:AnthropicMessages.parse": "the request's fields",
    "polar_mitm/cli/fidelity_report.py:fidelity": "one report's rows, read top to bottom",
    "polar_mitm/cli/show.py:header": "one trace's header lines, in the order shown",
    "polar_mitm/cli/report_html.py:render": "one HTML page's sections, in the order shown",
    "polar_mitm/cli/app.py:export": "a click command: its options and their checks",
    "polar_mitm/cli/app.py:show": "a click command: its options and their checks",
    "polar_mitm/tokens/fidelity.py:rerender_checks": "one walk over the turns; to split next",
    "polar_mitm/tokens/fidelity.py:local_checks": "the call's own checks, one after another",
    "polar_mitm/control.py:ControlAPI._route": "the control plane's routes, one table",
    "polar_mitm/call/exchange.py:Call._fill": "the record's fields from the tally; to split next",
    "polar_mitm/trajectory/exact_prefix.py:ExactPrefix.plan": "the token-in plan's cases in order",
}


def long_functions(root: Path) -> dict[str, int]:
    """Every function of `SIZED` longer than `MAX_FUNCTION_LINES` (its `def` line to its last,
    decorators aside) -> its length, as ``path:Class.method``."""
    out: dict[str, int] = {}

    def walk(node: ast.AST, rel: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                n = (child.end_lineno or child.lineno) - child.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out[f"{rel}:{name}"] = n
                walk(child, rel, name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, rel, prefix + child.name + ".")

    for path in _sized_files(root):
        walk(ast.parse(path.read_text(), str(path)), str(path.relative_to(root)), "")
    return out


def function_violations(root: Path, allowed: dict[str, str]) -> list[str]:
    found = long_functions(root)
    out = [
        f"{name}: {n} lines (at most {MAX_FUNCTION_LINES}): split it into named steps"
        for name, n in sorted(found.items())
        if name not in allowed
    ]
    out.extend(
        f"{name}: allowed to be long but is not (any more): take it out of LONG_FUNCTIONS"
        for name in sorted(allowed)
        if name not in found
    )
    return out


def test_no_function_is_over_60_lines_unless_allowed() -> None:
    found = function_violations(ROOT, LONG_FUNCTIONS)
    assert not found, "\n".join(found)


def test_a_planted_long_function_and_a_stale_allowance_are_found(tmp_path: Path) -> None:
    body = "".join(f"        x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    root = _plant(tmp_path, {"call/exchange.py": f"class Call:\n    def run(self):\n{body}"})
    found = function_violations(root, {"polar_mitm/call/gone.py:f": "was long"})
    assert found == [
        "polar_mitm/call/exchange.py:Call.run: 61 lines (at most 60): split it into named steps",
        "polar_mitm/call/gone.py:f: allowed to be long but is not (any more): take it out of "
        "LONG_FUNCTIONS",
    ]
