"""A multi-turn tool-calling session with the official openai SDK, as a harness would run it.

It talks to https://api.openai.com/v1 and knows nothing of polar-mitm: HTTPS_PROXY and
SSL_CERT_FILE (from `polar-mitm env`) send it through the proxy. The `run_shell` tool really runs,
in a scratch directory holding a small notes.txt.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_shell",
            "description": "Run a shell command in the project directory and return its output.",
            "parameters": {
                "type": "object",
                "properties": {"cmd": {"type": "string"}},
                "required": ["cmd"],
            },
        },
    }
]


def main() -> int:
    client = openai.OpenAI(base_url="https://api.openai.com/v1", max_retries=0)
    workdir = tempfile.mkdtemp(prefix="polar-demo-")
    with open(os.path.join(workdir, "notes.txt"), "w") as f:
        f.write("buy milk\ncall the plumber\nship polar-mitm\n")
    messages: list[dict] = [
        {"role": "system", "content": "You are a coding agent. Use run_shell to inspect files."},
        {
            "role": "user",
            "content": "How many lines does notes.txt have, and what is the first one?",
        },
    ]
    for turn in range(1, 9):
        stream = client.chat.completions.create(
            model="gpt-4.1", messages=messages, tools=TOOLS, stream=True
        )
        text, calls = [], {}
        for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    text.append(choice.delta.content)
                for tc in choice.delta.tool_calls or ():
                    slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                    slot["id"] = tc.id or slot["id"]
                    if tc.function:
                        slot["name"] += tc.function.name or ""
                        slot["arguments"] += tc.function.arguments or ""
        content = "".join(text) or None
        print(f"turn {turn}: {content or ''}".rstrip())
        tool_calls = [calls[i] for i in sorted(calls)]
        messages.append(
            {
                "role": "assistant",
                "content": content,
                "tool_calls": [
                    {
                        "id": c["id"],
                        "type": "function",
                        "function": {"name": c["name"], "arguments": c["arguments"]},
                    }
                    for c in tool_calls
                ]
                or None,
            }
        )
        if not tool_calls:
            return 0
        for call in tool_calls:
            cmd = json.loads(call["arguments"])["cmd"]
            out = subprocess.run(
                cmd, shell=True, cwd=workdir, capture_output=True, text=True
            ).stdout
            print(f"  $ {cmd}\n  {out.strip()}")
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": out})
    return 1


if __name__ == "__main__":
    sys.exit(main())
