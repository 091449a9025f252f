"""Run in NeMo Gym's venv: do Gym's own models accept every collected row, with token fields?

Usage: python gym_check.py ROLLOUTS.jsonl. Each row must validate as ``BaseVerifyResponse``, its
response as ``NeMoGymResponse`` with every output item parsed as the ...ForTraining type (so the
token ids survive Gym's parsing), and pass NeMo RL's rule: each item's prompt starts with all
the tokens before it ("Non-contiguous messages found!" otherwise). Prints {"rows": N}; exits 1
with the first problem.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from nemo_gym.base_resources_server import BaseVerifyResponse
from nemo_gym.openai_utils import NeMoGymResponse, NeMoGymResponseOutputMessageForTraining


def check(line: str) -> None:
    row = BaseVerifyResponse.model_validate_json(line)
    response = NeMoGymResponse.model_validate(json.loads(line)["response"])
    seen: list[int] = []
    for item in response.output:
        if not isinstance(item, NeMoGymResponseOutputMessageForTraining):
            raise SystemExit(
                f"item {getattr(item, 'id', '?')} lost its token fields: {type(item).__name__}"
            )
        if item.prompt_token_ids[: len(seen)] != seen:
            raise SystemExit(f"Non-contiguous messages found! (item {item.id})")
        if len(item.generation_token_ids) != len(item.generation_log_probs):
            raise SystemExit(f"item {item.id}: ids and log probs differ in length")
        seen = item.prompt_token_ids + item.generation_token_ids
    assert row.reward in (0.0, 1.0)


def main() -> None:
    lines = [line for line in Path(sys.argv[1]).read_text().splitlines() if line.strip()]
    for line in lines:
        check(line)
    print(json.dumps({"rows": len(lines)}))


if __name__ == "__main__":
    main()
