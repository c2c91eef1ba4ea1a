"""rsync's filter habits: --include/--exclude globs, --exclude-from, --files-from, and -i/-e regexes."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import run_cli
from test_tree import snapshot


def sync(*args, ok: bool = True, input_text=None):
    if input_text is None:
        done = run_cli("--no-progress", *map(str, args))
    else:
        from conftest import pdiffcopy_command

        done = subprocess.run(pdiffcopy_command("--no-progress", *map(str, args)), input=input_text,
                              capture_output=True, text=True, timeout=60)
    if ok:
        assert done.returncode == 0, done.stderr
    return done


def small_tree(root: Path) -> Path:
    """Names that tell rsync's anchoring rules apart: sub/ at the top and deeper down."""
    for name in ("a.txt", "b.bin", "core.tmp", "sub/c.bin", "sub/d.txt", "sub/deeper/e.bin",
                 "x/sub/f.bin", "x/sub/g.txt", "x/y/z/h.bin", "build/out.o", "x/build/keep.o"):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(name.encode())
    (root / "empty").mkdir()
    return root


def names(root: Path) -> set:
    return set(snapshot(root))


RSYNC_CASES = [
    ["--exclude", "*.bin"],
    ["--exclude", "sub/"],
    ["--exclude", "/sub/"],
    ["--exclude", "sub/*.bin"],
    ["--exclude", "/sub/*.bin"],
    ["--exclude", "x/**/*.bin"],
    ["--exclude", "s?b"],
    ["--exclude", "[a-c].*"],
    ["--exclude", "/build/"],
    ["--exclude", "sub/***"],
    ["--include", "*.bin", "--include", "*/", "--exclude", "*"],
    ["--include", "/sub/", "--include", "/sub/**", "--exclude", "*"],
    ["--include", "d.txt", "--exclude", "*.txt", "--exclude", "/x/"],
    # A leading **/ may stand for no directory (issue 35): the top level's names match too;
    # anchored, or in the middle, it stands for one directory or more, as in rsync.
    ["--exclude", "**/*.bin"],
    ["--exclude", "**/sub/"],
    ["--exclude", "/**/a.txt"],
    ["--exclude", "x/**/sub/"],
    ["--exclude", "**/x/**/*.txt"],
]


@pytest.mark.skipif(shutil.which("rsync") is None, reason="needs rsync to compare with")
@pytest.mark.parametrize("rules", RSYNC_CASES, ids=[" ".join(r) for r in RSYNC_CASES])
def test_globs_select_what_rsync_selects(tmp_path, rules):
    """Anchoring, trailing slashes, * and **, first match wins: the same files as rsync -r."""
    tree = small_tree(tmp_path / "src")
    subprocess.run(["rsync", "-r", *rules, f"{tree}/", f"{tmp_path / 'by-rsync'}/"], check=True,
                   capture_output=True, timeout=30)
    sync(*rules, f"{tree}/", tmp_path / "by-pdiffcopy")
    assert names(tmp_path / "by-pdiffcopy") == names(tmp_path / "by-rsync")


def test_regex_options_keep_their_meaning_and_get_long_names(tmp_path):
    tree = small_tree(tmp_path / "src")
    sync("--exclude-regex", r"\.bin$", "--exclude-regex", "^x/", f"{tree}/", tmp_path / "dst")
    assert names(tmp_path / "dst") == {"a.txt", "core.tmp", "sub", "sub/d.txt", "sub/deeper", "build",
                                       "build/out.o", "empty"}
    sync("--include-regex", r"\.o$", f"{tree}/", tmp_path / "dst2")
    assert names(tmp_path / "dst2") == {"build", "build/out.o", "x", "x/build", "x/build/keep.o"}


def test_glob_rules_come_before_regexes(tmp_path):
    """A glob include rescues what a regex excludes; an unmatched path falls to the regexes."""
    tree = small_tree(tmp_path / "src")
    sync("--include", "c.bin", "--exclude-regex", r"\.bin$", f"{tree}/", tmp_path / "dst")
    got = names(tmp_path / "dst")
    assert "sub/c.bin" in got and "b.bin" not in got and "sub/deeper/e.bin" not in got


@pytest.mark.parametrize("option,glob,hint", [("--exclude-regex", "*.tmp", "--exclude"),
                                              ("--include-regex", "?x", "--include"),
                                              ("--exclude-regex", "**", "--exclude")])
def test_glob_given_to_a_regex_option_gets_a_hint(tmp_path, option, glob, hint):
    tree = small_tree(tmp_path / "src")
    done = sync(option, glob, f"{tree}/", tmp_path / "dst", ok=False)
    assert done.returncode == 1
    assert f"looks like a glob: use {hint}" in done.stderr
    assert "nothing to repeat" not in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "dst").exists()


def test_exclude_from_reads_patterns_and_ignores_comments(tmp_path):
    tree = small_tree(tmp_path / "src")
    rules = tmp_path / "rules"
    rules.write_text("# build products\n*.o\n\n; scratch\ncore.tmp\n+ /x/y/\n- /x/\n")
    sync("--exclude-from", rules, f"{tree}/", tmp_path / "dst")
    assert names(tmp_path / "dst") == {"a.txt", "b.bin", "sub", "sub/c.bin", "sub/d.txt", "sub/deeper",
                                       "sub/deeper/e.bin", "build", "empty"}


