"""Local paths and URLs (``s3://``, ``gs://``, any fsspec filesystem) behind one small surface.

A local path keeps the durable file operations of `loopkit.storage.local` (fsync + atomic
rename). A URL goes through fsspec, whose filesystems take credentials and
endpoints from each service's standard environment (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ...; Google's application default credentials and
``STORAGE_EMULATOR_HOST``). On an object store there is neither rename nor
fsync: one object's write is atomic; how a tree of objects is committed is the
business of whoever writes it (the checkpoint plugin's staged backend writes a
marker object last). See docs/storage.md.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
from pathlib import Path
from typing import Any

from loopkit.storage.local import atomic_write_bytes

__all__ = [
    "check_url", "exists", "filesystem", "is_dir", "is_url", "join",
    "list_names", "makedirs", "name_of", "normalise", "parent", "read_bytes", "remove",
    "size_and_mtime", "upload_tree", "write_atomic",
]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
#: scheme -> (the extra that brings its client, the modules it needs)
_EXTRAS = {
    "s3": ("s3", ("s3fs", "boto3")),
    "s3a": ("s3", ("s3fs", "boto3")),
    "gs": ("gcs", ("gcsfs",)),
    "gcs": ("gcs", ("gcsfs",)),
}

def scheme_of(path: Any) -> str | None:
    """The URL scheme of `path` (``"s3"``), or None for a local path (``file://`` too)."""
    if not isinstance(path, str):
        return None
    m = _SCHEME.match(path)
    if m is None or m.group(1).lower() == "file":
        return None
    return m.group(1).lower()


def is_url(path: Any) -> bool:
    """Whether `path` is a URL that fsspec reaches (not a local path)."""
    return scheme_of(path) is not None


def normalise(path: str | os.PathLike[str], field: str = "path") -> Path | str:
    """An absolute `Path` for a local path (``file://`` stripped); a URL without its trailing ``/``.

    A URL that cannot be reached fails here, naming `field` (see `check_url`).
    """
    if is_url(path):
        check_url(str(path), field)
        return str(path).rstrip("/")
    text = os.fspath(path)
    if isinstance(text, str) and text.lower().startswith("file://"):
        text = text[len("file://"):]
    return Path(text).absolute()


def check_url(url: str, field: str = "path") -> None:
    """Fail now, naming `field`, the URL and what to install, if `url` cannot be reached.

    An unknown scheme raises `ValueError`; a known one whose client library is
    missing raises `ImportError` naming the extra (``jax-loopkit[s3]``).
    """
    scheme = scheme_of(url)
    if scheme is None:
        return
    if scheme in _EXTRAS:
        _import_extra(url, field, scheme)
        return
    if importlib.util.find_spec("fsspec") is None:
        raise ImportError(f"{field}={url!r} is a {scheme}:// URL, which needs fsspec "
                          "(pip install fsspec); s3:// and gs:// come with the extras "
                          "jax-loopkit[s3] and jax-loopkit[gcs]")
    import fsspec

    try:
        fsspec.get_filesystem_class(scheme)
    except ValueError:
        raise ValueError(
            f"{field}={url!r} has the unknown URL scheme {scheme!r}: expected a local path, "
            "s3://, gs://, or a scheme fsspec knows (memory://, ...)") from None
    except ImportError as e:
        raise ImportError(f"{field}={url!r} needs the fsspec filesystem for {scheme}://: "
                          f"{e}") from e


def _import_extra(url: str, field: str, scheme: str) -> None:
    """Import the client modules of `scheme`'s extra, or raise `ImportError` naming it.

    However the import fails (a module missing, or installed but broken: a
    botocore that aiobotocore refuses), the error names the extra to install.
    """
    extra, modules = _EXTRAS[scheme]
    missing, broken = [], None
    for module in ("fsspec", *modules):
        if importlib.util.find_spec(module) is None:
            missing.append(module)
            continue
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - any failure: say what to install
            broken = broken or e
            missing.append(module)
    if missing:
        raise ImportError(
            f"{field}={url!r} needs {', '.join(missing)}, which "
            + ("failed to import" if broken is not None else "is not installed")
            + f": install the extra jax-loopkit[{extra}] (pip install 'jax-loopkit[{extra}]')"
            + (f" ({type(broken).__name__}: {broken})" if broken is not None else "")) from broken


def filesystem(url: str) -> tuple[Any, str]:
    """fsspec's filesystem for `url` and the path inside it."""
    scheme = scheme_of(url)
    if scheme in _EXTRAS:
        _import_extra(url, "path", scheme)
    try:
        from fsspec.core import url_to_fs

        return url_to_fs(url)
    except ImportError as e:
        raise ImportError(f"{url!r} needs a client library that failed to import ({e}); "
                          "s3:// and gs:// come with the extras jax-loopkit[s3] and "
                          "jax-loopkit[gcs]") from e


def join(base: Path | str, *names: str) -> Path | str:
    """`base` / `names`: a `Path` for a local base, a URL string for a URL."""
    if is_url(base):
        return "/".join([str(base).rstrip("/"), *names])
    return Path(base).joinpath(*names)


def name_of(path: Path | str) -> str:
    """The last component of a path or URL."""
    return str(path).rstrip("/").rsplit("/", 1)[-1]


def parent(path: Path | str) -> Path | str:
    """The directory (or prefix) holding `path`."""
    if is_url(path):
        return str(path).rstrip("/").rsplit("/", 1)[0]
    return Path(path).parent


def is_dir(path: Path | str) -> bool:
    if is_url(path):
        fs, p = filesystem(str(path))
        fs.invalidate_cache(p)
        return fs.isdir(p)
    return os.path.isdir(path)


def size_and_mtime(path: Path | str) -> tuple[int, float]:
    """Total bytes and the newest modification time (epoch seconds) of a file or tree.

    `FileNotFoundError` when nothing is there.
    """
    if not is_url(path):
        path = Path(path)
        if path.is_file():
            st = path.stat()
            return st.st_size, st.st_mtime
        total, newest = 0, path.stat().st_mtime
        for root, _dirs, files in os.walk(path):
            for f in files:
                with contextlib.suppress(FileNotFoundError):  # deleted while we look
                    st = os.stat(os.path.join(root, f))
                    total += st.st_size
                    newest = max(newest, st.st_mtime)
        return total, newest
    fs, p = filesystem(str(path))
    entries = fs.find(p, detail=True)
    if not entries:
        raise FileNotFoundError(path)
    total, newest = 0, 0.0
    for name, info in entries.items():
        total += int(info.get("size") or 0)
        stamp = info.get("LastModified") or info.get("mtime") or info.get("created")
        if stamp is None:
            stamp = fs.modified(name)
        newest = max(newest, stamp if isinstance(stamp, (int, float)) else stamp.timestamp())
    return total, newest


def makedirs(path: Path | str) -> None:
    """Create the directory `path` (nothing to create on an object store)."""
    if is_url(path):
        fs, p = filesystem(str(path))
        fs.makedirs(p, exist_ok=True)
    else:
        Path(path).mkdir(parents=True, exist_ok=True)


def read_bytes(path: Path | str) -> bytes:
    """The contents of one file or object; `FileNotFoundError` when there is none."""
    if is_url(path):
        fs, p = filesystem(str(path))
        return fs.cat_file(p)
    return Path(path).read_bytes()


def write_atomic(path: Path | str, data: bytes) -> None:
    """Replace one file so that a reader (or a crash) meets the old one or the new one.

    Local: a temporary file, fsync, rename, fsync of the directory. A URL: one
    object write (a single PUT, atomic on an object store).
    """
    if is_url(path):
        fs, p = filesystem(str(path))
        fs.pipe_file(p, data)
    else:
        atomic_write_bytes(path, data)


def exists(path: Path | str) -> bool:
    if is_url(path):
        fs, p = filesystem(str(path))
        return fs.exists(p)
    return os.path.exists(path)


def list_names(path: Path | str) -> dict[str, bool]:
    """Name -> is a directory, of the entries directly in `path` (fresh, never cached)."""
    if not is_url(path):
        try:
            return {e.name: e.is_dir(follow_symlinks=False) for e in os.scandir(path)}
        except (FileNotFoundError, NotADirectoryError):
            return {}
    fs, p = filesystem(str(path))
    fs.invalidate_cache(p)  # s3fs and gcsfs cache listings; a poller must see new objects
    try:
        entries = fs.ls(p, detail=True, refresh=True)
    except FileNotFoundError:
        return {}
    return {name_of(e["name"]): e["type"] == "directory" for e in entries}


def remove(path: Path | str) -> None:
    """Remove a file, an object, or a directory / prefix and all it holds (none: nothing)."""
    if is_url(path):
        fs, p = filesystem(str(path))
        with contextlib.suppress(FileNotFoundError):
            fs.rm(p, recursive=True)
        fs.invalidate_cache(p)
    elif os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def upload_tree(local: Path, url: str) -> None:
    """Copy every file under the local directory `local` to the same names under `url`."""
    fs, base = filesystem(url)
    files = sorted(p for p in Path(local).rglob("*") if p.is_file())
    if files:
        # one call: s3fs and gcsfs upload a batch of files concurrently (a file at a time,
        # a checkpoint of many small objects waited a round trip per object)
        fs.put([str(f) for f in files],
               [f"{base}/{f.relative_to(local).as_posix()}" for f in files])
    fs.invalidate_cache(base)
