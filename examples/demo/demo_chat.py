"""One rollout of a multi-turn chat with the official openai SDK, for the real-model demo.

Like demo_session.py it talks to https://api.openai.com/v1 and knows nothing of polar-mitm: the
environment (`polar-mitm env --rollout ...`) sends it through the proxy. A 135M model does not call
tools usefully, so this is a plain conversation whose replies go back into the history, as a
harness does. At the end the "environment" grades it (a stand-in grader that prefers short final
answers, so a GRPO group gets different rewards) and ends the rollout with that reward through the
proxy's control plane (--control-token), as a trainer would; --rewards FILE also records it there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import openai

TURNS = ["Give me one tip for writing clear Python.", "Now say it in five words or fewer."]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rollout", required=True, help="the rollout id (for the reward file)")
    ap.add_argument("--rewards", type=Path, default=None)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--control-token", default=None, help="end the rollout with its reward")
    args = ap.parse_args()
    client = openai.OpenAI(base_url="https://api.openai.com/v1", max_retries=0)
    messages: list[dict] = []
    reply = ""
    for user in TURNS:
        messages.append({"role": "user", "content": user})
        parts = []
        stream = client.chat.completions.create(
            model="gpt-4.1-mini", messages=messages, stream=True, max_tokens=args.max_tokens
        )
        for chunk in stream:
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
        reply = "".join(parts)
        print(f"  [{args.rollout}] user: {user}\n  [{args.rollout}] model: {reply.strip()}")
        messages.append({"role": "assistant", "content": reply})
    reward = -float(len(reply.split()))
    if args.control_token:
        from polar_mitm.control import ControlClient

        proxy = os.environ["HTTPS_PROXY"]
        ended = ControlClient(args.control_token, proxy=proxy).end(args.rollout, reward=reward)
        print(f"  [{args.rollout}] ended through the control plane: reward {ended['reward']}")
    if args.rewards is not None:
        rewards = json.loads(args.rewards.read_text()) if args.rewards.exists() else {}
        rewards[args.rollout] = reward
        tmp = args.rewards.with_suffix(".tmp")
        tmp.write_text(json.dumps(rewards, indent=1))
        os.replace(tmp, args.rewards)
    return 0


if __name__ == "__main__":
    sys.exit(main())
