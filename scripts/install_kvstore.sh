#!/usr/bin/env bash
# Usage: install_kvstore.sh PYTHON [EXTRA...] [-- PIP_ARG...]
# Installs kvstore from this checkout, editable, into PYTHON's virtualenv with the extras
# named: first its requirements and those of the extras (read from pyproject.toml; any
# PIP_ARGs resolved with them), then kvstore itself with --no-deps under a lock on
# pyproject.toml. setuptools writes kvstore.egg-info into the checkout during an editable
# install, and scripts/setup.sh builds its virtualenvs side by side: two such writes at
# once could leave one virtualenv with half a file of metadata.
set -euo pipefail
cd "$(dirname "$0")/.."

py=$1
shift
extras=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    extras+=("$1")
    shift
done
[ $# -gt 0 ] && shift  # the "--"

requirements=$(mktemp)
trap 'rm -f "$requirements"' EXIT
"$py" - "${extras[@]}" > "$requirements" <<'PY'
import re, sys, tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
wanted, named, todo = list(project["dependencies"]), set(), list(sys.argv[1:])
while todo:  # an extra may name others of kvstore's own ("kvstore[plots]")
    extra = todo.pop()
    if extra in named:
        continue
    named.add(extra)
    for requirement in project["optional-dependencies"][extra]:
        own = re.fullmatch(r"\s*kvstore\s*\[([^\]]*)\]\s*", requirement)
        if own:
            todo += [e.strip() for e in own.group(1).split(",")]
        else:
            wanted.append(requirement)
print("\n".join(wanted))
PY
"$py" -m pip install -q "$@" -r "$requirements"
flock pyproject.toml "$py" -m pip install -q --no-deps -e .
