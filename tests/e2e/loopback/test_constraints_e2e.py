"""The grammar-constrained sampling option on a real mitmdump (the rest of it, without a server:
tests/test_constraints.py; on the real vLLM: tests/vllm/test_constrained.py)."""

from __future__ import annotations


def test_a_bad_mode_is_one_startup_line(make_mitm):
    mitm = make_mitm("http://127.0.0.1:9", polar_harness_constraints="maybe", ready=None)
    mitm.proc.wait_for(r"polar_harness_constraints: 'maybe' is not one of pass, drop")
    assert mitm.proc.popen.wait(10) == 1
    assert "Traceback" not in mitm.proc.output()
