"""One CA folder that the proxy, `polar-mitm env` and `polar-mitm certs` agree on, wherever each
runs (issue 46): `$POLAR_MITM_CONFDIR`, else the user's config folder; never a path relative to
the current directory or to the installed package."""

from __future__ import annotations

from pathlib import Path

from click import Context
from click.testing import CliRunner

from polar_mitm.certs import default_confdir
from polar_mitm.cli.app import main


def test_default_is_the_user_config_folder(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("POLAR_MITM_CONFDIR", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    assert default_confdir() == tmp_path / "cfg" / "polar-mitm"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_confdir() == tmp_path / "home" / ".config" / "polar-mitm"


def test_certs_env_and_proxy_name_one_folder_from_any_directory(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("POLAR_MITM_CONFDIR", "relative-ca")  # resolved once, absolute
    monkeypatch.chdir(tmp_path)
    ca = CliRunner().invoke(main, ["certs"]).stdout.strip()
    assert ca == str(tmp_path / "relative-ca" / "mitmproxy-ca-cert.pem") and Path(ca).is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("POLAR_MITM_CONFDIR", str(tmp_path / "relative-ca"))
    env = CliRunner().invoke(main, ["env", "--proxy", "http://127.0.0.1:8080"]).stdout
    assert f"export SSL_CERT_FILE={ca}" in env
    cmd = CliRunner().invoke(main, ["proxy", "--upstream", "http://127.0.0.1:8000", "--dry-run"])
    assert f"confdir={tmp_path / 'relative-ca'}" in cmd.stdout
    assert f"polar_output={elsewhere / 'polar-data'}" in cmd.stdout  # absolute too


def test_proxy_passes_sets_and_mitmdump_arguments_through():
    cmd = (
        CliRunner()
        .invoke(
            main,
            [
                "proxy",
                "--upstream",
                "http://h:1",
                "--dry-run",
                "--set",
                "polar_rollout_idle=5",
                "-q",
            ],
        )
        .stdout
    )
    assert "--set polar_rollout_idle=5" in cmd and cmd.rstrip().endswith(" -q")
    assert "polar_mitm/addons/script/addon.py" in cmd


def test_every_command_names_the_output_folder_dir():
    """`DIR` in every usage line (it was `DIRECTORY` in some, `DIR` in others)."""
    root = Context(main, info_name="polar-mitm")
    for name in main.list_commands(root):
        cmd = main.get_command(root, name)
        if cmd is None:
            continue
        usage = " ".join(cmd.collect_usage_pieces(Context(cmd, info_name=name, parent=root)))
        assert "DIRECTORY" not in usage, (name, usage)
