"""One line for an I/O fault: the path and the real cause, whichever library raised it.

Checkpoints, converted folders, manifests, tables and reports are read and
written through Python's `open`, safetensors and `json`; each reports the same
fault differently (safetensors' write error is no OSError and names no path; its
`safe_open` reports a permission error as "No such file or directory"). Every
reader and writer of the package turns what it caught into `describe(...)`'s
line and raises its own error type with it (CheckpointError for the loaders, ...),
so an operator's fault (permission, full disk, read-only filesystem, a file that
is not UTF-8 or not JSON) never reads as corruption or as an internal error.
Kept free of other package imports: everything may import it.
"""
from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_CAUSES = {
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.ENOENT: "does not exist",
    errno.EISDIR: "is a folder, not a file",
    errno.ENOTDIR: "a part of the path is not a folder",
    errno.EFBIG: "file too large (the process's file-size limit?)",
    errno.EIO: "input/output error (a failing disk or network filesystem?)",
    errno.ENAMETOOLONG: "name too long",
}
# safetensors' Rust errors carry the OS error only in their text: "... (os error 28)"
_RUST_OS_ERROR = re.compile(r"os error (\d+)")


class IOFault(OSError):
    """An I/O failure already described in one line (path and cause); raised where no more specific
    error type of the package applies."""


def _errno_of(exc: BaseException) -> int | None:
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.errno
    found = _RUST_OS_ERROR.search(str(exc))
    return int(found.group(1)) if found else None


def _probe(path: Path) -> int | None:
    """The errno that opening `path` for reading gives, None if it opens (safetensors hides it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        return exc.errno
    os.close(fd)
    return None


def is_io_error(exc: BaseException) -> bool:
    """Whether `exc` is an I/O or decoding failure `describe` knows how to say."""
    return isinstance(exc, (OSError, UnicodeError, json.JSONDecodeError)) or type(exc).__name__ == "SafetensorError"


def cause(exc: BaseException, path: str | os.PathLike | None = None) -> str:
    """The real cause of `exc` in a few words (no path)."""
    if isinstance(exc, UnicodeDecodeError):
        return f"not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})"
    if isinstance(exc, json.JSONDecodeError):
        return f"not valid JSON: {exc.msg}: line {exc.lineno} column {exc.colno}"
    code = _errno_of(exc)
    if code == errno.ENOENT and path is not None:  # safe_open says ENOENT for EACCES too
        code = _probe(Path(path)) or code
    if code in _CAUSES:
        return _CAUSES[code]
    if code is not None:
        return os.strerror(code).lower()
    return " ".join(str(exc).split()) or type(exc).__name__


def describe(exc: BaseException, path: str | os.PathLike, doing: str = "cannot read") -> str:
    """'cannot read /m/x.safetensors: permission denied' (`doing`: what was being done to `path`);
    for content that does not decode, '/m/x.json is not valid JSON: ...'."""
    if isinstance(exc, (UnicodeDecodeError, json.JSONDecodeError)):
        return f"{path} is {cause(exc, path)}"
    return f"{doing} {path}: {cause(exc, path)}"


@contextmanager
def mapped(error: type[Exception], path: str | os.PathLike, doing: str = "cannot read") -> Iterator[None]:
    """Inside the block, an I/O or decoding failure becomes `error(describe(...))`."""
    try:
        yield
    except BaseException as exc:
        if not is_io_error(exc):
            raise
        raise error(describe(exc, path, doing)) from None


def read_text(path: str | os.PathLike, error: type[Exception] = IOFault) -> str:
    """A UTF-8 file's text, or `error` naming it and the cause."""
    with mapped(error, path):
        return Path(path).read_text(encoding="utf-8")


def read_json(path: str | os.PathLike, error: type[Exception] = IOFault):
    """A JSON file's value, or `error` naming it and the cause (unreadable, not UTF-8, not JSON)."""
    text = read_text(path, error)
    with mapped(error, path):
        return json.loads(text)


def write_text(path: str | os.PathLike, text: str, error: type[Exception] = IOFault) -> None:
    """Write `text` to a sibling temporary and rename it over `path` (a reader never sees half a
    file), or `error` naming the path and the cause; the temporary never outlives a failure."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with mapped(error, path, "cannot write"):
        try:
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, path)
        except BaseException:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:  # e.g. the filesystem went read-only: the first error is the one to say
                pass
            raise
