"""Rewrite the usage block of README.rst from ``pdiffcopy --help``.

The usage is written once, in the argument parser; run this after changing
an option (tests/test_cli.py fails until README.rst shows the current text).
"""

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.rst"


def main() -> None:
    help_text = subprocess.run([sys.executable, "-m", "pdiffcopy", "--help"], check=True,
                               capture_output=True, text=True).stdout.rstrip("\n")
    block = "\n".join(("   " + line) if line.strip() else "" for line in help_text.splitlines())
    text = README.read_text()
    pattern = re.compile(r"(\.\. code-block:: text\n\n)(   [Uu]sage: pdiffcopy.*?)(\n\n\S)", re.DOTALL)
    new, count = pattern.subn(lambda m: m.group(1) + block + m.group(3), text)
    if count != 1:
        sys.exit("README.rst has no usage block to replace")
    README.write_text(new)


if __name__ == "__main__":
    main()
