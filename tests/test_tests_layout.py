"""Where tests live (issue 34): unit tests at the top of tests/, end-to-end tests under tests/e2e/,
the modules they share under tests/helpers/. Checked by parsing, not importing, so it is fast.

- A test module at the top of tests/ starts no process of ours: it imports neither the process
  helpers (`tests.helpers.procs`, `tests.helpers.capture_session`) nor anything of the end-to-end
  packages, takes neither `make_mitm` nor `make_policy_server`, and names neither `mitmdump` nor
  `-m polar_reference` on a command line. Tests that do belong in tests/e2e/loopback/
  (our own processes) or tests/e2e/ (the real harnesses); tests/faults/ and tests/vllm/ are tiers
  of their own that start processes too.
- No `*_e2e.py` outside tests/e2e/.
- A module that is not a test, a conftest or a package's `__init__` is in tests/helpers/, or is
  one of the subpackages' own helpers listed in `OWN_HELPERS`.
- Every pattern of the time limits (`TIERS`) and xdist groups (`GROUPS`) still names a test file:
  a test moved elsewhere would silently lose its limit or its group.
"""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import pytest

from tests.helpers import TESTS
from tests.helpers.time_limits import TIERS
from tests.helpers.xdist_groups import GROUPS

# Helpers that start mitmdump or the reference policy server (or a whole session of both).
PROCESS_HELPERS = ("tests.helpers.procs", "tests.helpers.capture_session")
# Packages whose modules start processes: importing one pulls its processes in.
PROCESS_PACKAGES = ("tests.e2e", "tests.faults", "tests.vllm")
PROCESS_FIXTURES = {"make_mitm", "make_policy_server"}
# The subpackages' own helper modules (used by that subpackage's tests only).
OWN_HELPERS = {
    "tests/e2e/gym_check.py",  # runs in NeMo Gym's venv: the items a Gym run returned
    "tests/e2e/harnesses.py",  # the pinned npm harnesses: install, run
    "tests/e2e/netns.py",  # a network namespace per harness run
    "tests/e2e/record_wire.py",  # `python -m tests.e2e.record_wire`: tests/fixtures/harness/
    "tests/e2e/wire_capture.py",  # its stand-alone capture addon
    "tests/faults/dialects.py",
    "tests/faults/fuzzing.py",
    "tests/faults/harness.py",
    "tests/vllm/checks.py",
    "tests/vllm/recorder.py",
    "tests/loop/weights_util.py",  # checkpoints made and broken for the weight-push tests
}
SELF = "tests/test_tests_layout.py"  # it names what it looks for: not checked for it
DATA = ("tests/fixtures/", "tests/golden/", "tests/scenarios/", "tests/e2e/npm/")


def python_files(tests: Path) -> list[str]:
    root = tests.parent
    files = (p.relative_to(root).as_posix() for p in sorted(tests.rglob("*.py")))
    return [f for f in files if not f.startswith(DATA)]


def imported(tree: ast.Module, module: str) -> set[str]:
    """The modules a file imports (anywhere in it), relative imports resolved against `module`."""
    package = module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def starts_processes(path: Path, module: str) -> list[str]:
    """Why the module at `path` starts processes of ours (empty: it does not)."""
    tree = ast.parse(path.read_text(), str(path))
    hits = {
        name
        for name in imported(tree, module)
        if any(name == p or name.startswith(p + ".") for p in PROCESS_HELPERS + PROCESS_PACKAGES)
    }  # `from a import b` is both `a` and `a.b`: named once, as `a`
    why = [f"imports {n}" for n in sorted(hits) if not any(n.startswith(h + ".") for h in hits)]
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = {a.arg for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]}
            why += [f"{node.name}() takes {a}" for a in sorted(args & PROCESS_FIXTURES)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value == "mitmdump" or node.value.endswith("/mitmdump"):
                why.append(f"line {node.lineno} runs mitmdump")
        elif isinstance(node, ast.List | ast.Tuple):
            words = [e.value for e in node.elts if isinstance(e, ast.Constant)]
            if any(words[i : i + 2] == ["-m", "polar_reference"] for i in range(len(words))):
                why.append(f"line {node.lineno} runs the policy server")
    return why


def violations(tests: Path) -> list[str]:
    out = []
    for rel in python_files(tests):
        parts = rel.split("/")
        name = parts[-1]
        is_test = name.startswith("test_")
        if name.endswith("_e2e.py") and parts[1] != "e2e":
            out.append(f"{rel}: an end-to-end test outside tests/e2e/")
        if len(parts) == 2 and is_test and rel != SELF:
            module = rel.removesuffix(".py").replace("/", ".")
            out += [
                f"{rel} {why}: an end-to-end test, for tests/e2e/loopback/"
                for why in starts_processes(tests.parent / rel, module)
            ]
        helper = not (is_test or name in ("conftest.py", "__init__.py"))
        if helper and parts[1] != "helpers" and rel not in OWN_HELPERS:
            out.append(f"{rel}: a helper module outside tests/helpers/ (or OWN_HELPERS)")
    return out


def stale_patterns(tests: Path) -> list[str]:
    files = [f for f in python_files(tests) if f.rsplit("/", 1)[-1].startswith("test_")]
    return [
        f"{table} {pattern!r} names no test file"
        for table, patterns in (("TIERS", TIERS), ("GROUPS", GROUPS))
        for pattern, _ in patterns
        if not any(fnmatch.fnmatch(f, pattern) for f in files)
    ]


def test_tests_keep_their_places() -> None:
    assert violations(TESTS) == []
    assert set(python_files(TESTS)) >= OWN_HELPERS, "OWN_HELPERS names a file that is gone"


def test_every_time_limit_and_group_pattern_names_a_test_file() -> None:
    assert stale_patterns(TESTS) == []


@pytest.mark.parametrize(
    ("rel", "text", "expected"),
    [
        (
            "tests/test_x.py",
            "from tests.helpers.procs import start_mitm\n",
            "imports tests.helpers",
        ),
        ("tests/test_x.py", "from .helpers.capture_session import produce\n", "imports tests.help"),
        ("tests/test_x.py", "from .e2e.loopback.test_capture_e2e import calls_of\n", "imports te"),
        ("tests/test_x.py", "def test_a(make_mitm):\n    pass\n", "test_a() takes make_mitm"),
        ("tests/test_x.py", "import subprocess\nsubprocess.run(['mitmdump'])\n", "runs mitmdump"),
        ("tests/test_x.py", "A = ['python', '-m', 'polar_reference']\n", "policy server"),
        ("tests/test_x_e2e.py", "", "an end-to-end test outside tests/e2e/"),
        ("tests/vllm/test_x_e2e.py", "", "an end-to-end test outside tests/e2e/"),
        ("tests/procs.py", "", "a helper module outside tests/helpers/"),
        ("tests/e2e/loopback/clients.py", "", "a helper module outside tests/helpers/"),
    ],
)
def test_a_misplaced_module_is_found(tmp_path: Path, rel: str, text: str, expected: str) -> None:
    (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / rel).write_text(text)
    (tmp_path / "tests/test_fine.py").write_text(
        "from tests.helpers.clients import http_client\nfrom .test_store import call_row\n"
        "def test_b(tmp_path):\n    '''mitmdump, python -m polar_reference'''\n"
    )
    (tmp_path / "tests/e2e/loopback").mkdir(parents=True, exist_ok=True)
    (tmp_path / "tests/e2e/loopback/test_y_e2e.py").write_text("def test_c(make_mitm): pass\n")
    found = violations(tmp_path / "tests")
    assert len(found) == 1 and expected in found[0], found
