"""The docs site's pictures of `polar-mitm show` and `polar-mitm report`, made from a demo run's
data, so a newcomer sees a trace and a report before installing anything. Regenerated, never
pasted: run the demo, then this script on what it captured.

    POLAR_DEMO_OUT=/tmp/polar-demo POLAR_DEMO_SESSION=sdk ./scripts/demo.sh
    .venv/bin/python docs/tools/pictures.py /tmp/polar-demo/data docs/images

- show.svg: `polar-mitm show DIR demo-task.0` as a 110-column colour terminal shows it (the real
  command's ANSI output, drawn by rich's own SVG export: environment tokens cyan, policy tokens
  bold green, a rule per call);
- report.png: the `polar-mitm report` page, screenshot by headless Chromium with the flags the
  report's test uses (tests/e2e/loopback/test_cli_e2e.py).

tests/e2e/loopback/test_demo.py runs this script on its demo's data (both pictures made and
valid). Exits 1 with one line when a step fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROLLOUT = "demo-task.0"
WIDTH = 110


def polar(*args: str, env: dict[str, str] | None = None) -> str:
    exe = Path(sys.executable).parent / "polar-mitm"
    done = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300, env=env)
    if done.returncode != 0:
        sys.exit(f"error: polar-mitm {args[0]} failed: {done.stderr.strip()}")
    return done.stdout


def show_svg(data: Path, out: Path) -> None:
    from rich.console import Console
    from rich.text import Text

    env = {**os.environ, "FORCE_COLOR": "1", "COLUMNS": str(WIDTH), "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    ansi = polar("show", str(data), ROLLOUT, "--no-pager", env=env)
    with open(os.devnull, "w") as sink:
        console = Console(record=True, width=WIDTH, file=sink, color_system="truecolor")
        console.print(Text.from_ansi(ansi), soft_wrap=True)
    out.write_text(console.export_svg(title=f"polar-mitm show DIR {ROLLOUT}"), encoding="utf-8")


def report_png(data: Path, out: Path) -> None:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        sys.exit("error: chromium is not installed (scripts/test.sh installs Debian's chromium)")
    with tempfile.TemporaryDirectory(prefix="polar-pictures-") as tmp:
        page = Path(tmp) / "report.html"
        polar("report", str(data), "--html", str(page))
        done = subprocess.run(
            [
                exe,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                f"--user-data-dir={Path(tmp) / 'profile'}",
                "--hide-scrollbars",
                "--window-size=1280,1150",
                f"--screenshot={out}",
                page.as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0 or not out.is_file():
            sys.exit(f"error: chromium made no screenshot: {done.stderr.strip()[-500:]}")


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit("usage: pictures.py DEMO_DATA_DIR OUT_DIR")
    data, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    show_svg(data, out / "show.svg")
    report_png(data, out / "report.png")
    print(f"wrote {out / 'show.svg'} and {out / 'report.png'}")


if __name__ == "__main__":
    main()
