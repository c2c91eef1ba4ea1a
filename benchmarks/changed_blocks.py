"""What a sync of a changed device reads: plainly, with --digest-file, with --changed-since.

Three loop devices over files (root and losetup needed): an old snapshot, a new one that
differs from it in scattered 1 MiB runs (``--changed`` of it), and a target. Before each
measured run the target is synced from the old snapshot with a digest record; the run then
syncs the new snapshot into it. The thin pool's metadata that says what differs is made by
``thin_restore`` from XML, as tests/test_changed_since.py does (no device-mapper needed).
Bytes read are the devices' own counters (``/sys/dev/block/MAJ:MIN/stat``)::

    sudo python benchmarks/changed_blocks.py --size 1G --changed 0.02
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import tempfile
import time

from pdiffcopy import api
from pdiffcopy.local import devices
from pdiffcopy.local.thindelta import MetadataFilePool

MiB = 1024 * 1024
THIN_BLOCK_SECTORS = 128  # 64 KiB, LVM's default chunk for a thin pool of this size


def pool_xml(size: int, changed_runs: "list[int]") -> str:
    """Metadata of two thin volumes over ``size`` bytes; volume 2 has new data blocks at the runs (MiB offsets)."""
    block = THIN_BLOCK_SECTORS * 512
    count = size // block
    per_run = MiB // block
    moved = {first * per_run + step for first in changed_runs for step in range(per_run)}
    lines = [f'<superblock uuid="" time="1" transaction="2" version="2" data_block_size="{THIN_BLOCK_SECTORS}" '
             f'nr_data_blocks="{2 * count}">',
             f'<device dev_id="1" mapped_blocks="{count}" transaction="0" creation_time="0" snap_time="1">',
             f'<range_mapping origin_begin="0" data_begin="0" length="{count}" time="0"/>', '</device>',
             f'<device dev_id="2" mapped_blocks="{count}" transaction="1" creation_time="1" snap_time="1">']
    for origin in range(count):
        data = count + origin if origin in moved else origin
        lines.append(f'<single_mapping origin_block="{origin}" data_block="{data}" time="{int(origin in moved)}"/>')
    lines += ["</device>", "</superblock>"]
    return "\n".join(lines)


def read_bytes(device: str) -> int:
    return devices.counters(os.stat(device).st_rdev).bytes_read


def drop_caches(*paths: str) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1G")
    parser.add_argument("--changed", type=float, default=0.02, help="fraction of the volume changed")
    arguments = parser.parse_args()
    import humanfriendly

    size = humanfriendly.parse_size(arguments.size, binary=True)
    runs = sorted(random.Random(1).sample(range(size // MiB), max(1, int(size // MiB * arguments.changed))))
    made = []
    with tempfile.TemporaryDirectory(dir="/var/tmp") as directory:
        try:
            old_file, new_file, target_file = (os.path.join(directory, name) for name in ("old", "new", "target"))
            subprocess.run(["head", "-c", str(size), "/dev/urandom"], stdout=open(old_file, "wb"), check=True)
            subprocess.run(["cp", old_file, new_file], check=True)
            with open(new_file, "r+b") as handle:
                for first in runs:
                    handle.seek(first * MiB)
                    handle.write(os.urandom(MiB))
            with open(target_file, "wb") as handle:
                handle.truncate(size)
            for backing in (old_file, new_file, target_file):
                done = subprocess.run(["losetup", "--find", "--show", backing], capture_output=True, text=True,
                                      check=True)
                made.append(done.stdout.strip())
            old, new, target = made
            xml, metadata = os.path.join(directory, "pool.xml"), os.path.join(directory, "pool.meta")
            with open(xml, "w") as handle:
                handle.write(pool_xml(size, runs))
            with open(metadata, "wb") as handle:
                handle.truncate(64 * MiB)
            subprocess.run(["thin_restore", "-i", xml, "-o", metadata], check=True, capture_output=True)
            pool = MetadataFilePool(metadata, {old: 1, new: 2})
            record = os.path.join(directory, "target.digests")
            print(f"{size // MiB} MiB volume, {len(runs)} MiB changed in {len(runs)} runs of 1 MiB")
            print(f"{'mode':<28}{'source read':>14}{'target read':>14}{'moved':>10}{'seconds':>10}")
            for mode, options in (("plain", {}), ("--digest-file", {"digest_file": record}),
                                  ("--changed-since", {"digest_file": record, "changed_since": old})):
                api.sync(old, target, digest_file=record, thin_pools=pool, verify_whole=True)
                drop_caches(old, new, target, old_file, new_file, target_file)
                before = read_bytes(new), read_bytes(target)
                started = time.monotonic()
                result = api.sync(new, target, thin_pools=pool, **options)
                seconds = time.monotonic() - started
                source_read, target_read = read_bytes(new) - before[0], read_bytes(target) - before[1]
                print(f"{mode:<28}{source_read // MiB:>10} MiB{target_read // MiB:>10} MiB"
                      f"{result.bytes_moved // MiB:>6} MiB{seconds:>10.2f}")
        finally:
            for device in made:
                subprocess.run(["losetup", "--detach", device], capture_output=True)


if __name__ == "__main__":
    main()
