"""Pull and push through the real server, for the awkward cases a sync must get right."""

from __future__ import annotations

import os
import shutil

import pytest

from conftest import mutate, random_bytes, run_cli
from pdiffcopy import sync

BLOCK = 4096

#: (name, source bytes, old target bytes or None for a missing target)
CASES = [
    ("identical", random_bytes(10 * BLOCK), random_bytes(10 * BLOCK)),
    ("scattered", random_bytes(20 * BLOCK + 5), mutate(random_bytes(20 * BLOCK + 5), [7, 3 * BLOCK + 1, 19 * BLOCK])),
    ("missing", random_bytes(5 * BLOCK + 3), None),
    ("target-longer", random_bytes(6 * BLOCK), random_bytes(6 * BLOCK) + b"x" * (3 * BLOCK + 11)),
    ("target-shorter", random_bytes(9 * BLOCK + 100), random_bytes(9 * BLOCK + 100)[: 4 * BLOCK + 5]),
    ("empty-source", b"", random_bytes(3 * BLOCK)),
    ("empty-both", b"", b""),
    ("one-byte", b"\x42", b"\x41"),
    ("one-byte-missing", b"\x42", None),
    ("not-multiple", random_bytes(7 * BLOCK + 1), random_bytes(7 * BLOCK + 1, seed=9)),
]


def expected_changed_blocks(source: bytes, target) -> int:
    if target is None:
        target = b""
    count = 0
    for offset in range(0, len(source), BLOCK):
        if source[offset : offset + BLOCK] != target[offset : offset + BLOCK]:
            count += 1
    return count


def arrange(server, tmp_path, unique, direction, source_data, target_data):
    """Write a source and (unless None) a target for a pull or a push.

    :returns: (SOURCE, TARGET arguments, path of the target file).
    """
    local, remote = tmp_path / "local.img", server.root / unique
    src, dst = (remote, local) if direction == "pull" else (local, remote)
    src.write_bytes(source_data)
    if target_data is not None:
        dst.write_bytes(target_data)
    args = (server.url(unique), str(local)) if direction == "pull" else (str(local), server.url(unique))
    return args, dst


@pytest.mark.parametrize("direction", ["pull", "push"])
@pytest.mark.parametrize("name,source_data,target_data", CASES, ids=[c[0] for c in CASES])
def test_sync_makes_target_identical(server, tmp_path, unique, direction, name, source_data, target_data):
    args, target_path = arrange(server, tmp_path, unique, direction, source_data, target_data)
    result = sync(*args, block_size=BLOCK, concurrency=2)
    assert target_path.read_bytes() == source_data
    assert result.verified
    assert result.changed_blocks == expected_changed_blocks(source_data, target_data)
    if target_data is not None:
        assert result.bytes_moved <= result.changed_blocks * BLOCK
    # Nothing else was left behind: no temporary files next to the target.
    assert sorted(p.name for p in target_path.parent.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_only_changed_blocks_move(server, tmp_path, unique, direction):
    source_data = random_bytes(64 * BLOCK)
    target_data = mutate(source_data, [5 * BLOCK + 10, 40 * BLOCK])
    args, dst = arrange(server, tmp_path, unique, direction, source_data, target_data)
    result = sync(*args, block_size=BLOCK)
    assert result.changed_blocks == 2
    assert result.bytes_moved == 2 * BLOCK
    assert round(result.similarity, 2) == round(100 * 62 / 64, 2)
    assert dst.read_bytes() == source_data


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_whole_file_copies_everything(server, tmp_path, unique, direction):
    source_data = random_bytes(10 * BLOCK + 1)
    target_data = source_data[:-1] + b"\x00"
    args, dst = arrange(server, tmp_path, unique, direction, source_data, target_data)
    result = sync(*args, block_size=BLOCK, whole_file=True)
    assert dst.read_bytes() == source_data
    assert result.bytes_moved == len(source_data)


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_dry_run_reports_and_changes_nothing(server, tmp_path, unique, direction):
    source_data = random_bytes(16 * BLOCK)
    target_data = mutate(source_data, [0, 8 * BLOCK, 15 * BLOCK + 100, 15 * BLOCK + 200])
    args, dst = arrange(server, tmp_path, unique, direction, source_data, target_data)
    before = os.stat(dst)
    completed = run_cli("-n", "-b", str(BLOCK), *args)
    assert completed.returncode == 0, completed.stderr
    assert "Similarity index: 81.25%" in completed.stdout
    assert "3 of 16 blocks differ" in completed.stdout
    assert dst.read_bytes() == target_data
    assert os.stat(dst).st_mtime_ns == before.st_mtime_ns


def test_dry_run_with_missing_target_creates_nothing(server, tmp_path, unique):
    (server.root / unique).write_bytes(random_bytes(3 * BLOCK))
    completed = run_cli("-n", "-b", str(BLOCK), server.url(unique), str(tmp_path / "new.img"))
    assert completed.returncode == 0, completed.stderr
    assert "Similarity index: 0.00%" in completed.stdout
    assert not (tmp_path / "new.img").exists()


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_atomic_replaces_the_file(server, tmp_path, unique, direction):
    source_data = random_bytes(30 * BLOCK + 7)
    target_data = mutate(source_data, [BLOCK * 3, BLOCK * 29])
    args, dst = arrange(server, tmp_path, unique, direction, source_data, target_data)
    inode_before = os.stat(dst).st_ino
    completed = run_cli("--atomic", "-b", str(BLOCK), *args)
    assert completed.returncode == 0, completed.stderr
    assert dst.read_bytes() == source_data
    # A new file took the old one's place (rename), and no temporary is left.
    assert os.stat(dst).st_ino != inode_before
    assert [p.name for p in dst.parent.iterdir() if ".pdiffcopy-" in p.name] == []


def test_cli_pull_and_push(server, tmp_path, unique):
    data = random_bytes(3 * 1024 * 1024 + 17)
    (tmp_path / "a.img").write_bytes(data)
    completed = run_cli(str(tmp_path / "a.img"), server.url(unique))
    assert completed.returncode == 0, completed.stderr
    assert (server.root / unique).read_bytes() == data
    completed = run_cli(server.url(unique), str(tmp_path / "b.img"))
    assert completed.returncode == 0, completed.stderr
    assert (tmp_path / "b.img").read_bytes() == data


def test_local_to_local(tmp_path):
    data = random_bytes(50 * BLOCK + 3)
    (tmp_path / "a").write_bytes(data)
    (tmp_path / "b").write_bytes(mutate(data, [BLOCK * 10]))
    result = sync(str(tmp_path / "a"), str(tmp_path / "b"), block_size=BLOCK)
    assert (tmp_path / "b").read_bytes() == data
    assert result.changed_blocks == 1


def test_benchmark_mode_creates_and_resyncs_target(tmp_path):
    source = tmp_path / "source.img"
    target = tmp_path / "target.img"
    data = random_bytes(40 * BLOCK + 5)
    source.write_bytes(data)
    completed = run_cli("-B", "2", "-b", str(BLOCK), str(source), str(target))
    assert completed.returncode == 0, completed.stderr
    rows = [line for line in completed.stdout.splitlines() if line.startswith("| ") and "%" in line]
    # Round 1 mutates round(50 % of 41) = 20 blocks, one of which may be the 5-byte last block;
    # "Of the file" is the share that moved: 19 or 20 blocks of 40, 48 % to 50 %.
    rows = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]
    assert [row[1] for row in rows] == ["50%", "100%"]  # the blocks mutated
    moved = float(rows[0][2].split()[0])
    assert 19 * 4 <= moved <= 20 * 4
    assert [row[3] for row in rows] == ["%d%%" % round(100 * moved / 160), "100%"]
    assert rows[1][2] == "160 KiB"  # every block, 40 * 4 KiB + 5 bytes
    if shutil.which("rsync"):
        assert all(row[5].endswith(" s") for row in rows)
    assert target.read_bytes() == data
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    # With a local source, whole-file copies are compared too, every one verified.
    copies = [line.split("|")[1].strip() for line in completed.stdout.splitlines()
              if line.startswith("| ") and "MB/s" in line]
    assert copies[:3] == ["pdiffcopy -W", "shutil.copyfile", "cp"]


