"""Record what the real harnesses send: `python -m tests.e2e.record_wire [NAME ...]`.

Runs each pinned harness in its own network namespace through mitmdump with the stand-alone
`wire_capture.py` script (not the polar-mitm addon), with the same scripted task the e2e tests
use (call the harness's own shell tool to create hello.txt, then answer with text), and writes
`tests/fixtures/harness/<name>/`:
- `sequence.txt`: every CONNECT and request in order, with the status it got;
- `NN-<method>-<host><path>.json`: each request (headers with credentials redacted, JSON body;
  bodies of non-LLM requests over 4 KiB are cut to their keys), temp paths replaced by
  /home/agent and /work.
Needs root (network namespaces) and the harnesses (scripts/install_harnesses.sh).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

from polar_mitm.certs import ensure_ca, env_lines
from tests.helpers.procs import MITMDUMP, Proc, free_port

from .harnesses import FINAL_TEXT, HARNESSES, ROOT, SHELL_COMMAND, install, run_harness
from .netns import create_netns

FIXTURES = ROOT / "tests" / "fixtures" / "harness"
CAPTURE = Path(__file__).with_name("wire_capture.py")
LLM_PATHS = ("/v1/responses", "/v1/messages", "/v1/chat/completions")
LLM_SUFFIXES = (":generateContent", ":streamGenerateContent")  # Google's, after the model name

# What the capture proxy answers: the harness's own shell tool, then the final text.
CODEX_EXEC_INPUT = (
    f"const r = await tools.exec_command({{cmd: {json.dumps(SHELL_COMMAND)}}});\ntext(r.output);\n"
)
PLAN = {
    "responses": [{"custom": {"name": "exec", "input": CODEX_EXEC_INPUT}}, {"text": FINAL_TEXT}],
    "messages": [
        {
            "tool": {
                "name": "Bash",
                "arguments": {"command": SHELL_COMMAND, "description": "Create hello.txt"},
            }
        },
        {"text": FINAL_TEXT},
    ],
    "chat": [
        {"tool": {"name": "bash", "arguments": {"command": SHELL_COMMAND}}},
        {"text": FINAL_TEXT},
    ],
    "gemini": [
        {
            "tool": {
                "name": "run_shell_command",
                "arguments": {"command": SHELL_COMMAND, "description": "Create hello.txt"},
            }
        },
        {"text": FINAL_TEXT},
    ],
    # Gemini CLI's model router (a tool-less call) wants its JSON, else it asks four times more.
    "gemini_side": [
        {"text": '{"complexity_reasoning": "One small file.", "complexity_score": 10}'}
    ],
}
# Harnesses whose shell tool is not their dialect's usual one.
HARNESS_PLAN = {
    "qwen": {
        "chat": [
            {"tool": {"name": "run_shell_command", "arguments": {"command": SHELL_COMMAND}}},
            {"text": FINAL_TEXT},
        ]
    },
    # OpenClaw speaks Responses with function tools (its shell tool is `exec`, argument `command`)
    "openclaw": {
        "responses": [
            {"tool": {"name": "exec", "arguments": {"command": SHELL_COMMAND}}},
            {"text": FINAL_TEXT},
        ]
    },
}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[:60]


def _normalize(obj: object, paths: dict[str, str]) -> object:
    text = json.dumps(obj)
    for old, new in paths.items():
        text = text.replace(old, new)
    return json.loads(text)


def record(name: str, bin_dir: Path, out: Path) -> None:
    harness = HARNESSES[name]
    with tempfile.TemporaryDirectory(prefix=f"wire-{name}-") as tmp_s:
        tmp = Path(tmp_s)
        ca = ensure_ca(tmp / "certs")
        (tmp / "plan.json").write_text(json.dumps({**PLAN, **HARNESS_PLAN.get(name, {})}))
        log = tmp / "wire.jsonl"
        ns = create_netns(name[:3])
        mitm = None
        try:
            port = free_port()
            mitm = Proc(
                [
                    MITMDUMP,
                    "-s",
                    str(CAPTURE),
                    "--listen-host",
                    ns.host_ip,
                    "--listen-port",
                    str(port),
                    "--set",
                    f"confdir={tmp / 'certs'}",
                    "--set",
                    "connection_strategy=lazy",
                    "--set",
                    f"wire_log={log}",
                    "--set",
                    f"wire_plan={tmp / 'plan.json'}",
                ],
                tmp / "mitm.log",
            )
            mitm.wait_for("proxy listening at", timeout=60)
            lines = "\n".join(env_lines(f"http://{ns.host_ip}:{port}", ca, f"record-{name}.0"))
            result = run_harness(harness, bin_dir, tmp, lines, f"polar-record-{name}.0", ns.wrap)
        finally:
            if mitm is not None:
                mitm.stop()
            ns.delete()
        print(f"{name}: rc={result.returncode} in {result.seconds:.1f} s", file=sys.stderr)
        print(result.stdout[-2000:], result.stderr[-3000:], sep="\n", file=sys.stderr)
        paths = {
            str(result.home): "/home/agent",
            str(result.workdir): "/work",
            str(tmp): "/tmp/rec",
        }
        entries = [json.loads(line) for line in log.read_text().splitlines()]
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    sequence = []
    for e in entries:
        e = _normalize(e, paths)
        e.pop("t", None)
        if e["kind"] == "connect":
            sequence.append(f"{e['seq']:02d} CONNECT {e['host']}:{e['port']}")
            continue
        path = e["path"]
        sequence.append(f"{e['seq']:02d} {e['method']} {e['host']}{path} -> {e['status']}")
        bare = path.partition("?")[0]
        llm = (bare in LLM_PATHS or bare.endswith(LLM_SUFFIXES)) and e["method"] == "POST"
        body = e.get("body")
        if not llm and body is not None and len(json.dumps(body)) > 4096:
            keys = sorted(body) if isinstance(body, dict) else type(body).__name__
            e["body"] = {"_cut": f"{len(json.dumps(body))} bytes", "_keys": keys}
        fname = f"{e['seq']:02d}-{e['method']}-{_slug(e['host'] + path)}.json"
        (out / fname).write_text(json.dumps(e, indent=1, ensure_ascii=False) + "\n")
    (out / "sequence.txt").write_text(
        f"# {harness.package}@{harness.version}, recorded by tests/e2e/record_wire.py\n"
        + "\n".join(sequence)
        + "\n"
    )
    (out / "harness-output.txt").write_text(
        f"rc={result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n"
        + "\n".join(line for line in result.stderr.splitlines())
        .replace(str(result.workdir), "/work")
        .replace(str(result.home), "/home/agent")
        + "\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "names", nargs="*", help=f"harnesses to record (default: all of {', '.join(HARNESSES)})"
    )
    parser.add_argument("--out", type=Path, default=FIXTURES)
    args = parser.parse_args()
    unknown = set(args.names) - set(HARNESSES)
    if unknown:
        parser.error(f"unknown harness {', '.join(sorted(unknown))}")
    bin_dir = install()
    for name in args.names or list(HARNESSES):
        record(name, bin_dir, args.out / name)


if __name__ == "__main__":
    main()
