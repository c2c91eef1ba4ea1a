"""``python -m pdiffcopy``: the same as the ``pdiffcopy`` command."""

from pdiffcopy.cli import console_main

console_main()
