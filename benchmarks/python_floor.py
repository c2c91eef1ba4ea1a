#!/usr/bin/env python3
"""
The floor of a tree copy in Python on this machine: ``python_floor.py SRC DST``.

Not a copier (no filters, no confinement, no verification, no errors handled, no
metadata besides modes and mtimes): the least that any Python program must do to copy a
tree, or to find that an existing copy is up to date, with every core busy. A row of
``tree_bench.py --tools floor`` beside the real tools, so that a target beyond its reach
is shown to be beyond Python's, not pdiffcopy's.

A new ``DST``: two forked processes walk the whole tree (``os.listdir`` and one
``lstat`` a name below the directory's descriptor, the calls pdiffcopy's listing
makes), both make every directory, and
each copies every other file of a directory the way pdiffcopy's local copy does (open
both, ``copy_file_range``, ``futimens``, close both: the same 8 system calls). No
process waits for another, nothing is sent between them; the parent sets the
directories' modes and times at the end.

An existing ``DST`` (a no-change sync): two forked processes walk one tree each and
send their listings (path, mode, size, mtime, with ``marshal``) to the parent, which
compares them, the least a sync must do before it knows there is nothing to copy.
"""

import marshal
import os
import stat
import sys

COPY_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def copy_part(src: str, dst: str, part: int, parts: int) -> list:
    """Copy every ``parts``-th file of each directory, from the ``part``-th; the directories' metadata
    (from part 0 only: every part walks all of them)."""
    directories = []
    pending = [(os.open(src, DIRECTORY_FLAGS), os.open(dst, DIRECTORY_FLAGS), "")]
    while pending:
        source, target, relative = pending.pop()
        names = os.listdir(source)
        names.sort()
        for index, name in enumerate(names):
            info = os.lstat(name, dir_fd=source)
            mode = info.st_mode
            if stat.S_ISDIR(mode):
                try:
                    os.mkdir(name, 0o700, dir_fd=target)
                except FileExistsError:
                    pass
                child = relative + "/" + name if relative else name
                pending.append((os.open(name, DIRECTORY_FLAGS, dir_fd=source),
                                os.open(name, DIRECTORY_FLAGS, dir_fd=target), child))
                if part == 0:
                    directories.append((child, stat.S_IMODE(mode), info.st_atime_ns, info.st_mtime_ns))
            elif index % parts == part and stat.S_ISREG(mode):
                reader = os.open(name, COPY_FLAGS, dir_fd=source)
                writer = os.open(name, CREATE_FLAGS, stat.S_IMODE(mode), dir_fd=target)
                left = info.st_size
                while left > 0:
                    done = os.copy_file_range(reader, writer, left)
                    if not done:
                        break
                    left -= done
                os.utime(writer, ns=(info.st_atime_ns, info.st_mtime_ns))
                os.close(writer)
                os.close(reader)
            elif index % parts == part and stat.S_ISLNK(mode):
                os.symlink(os.readlink(name, dir_fd=source), name, dir_fd=target)
        os.close(source)
        os.close(target)
    return directories


def listing(root: str) -> dict:
    """Path -> (mode, size, mtime) of everything below ``root``."""
    found = {}
    pending = [(os.open(root, DIRECTORY_FLAGS), "")]
    while pending:
        directory, prefix = pending.pop()
        names = os.listdir(directory)
        names.sort()
        for name in names:
            info = os.lstat(name, dir_fd=directory)
            found[prefix + name] = (info.st_mode, info.st_size, info.st_mtime_ns)
            if stat.S_ISDIR(info.st_mode):
                pending.append((os.open(name, DIRECTORY_FLAGS, dir_fd=directory), prefix + name + "/"))
        os.close(directory)
    return found


def in_child(work) -> tuple:
    """Fork a process that runs ``work()`` and sends its result back; (pid, pipe)."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(reader)
            with os.fdopen(writer, "wb") as out:
                marshal.dump(work(), out)
        except BaseException as error:
            print(f"python_floor.py: {error}", file=sys.stderr)
            os._exit(1)
        os._exit(0)
    os.close(writer)
    return pid, reader


def result_of(child: tuple):
    pid, reader = child
    with os.fdopen(reader, "rb") as source:
        data = source.read()
    _, status = os.waitpid(pid, 0)
    if status:
        raise SystemExit("a floor process failed")
    return marshal.loads(data)


def main() -> int:
    src, dst = sys.argv[1].rstrip("/"), sys.argv[2].rstrip("/")
    if os.path.isdir(dst):
        theirs = in_child(lambda: listing(dst))
        ours = in_child(lambda: listing(src))
        source, target = result_of(ours), result_of(theirs)
        stale = [path for path, seen in source.items() if target.get(path) != seen]
        if stale:
            raise SystemExit(f"{len(stale)} entries differ, e.g. {stale[0]!r}: the floor only measures no-change syncs")
        return 0
    info = os.stat(src)
    os.mkdir(dst, 0o700)
    parts = os.cpu_count() or 1
    children = [in_child(lambda part=part: copy_part(src, dst, part, parts)) for part in range(parts)]
    directories = [result_of(child) for child in children][0]
    for path, mode, atime, mtime in reversed(directories):  # deepest first: a child's times are final
        os.chmod(dst + "/" + path, mode)
        os.utime(dst + "/" + path, ns=(atime, mtime))
    os.chmod(dst, stat.S_IMODE(info.st_mode))
    os.utime(dst, ns=(info.st_atime_ns, info.st_mtime_ns))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except OSError as error:
        sys.exit(f"python_floor.py: {error}")
