"""The docs site's generated pages (an mkdocs hook: mkdocs.yml `hooks:`): the CLI reference from
the click commands and the options reference from the addons' own `load()` declarations.

Generated at every build, never written by hand or committed, so a command or an option cannot
be missing from the site or described differently there than in `--help` / `mitmdump
--options`. A page asks for a reference with a marker line: `<!-- generated: cli -->` or
`<!-- generated: options -->`. Run alone (`python docs/tools/reference.py cli|options`) it
prints the markdown.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

MARKERS = {"<!-- generated: cli -->": "cli", "<!-- generated: options -->": "options"}


def _prose(text: str) -> str:
    """Help text as markdown prose: `<` and `>` outside code spans escaped (`http://<this
    host>/...` is text, not an HTML tag the browser would drop)."""
    parts = str(text).split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def _cell(text: str) -> str:
    """One markdown table cell: one line, pipes escaped."""
    return " ".join(_prose(text).split()).replace("|", "\\|")


def _help_markdown(text: str) -> str:
    """A click help text as markdown: its `\\b` paragraphs (kept as written) as code blocks."""
    out = []
    for para in inspect.cleandoc(text or "").split("\n\n"):
        if para.startswith("\b"):
            out.append("```\n" + inspect.cleandoc(para[1:].lstrip("\n")) + "\n```")
        else:
            out.append(" ".join(_prose(para).split()))
    return "\n\n".join(out)


def cli_markdown() -> str:
    """Every `polar-mitm` command: usage, help, arguments and options (with defaults and
    environment variables as `--help` gives them)."""
    import click

    from polar_mitm.cli.app import main

    root = click.Context(main, info_name="polar-mitm")
    out = []
    for name in main.list_commands(root):
        cmd = main.get_command(root, name)
        if cmd is None:  # a lazy command whose module is not in this install
            continue
        ctx = click.Context(cmd, info_name=name, parent=root)
        usage = " ".join(cmd.collect_usage_pieces(ctx))
        out.append(f"## `polar-mitm {name}`\n")
        out.append(f"```\npolar-mitm {name} {usage}\n```\n")
        out.append(_help_markdown(cmd.help or cmd.short_help or "") + "\n")
        rows = []
        for param in cmd.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                if isinstance(param, click.Argument):
                    rows.append((param.make_metavar(ctx), "argument"))
                continue
            rows.append((record[0], record[1] or "argument"))
        if rows:
            out.append("| argument / option | meaning |\n|---|---|")
            out.extend(f"| `{' '.join(opts.split())}` | {_cell(text)} |" for opts, text in rows)
            out.append("")
    return "\n".join(out)


class _Master:
    """What `mitmproxy.addonmanager.Loader` needs of a master: its options."""

    def __init__(self) -> None:
        from mitmproxy import options

        self.options = options.Options()


def polar_options() -> list[Any]:
    """The options the addons declare (mitmproxy's `_Option`s named `polar_*`), in name order."""
    from mitmproxy.addonmanager import Loader

    from polar_mitm.addons.polar import polar_addons

    master = _Master()
    before = set(master.options.keys())
    for addon in polar_addons():
        load = getattr(addon, "load", None)
        if load is not None:
            load(Loader(master))
    return [master.options._options[n] for n in sorted(set(master.options.keys()) - before)]


def options_markdown() -> str:
    rows = ["| option | type | default | meaning |", "|---|---|---|---|"]
    for opt in polar_options():
        kind = getattr(opt.typespec, "__name__", str(opt.typespec))
        default = "" if opt.default in ("", None) else f"`{opt.default}`"
        choices = f" One of: {', '.join(opt.choices)}." if opt.choices else ""
        rows.append(f"| `{opt.name}` | {kind} | {_cell(default)} | {_cell(opt.help + choices)} |")
    return "\n".join(rows) + "\n"


def generate(kind: str) -> str:
    return cli_markdown() if kind == "cli" else options_markdown()


def on_page_markdown(markdown: str, **_: Any) -> str:  # mkdocs hook
    for marker, kind in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, generate(kind))
    return markdown


if __name__ == "__main__":
    print(generate(sys.argv[1] if len(sys.argv) > 1 else "cli"))
