"""The command line's own behaviour: usage text, version, option parsing."""

from __future__ import annotations

from pathlib import Path

from conftest import run_cli
from pdiffcopy import __version__

README = Path(__file__).resolve().parent.parent / "README.rst"


def test_readme_shows_the_current_usage():
    """The usage is written once (in the parser) and README must show it as --help prints it."""
    completed = run_cli("--help")
    assert completed.returncode == 0
    readme = README.read_text()
    for line in completed.stdout.splitlines():
        if line.strip():
            assert "   " + line in readme, f"README.rst lacks this line of --help: {line!r}"


def test_version():
    completed = run_cli("--version")
    assert completed.returncode == 0
    assert completed.stdout.strip() == f"pdiffcopy {__version__}"


def test_one_positional_argument_is_a_usage_error():
    completed = run_cli("/etc/hostname")
    assert completed.returncode == 1
    assert "Expected SOURCE and TARGET" in completed.stderr
    assert "Traceback" not in completed.stderr


def test_block_size_accepts_binary_suffixes(tmp_path):
    source = tmp_path / "a"
    source.write_bytes(b"x" * 10000)
    completed = run_cli("-n", "-b", "5K", str(source), str(tmp_path / "b"))
    assert completed.returncode == 0, completed.stderr
    # 10000 bytes in 5120-byte blocks: 2 blocks.
    assert "2 of 2 blocks differ" in completed.stdout
