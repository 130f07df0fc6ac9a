"""Paths that may name an object store (gs://, ...): which do, and whether their bucket exists.

A leaf: it imports nothing of podrun's, so that the checkpoint store, the command line and the
request and results files all use it without importing one another."""

from __future__ import annotations

import fsspec
from etils import epath


class BucketError(ValueError):
    """An object-store path whose bucket is missing or cannot be reached."""


def is_remote(path: str) -> bool:
    """An object store (gs://, ...): no directories, no append, no rename."""
    return "://" in path


def check_bucket(path: str, what: str, error: type[Exception] = BucketError) -> None:
    """A missing bucket fails here, in one line (an `error` naming `what`, the setting that gave
    the path), rather than being created (as gcsfs's mkdir would)."""
    if not is_remote(path):
        return
    scheme, rest = path.split("://", 1)
    name = rest.split("/", 1)[0]
    bucket = f"{scheme}://{name}"
    try:
        if scheme == "gs":  # listing needs object access only (objectViewer), not buckets.get
            fsspec.filesystem("gs").call("GET", "b/{}/o", name, maxResults=1, json_out=True)
        elif not epath.Path(bucket).exists():
            raise FileNotFoundError(bucket)
    except FileNotFoundError:
        raise error(f"{what}={path}: bucket {bucket} does not exist") from None
    except Exception as e:  # auth or network: gcsfs raises several kinds
        raise error(f"{what}={path}: cannot reach {bucket} ({type(e).__name__}: {e})") from e
