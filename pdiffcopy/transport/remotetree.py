"""A directory tree behind a pdiffcopy server, as a :class:`~pdiffcopy.engine.treeendpoints.TreeEndpoint`.

:class:`RemoteTree` speaks the tree endpoints of :mod:`pdiffcopy.server.treeserver`
(docs/protocol.rst, section Trees) through the transport of
:mod:`pdiffcopy.transport.remote` (:class:`~pdiffcopy.transport.httpclient.HttpClient`): the same
keep-alive connections, token, TLS, timeouts, 503 retries and one-line
errors as a file sync. Batches larger than one request may carry are split
into several requests, in order. Big files go through
:meth:`RemoteTree.file_endpoint`, a :class:`~pdiffcopy.transport.remote.RemoteFile`.

It may be used from several threads at once (each has its own connection)
and from processes forked after it was made (each opens its own).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import posixpath
import time
from typing import Any, Dict, FrozenSet, Iterable, Iterator, List, Optional, Sequence, Set, Tuple
from urllib.parse import quote

from pdiffcopy.transport import counters
from pdiffcopy.errors import AccessDenied, PdiffcopyError, RemoteError, ServerFailed
from pdiffcopy.core.jsonstream import JsonStream
from pdiffcopy.core import compression, packedlisting
from pdiffcopy.engine.forkshared import Throttle
from pdiffcopy.transport.compressionpolicy import Compression, compressing_cores
from pdiffcopy.transport.httpclient import DEFAULT_TIMEOUT, HttpClient
from pdiffcopy.transport.remote import RemoteFile
from pdiffcopy.core.locations import quote_path
from pdiffcopy.transport.urls import split_server_url
from pdiffcopy.engine.treeendpoints import (
    BACKUP,
    LINK,
    TAKEN_FROM_ALTERNATES,
    Alternates,
    Failure,
    KeptAttributes,
    Listing,
    ListingStream,
    MetadataOptions,
    Operation,
    ServedTree,
    TreeEndpoint,
)
from pdiffcopy.core.treeplan import FILE, Entry
from pdiffcopy.core.treewire import (
    MAX_BATCH_BYTES,
    MAX_BATCH_FILES,
    MAX_BATCH_OPERATIONS,
    MAX_FILE_BYTES,
    MAX_JSON_BODY_BYTES,
    MAX_JSON_ITEM_CHARS,
    NOT_ATTEMPTED,
    NODES_HEADER,
    NOT_KEPT_HEADER,
    PACKED_RECORDS_PARAMETER,
    TREE_ORDER_HEADER,
    TREE_ORDER_WALK,
    Record,
    TreeWireError,
    ExactSource,
    check_relative_path,
    decode_files,
    encode_files,
    parse_entry,
    stop_cause,
)

logger = logging.getLogger(__name__)

#: JSON bytes a read or apply request is kept under: half the server's limit,
#: which leaves room for the escaping of odd names measured per item.
_JSON_BATCH_BYTES = MAX_JSON_BODY_BYTES // 2

#: Most bytes of files one plain write request carries: its body is gathered before it is sent.
SIZED_WRITE_BYTES = 16 * 1024 * 1024

#: Entries of a listing handed on at a time as they are read (the local walk's batch size too).
LISTING_BATCH_ENTRIES = 2048


class RemoteTree(TreeEndpoint):
    """The tree at a directory URL (``http(s)://HOST:PORT/some/dir``, with or without a final slash).

    :param rate_limit: The bucket every byte on the wire is taken from (``--bwlimit``): one
                       for the whole sync, in shared memory for its worker processes.
    :param compress: A mode (``"auto"``, ``"always"``, ``"never"``) or a
                     :class:`~pdiffcopy.transport.compressionpolicy.Compression` to share, as
                     :class:`~pdiffcopy.transport.remote.RemoteFile` takes it.
    """

    capabilities = (ServedTree, KeptAttributes, Alternates)

    def __init__(self, url: str, token: Optional[str] = None, concurrency: int = 4,
                 timeout: float = DEFAULT_TIMEOUT, ca_file: Optional[str] = None,
                 compress: "str | Compression" = "auto", rate_limit: Optional[Throttle] = None) -> None:
        self.location = url
        self.base, path = split_server_url(url)
        #: The tree's path below the server's root ("" for the root itself).
        self.path = path.strip("/")
        self.token = token
        self.concurrency = concurrency
        self.timeout = timeout
        self.ca_file = ca_file
        self.client = HttpClient(self.base, token, timeout, ca_file, rate_limit)
        #: One for the tree's files: what the first big files showed of the link serves the next.
        self.compression = compress if isinstance(compress, Compression) else Compression(
            compress, self.base, cores=compressing_cores(self.concurrency))
        self._warned: set = set()
        self._notices: List[str] = []
        #: What the listing asks for (-X, -A; :meth:`list_attributes`), or None.
        self._attributes: Optional[MetadataOptions] = None
        #: The listing removes the temporaries of writers that are gone (:meth:`sweep_while_listing`).
        self._sweep = False
        #: What the sync will ask of this target (:meth:`expect_writes`): sent with the listing.
        self._asked: Tuple[str, ...] = ()
        #: The server sent a packed listing, so it takes packed record headers too (before: JSON only).
        self._server_packs = False
        #: The listing describes a root that is a symlink as the link (:meth:`describe_root_link`).
        self._root_link = False
        #: What the server's listing said it does not set of what clients send (:meth:`not_kept`).
        self._not_kept: FrozenSet[str] = frozenset()
        #: The nodes the server's listing said it makes (:meth:`makes_nodes`): an older one, none.
        self._nodes: FrozenSet[str] = frozenset()

    def _target(self, endpoint: str, options: Optional[MetadataOptions] = None) -> str:
        target = f"/.pdiffcopy/{endpoint}/{quote_path(self.path)}"
        if options is not None:
            target += f"?times={int(options.times)}&owner={int(options.owner)}&fsync={int(options.fsync)}"
            target += _attribute_flags(options, "&")
            if options.sparse:  # only when asked: an older server ignores it, and writes the zeros
                target += "&sparse=1"
        return target

    # -- TreeEndpoint ----------------------------------------------------

    def list(self) -> Listing:
        """The listing, read and checked entry by entry as the server sends it."""
        stream = self.stream()
        entries: List[Entry] = []
        failures: List[Failure] = []
        for found, failed in stream.batches:
            entries += found
            failures += failed
        return Listing(stream.root, entries, failures)

    def stream(self) -> ListingStream:
        """The root entry now; the rest as the iterator reads it from the server.

        The server streams the listing (docs/protocol.rst): the answer ends with
        ``"complete": true``, or with ``"error"`` when the walk failed midway.
        The failures come last, after every entry. A server that says
        ``Pdiffcopy-Tree-Order: walk`` sends the entries in
        :func:`~pdiffcopy.core.treeplan.walk_order`; an older one in no particular order.
        """
        target = self._target("tree")
        if self._attributes is not None:
            target += _attribute_flags(self._attributes, "?")
        if self._sweep:  # an older server ignores it
            target += ("&" if "?" in target else "?") + "sweep=1"
        if self._asked:  # an older server ignores it
            target += ("&" if "?" in target else "?") + "asking=" + ",".join(self._asked)
        if self._root_link:  # an older server ignores it: it follows the link
            target += ("&" if "?" in target else "?") + "root_link=1"
        # The packed form when the server knows it; an older one answers JSON, as it always did.
        response = self.client.request("GET", target, headers={"Accept": _LISTING_FORMS})
        try:
            ordered = response.headers.get(TREE_ORDER_HEADER, "").strip().lower() == TREE_ORDER_WALK
            packed = packedlisting.media_type(response.headers.get("Content-Type")) == packedlisting.PACKED_LISTING_TYPE
            self._server_packs = self._server_packs or packed
            self._not_kept = _names(response.headers.get(NOT_KEPT_HEADER, ""))
            self._nodes = _names(response.headers.get(NODES_HEADER, ""))
            root: Optional[Entry] = None
            with self._reading_listing():
                if packed:
                    source = ExactSource(response.raw)
                    root = packedlisting.decode_head(source.read)
                    reader = JsonStream(source, MAX_JSON_ITEM_CHARS, error=_MalformedListing)
                    key: Optional[str] = "entries"
                else:
                    source = None
                    reader = JsonStream(response.raw, MAX_JSON_ITEM_CHARS, error=_MalformedListing)
                    reader.begin_object()
                    key = reader.next_key()
                    if key == "root":
                        value = reader.value()
                        root = None if value is None else parse_entry(value, allow_root=True)
                        key = reader.next_key()
        except BaseException:
            response.close()
            raise
        batches = self._listing_batches(response, reader, key, source)

        def close() -> None:
            batches.close()
            response.close()  # a generator closed before it started runs no finally

        return ListingStream(root, batches, ordered, close)

    @contextlib.contextmanager
    def _reading_listing(self) -> Iterator[None]:
        try:
            yield
        except (_MalformedListing, PdiffcopyError, KeyError, TypeError, ValueError) as error:
            if isinstance(error, RemoteError):
                raise
            raise self.client.malformed(f"listing: {error}" if str(error) else "listing") from None
        except (OSError, http.client.HTTPException) as error:
            raise self.client.lost(error) from None

    def _listing_batches(self, response, reader: JsonStream, key: Optional[str], packed: Optional[ExactSource]
                         ) -> Iterator[Tuple[List[Entry], List[Failure]]]:
        """The rest of a listing after its root, in batches of about ``LISTING_BATCH_ENTRIES``
        (a packed listing's: as the server cut them)."""
        try:
            complete = False
            with self._reading_listing():
                if packed is not None:
                    for entries in packedlisting.decode_batches(packed.read):
                        yield entries, []
                    # The ending, in JSON: the rest of the object whose "{" came with the end marker.
                    reader.begin_object()
                    key = reader.next_key()
                while key is not None:
                    if key == "entries" and packed is not None:
                        raise _MalformedListing("entries after the packed ones")
                    if key == "entries":
                        batch: List[Entry] = []
                        for value in reader.items():
                            batch.append(parse_entry(value))
                            if len(batch) >= LISTING_BATCH_ENTRIES:
                                yield batch, []
                                batch = []
                        if batch:
                            yield batch, []
                    elif key == "failures":
                        yield [], _failures(list(reader.items()))
                    elif key == "complete":
                        complete = reader.value() is True
                    elif key == "error":
                        message = " ".join(str(reader.value()).splitlines())[:1000]
                        raise ServerFailed(f"Server {self.client.base} could not list "
                                           f"{self.location}: {message}")
                    else:
                        reader.value()  # a key of a later version: ignored
                    key = reader.next_key()
                reader.end()
                if not complete:
                    raise _MalformedListing("it ended early")
        finally:
            response.close()

    def read_files(self, entries: Sequence[Entry]) -> Iterator[Tuple[Entry, Optional[bytes], str]]:
        """Yield each file as the server sends it, one request per batch the server accepts.

        A file too large to travel whole, or not a regular file, is a
        failure without a request; the block engine moves big files.
        """
        readable: List[Entry] = []
        for entry in entries:
            refusal = _leaves_the_tree(entry.path)
            if refusal:
                yield entry, None, refusal
            elif entry.kind != FILE:
                yield entry, None, f"not a regular file but a {entry.kind}"
            elif entry.size > MAX_FILE_BYTES:
                yield entry, None, f"too large to copy whole ({entry.size} bytes)"
            else:
                readable.append(entry)
        if self._server_packs:  # it takes the entries packed too, a fifth of the work of JSON at each end
            batches: Iterable[Tuple[List[Entry], bytes]] = _packed_batches(readable)
            content_type = packedlisting.PACKED_LISTING_TYPE
        else:
            batches = _batches(readable, MAX_BATCH_FILES, MAX_BATCH_BYTES, lambda entry: entry.size,
                               lambda entry: entry.to_wire(), "entries")
            content_type = "application/json"
        for batch, body in batches:
            yield from self._read_batch(batch, body, content_type)

    def _read_batch(self, entries: List[Entry], body: bytes, content_type: str) -> Iterator[Record]:
        """One read request (``body``: its entries, JSON or packed), decoded as it arrives; the records come
        in the order asked."""
        # A connection of its own: the caller reads the answer at its pace,
        # maybe from several threads, and may send other requests meanwhile.
        connection = self.client.dedicated()
        headers = {"Content-Type": content_type}
        # Packed record headers: an older server ignores the parameter and sends JSON ones.
        target = self._target("tree-read") + f"?{PACKED_RECORDS_PARAMETER}=1"
        level = self.compression.level()
        if level is not None:
            headers["Accept-Encoding"] = compression.ENCODING
            target += f"&{compression.LEVEL_PARAMETER}={level}"
        # A plain batch tells the adaptive rule how fast the link is and how the data shrinks.
        learning = self.compression.learning()
        started, moved, sample = time.perf_counter(), 0, b""
        try:
            response = self.client.request("POST", target, body=body,
                                           headers=headers, connection=connection)
        except BaseException:
            self.client.release(connection)  # an error answer was read whole: still usable
            raise
        try:
            position = 0
            coded = (response.headers.get("Content-Encoding") or "").strip().lower() == compression.ENCODING
            stream = compression.DecompressingReader(response.raw, TreeWireError) if coded else response.raw
            for sent, data, error in decode_files(stream, expected=entries):
                if position == len(entries) or sent.path != entries[position].path:
                    raise self.client.malformed(f"it sent {sent.path!r}, which was not asked for "
                                                f"at that point")
                if learning and data:
                    moved += len(data)
                    if len(sample) < compression.SAMPLE_BYTES:
                        sample += data[:compression.SAMPLE_BYTES - len(sample)]
                yield entries[position], data, error
                position += 1
            if position != len(entries):
                raise self.client.malformed(f"it left out {len(entries) - position} of the files")
            if learning:
                self.compression.observed(moved, time.perf_counter() - started, sample)
        except TreeWireError as error:
            raise self.client.malformed(str(error)) from None
        except (OSError, http.client.HTTPException) as error:
            raise self.client.lost(error) from None
        finally:
            response.close()  # closes the connection unless the answer was read to its end
            self.client.release(connection)

    def write_files(self, files: Iterable[Tuple[Entry, bytes]], options: MetadataOptions,
                    fresh: bool = False) -> List[Failure]:
        """Send the files in as few requests as the server's bounds allow: plain ones gathered into
        bodies of known length, at most :data:`SIZED_WRITE_BYTES` of files each (or one bigger
        file); compressed or rate-limited ones streamed."""
        failures: List[Failure] = []
        pending = _Pending(files)
        while pending.more():
            headers = {"Content-Type": "application/octet-stream"}
            # Only to a server that lists our compressed PATCH bodies: an older one would refuse it.
            learning = self.compression.learning()
            level = self.compression.level()
            compressing = level is not None and self.client.patch_frames
            # A body of known length is read straight from the socket by the server; a chunked one
            # through gunicorn's chunk parser. Streamed when compressed, and under --bwlimit, whose
            # bucket paces a streamed body chunk by chunk.
            sized = not compressing and self.client.rate_limit is None
            records = self._write_batch(pending, failures,
                                        min(SIZED_WRITE_BYTES, MAX_BATCH_BYTES) if sized else MAX_BATCH_BYTES)
            body: Any = encode_files(records, packed=self._server_packs)
            if compressing:
                body = compression.compressed_stream(body, level)
                headers["Content-Encoding"] = compression.ENCODING
            elif sized:
                body = b"".join(body)
            elif learning:
                body = _measured(body)
            started = time.perf_counter()
            response = self.client.request(
                "POST", self._target("tree-write", options) + f"&fresh={int(fresh)}", body=body,
                headers=headers, replayable=False)
            answered = self._failures_of(response)
            failures.extend(answered)
            if any(stop_cause(message)[0] for _, message in answered):
                # The rest would fail the same way.
                failures.extend((entry.path, NOT_ATTEMPTED) for entry, _ in pending)
            if learning and sized:
                self.compression.observed(len(body), time.perf_counter() - started,
                                          body[:compression.SAMPLE_BYTES])
            elif learning and isinstance(body, _measured):
                self.compression.observed(body.count, time.perf_counter() - started, bytes(body.sample))
        return failures

    @staticmethod
    def _write_batch(pending: "_Pending", failures: List[Failure], max_bytes: int) -> Iterator[Record]:
        """The records of one write request (at most ``max_bytes`` of files, or one file), taken from
        ``pending`` as the body is made."""
        count = total = 0
        for entry, data in pending:
            refusal = _leaves_the_tree(entry.path)
            if refusal:
                failures.append((entry.path, refusal))
                continue
            if len(data) != entry.size:
                failures.append((entry.path, f"got {len(data)} bytes, expected {entry.size}"))
                continue
            if len(data) > MAX_FILE_BYTES:
                failures.append((entry.path, f"too large to copy whole ({len(data)} bytes)"))
                continue
            if count and (count == MAX_BATCH_FILES or total + len(data) > max_bytes):
                pending.put_back((entry, data))  # starts the next request
                return
            count += 1
            total += len(data)
            yield entry, data, ""

    def apply(self, operations: Sequence[Operation], options: MetadataOptions) -> List[Failure]:
        """Send the operations in order; one whose path leaves the tree is a failure, never sent.

        Such failures come first in the list, before those the server reports.
        """
        failures: List[Failure] = []
        allowed: List[Operation] = []
        for operation in operations:
            refusal = _leaves_the_tree(operation.entry.path, allow_root=True)
            if not refusal and operation.name == LINK:
                refusal = _leaves_the_tree(operation.entry.target)  # the file it is linked to
            if operation.name == BACKUP and operation.entry.target.startswith("/"):
                operation = Operation(BACKUP, operation.entry._replace(target=self._from_server_root(
                    operation.entry.target)))
            if refusal:
                failures.append((operation.entry.path, refusal))
            else:
                allowed.append(operation)
        stopped = False
        for batch, body in _batches(allowed, MAX_BATCH_OPERATIONS, None, None,
                                    lambda operation: operation.to_wire(), "operations"):
            if stopped:  # the rest would fail the same way
                failures.extend((operation.entry.path, NOT_ATTEMPTED) for operation in batch)
                continue
            response = self.client.request("POST", self._target("tree-apply", options), body=body,
                                           headers={"Content-Type": "application/json"})
            answered = self._failures_of(response)
            failures.extend(answered)
            stopped = any(stop_cause(message)[0] for _, message in answered)
        return failures

    def describe_root_link(self) -> None:
        self._root_link = True

    def expect_writes(self, asked: Tuple[str, ...]) -> None:
        self._asked = tuple(asked)

    def sweep_while_listing(self) -> None:
        """Have the server remove the temporaries of writers that are gone as it lists the tree."""
        self._sweep = True

    def list_attributes(self, options: MetadataOptions) -> None:
        self._attributes = options if options.attributes else None

    def take_notices(self) -> List[str]:
        notices, self._notices = self._notices, []
        return notices

    def not_kept(self) -> FrozenSet[str]:
        return self._not_kept

    def makes_nodes(self) -> FrozenSet[str]:
        return self._nodes

    def may_change_root(self) -> bool:
        return self.path != ""  # the server keeps its root directory as it is

    def file_endpoint(self, path: str) -> RemoteFile:
        # A member's path is relative; an absolute one is refused as a local
        # tree refuses it (the URL would quietly make it relative again).
        if path.startswith("/"):
            raise AccessDenied(f"Path outside the root: {path[:200]!r}")
        full = f"{self.path}/{path}" if self.path else path
        # Not followed, as a local tree's member is not: a member that became a
        # symlink since the listing is refused (NotAFile), never read through.
        return RemoteFile(f"{self.base}/{quote_path(full)}", self.token, self.concurrency,
                          self.timeout, self.ca_file, rate_limit=self.client.rate_limit, follow=False,
                          compress=self.compression)

    def traffic(self) -> Tuple[int, int]:
        return counters.totals()

    def add_traffic(self, sent: int, received: int) -> None:
        counters.add(sent, received)

    def close(self) -> None:
        self.client.close()

    # -- Alternates --------------------------------------------------------

    def takes_from_alternates(self) -> bool:
        return True

    def take_from_alternates(self, entries: Sequence[Entry], existing: Set[str], directories: Sequence[str],
                             use: str, options: MetadataOptions, dry_run: bool = False
                             ) -> Tuple[Dict[str, str], int, List[Failure]]:
        """The server takes them, in batches: the directories are its, relative to the tree (an
        absolute one is from the server's root: over ssh, the host's ``/``)."""
        directories = [self._from_server_root(directory) if directory.startswith("/") else directory
                       for directory in directories]
        target = self._target("tree-alternates", options) + f"&use={quote(use, safe='')}&dry_run={int(dry_run)}" + \
            "".join(f"&dir={quote(os.fsencode(directory), safe='')}" for directory in directories)
        taken: Dict[str, str] = {}
        copied = 0
        failures: List[Failure] = []
        items = [(entry, entry.path in existing) for entry in entries]
        for _, body in _batches(items, MAX_BATCH_OPERATIONS, None, None, lambda item: [item[0].to_wire(), item[1]],
                                "entries"):
            document = self.client.json(self.client.request("POST", target, body=body,
                                                            headers={"Content-Type": "application/json"}))
            try:
                answered = document["taken"]
                if not isinstance(answered, dict) or not all(
                        isinstance(path, str) and how in TAKEN_FROM_ALTERNATES for path, how in answered.items()):
                    raise ValueError("taken")
                taken.update(answered)
                copied += int(document["copied_bytes"])
                failures += _failures(document["failures"])
            except (KeyError, TypeError, ValueError, AttributeError):
                raise self.client.malformed("taken") from None
        return taken, copied, failures

    def _from_server_root(self, path: str) -> str:
        """An absolute path on the server's side (from its root: over ssh, the host's /) as one relative
        to this tree, for the server to confine."""
        return posixpath.relpath(path, "/" + self.path)

    def _failures_of(self, response) -> List[Failure]:
        document = self.client.json(response)
        try:
            failures = _failures(document["failures"])
            ignored = [str(message) for message in document.get("ignored", ())]
        except (KeyError, TypeError, ValueError, AttributeError):
            raise self.client.malformed("failures") from None
        self._warn(ignored)
        return failures

    def _warn(self, ignored: List[str]) -> None:
        """Keep what the server did not do, such as keeping owners, for :meth:`take_notices` (once per process)."""
        for message in ignored:
            if message not in self._warned:
                self._warned.add(message)
                self._notices.append(" ".join(message.splitlines())[:500])


#: What a listing request accepts: the packed form, or JSON (all an older server sends).
_LISTING_FORMS = f"{packedlisting.PACKED_LISTING_TYPE}, application/json;q=0.5"


def _names(header: str) -> FrozenSet[str]:
    """The comma-separated names of a header, in lower case."""
    return frozenset(filter(None, (name.strip().lower() for name in header.split(","))))


def _attribute_flags(options: MetadataOptions, separator: str) -> str:
    """The query flags of -X, -A and --numeric-ids; none without them (as older servers were asked)."""
    if not options.attributes:
        return ""
    return (f"{separator}xattrs={int(options.xattrs)}&acls={int(options.acls)}"
            f"&numeric_ids={int(options.numeric_ids)}")


def _leaves_the_tree(path: str, allow_root: bool = False) -> str:
    """Why ``path`` is refused without a request (a ``..`` component, an absolute path), or ``""``.

    A local tree reports such a path as that entry's failure and goes on
    (rsync's habit); the server refuses a whole batch that carries one (403),
    as a request no client of ours sends. Checked here, the remote kind
    reports it like the local one, and the server still never sees it.
    """
    if path[:1] != "/" and ".." not in path:  # nothing to refuse: the check cost a pushed file 2 us
        return ""
    try:
        check_relative_path(path, allow_root)
    except AccessDenied as error:
        return str(error)
    except TreeWireError:
        pass  # malformed in another way: the server's 400 says what is wrong
    return ""


class _MalformedListing(ValueError):
    """A listing's JSON text is malformed (reported as the server's fault)."""


class _measured:
    """A streamed body that counts its bytes and keeps the start of them (for the adaptive rule)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks = chunks
        self.count = 0
        self.sample = bytearray()

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._chunks:
            self.count += len(chunk)
            if len(self.sample) < compression.SAMPLE_BYTES:
                self.sample += chunk[:compression.SAMPLE_BYTES - len(self.sample)]
            yield chunk


class _Pending:
    """The files still to write, with room to put back the one that starts the next request."""

    def __init__(self, files: Iterable[Tuple[Entry, bytes]]) -> None:
        self._files = iter(files)
        self._back: List[Tuple[Entry, bytes]] = []

    def more(self) -> bool:
        """Whether another file waits (looks ahead by one, without losing it)."""
        if not self._back:
            try:
                self._back.append(next(self._files))
            except StopIteration:
                return False
        return True

    def put_back(self, item: Tuple[Entry, bytes]) -> None:
        self._back.append(item)

    def __iter__(self) -> Iterator[Tuple[Entry, bytes]]:
        while self.more():
            yield self._back.pop()


def _batches(items: List[Any], max_count: int, max_bytes: Optional[int], size_of,
             wire_of, key: str) -> Iterator[Tuple[List[Any], bytes]]:
    """``items`` cut into requests within their bounds (count, data bytes, JSON bytes), each
    with its body, ``{key: [wire_of(item), ...]}`` in JSON.

    A batch is encoded whole, in one call, and cut shorter only if its JSON is too long:
    encoding every item alone to measure it cost a 6,000-file tree push 45 ms of the
    client's CPU, more than the rest of its batching. An item too long alone still goes
    alone (the server says what it thinks of it).
    """
    start = 0
    while start < len(items):
        end, data = start, 0
        while end < len(items) and end - start < max_count:
            item_data = size_of(items[end]) if size_of else 0
            if end > start and max_bytes is not None and data + item_data > max_bytes:
                break
            data += item_data
            end += 1
        wires = [wire_of(item) for item in items[start:end]]
        body = _json_bytes({key: wires})
        while len(body) > _JSON_BATCH_BYTES and len(wires) > 1:
            # Shorter in proportion (names are of similar lengths), and at least by one.
            keep = max(1, min(len(wires) - 1, len(wires) * _JSON_BATCH_BYTES * 9 // (len(body) * 10)))
            wires = wires[:keep]
            body = _json_bytes({key: wires})
        yield items[start:start + len(wires)], body
        start += len(wires)


def _packed_batches(entries: List[Entry]) -> Iterator[Tuple[List[Entry], bytes]]:
    """``entries`` cut into read requests within their bounds, each with its packed body
    (batches and the end marker; no head, no ending)."""
    start = 0
    while start < len(entries):
        end, data = start, 0
        while end < len(entries) and end - start < MAX_BATCH_FILES:
            if end > start and data + entries[end].size > MAX_BATCH_BYTES:
                break
            data += entries[end].size
            end += 1
        while True:
            body = b"".join(packedlisting.encode_batches(entries[start:end])) + packedlisting.END
            if len(body) <= _JSON_BATCH_BYTES or end - start == 1:
                break
            end = start + (end - start) // 2  # long names: fewer entries a request
        yield entries[start:end], body
        start = end


def _json_bytes(document: Any) -> bytes:
    return json.dumps(document, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _failures(value: Any) -> List[Failure]:
    """The ``[[path, message], ...]`` of an answer, checked."""
    if not isinstance(value, list):
        raise TypeError("failures must be a list")
    failures: List[Failure] = []
    for item in value:
        if not (isinstance(item, list) and len(item) == 2
                and isinstance(item[0], str) and isinstance(item[1], str)):
            raise TypeError("a failure must be [path, message]")
        failures.append((item[0], " ".join(item[1].splitlines())[:1000]))
    return failures


__all__ = ["RemoteTree"]
