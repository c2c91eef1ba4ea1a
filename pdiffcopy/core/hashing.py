"""Block hashing: the hash methods and what a digest is (no I/O: files are hashed by :mod:`pdiffcopy.local.filehash`).

The methods are every algorithm of :mod:`hashlib` plus the fast ones of two
well-kept libraries: ``xxh3_64``/``xxh3_128``/``xxh64``/``xxh32`` from xxhash
and ``blake3``. Both release the GIL while hashing, like hashlib does.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from pdiffcopy.core.blocks import ByteRange
from pdiffcopy.errors import UsageError

#: Default block hash. Measured here (docs/design.rst): xxh3_128 hashes about
#: 20 GB/s per core, ten times sha1, so hashing costs less than reading the
#: page cache; its 128 bits make an accidental collision between two blocks
#: no practical concern (rsync 3.2 uses the same family as its strong checksum).
DEFAULT_HASH_METHOD = "xxh3_128"

#: Fewest digest bits a whole-file verification may rest on. A weaker block
#: hash (xxh3_64, say) is fine for finding changes, but the final check then
#: hashes both files again with the default method.
MIN_VERIFY_DIGEST_BITS = 128

#: Bytes read per system call when a file cannot be mapped. 1 MiB reads ran
#: 2.4 times faster here than 4 MiB ones (they stay in the CPU cache).
READ_CHUNK_SIZE = 1024 * 1024

#: The hash methods a server accepts unless its operator lists others
#: (``--hash-methods``): the ones that hash at least about 500 MB/s per core
#: here (1 MiB blocks; xxhash and blake3 several GB/s, sha1 and sha256 with
#: the CPU's SHA instructions). A client may pick the method, and one request
#: may cover 1 GiB: with sm3 or sha3_512 (100-190 MB/s) and 1 KiB blocks one
#: request costs five to ten seconds of a core. The client's default method,
#: and the method of its final check, are among them.
SERVER_HASH_METHODS = ("blake3", "sha1", "sha256", "xxh128", "xxh32", "xxh3_128", "xxh3_64", "xxh64")

#: What ``--hash-methods`` takes to accept every method this installation has.
ALL_METHODS = "all"

_XXHASH_METHODS = ("xxh3_64", "xxh3_128", "xxh32", "xxh64", "xxh128")
# Variable-length digests need a fixed length; 32 bytes is their natural size.
_SHAKE_LENGTHS = {"shake_128": 32, "shake_256": 64}


def available_methods() -> List[str]:
    """Every hash method name this installation supports, sorted."""
    import hashlib  # (loads OpenSSL: a few ms that the default method, xxh3, never needs)

    names = set(hashlib.algorithms_available)
    try:
        import xxhash  # noqa: F401

        names.update(_XXHASH_METHODS)
    except ImportError:
        pass
    try:
        import blake3  # noqa: F401

        names.add("blake3")
    except ImportError:
        pass
    return sorted(names)


def accepted_methods(names: Optional[str] = None) -> Tuple[str, ...]:
    """The hash methods a server accepts: a comma-separated list, ``all``, or the default.

    :param names: ``--hash-methods``: ``xxh3_128,sha256``, ``all``, or
                  :data:`None` for :data:`SERVER_HASH_METHODS` (those installed).
    :raises UsageError: For an unknown method or an empty list.
    """
    available = available_methods()
    if names is None:
        return tuple(method for method in SERVER_HASH_METHODS if method in available)
    if names.strip().lower() == ALL_METHODS:
        return tuple(available)
    chosen = sorted({name.strip() for name in names.split(",") if name.strip()})
    if not chosen:
        raise UsageError("--hash-methods needs at least one method (or 'all')")
    for method in chosen:
        validate_method(method)
    return tuple(chosen)


def _factory(method: str) -> Callable[[], "object"]:
    if method in _XXHASH_METHODS:
        import xxhash

        return getattr(xxhash, method)
    if method == "blake3":
        import blake3

        return blake3.blake3
    import hashlib

    if method in hashlib.algorithms_available:
        return lambda: hashlib.new(method)
    raise UsageError(
        f"Unknown hash method: {method!r} (choose from {', '.join(available_methods())})"
    )


_FACTORIES: Dict[str, Callable[[], "object"]] = {}


def new_hasher(method: str):
    """A fresh hash object for ``method``.

    :raises UsageError: When the method is unknown or unavailable.
    """
    if not isinstance(method, str) or not method:
        raise UsageError(f"Unknown hash method: {method!r}")
    factory = _FACTORIES.get(method)
    if factory is None:
        factory = _factory(method)
        _FACTORIES[method] = factory
    return factory()


def validate_method(method: str) -> str:
    """Check that ``method`` names a usable hash; return it unchanged."""
    new_hasher(method)
    return method


def finish(hasher, method: str) -> bytes:
    """The digest of a hasher, with a fixed length for the SHAKE family."""
    if method in _SHAKE_LENGTHS:
        return hasher.digest(_SHAKE_LENGTHS[method])
    return hasher.digest()


def digest_size(method: str) -> int:
    """Length in bytes of one digest of ``method``."""
    return len(finish(new_hasher(method), method))


def verify_method(method: str) -> str:
    """The method a whole-file verification uses when blocks use ``method``."""
    if digest_size(method) * 8 >= MIN_VERIFY_DIGEST_BITS:
        return method
    return DEFAULT_HASH_METHOD


def digest_bytes(method: str, data: bytes) -> bytes:
    """Hash one buffer (pure; used by tests and the tree digest)."""
    hasher = new_hasher(method)
    hasher.update(data)
    return finish(hasher, method)


@functools.lru_cache(maxsize=64)
def zero_digest(method: str, length: int) -> bytes:
    """The digest of ``length`` zero bytes: a block in a hole, hashed once per method and size."""
    hasher = new_hasher(method)
    zeros = bytes(min(length, READ_CHUNK_SIZE))
    for start in range(0, length, len(zeros) or 1):
        hasher.update(memoryview(zeros)[: min(len(zeros), length - start)])
    return finish(hasher, method)


def zero_digests(ranges: Sequence[ByteRange], block_size: int, method: str) -> bytes:
    """The digests of the blocks of ``ranges`` (block-aligned, the last block may be short) if all were zeros.

    A run of whole blocks costs one digest, repeated: no work per block.
    """
    digests = []
    for _, length in ranges:
        whole, tail = divmod(length, block_size)
        digests.append(zero_digest(method, block_size) * whole)
        if tail:
            digests.append(zero_digest(method, tail))
    return b"".join(digests)


def digest_count(ranges: Sequence[ByteRange], block_size: int) -> int:
    """How many block digests hashing ``ranges`` yields."""
    return sum(-(-length // block_size) for _, length in ranges)
