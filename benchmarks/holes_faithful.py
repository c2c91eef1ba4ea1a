#!/usr/bin/env python3
"""
What faithful holes cost (issue 38), locally: ours against ``--baseline REV`` in one run.

The source is a raw image of ``--size`` bytes (default 1 GiB) holding ``--data`` bytes
(default 12 MiB) of random data in ``--extents`` extents at seeded, 4 KiB-aligned offsets;
the rest is holes. Cases, each timed as the wall time of one ``pdiffcopy`` process:

- ``equal-dense``: the target has the source's bytes but is allocated in full (its zeros
  are data): ours punches the source's holes into it, the baseline leaves it dense;
- ``equal-sparse``: the target is an exact sparse copy (nothing to do for either);
- ``tree-S-image``: ``pdiffcopy -S SRC/ DST`` of a directory holding the image, new target;
- ``tree-S-small``: ``pdiffcopy -S SRC/ DST`` of ``--small-files`` dense files of 8 MiB, each
  half random data, half zeros in runs of 1 MiB, new target: ours makes the zeros holes,
  the baseline writes them.

The tree cases also run ``rsync -a -S`` (where rsync exists), for reference.

Targets are made again before every run (outside the timing), and everything is flushed
(``sync``) before the clock starts. Every result is checked by its bytes; the report gives
the target's allocation beside the time.
"""

import argparse
import hashlib
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchlib
from benchlib import log

MIB = 1024 * 1024
SMALL_SIZE = 8 * MIB
CASES = ("equal-dense", "equal-sparse", "tree-S-image", "tree-S-small")


def make_image(path: Path, size: int, data: int, extents: int, seed: int = 38) -> None:
    rng = random.Random(seed)
    piece = data // extents
    slots = sorted(rng.sample(range(size // piece), extents))
    with open(path, "wb") as handle:
        handle.truncate(size)
        for slot in slots:
            handle.seek(slot * piece // 4096 * 4096)
            handle.write(rng.randbytes(piece))


def make_small_files(directory: Path, count: int, seed: int = 39) -> None:
    rng = random.Random(seed)
    directory.mkdir(parents=True)
    for index in range(count):
        parts = [rng.randbytes(MIB) if part % 2 == 0 else bytes(MIB) for part in range(SMALL_SIZE // MIB)]
        (directory / f"file{index:04d}.img").write_bytes(b"".join(parts))


def allocated(path: Path) -> int:
    if path.is_dir():
        return sum(allocated(child) for child in path.rglob("*") if child.is_file())
    return os.stat(path).st_blocks * 512


def digest(path: Path) -> str:
    if path.is_dir():
        return ",".join(f"{child.relative_to(path)}:{digest(child)}" for child in sorted(path.rglob("*"))
                        if child.is_file())
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def prepare(case: str, source: Path, image_dir: Path, small_dir: Path, target: Path) -> tuple:
    """Make the target of ``case`` anew; return (SOURCE, TARGET, extra arguments, what to compare)."""
    if target.is_dir():
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()
    if case == "equal-dense":
        subprocess.run(["cp", "--sparse=never", str(source), str(target)], check=True)
        return str(source), str(target), [], (source, target)
    if case == "equal-sparse":
        subprocess.run(["cp", "--sparse=always", str(source), str(target)], check=True)
        return str(source), str(target), [], (source, target)
    tree = image_dir if case == "tree-S-image" else small_dir
    return f"{tree}/", str(target), ["-S"], (tree, target)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=benchlib.parse_size, default=1024 * MIB)
    parser.add_argument("--data", type=benchlib.parse_size, default=12 * MIB)
    parser.add_argument("--extents", type=int, default=12)
    parser.add_argument("--small-files", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", metavar="REV", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="holes-faithful-", dir=args.workdir))
    try:
        ours, description = benchlib.find_ours()
        if ours is None:
            log(description)
            return 1
        before = benchlib.baseline_installation(args.baseline, work)
        tools = {"ours": ours, "baseline": before}
        if shutil.which("rsync"):
            tools["rsync"] = benchlib.OursInstallation(["rsync", "-a"], dict(os.environ), "rsync -a")
        print(f"ours: {ours.description}\nbaseline: {before.description}")
        print(f"image: {args.size // MIB} MiB holding {args.data // MIB} MiB in {args.extents} extents; "
              f"{args.small_files} small files of 8 MiB (half zeros); {args.rounds} rounds; "
              f"file system of {work}: {benchlib.command_output(['findmnt', '-no', 'FSTYPE', '-T', str(work)])}")
        image_dir = work / "image"
        image_dir.mkdir()
        source = image_dir / "disk.img"
        make_image(source, args.size, args.data, args.extents)
        small_dir = work / "small"
        cases = args.cases.split(",")
        if "tree-S-small" in cases:
            make_small_files(small_dir, args.small_files)
        target = work / "target"
        def runs_case(tool: str, case: str) -> bool:
            return tool != "rsync" or case.startswith("tree")

        times = {(case, tool): [] for case in cases for tool in tools if runs_case(tool, case)}
        blocks = {}
        for round_number in range(args.rounds):
            for case in cases:
                order = list(tools) if round_number % 2 == 0 else list(tools)[::-1]
                for tool in order:
                    if not runs_case(tool, case):
                        continue
                    source_arg, target_arg, extra, compare = prepare(case, source, image_dir, small_dir, target)
                    os.sync()
                    started = time.monotonic()
                    subprocess.run([*tools[tool].command, *extra, source_arg, target_arg], env=tools[tool].env,
                                   check=True, stdout=subprocess.DEVNULL)
                    times[(case, tool)].append(time.monotonic() - started)
                    os.sync()
                    if digest(compare[0]) != digest(compare[1]):
                        raise SystemExit(f"{tool} {case}: the target differs from the source")
                    blocks[(case, tool)] = allocated(compare[1])
        print(f"\n{'case':<14} {'tool':<9} {'median (s)':>10} {'runs (s)':<22} {'target allocated':>17}")
        for case in cases:
            source_blocks = allocated(image_dir if case.startswith("tree-S-image") else
                                      small_dir if case == "tree-S-small" else source)
            for tool in tools:
                if not runs_case(tool, case):
                    continue
                runs = times[(case, tool)]
                print(f"{case:<14} {tool:<9} {statistics.median(runs):>10.2f} "
                      f"{' '.join(f'{r:.2f}' for r in runs):<22} "
                      f"{blocks[(case, tool)] / MIB:>10.1f} MiB (source {source_blocks / MIB:.1f})")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
