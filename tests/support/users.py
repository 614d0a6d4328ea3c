"""Other local users for the tests that attack through a shared host's doors: a throwaway
unprivileged user (made as root with useradd, removed after) that runs Python code as
itself, a directory such a user can reach (pytest's own are private to root), and a copy
of the packages its code imports that it can read wherever the checkout sits (root's
0700 home, a path with spaces)."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SITE = sysconfig.get_paths()["purelib"]


def python_for_others() -> list[str] | None:
    """An interpreter another user may run, of this one's version (so this project's
    packages import where the user can read them): this one if every directory up to it
    is searchable, else the system's."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        path = Path(os.path.realpath(candidate))
        if not path.exists():
            continue
        if all(os.stat(p).st_mode & 0o001 for p in path.parents) and os.stat(path).st_mode & 0o001:
            version = subprocess.run([str(path), "-c", "import sys; print(sys.version_info[:2])"],
                                     capture_output=True, text=True).stdout.strip()
            if version == str(sys.version_info[:2]):
                return [str(path)]
    return None


PYTHON_FOR_OTHERS = python_for_others() or []


def cannot_make_users() -> str | None:
    """Why this process cannot make a throwaway user that runs Python (None: it can)."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        return "needs root and useradd to create a throwaway user"
    if not PYTHON_FOR_OTHERS:
        return (f"no Python {sys.version_info[:2]} that another user may run (this one is "
                f"{sys.executable}, behind a private directory)")
    return None


# Run by the other user's interpreter: the files of every module it loaded, and of the
# shared libraries the packages brought in beside them (numpy's numpy.libs).
_LOADED = """\
import importlib, json, os, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
files = {getattr(module, "__file__", None) for module in list(sys.modules.values())}
with open("/proc/self/maps") as maps:
    mapped = (line.rstrip("\\n").split(maxsplit=5) for line in maps)
    files |= {fields[5] for fields in mapped if len(fields) == 6}
print(json.dumps(sorted(os.path.realpath(name) for name in files if name and os.path.isabs(name))))
"""


@contextmanager
def readable_packages(modules: tuple[str, ...]) -> Iterator[str]:
    """A copy of the packages importing `modules` loads, in a fresh 0755 directory in /tmp
    (removed after), for another user's PYTHONPATH: the checkout and its virtualenv may sit
    where another user cannot enter (root's home is 0700), and a link into them would not
    help. Found as that user's interpreter loads them, run here as root: every package of
    the checkout or the virtualenv (the innermost of the two: the virtualenv may lie in the
    checkout) one of its loaded files lies in. The user gets no privilege for it; the
    checkout's own modes stay as they are."""
    roots = [Path(os.path.realpath(path)) for path in (REPO, SITE)]  # the other user's order
    loaded = subprocess.run([*PYTHON_FOR_OTHERS, "-c", _LOADED, *modules], cwd="/",
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join(map(str, roots))},
                            capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    innermost_first = sorted(roots, key=lambda root: len(str(root)), reverse=True)
    tops: dict[str, Path] = {}  # name in the snapshot -> what is copied there
    for name in map(Path, json.loads(loaded.stdout)):
        root = next((root for root in innermost_first if name.is_relative_to(root)), None)
        if root is not None:
            top = os.path.relpath(name, root).split(os.sep, 1)[0]
            tops.setdefault(top, root / top)
    snapshot = Path(tempfile.mkdtemp(prefix="kvstore-sec-python-", dir="/tmp"))
    try:
        for name, source in tops.items():
            if source.is_dir():
                shutil.copytree(source, snapshot / name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(source, snapshot / name)
        for path in (snapshot, *snapshot.rglob("*")):  # readable by all whatever the checkout's umask
            path.chmod(path.stat().st_mode | (0o555 if path.is_dir() else 0o444))
        yield str(snapshot)
    finally:
        shutil.rmtree(snapshot, ignore_errors=True)


class User:
    """A throwaway unprivileged user: runs Python code as itself (`run` to the end, `start`
    in the background), finding packages on `pythonpath` (readable_packages; none: the
    standard library only); `remove` kills every process of it and deletes the user."""

    def __init__(self, pythonpath: str = "") -> None:
        self.pythonpath = pythonpath
        self.name = f"kvs{uuid.uuid4().hex[:8]}"
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", self.name],
                       check=True, capture_output=True)
        entry = pwd.getpwnam(self.name)
        self.uid, self.gid = entry.pw_uid, entry.pw_gid
        self._started: list[subprocess.Popen[str]] = []

    def run(self, code: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self._command(code), preexec_fn=self._drop, cwd="/", env=self._env(env),
                              capture_output=True, text=True, timeout=timeout)

    def start(self, code: str, **env: str) -> subprocess.Popen[str]:
        """`code` running as this user, its stdin and stdout pipes of text (stderr too)."""
        process = subprocess.Popen(self._command(code), preexec_fn=self._drop, cwd="/", env=self._env(env),
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
        self._started.append(process)
        return process

    def remove(self) -> None:
        for process in self._started:
            process.kill()
            process.communicate()
        subprocess.run(["pkill", "-KILL", "-u", self.name], capture_output=True)  # what its code started
        subprocess.run(["userdel", "--force", self.name], capture_output=True)

    def _command(self, code: str) -> list[str]:
        return [*PYTHON_FOR_OTHERS, "-c", code]

    def _env(self, env: dict[str, str]) -> dict[str, str]:
        return {"PATH": "/usr/bin:/bin", "PYTHONPATH": self.pythonpath, "HOME": "/tmp", **env}

    def _drop(self) -> None:
        os.setgroups([])
        os.setgid(self.gid)
        os.setuid(self.uid)


@contextmanager
def shared_directory() -> Iterator[Path]:
    """A fresh directory under /tmp that other users can reach (0755), removed after."""
    path = Path(tempfile.mkdtemp(prefix="kvstore-sec-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
