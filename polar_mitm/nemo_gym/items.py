"""A polar-mitm trace as NeMo Gym output items: what NeMo RL trains on.

One item per call of the trace, a ``message`` (Gym's ``NeMoGymResponseOutputMessageForTraining``)
carrying that call's whole prompt (``prompt_token_ids``), its sampled ids and their log probs. A
trace was merged so that each call's prompt starts with everything before it, which is NeMo RL's
contiguity rule ("Non-contiguous messages found!"), so the items pass it by construction.

Standard library only (plus `traceview`): the NeMo Gym agent imports this inside Gym's own venv,
where mitmproxy and transformers are not installed; ``polar-mitm export --format nemo-gym`` uses
it too, so the two outputs never disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..trajectory.traceview import segments

STATUS = {"completed": "completed", "incomplete": "incomplete", "error": "failed"}


def output_items(
    trace: dict[str, Any], text: Callable[[Sequence[int]], str] = lambda ids: ""
) -> list[dict[str, Any]]:
    """The trace's calls as output messages with ids and log probs; `text` decodes a call's
    sampled ids (the ids are what a trainer uses; without a tokenizer the text is empty)."""
    ids = list(trace["input_ids"])
    lps = [float(x) for x in trace["logprobs"]]
    items = []
    for seg in segments(trace):
        items.append(
            {
                "id": seg.call_id or f"{trace['trace_id']}-{seg.index}",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [
                    {
                        "type": "output_text",
                        "text": text(ids[seg.gen_start : seg.end]),
                        "annotations": [],
                    }
                ],
                "prompt_token_ids": ids[: seg.gen_start],
                "generation_token_ids": ids[seg.gen_start : seg.end],
                "generation_log_probs": lps[seg.gen_start : seg.end],
            }
        )
    return items


def response(
    response_id: str,
    model: str,
    output: list[dict[str, Any]],
    status: str,
    metadata: dict[str, str],
    created_at: float = 0.0,
) -> dict[str, Any]:
    """A Responses-API response object around `output` (Gym's ``NeMoGymResponse``).
    ``metadata`` values are strings, as the OpenAI type requires."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "status": status,
        "metadata": metadata,
    }
