"""Other local users for the tests that attack through a shared host's doors: a throwaway
unprivileged user (made as root with useradd, removed after) that runs Python code as
itself, and a directory such a user can reach (pytest's own are private to root)."""

from __future__ import annotations

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


class User:
    """A throwaway unprivileged user: runs Python code as itself (`run` to the end, `start`
    in the background); `remove` kills what it started and deletes the user."""

    def __init__(self) -> None:
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
        subprocess.run(["userdel", "--force", self.name], capture_output=True)

    def _command(self, code: str) -> list[str]:
        return [*PYTHON_FOR_OTHERS, "-c", code]

    def _env(self, env: dict[str, str]) -> dict[str, str]:
        return {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{REPO}:{SITE}", "HOME": "/tmp", **env}

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
