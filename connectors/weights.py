"""A fingerprint of a model's weights, for the namespace of every chunk it computes.

Two checkpoints at one path (a model re-deployed in place, one `model_id` given to two
fine-tunes) compute different KV for the same tokens; the namespace must tell them
apart. The fingerprint is SHA-256 over the checkpoint's weight files (`*.safetensors`;
without any, `*.bin`, `*.pt`, `*.pth`, `*.gguf`) and the config files that shape the KV
(CONFIG_FILES), each by name and content digest; a path that is a file is hashed alone.
A collision-resistant hash, as for every other part of a key (kvstore/format/keys.py): a
LoRA adapter may come from a client.

Hashing reads every byte of the checkpoint (about 16 GB for an 8B model), so each file's
digest is kept in a cache file keyed by the file's (device, inode, size, mtime, ctime): a
restart re-reads nothing, and a file replaced or rewritten in place is hashed again. The
ctime is what `cp -p` and `rsync -a` cannot carry over (no call sets it but the kernel,
at any change): new weights of the same size deployed with the old times are hashed
again. The cache is `weight-digests.json` in `$XDG_CACHE_HOME/kvstore` (else
`~/.cache/kvstore`), a directory only this user may write (made 0700), the file 0600,
read up to MAX_CACHE_BYTES and never followed through a link; if the directory is unsafe
or unwritable, digests are not cached. An entry that is not exactly what this version
writes counts as absent, and a cache file that cannot be read as a whole counts as empty:
an engine never fails to start because of the cache. Weight files themselves may be links
(a Hugging Face snapshot's are): they are read, never written.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import logging
import os
import re
import threading
import time

from kvstore.config.runtime import directory_problem, open_private
from kvstore.format.errors import ConfigError

log = logging.getLogger("kvstore.weights")

WEIGHT_PATTERNS = (("*.safetensors",), ("*.bin", "*.pt", "*.pth", "*.gguf"))  # first that matches
CONFIG_FILES = ("config.json", "params.json", "preprocessor_config.json", "processor_config.json",
                "quant_config.json", "hf_quant_config.json", "adapter_config.json")
CACHE_ENTRIES = 4096  # files remembered (oldest dropped)
MAX_CACHE_BYTES = 4 << 20  # a cache file of CACHE_ENTRIES entries is under 1.5 MiB
_DIGEST = re.compile(r"[0-9a-f]{64}")  # a SHA-256, as this version writes it


class WeightsUnknown(ValueError):
    """No weight files at the path: its weights cannot be fingerprinted."""


def cache_directory() -> str:
    base = os.environ.get("XDG_CACHE_HOME")
    if not base or not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvstore")


class FileDigests:
    """SHA-256 of files, remembered by (device, inode, size, mtime_ns, ctime_ns) in `path`
    (None: in memory only). Thread-safe; a damaged cache file counts as empty, a damaged
    entry as absent. `hashed` counts the files this one read (not found in the cache)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.hashed = 0
        self._lock = threading.Lock()
        self._known: dict[str, list[int | str]] = self._load()

    def digest(self, file: str) -> bytes:
        st = os.stat(file)
        stamp: list[int | str] = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
        name = os.path.realpath(file)
        with self._lock:
            known = self._known.get(name)
        if known is not None and known[:-1] == stamp:
            return bytes.fromhex(str(known[-1]))
        digest = _hash_file(file)
        with self._lock:
            self.hashed += 1
            self._known.pop(name, None)
            self._known[name] = [*stamp, digest.hex()]
            while len(self._known) > CACHE_ENTRIES:
                del self._known[next(iter(self._known))]
            self._save()
        return digest

    def _load(self) -> dict[str, list[int | str]]:
        if self.path is None:
            return {}
        try:
            fd = open_private(self.path, os.O_RDONLY)  # made empty where there was none
            with os.fdopen(fd, "rb") as f:
                text = f.read(MAX_CACHE_BYTES + 1)
            loaded = json.loads(text[:MAX_CACHE_BYTES]) if text else {}
        except Exception as exc:  # whatever the file holds (nested past the parser's stack too)
            log.warning("weights digest cache %s not read (%s): %s; files are hashed again", self.path,
                        type(exc).__name__, str(exc)[:200])
            return {}
        if not isinstance(loaded, dict):
            return {}
        return {name: entry for name, entry in loaded.items() if _entry_ok(entry)}

    def _save(self) -> None:
        """Written whole to a temporary file, then renamed over the cache (lock held)."""
        if self.path is None:
            return
        temporary = f"{self.path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with os.fdopen(open_private(temporary, os.O_WRONLY | os.O_TRUNC), "w") as f:
                json.dump(self._known, f)
            os.replace(temporary, self.path)
        except (OSError, ValueError) as exc:
            log.warning("weights digest cache %s not written (%s); a restart hashes again", self.path, exc)
            with contextlib.suppress(OSError):
                os.unlink(temporary)


def _entry_ok(entry: object) -> bool:
    """An entry exactly as `digest` writes it: five stamp integers and a SHA-256 in hex
    (an older version's entries, of other stamps or digests, are not)."""
    return (isinstance(entry, list) and len(entry) == 6
            and all(type(value) is int for value in entry[:5])
            and isinstance(entry[5], str) and _DIGEST.fullmatch(entry[5]) is not None)