def test_missing_exclude_from_is_one_line(tmp_path):
    tree = small_tree(tmp_path / "src")
    done = sync("--exclude-from", tmp_path / "nope", f"{tree}/", tmp_path / "dst", ok=False)
    assert done.returncode == 1
    assert str(tmp_path / "nope") in done.stderr and "Traceback" not in done.stderr


def test_files_from_transfers_only_the_listed_paths_and_their_parents(tmp_path):
    tree = small_tree(tmp_path / "src")
    listing = tmp_path / "list"
    listing.write_text("# wanted\nsub/deeper/e.bin\n\n./a.txt\n; the whole of x/y\nx/y/\n")
    target = tmp_path / "dst"
    target.mkdir()
    (target / "mine").write_bytes(b"not listed: never deleted")
    sync("--delete", "--files-from", listing, f"{tree}/", target)
    assert names(target) == {"a.txt", "sub", "sub/deeper", "sub/deeper/e.bin", "x", "x/y", "x/y/z",
                             "x/y/z/h.bin", "mine"}


def test_files_from_stdin(tmp_path):
    tree = small_tree(tmp_path / "src")
    sync("--files-from", "-", f"{tree}/", tmp_path / "dst", input_text="b.bin\nsub/d.txt\n")
    assert names(tmp_path / "dst") == {"b.bin", "sub", "sub/d.txt"}


def test_glob_filters_through_the_server_pull_and_push(tmp_path, server, unique):
    tree = small_tree(tmp_path / "src")
    name = unique.replace(".img", "")
    url = server.url(name) + "/"
    sync("--exclude", "*.bin", "--exclude", "/x/", f"{tree}/", url)
    assert names(server.root / name) == {"a.txt", "core.tmp", "sub", "sub/d.txt", "sub/deeper", "build",
                                         "build/out.o", "empty"}
    listing = tmp_path / "list"
    listing.write_text("sub/d.txt\n")
    sync("--files-from", listing, url, tmp_path / "back")
    assert names(tmp_path / "back") == {"sub", "sub/d.txt"}
    os.remove(server.root / name / "a.txt")


def test_remove_takes_glob_filters(tmp_path):
    tree = small_tree(tmp_path / "src")
    sync("--remove", "--exclude", "*.txt", tree)
    assert names(tree) == {"a.txt", "sub", "sub/d.txt", "x", "x/sub", "x/sub/g.txt"}


def test_files_from_entries_are_normalised_as_rsync_normalises_them(ends, tmp_path):
    """``a//b`` is ``a/b``, and ``from/./dir`` is rsync's relative-path marker: ``from/dir``
    synced as ``dir``. Both once selected nothing, silently."""
    if shutil.which("rsync") is None:
        pytest.skip("rsync is not installed")
    tree = small_tree(ends.source)
    for name in ("from/dir/f.txt", "from/dir/deep/g.bin", "from/other"):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_bytes(name.encode())
    listing = tmp_path / "list"
    listing.write_text("from/./dir\nx//y/\nsub/./deeper/e.bin\n./a.txt\n")
    sync("-a", "--files-from", listing, ends.source_arg(), ends.target_arg)
    reference = tmp_path / "rsync"
    subprocess.run(["rsync", "-a", "-r", "--files-from", str(listing), f"{tree}/", f"{reference}/"], check=True)
    assert names(ends.target) == names(reference) == {
        "a.txt", "dir", "dir/f.txt", "dir/deep", "dir/deep/g.bin", "x", "x/y", "x/y/z", "x/y/z/h.bin",
        "deeper", "deeper/e.bin"}
    assert snapshot(ends.target) == snapshot(reference)


def test_a_missing_files_from_entry_is_reported_with_exit_23(ends, tmp_path):
    """As rsync's: the others are synced, each missing one is named, and the exit status is 23."""
    tree = small_tree(ends.source)
    listing = tmp_path / "list"
    listing.write_text("a.txt\nnonexistent/x\nsub/missing.bin\nsub/d.txt\n")
    done = sync("-a", "--files-from", listing, ends.source_arg(), ends.target_arg, ok=False)
    assert done.returncode == 23, done.stderr
    assert "nonexistent/x" in done.stderr and "sub/missing.bin" in done.stderr
    assert "Traceback" not in done.stderr
    assert names(ends.target) == {"a.txt", "sub", "sub/d.txt"}
    if shutil.which("rsync"):
        rsynced = subprocess.run(["rsync", "-a", "--files-from", str(listing), f"{tree}/", str(tmp_path / "r")],
                                 capture_output=True)
        assert rsynced.returncode == 23


@pytest.mark.parametrize("option", ["--exclude-from", "--files-from"])
def test_a_list_reached_through_another_users_symlink_is_refused(tmp_path, option):
    """As rsync 3.5.0: in a shared directory, another user's link would choose what the sync reads."""
    tree = small_tree(tmp_path / "src")
    listing = tmp_path / "list"
    listing.write_text("a.txt\n")
    (tmp_path / "shared").mkdir()
    os.symlink(listing, tmp_path / "shared" / "theirs")
    os.lchown(tmp_path / "shared" / "theirs", 65534, 65534)
    os.symlink(listing, tmp_path / "shared" / "mine")
    refused = sync(option, tmp_path / "shared" / "theirs", f"{tree}/", tmp_path / "dst", ok=False)
    assert refused.returncode == 1 and "another user" in refused.stderr and "Traceback" not in refused.stderr
    assert not (tmp_path / "dst").exists()
    sync(option, tmp_path / "shared" / "mine", f"{tree}/", tmp_path / "dst")
    assert (tmp_path / "dst" / "a.txt").exists() is (option == "--files-from")  # the list was read
