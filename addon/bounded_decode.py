"""A compressed request body, decompressed with a bound (sans-IO).

The proxy bounds a request's body (``polar_max_body``, ``polar_max_control_body``). A harness may
send it compressed (``content-encoding``), and mitmproxy's ``request.content`` inflates it whole:
a 64 KB gzip bomb becomes 64 MB or more in the proxy's memory before any check could refuse it.
So the bound applies to the decompressed size, and decompression stops one byte past it.

Encodings as mitmproxy reads them (mitmproxy/net/encoding.py): gzip / x-gzip, deflate (zlib or raw),
zstd (frames read across), br, identity; a list is undone last to first. brotli before 1.2 has no
output bound, so there ``br`` is refused (415) rather than inflated unbounded.
"""
from __future__ import annotations

import io
import zlib


class BodyTooLarge(Exception):
    """The body decompresses to more than the bound (the proxy answers 413)."""


class EncodingRefused(Exception):
    """An encoding this proxy cannot decompress with a bound (the proxy answers 415); says which."""


def encodings(header: str) -> list[str]:
    """The content codings applied, in order (``identity`` left out)."""
    return [e for e in (x.strip().lower() for x in header.split(",")) if e and e != "identity"]


def _zlib(data: bytes, wbits: int, limit: int) -> bytes:
    d = zlib.decompressobj(wbits)
    out = d.decompress(data, limit + 1)
    if len(out) > limit or d.unconsumed_tail:
        raise BodyTooLarge
    return out + d.flush()  # (at most the bytes zlib still holds: the tail above is empty)


def _gzip(data: bytes, limit: int) -> bytes:
    return _zlib(data, 16 + zlib.MAX_WBITS, limit)


def _deflate(data: bytes, limit: int) -> bytes:
    try:
        return _zlib(data, zlib.MAX_WBITS, limit)
    except zlib.error:  # raw deflate, without the zlib header (as mitmproxy accepts it)
        return _zlib(data, -zlib.MAX_WBITS, limit)


def _zstd(data: bytes, limit: int) -> bytes:
    import zstandard

    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True)
    out = reader.read(limit + 1)
    if len(out) > limit:
        raise BodyTooLarge
    return out


def _brotli(data: bytes, limit: int) -> bytes:
    import brotli

    d = brotli.Decompressor()
    try:
        out = d.process(data, output_buffer_limit=limit + 1)  # (brotli >= 1.2)
    except TypeError:
        raise EncodingRefused("content-encoding br cannot be decompressed with a size bound by this proxy's brotli "
                              "(< 1.2); send the body uncompressed, or as gzip, deflate or zstd") from None
    if len(out) > limit or not d.is_finished():
        raise BodyTooLarge
    return out


_DECODERS = {"gzip": _gzip, "x-gzip": _gzip, "deflate": _deflate, "zstd": _zstd, "br": _brotli}


def bounded_decode(raw: bytes, header: str, limit: int) -> bytes:
    """``raw`` with the ``content-encoding`` ``header`` undone, at most ``limit`` bytes: raises
    BodyTooLarge past it, EncodingRefused for a coding it cannot bound (or does not know), and
    ValueError for data that does not decode (the caller treats it as mitmproxy would)."""
    data = raw
    for enc in reversed(encodings(header)):
        fn = _DECODERS.get(enc)
        if fn is None:
            raise EncodingRefused(f"content-encoding {enc!r} is not one this proxy decompresses (gzip, deflate, "
                                  f"zstd, br)")
        if not data:
            continue
        try:
            data = fn(data, limit)
        except (BodyTooLarge, EncodingRefused):
            raise
        except Exception as exc:  # noqa: BLE001 - zlib.error, zstd/brotli errors: not this coding's data
            raise ValueError(f"{enc}: {exc}") from None
    return data
