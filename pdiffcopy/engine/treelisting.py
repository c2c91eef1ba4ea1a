"""Both listings of a tree sync, made at the same time and read as they come."""

from __future__ import annotations

import itertools
import os
import signal
from typing import Iterator, List, Optional, Tuple

from pdiffcopy.errors import StorageError
from pdiffcopy.core.treeplan import Entry
from pdiffcopy.core.treestream import in_walk_order
from pdiffcopy.engine.treeendpoints import Failure, ListingStream, TreeEndpoint
from pdiffcopy.engine import workers
from pdiffcopy.engine.workers import WorkerStart


#: A local source tree listed in fewer entries than this is small: the target is walked in this
#: process too, since forking a child to walk it (the fork, its page faults, pickling) costs a
#: small tree more than the walk (no-change syncs of 1,000 files: 7 ms slower forked; even at 3,000).
SMALL_TREE_ENTRIES = 2048


def stream_both(source: TreeEndpoint, target: TreeEndpoint, on_worker_start: Optional[WorkerStart]
                ) -> Tuple[ListingStream, ListingStream]:
    """Start listing both trees; their entries come in walk order as they are read.

    Two local trees are walked by two processes when the source is not small
    (:data:`SMALL_TREE_ENTRIES`: its walk is read that far first): the walk is
    mostly Python, which two threads would run one at a time; the target's walk
    comes through a pipe, a batch at a time. A remote tree is walked by its server
    while this process walks the local one, and read as the plan needs it.
    A listing that does not come in walk order (an older server) is read whole and sorted.
    """
    if not (source.walks_here() and target.walks_here()):
        target_stream = target.stream()
        try:
            source_stream = source.stream()
        except BaseException:
            target_stream.close()
            raise
        return ordered(source_stream), ordered(target_stream)
    source_stream = source.stream()
    try:
        ahead, small = _read_ahead(source_stream, SMALL_TREE_ENTRIES)
        target_stream = target.stream() if small else _stream_in_child(target, on_worker_start)
    except BaseException:
        source_stream.close()
        raise
    source_stream = ListingStream(source_stream.root, itertools.chain(ahead, source_stream.batches),
                                  source_stream.ordered, source_stream.close)
    return ordered(source_stream), ordered(target_stream)


def _read_ahead(stream: ListingStream, most: int) -> Tuple[List[Tuple[List[Entry], List[Failure]]], bool]:
    """The first batches of ``stream``, copied (a walk reuses its lists), until ``most`` entries or
    its end; and whether it ended."""
    ahead = []
    count = 0
    while count < most:
        try:
            found, failed = next(stream.batches)
        except StopIteration:
            return ahead, True
        ahead.append((list(found), list(failed)))
        count += len(found)
    return ahead, False


def ordered(stream: ListingStream) -> ListingStream:
    """``stream`` itself when it comes in walk order; otherwise read whole and sorted (the fallback)."""
    if stream.ordered:
        return stream
    entries: List[Entry] = []
    failures: List[Failure] = []
    for found, failed in stream.batches:
        entries += found
        failures += failed
    return ListingStream(stream.root, iter([(in_walk_order(entries), failures)]), True, stream.close)


def _stream_in_child(tree: TreeEndpoint, on_worker_start: Optional[WorkerStart]) -> ListingStream:
    """Walk ``tree`` in a forked process that sends its batches through a pipe as it finds them."""
    pid, reader = workers.fork_child(lambda pipe: _send_walk(tree, pipe), on_worker_start)
    pipe = os.fdopen(reader, "rb")
    done = [False]

    def reap() -> None:
        if not done[0]:
            done[0] = True
            pipe.close()
            try:
                os.kill(pid, signal.SIGKILL)  # stopped early: the rest of its walk is not wanted
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)

    def receive():
        try:
            return workers.receive(pipe)
        except (EOFError, OSError):
            raise StorageError(f"Listing {tree.location} failed: the listing process died") from None

    try:
        kind, root = receive()
        if kind == "error":
            raise root
    except BaseException:
        reap()
        raise
    new = tuple.__new__  # Entry._make, without a Python call per entry

    def batches() -> Iterator[Tuple[List[Entry], List[Failure]]]:
        try:
            while True:
                kind, value = receive()
                if kind == "error":
                    raise value
                if kind == "end":
                    tree.add_traffic(*value)  # the child's bytes on the wire are this sync's too
                    return
                entries, failures = value
                for index, entry in enumerate(entries):  # in place: each plain tuple goes as its Entry comes
                    entries[index] = new(Entry, entry)
                yield entries, failures
        finally:
            reap()

    walk = batches()

    def close() -> None:
        walk.close()
        reap()  # a generator closed before it started runs no finally

    return ListingStream(new(Entry, root) if root else None, walk, True, close)


def _send_walk(tree: TreeEndpoint, pipe) -> None:
    send = workers.send
    try:
        stream = tree.stream()
        send(pipe, ("root", stream.root and tuple(stream.root)))
        for entries, failures in stream.batches:
            # Plain tuples pickle without naming the class.
            send(pipe, ("batch", ([tuple(entry) for entry in entries], list(failures))))
        send(pipe, ("end", tree.traffic()))
    except BrokenPipeError:
        raise
    except BaseException as error:  # handed to the parent, which raises it
        send(pipe, ("error", error))


__all__ = ["ordered", "stream_both"]
