"""Both listings of a tree sync, made at the same time."""

from __future__ import annotations

import threading
from typing import Callable, List, Optional, Tuple

from pdiffcopy.errors import StorageError
from pdiffcopy.core.treeplan import Entry
from pdiffcopy.engine.treeendpoints import Listing, TreeEndpoint
from pdiffcopy.engine.workers import Worker, WorkerFailed, WorkerStart


def list_both(source: TreeEndpoint, target: TreeEndpoint, on_worker_start: Optional[WorkerStart]
              ) -> Tuple[Listing, Listing]:
    """List both trees at the same time.

    A remote tree is listed by its server while this process walks the
    local one (a thread waits for the answer). Two local trees are walked by
    two processes: the walk is mostly Python, which two threads would run
    one at a time (64,000 entries: 0.38 s each; the child's list costs
    ~0.1 s to pickle and 0.03 s to read back).
    """
    if source.walks_here() and target.walks_here():
        receive = _list_in_child(target, on_worker_start)
        try:
            source_listing = source.list()
        except BaseException:
            try:
                receive()  # reap the child
            except BaseException:
                pass
            raise
        return source_listing, receive()
    listed: List[Listing] = []
    errors: List[BaseException] = []

    def list_target() -> None:
        try:
            listed.append(target.list())
        except BaseException as error:  # handed to the caller below
            errors.append(error)

    thread = threading.Thread(target=list_target, name="list-target")
    thread.start()
    try:
        source_listing = source.list()
    finally:
        thread.join()
    if errors:
        raise errors[0]
    return source_listing, listed[0]


def _list_in_child(tree: TreeEndpoint, on_worker_start: Optional[WorkerStart]) -> Callable[[], Listing]:
    """Start listing ``tree`` in a forked process; return the function that collects it."""
    def listed() -> tuple:
        listing = tree.list()
        entries = listing.entries
        # Plain tuples pickle without naming the class; replaced in place, not copied, so the
        # child never holds the listing twice.
        for index, entry in enumerate(entries):
            entries[index] = tuple(entry)
        return (listing.root and tuple(listing.root), entries, listing.failures, tree.traffic())

    worker = Worker(listed, on_worker_start)

    def receive() -> Listing:
        try:
            root, entries, failures, child_wire = worker.answer()
        except WorkerFailed as failed:
            if failed.error is not None:
                raise failed.error from None
            raise StorageError(f"Listing {tree.location} failed: the listing process died") from None
        tree.add_traffic(*child_wire)  # the child's bytes on the wire are this sync's too
        new = tuple.__new__  # Entry._make, without a Python call per entry
        for index, entry in enumerate(entries):  # in place: each plain tuple goes as its Entry comes
            entries[index] = new(Entry, entry)
        return Listing(new(Entry, root) if root else None, entries, failures)

    return receive


__all__ = ["list_both"]
