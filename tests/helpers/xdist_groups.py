"""Which tests share a pytest-xdist worker (a plugin; scripts/test.sh runs `-n 2 --dist loadgroup`).

Under `--dist loadgroup` every test carrying `@pytest.mark.xdist_group(name)` runs on the same
worker, one after another; the rest are spread one test at a time. A test that sets no group gets
its directory's or file's (`GROUPS`), first match wins: tests that would get in each other's way
side by side (network namespaces picked from one host-wide pool of subnets, two CPU-bound model
servers at once) or that would each start the same expensive module-wide server on both workers.
Without xdist the marks do nothing. Paths are fnmatch patterns (`*` also matches `/`:
`tests/e2e/test_*` is the real-harness tests at the top of tests/e2e/, not tests/e2e/loopback/).
"""

from __future__ import annotations

import fnmatch

import pytest

GROUPS: tuple[tuple[str, str], ...] = (
    ("tests/e2e/test_*", "netns"),  # real harnesses, each in a network namespace (root)
    ("tests/vllm/test_harnesses_vllm.py", "netns"),  # the same, on the real vLLM
    ("tests/vllm/*", "vllm"),  # one CPU-bound vLLM server (the demo's and bench's: their own)
    ("tests/e2e/loopback/test_realmodel.py", "realmodel"),  # one llama.cpp server per module
    ("tests/faults/test_fuzz.py", "fuzz"),  # the fault server per module, 10,000 cases
    ("tests/e2e/loopback/test_readers.py", "ray"),  # a local Ray cluster per module
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        try:
            path = item.path.relative_to(config.rootpath).as_posix()
        except ValueError:
            continue
        for pattern, group in GROUPS:
            if fnmatch.fnmatch(path, pattern):
                item.add_marker(pytest.mark.xdist_group(group))
                break
