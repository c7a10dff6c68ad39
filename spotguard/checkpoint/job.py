"""Which job a checkpoint location belongs to: its location's key, and an identity kept in it.

Two jobs that both say `Guard("ckpt")` in different working directories are two jobs: the location
is keyed as its store names it (`canonical_location`: an absolute, real path; a bucket URL without
the slashes around its prefix), never as it was typed. And a job started over in the same place
(its checkpoint_dir deleted) is a new job: the first start writes a random identity into the
checkpoint_dir (`spotguard-job.json`, created only where absent), and every later start of the job
reads the same one back.
"""

from __future__ import annotations

import hashlib
import json
import secrets

from cloud_adapters.storage import AlreadyExists, NotFound, ObjectStore
from cloud_adapters.stores import canonical_location

IDENTITY_NAME = "spotguard-job.json"


def location_key(checkpoint_dir: str) -> str:
    """A short key of the location as its store names it: the same for every spelling of one place."""
    return hashlib.sha256(canonical_location(checkpoint_dir).encode()).hexdigest()[:16]


def job_identity(remote: ObjectStore) -> str:
    """The job identity kept in the checkpoint location `remote`, written there first if there is none.

    Two starters racing to write it both end with the one that was written first (`create_only`).
    """
    for _ in range(3):
        try:
            return _read(remote)
        except NotFound:
            pass
        try:
            remote.put_bytes(IDENTITY_NAME, json.dumps({"job": secrets.token_hex(16)}).encode(), create_only=True)
        except AlreadyExists:
            pass
    return _read(remote)


def _read(remote: ObjectStore) -> str:
    data = remote.get_bytes(IDENTITY_NAME)
    try:
        job = json.loads(data)["job"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{IDENTITY_NAME} in the checkpoint location is not spotguard's") from None
    if not isinstance(job, str) or not job.isalnum() or len(job) > 64:
        raise ValueError(f"{IDENTITY_NAME} in the checkpoint location holds no valid job identity")
    return job
