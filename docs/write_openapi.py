"""Write docs/openapi.json from the code (pdiffcopy.server.openapi.build_document).

Run this after changing an endpoint; tests/test_openapi.py fails until the
copy in docs/ is current. ``--check`` only reports whether it is.
"""

import sys
from pathlib import Path

from pdiffcopy.server.openapi import render_document

DOCUMENT = Path(__file__).resolve().parent / "openapi.json"


def main() -> None:
    text = render_document()
    if "--check" in sys.argv[1:]:
        if not DOCUMENT.exists() or DOCUMENT.read_text() != text:
            sys.exit(f"{DOCUMENT} is stale: run python3 docs/write_openapi.py")
        return
    DOCUMENT.write_text(text)


if __name__ == "__main__":
    main()