def _hash_file(file: str) -> bytes:
    with open(file, "rb") as f:
        return hashlib.file_digest(f, "sha256").digest()


def default_digests() -> FileDigests:
    """Digests cached in the user's cache directory, or in memory where it is unsafe."""
    directory = cache_directory()
    with contextlib.suppress(OSError):
        os.makedirs(directory, 0o700, exist_ok=True)
    problem = directory_problem(directory)
    if problem is not None:
        log.warning("weights digests are not cached: %s %s", directory, problem)
        return FileDigests(None)
    return FileDigests(os.path.join(directory, "weight-digests.json"))


_shared: FileDigests | None = None
_shared_lock = threading.Lock()


def shared_digests() -> FileDigests:
    """One FileDigests per process (its cache file read once)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = default_digests()
        return _shared


def checkpoint_files(path: str) -> list[str]:
    """The files a fingerprint of `path` covers, by name (relative to `path`)."""
    if os.path.isfile(path):
        return [os.path.basename(path)]
    names = sorted(os.listdir(path))
    weights: list[str] = []
    for kind in WEIGHT_PATTERNS:
        weights = [n for n in names if any(fnmatch.fnmatch(n, p) for p in kind)]
        if weights:
            break
    if not weights:
        patterns = ", ".join(p for ps in WEIGHT_PATTERNS for p in ps)
        raise WeightsUnknown(f"no weight files ({patterns}) in {path}")
    return sorted(weights + [n for n in names if n in CONFIG_FILES])


def fingerprint(path: str, digests: FileDigests | None = None) -> str:
    """`sha256:` and 64 hex digits naming the weights at `path` (a checkpoint directory or
    one file); WeightsUnknown if it holds none, OSError if it cannot be read."""
    digests = digests if digests is not None else shared_digests()
    started = time.monotonic()
    files = checkpoint_files(path)
    base = path if os.path.isdir(path) else os.path.dirname(path)
    hasher = hashlib.sha256(b"kvstore-weights-v2")
    for name in files:
        hasher.update(name.encode() + b"\0" + digests.digest(os.path.join(base, name)))
    found = "sha256:" + hasher.hexdigest()
    log.debug("weights at %s: %s (%d files, %.2f s)", path, found, len(files), time.monotonic() - started)
    return found


def weights_identity(model: str, model_revision: str | None, hub_revision: str | None = None) -> str:
    """What names a model's weights in its namespaces: `rev:` and the operator's
    `model_revision`, else the fingerprint of its checkpoint (model_fingerprint).
    ConfigError naming `model_revision` where neither can be had: kvstore would not know
    which weights computed what it stores."""
    if model_revision:
        return f"rev:{model_revision}"
    try:
        found = model_fingerprint(model, hub_revision)
    except (WeightsUnknown, OSError) as exc:
        raise ConfigError("model_revision", None, f"the weights of {model} could not be fingerprinted "
                                                  f"({exc}): name them with model_revision") from None
    log.info("weights of %s: %s", model, found)
    return found


def numerics(**settings: str | None) -> str:
    """What changes the KV an engine computes from a checkpoint's files, as a suffix of the
    weights' identity: each of the engine's `settings` that is set, `|name:value` in the
    order given. The engines name a quantization they apply or read (`quant`: `--quantization
    fp8` on a bf16 checkpoint makes other KV from the same files), the compute dtype where
    the KV cache's dtype does not name it already (`compute`: an fp8 cache filled by bf16 or
    by fp16 compute), and overrides of the model's config (`overrides`, a rope scaling: by
    `overrides_digest`). None set: empty, so the keys made before these were named stay."""
    return "".join(f"|{name}:{value}" for name, value in settings.items() if value)


def overrides_digest(overrides: object) -> str | None:
    """A short SHA-256 naming overrides of a model's config (a mapping, or its JSON text),
    the same however they were spelled (key order, spacing); None for none. Text that is
    not JSON is named as it is."""
    canonical = overrides
    if isinstance(overrides, str):
        try:
            canonical = json.loads(overrides) if overrides.strip() else None
        except ValueError:
            return hashlib.sha256(overrides.encode()).hexdigest()[:32]
    if not canonical:
        return None
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def model_fingerprint(model: str, revision: str | None = None) -> str:
    """The fingerprint of a model given as an engine names it: a local checkpoint (a
    directory or file), else a Hugging Face id the engine downloaded (its local snapshot at
    `revision`); WeightsUnknown where neither holds weight files."""
    path = model if os.path.exists(model) else _hub_snapshot(model, revision)
    if path is None:
        raise WeightsUnknown(f"{model} is neither a local checkpoint nor a downloaded Hugging Face model")
    return fingerprint(path)


def _hub_snapshot(repo: str, revision: str | None) -> str | None:
    """The local snapshot directory of a downloaded Hugging Face model, or None."""
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(repo, revision=revision, local_files_only=True))
    except Exception as exc:  # not a hub id, not downloaded, no hub package: not found
        log.debug("no local snapshot of %s (%s)", repo, exc)
        return None