def test_verification_catches_a_corrupted_write(server, tmp_path, unique, monkeypatch):
    """A write that lands wrong (here: one flipped byte) fails the sync; --atomic keeps the old file."""
    import pdiffcopy.local.localfile
    from pdiffcopy.errors import VerificationFailed

    real_write_all = pdiffcopy.local.localfile.write_all

    def corrupting_write_all(fd, data, offset):
        data = bytearray(data)
        data[0] ^= 0xFF
        real_write_all(fd, data, offset)

    monkeypatch.setattr(pdiffcopy.local.localfile, "write_all", corrupting_write_all)
    data = random_bytes(8 * BLOCK)
    old = mutate(data, [3 * BLOCK])
    (server.root / unique).write_bytes(data)
    (tmp_path / "b").write_bytes(old)
    with pytest.raises(VerificationFailed, match="1 block"):
        sync(server.url(unique), str(tmp_path / "b"), block_size=BLOCK, atomic=True)
    assert (tmp_path / "b").read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


@pytest.mark.parametrize("method", ["xxh3_64", "md5", "sha256", "blake3", "shake_128"])
@pytest.mark.parametrize("direction", ["pull", "push"])
def test_every_kind_of_hash_method(server, tmp_path, unique, direction, method):
    """Weak (64-bit) block hashes still verify with a strong one; others verify with their own."""
    source_data = random_bytes(12 * BLOCK + 9)
    target_data = mutate(source_data, [BLOCK + 3, 11 * BLOCK])
    args, dst = arrange(server, tmp_path, unique, direction, source_data, target_data)
    result = sync(*args, block_size=BLOCK, hash_method=method)
    assert dst.read_bytes() == source_data
    assert result.changed_blocks == 2
    # The whole-file digest is at least 128 bits even when the block hash is not.
    assert len(result.digest) >= 32


def test_push_works_through_the_plain_wsgi_body_path(tmp_path):
    """The server's direct socket reading can be switched off; pushes work the same."""
    from conftest import start_server

    root = tmp_path / "root"
    root.mkdir()
    data = random_bytes(70 * BLOCK + 1)
    (tmp_path / "a.img").write_bytes(data)
    (root / "a.img").write_bytes(mutate(data, [0, 33 * BLOCK, 69 * BLOCK]))
    import os as _os

    _os.environ["PDIFFCOPY_DIRECT_BODY"] = "0"
    try:
        server = start_server(root, tmp_path / "server.log")
    finally:
        del _os.environ["PDIFFCOPY_DIRECT_BODY"]
    try:
        result = sync(str(tmp_path / "a.img"), server.url("a.img"), block_size=BLOCK)
    finally:
        server.stop()
    assert (root / "a.img").read_bytes() == data
    assert result.changed_blocks == 3
