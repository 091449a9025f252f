"""What the tests share that is not a test: clients, real processes, waits, upstream truths, and the
pytest plugins (time limits, xdist groups, run-wide servers) that tests/conftest.py loads."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
TESTS = ROOT / "tests"
