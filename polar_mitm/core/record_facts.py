"""Facts read back from a call's record, the same for the live proxy and for the CLI.

The live metrics (`metrics.py`) and the CLI's reports (`cli/summary.py`, `cli/fidelity_report.py`)
both name a call's harness from its User-Agent and both ask whether a fidelity check with the
policy tokenizer ran on it. The answers must agree, and the live proxy must import nothing from
the CLI (tests/test_layout.py), so they live here, below both.
"""

from __future__ import annotations

import re

_UA_RULES = (
    (re.compile(r"codex", re.I), "codex"),
    (re.compile(r"claude-cli|claude-code", re.I), "claude-code"),
    (re.compile(r"pi-coding-agent|\bpi/", re.I), "pi"),
    (re.compile(r"GeminiCLI", re.I), "gemini-cli"),
    (re.compile(r"^OpenAI/Python", re.I), "openai-python"),
    (re.compile(r"^OpenAI/JS", re.I), "openai-js"),
)


def harness_of_agent(ua: str) -> str:
    """The harness a User-Agent names (codex, claude-code, pi, an SDK's name, else its product)."""
    for pattern, name in _UA_RULES:
        if pattern.search(ua):
            return name
    product = ua.split("/", 1)[0].split(" ", 1)[0].strip().lower()
    return product or "unknown"


# A call whose fidelity checks ran with the policy tokenizer: `tokens/fidelity.py` writes
# {"checked": {"mode": ..., "tokenizer": "<spec>"}}. Without a tokenizer ("tokenizer": null)
# only token positions are compared, not what the text would retokenize to: such a call counts
# as not checked, so no listing says "no flags" for it. A regex, so pyarrow can run it over a
# whole column (`cli/summary.py`) and the metrics per call without parsing the JSON.
CHECKED_WITH_TOKENIZER = r'"checked": \{"mode": "[a-z]+", "tokenizer": "'
_CHECKED = re.compile(CHECKED_WITH_TOKENIZER)


def checked_with_tokenizer(fidelity_json: str | None) -> bool:
    """Did a fidelity check with the policy tokenizer run on this call (its ``fidelity_json``)?"""
    return bool(fidelity_json) and _CHECKED.search(fidelity_json) is not None
