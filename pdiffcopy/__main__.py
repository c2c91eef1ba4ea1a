"""``python -m pdiffcopy``: the same as the ``pdiffcopy`` command."""

from pdiffcopy.cli.main import main

main()
