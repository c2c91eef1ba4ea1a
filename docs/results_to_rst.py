"""Fill docs/benchmarks.rst's results from a report of benchmarks/remote_delta.py.

Usage: python3 docs/results_to_rst.py benchmarks/results/remote-delta/tools-1g.txt
"""

import re
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parent / "benchmarks.rst"
START = ".. results-start"
END = ".. results-end"


def tables(report: str):
    """The report's (title, rows) pairs: each row a dict of column name to cell."""
    found = []
    for match in re.finditer(r"^## (Pull|Push)[^\n]*\n\n(\|.*?)\n\n", report, re.MULTILINE | re.DOTALL):
        lines = [line for line in match.group(2).splitlines() if not line.startswith("|--")]
        header = [cell.strip() for cell in lines[0].strip("|").split("|")]
        rows = [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|"))))
                for line in lines[1:]]
        found.append((match.group(1), rows))
    return found


def rst(report: str) -> str:
    machine = re.search(r"^Machine: (.*)$", report, re.MULTILINE).group(1)
    load = re.search(r"^Load average.*$", report, re.MULTILINE).group(0)
    out = [START, "", f"Measured on: {machine}.", "", f"{load}", ""]
    for title, rows in tables(report):
        out += [f"**{title}** (1 GiB, seconds, median (best) of 3):", "",
                ".. list-table::", "   :header-rows: 1", "",
                "   * - Delta", "     - rsync", "     - pdiffcopy 1.0.1", "     - pdiffcopy 2.0.0",
                "     - cp (whole file)", "     - curl (whole file)", "     - 2.0.0 / 1.0.1",
                "     - 2.0.0 / rsync"]
        for row in rows:
            def pair(name):
                return f"{row.get(name + ' median', '')} ({row.get(name + ' best', '')})"
            out += [f"   * - {row['delta %']} %", f"     - {pair('rsync')}", f"     - {pair('original')}",
                    f"     - {pair('ours')}", f"     - {pair('cp (whole file)')}",
                    f"     - {pair('curl (whole file)')}", f"     - {row['ours/original']}",
                    f"     - {row['ours/rsync']}"]
        out.append("")
    out.append(END)
    return "\n".join(out)


def main() -> None:
    report = Path(sys.argv[1]).read_text()
    doc = DOC.read_text()
    start, end = doc.index(START), doc.index(END) + len(END)
    DOC.write_text(doc[:start] + rst(report) + doc[end:])


if __name__ == "__main__":
    main()
