"""Read a large JSON document from a stream one bounded value at a time.

The tree endpoints exchange JSON objects whose lists may hold 10,000 items
(a read's entries, an apply's operations) or hundreds of thousands (a
listing). :func:`json.loads` on the whole document first holds all of its
text and then every object in it at once: a 64 MiB body of ``[[],[],...]``
made a server worker take 1.7 GiB. :class:`JsonStream` walks the object's
keys and its lists' items instead, and decodes each item by itself, bounded
in size, so that the caller can check it (and keep only what it needs)
before the next one is read. The text read stays a small buffer.

Only the shapes pdiffcopy uses are read: an object, whose values are small
(one bounded value) or lists of small values.
"""

from __future__ import annotations

import codecs
import json
import re
from typing import Any, Iterator, Optional

from pdiffcopy.errors import BadRequest, PayloadTooLarge

#: Bytes read from the stream at a time.
READ_SIZE = 64 * 1024

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


class JsonStream:
    """The values of one JSON object read from ``stream`` (with ``read(n)``), in order.

    :param stream: A binary stream: a request body or a response.
    :param max_value_chars: The longest value (a list item, a key's small
                            value) accepted, in characters of JSON text.
    :param max_bytes: The most bytes read in all (None: no bound).
    :param error: The exception raised for malformed JSON (a request's
                  :class:`~pdiffcopy.errors.BadRequest` by default).
    """

    def __init__(self, stream: Any, max_value_chars: int, max_bytes: Optional[int] = None,
                 error: type = BadRequest) -> None:
        self._stream = stream
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._text = ""
        self._position = 0
        self._eof = False
        self._bytes_read = 0
        self._first_key = True
        self.max_value_chars = max_value_chars
        self.max_bytes = max_bytes
        self.error = error

    # -- the document -------------------------------------------------------

    def begin_object(self) -> None:
        """Read the ``{`` that opens the document."""
        self._expect("{", "a JSON object")

    def next_key(self) -> Optional[str]:
        """The next key of the object, or :data:`None` at its end (``}``)."""
        self._skip_whitespace()
        if self._peek() == "}":
            self._position += 1
            return None
        if not self._first_key:
            self._expect(",", "',' or '}'")
        self._first_key = False
        key = self.value()
        if not isinstance(key, str):
            raise self.error("Malformed JSON: an object key must be a string")
        self._expect(":", "':'")
        return key

    def value(self) -> Any:
        """The next value, decoded whole: it must be at most ``max_value_chars`` long."""
        self._skip_whitespace()
        self._fill(self.max_value_chars + 1)
        try:
            value, end = _DECODER.raw_decode(self._text, self._position)
        except json.JSONDecodeError:
            if len(self._text) - self._position > self.max_value_chars:  # not cut off by the end
                raise self.error(f"Malformed JSON, or a value longer than {self.max_value_chars} "
                                 f"characters") from None
            raise self.error("Malformed JSON") from None
        except RecursionError:  # "[[[[...": nested too deep
            raise self.error("Malformed JSON: nested too deep") from None
        if end - self._position > self.max_value_chars:
            raise self.error(f"A JSON value is longer than {self.max_value_chars} characters")
        self._position = end
        return value

    def items(self, max_items: Optional[int] = None, what: str = "items") -> Iterator[Any]:
        """The items of the list that comes next, one at a time, at most ``max_items``."""
        self._expect("[", "a list")
        self._skip_whitespace()
        if self._peek() == "]":
            self._position += 1
            return
        count = 0
        while True:
            count += 1
            if max_items is not None and count > max_items:
                raise self.error(f"At most {max_items} {what} per request")
            yield self.value()
            self._skip_whitespace()
            following = self._peek()
            self._position += 1
            if following == "]":
                return
            if following != ",":
                raise self.error("Malformed JSON: expected ',' or ']' in a list")

    def end(self) -> None:
        """Check that nothing but whitespace follows the document."""
        self._skip_whitespace()
        if self._peek():
            raise self.error("Malformed JSON: text after the end of the document")

    # -- the buffer ---------------------------------------------------------

    def _expect(self, token: str, what: str) -> None:
        self._skip_whitespace()
        if self._peek() != token:
            raise self.error(f"Malformed JSON: expected {what}")
        self._position += 1

    def _peek(self) -> str:
        """The next character, or "" at the end of the stream."""
        self._fill(1)
        return self._text[self._position : self._position + 1]

    def _skip_whitespace(self) -> None:
        while True:
            self._position = _WHITESPACE.match(self._text, self._position).end()  # type: ignore[union-attr]
            if self._position < len(self._text) or self._eof:
                return
            self._fill(1)

    def _fill(self, wanted: int) -> None:
        """Have at least ``wanted`` characters after the position, unless the stream ends first."""
        while len(self._text) - self._position < wanted and not self._eof:
            try:
                chunk = self._stream.read(READ_SIZE)
            except OSError as error:
                raise self.error(f"The JSON text could not be read: {error}") from None
            if chunk:
                self._bytes_read += len(chunk)
                if self.max_bytes is not None and self._bytes_read > self.max_bytes:
                    raise PayloadTooLarge(f"The JSON text is larger than {self.max_bytes} bytes")
            else:
                self._eof = True
            try:
                text = self._decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError:
                raise self.error("Malformed JSON: not UTF-8") from None
            # Drop what was read already: the buffer holds about one value.
            self._text = self._text[self._position :] + text
            self._position = 0


__all__ = ["JsonStream", "READ_SIZE"]
