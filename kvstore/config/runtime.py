"""Where the service's runtime files live, and how they are made without trusting /tmp.

The socket, its lock, its log and the config handed to a spawned service sit in
one private directory: `$XDG_RUNTIME_DIR/kvstore` (a per-user tmpfs), else
`/tmp/kvstore-UID`, created 0700 (0711 for a service that allows other users: they
pass through to the socket). Any directory holding them, default or configured, must
be owned by this user (a client: or a user it trusts, service.allowed_uids), not a
link, and writable by no one else:
otherwise another local user could listen on the socket first, or point a lock or
log at a file of ours. Files in it are opened without following links and must
be ours. The state files kept there (what `learned` admission learned, the announced
namespaces) are read with bounds: their size, and a shape that bounds their nesting (a
file nested a million deep is refused, not a RecursionError); one that cannot be read is
set aside (`PATH.bad`), so that no later start trips on it again.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Collection
from typing import Any

import msgspec

from kvstore.format.errors import ConfigError

SOCKET_NAME = "kvstore.sock"


def default_socket() -> str:
    """The default `service.socket` (its directory is created when the service starts)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isabs(base):
        return os.path.join(base, "kvstore", SOCKET_NAME)
    return os.path.join("/tmp", f"kvstore-{os.geteuid()}", SOCKET_NAME)


def directory_problem(path: str, owners: Collection[int] = ()) -> str | None:
    """Why `path` is not a directory only this user (or one of `owners`: users this one
    trusts) can write, or None."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "does not exist"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.geteuid() and st.st_uid not in owners:
        return f"is owned by uid {st.st_uid}, not this user ({os.geteuid()})"
    if st.st_mode & 0o022:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}: others may create files in it"
    return None


def ensure_private_directory(socket: str, others_connect: bool = False) -> str:
    """Create (0700) or check the directory of `socket`; returns it. ConfigError
    naming `service.socket` when it is unsafe. With `others_connect` (a service that
    allows other users) it is made 0711: they may pass through it to the socket, not
    list it or create anything in it (the lock, log and config files stay 0600)."""
    directory = os.path.dirname(os.path.abspath(socket))
    if not os.path.lexists(directory):
        parent = os.path.dirname(directory)
        if directory_problem(parent) is not None and not _sticky_and_foreign_safe(parent):
            raise ConfigError("service.socket", socket, f"its directory {directory} does not exist, "
                                                        f"and its parent {parent} is unsafe to make it in")
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            pass  # another process made it first: checked below like any existing one
        except OSError as exc:
            raise ConfigError("service.socket", socket, f"cannot create its directory {directory}: "
                                                        f"{exc.strerror}") from exc
    problem = directory_problem(directory)
    if problem:
        raise ConfigError("service.socket", socket, f"its directory {directory} {problem}; the "
                          "service's socket, lock and log need a directory only this user can write")
    if others_connect:
        os.chmod(directory, 0o711)  # checked above: ours, not a link
    return directory


def _sticky_and_foreign_safe(path: str) -> bool:
    """/tmp and the like: world-writable with the sticky bit, so a name we create there
    cannot be replaced by another user (we then check what we find at it)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and bool(st.st_mode & stat.S_ISVTX)


def open_private(path: str, flags: int) -> int:
    """Open (creating 0600) a file in a private directory without following links;
    refuses one that is not ours or not a regular file."""
    fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise ConfigError("service.socket", path, "a runtime file there is not ours or not a regular file")
    return fd


def write_private_json(path: str, value: Any) -> None:
    """`value` as JSON in a 0600 file of a private directory, whole or not at all (a
    temporary file renamed over the old one); OSError or ConfigError when it cannot be.
    (msgspec's encoder: a `msgspec.Raw` in `value` is written as the JSON it holds.)"""
    temporary = f"{path}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temporary)
    with os.fdopen(open_private(temporary, os.O_WRONLY | os.O_EXCL), "wb") as f:
        f.write(msgspec.json.encode(value))
    os.replace(temporary, path)


def read_private_json(path: str, shape: Any, max_bytes: int) -> Any:
    """What `write_private_json` wrote there, decoded as `shape` (a type: the file is nested
    no deeper than it says); None when there is nothing (no file, or an empty one). OSError,
    ConfigError or ValueError when it cannot be read: not ours, over `max_bytes`, not JSON
    of that shape."""
    if not os.path.lexists(path):
        return None
    with os.fdopen(open_private(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:  # a FIFO never blocks
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"larger than {max_bytes} bytes")
    if not data:
        return None
    try:
        return msgspec.json.decode(data, type=shape)
    except (msgspec.DecodeError, RecursionError) as exc:  # ValidationError is a DecodeError
        raise ValueError(f"not what this file holds: {str(exc)[:300]}") from None


def set_aside(path: str) -> str:
    """Move a state file that could not be read to PATH.bad (replacing an older one), kept
    for a look while the service goes on without it; the name is moved, a link never
    followed. Where it went, or why it stayed, for the log."""
    try:
        os.replace(path, path + ".bad")
    except OSError as exc:
        return f"left in place: {exc.strerror or exc}"
    return f"moved to {path}.bad"
