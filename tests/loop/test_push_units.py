"""The weight push without an engine process: the checkpoint check on small safetensors files
written here byte by byte, and the control plane's order of a push (`ControlAPI.push_weights`)
with an engine that records what it is asked and when. The real engine: test_weight_push.py."""

from __future__ import annotations

import asyncio
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from polar_mitm.control import ControlAPI, ControlState
from polar_mitm.upstream.weights import EngineFailed, WeightsRefused, check_checkpoint


def write_model(folder: Path, tensors: dict[str, np.ndarray], tie: bool = False,
                dtype: str = "F32", extra: bytes = b"") -> Path:  # fmt: skip
    folder.mkdir(parents=True)
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 4,
              "num_hidden_layers": 1, "tie_word_embeddings": tie}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    header, blobs, at = {}, [], 0
    for name, a in tensors.items():
        raw = a.tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    h = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(
        struct.pack("<Q", len(h)) + h + b"".join(blobs) + extra
    )
    return folder


def good(folder: Path) -> Path:
    return write_model(folder, {"a.weight": np.ones((8, 4), "<f4"), "b.weight": np.ones(4, "<f4")})


def test_the_check_takes_a_whole_untied_finite_checkpoint(tmp_path):
    ref = good(tmp_path / "ref")
    summary = check_checkpoint(str(good(tmp_path / "new")), str(ref))
    assert summary["tensors"] == 2


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("truncated", "truncated or corrupt"),
        ("trailing", "after the last tensor"),
        ("nan", "NaN or infinite"),
        ("bf16_inf", "NaN or infinite"),
        ("tied", "tie_word_embeddings"),
        ("shape", r"the served model.s is F32 \[8, 4\]"),
        ("missing_tensor", "tensors differ"),
        ("no_config", "config.json"),
        ("relative", "not an absolute path"),
    ],
)
def test_the_check_refuses(tmp_path, kind, message):
    ref = good(tmp_path / "ref")
    path = tmp_path / "bad"
    ones = np.ones((8, 4), "<f4")
    if kind == "truncated":
        good(path)
        data = (path / "model.safetensors").read_bytes()
        (path / "model.safetensors").write_bytes(data[:-10])
    elif kind == "trailing":
        write_model(path, {"a.weight": ones, "b.weight": np.ones(4, "<f4")}, extra=b"\0" * 4)
    elif kind == "nan":
        bad = ones.copy()
        bad[3, 1] = np.nan
        write_model(path, {"a.weight": bad, "b.weight": np.ones(4, "<f4")})
    elif kind == "bf16_inf":
        top = (np.array([1.0, np.inf], "<f4").view("<u4") >> 16).astype("<u2")
        write_model(tmp_path / "bf16ref", {"x": np.zeros(2, "<u2")}, dtype="BF16")
        write_model(path, {"x": top}, dtype="BF16")
        ref = tmp_path / "bf16ref"
    elif kind == "tied":
        write_model(path, {"a.weight": ones, "b.weight": np.ones(4, "<f4")}, tie=True)
    elif kind == "shape":
        write_model(path, {"a.weight": np.ones((4, 8), "<f4"), "b.weight": np.ones(4, "<f4")})
    elif kind == "missing_tensor":
        write_model(path, {"a.weight": ones})
    elif kind == "no_config":
        good(path)
        (path / "config.json").unlink()
    elif kind == "relative":
        path = Path("bad")
    with pytest.raises(WeightsRefused, match=message):
        check_checkpoint(str(path), str(ref))


class Recording:
    """An engine that records each request with the proxy's state at that moment."""

    def __init__(self, state: ControlState, fail: bool = False) -> None:
        self.state, self.fail, self.seen = state, fail, []

    def reload(self, folder: str, version: str | None) -> None:
        self.seen.append(("reload", folder, self.state.paused, dict(self.state.in_flight)))
        if self.fail:
            raise EngineFailed("500 from the engine")

    def recover(self, folder: str, version: str | None) -> str:
        self.seen.append(("recover", folder, version))
        return f"reloaded the last good weights {folder}"

    def describe(self) -> dict:
        return {}


def api_with(tmp_path: Path, fail: bool = False) -> tuple[ControlAPI, Recording]:
    state = ControlState("v0")
    api = ControlAPI(state, rollouts=None)  # type: ignore[arg-type]  # the push reads no rollout
    api.engine = engine = Recording(state, fail)
    api.weights = str(good(tmp_path / "v0"))
    return api, engine


def test_a_push_reloads_paused_and_drained_then_changes_the_version(tmp_path):
    async def run() -> None:
        api, engine = api_with(tmp_path)
        new = str(good(tmp_path / "v1"))
        api.state.call_started("c1", "r.0")  # a call in flight: the reload waits for it

        async def finish() -> None:
            await asyncio.sleep(0.2)
            assert api.state.paused and api.state.policy_version == "v0"
            record = type("R", (), {"call_id": "c1", "policy_version_end": None})()
            api.state.call_finished(record)
            assert record.policy_version_end == "v0"  # it ran on the old weights: stamped so

        done = asyncio.create_task(finish())
        answer = await api.push_weights({"path": new, "version": "v1", "wait_s": 5})
        await done
        assert engine.seen == [("reload", new, True, {})]
        assert answer["policy_version"] == "v1" and answer["previous"] == "v0"
        assert not api.state.paused and api.weights == new

    asyncio.run(run())


def test_a_failed_reload_recovers_and_keeps_the_version(tmp_path):
    async def run() -> None:
        api, engine = api_with(tmp_path, fail=True)
        last_good = api.weights
        status, body = await api_handle(api, {"path": str(good(tmp_path / "v1")), "version": "v1"})
        assert status == 502 and "the policy version stays v0" in body["error"]["message"]
        assert engine.seen[-1] == ("recover", last_good, "v0")
        assert api.state.policy_version == "v0" and api.weights == last_good
        assert not api.state.paused

    asyncio.run(run())


async def api_handle(api: ControlAPI, body: dict) -> tuple[int, dict]:
    api.token = "t"
    return await api.handle(
        "POST", "/v1/weights", {"authorization": "Bearer t"}, json.dumps(body).encode()
    )
