"""Which job a checkpoint location belongs to: an identity kept in it.

The location itself is keyed as its store names it (`spotguard.job.topology.location_key`). A job
started over in the same place (its checkpoint_dir deleted) is a new job: the first start writes a
random identity into the checkpoint_dir (`spotguard-job.json`, created only where absent), every later
start reads the same one back, and once its snapshots have started the Guard writes it into the manifest
of every step it commits (`Manifest.job`). So the file is not the only copy: written once, it is the
location's oldest object, the first a bucket's lifecycle rule expires; lost or damaged while committed
steps carry the identity, it is re-adopted from the newest of them and written back. Only those steps
vouch for it, never the snapshots the nodes hold: a job started over must not load the snapshots of the
one before.
"""

from __future__ import annotations

import json
import logging
import secrets

from cloud_adapters.storage import AlreadyExists, NotFound, ObjectStore
from spotguard.checkpoint.format.layout import MANIFEST_NAME
from spotguard.checkpoint.format.listing import read_manifest, scan
from spotguard.checkpoint.format.manifest import ManifestError, is_identity

log = logging.getLogger(__name__)

IDENTITY_NAME = "spotguard-job.json"


def job_identity(remote: ObjectStore, key: bytes | None = None) -> str:
    """The job identity kept in the checkpoint location `remote`, written there first if there is none.

    A missing or damaged file is re-adopted from the newest committed step that carries the identity
    (signed with the checkpoint `key`, when one is set) and written back; with no such step a new
    identity is written: a new job, or steps from before identities were in manifests, whose
    snapshots nothing vouches for. Two starters racing to write a new one both end with the one
    that was written first (`create_only`).
    """
    for _ in range(3):
        try:
            return _read(remote)
        except NotFound:
            damaged = False
        except ValueError:
            damaged = True
        vouched, steps = _vouched(remote, key)
        lost = "is damaged" if damaged else "is missing"
        if vouched is not None:
            log.warning("%s in %s %s: re-adopted the job identity %s from its newest committed step that carries it",
                        IDENTITY_NAME, remote.url, lost, vouched)  # fmt: skip
            remote.put_bytes(IDENTITY_NAME, _body(vouched))
            return vouched
        if steps or damaged:
            log.warning("%s in %s %s, and none of its %d committed step(s) carries the job identity: a new one "
                        "(the snapshots the nodes hold for the old one are not resumed)", IDENTITY_NAME, remote.url,
                        lost, steps)  # fmt: skip
        try:  # a damaged file is replaced; a missing one only created, so that racing starters agree
            remote.put_bytes(IDENTITY_NAME, _body(secrets.token_hex(16)), create_only=not damaged)
        except AlreadyExists:
            pass
    return _read(remote)


def _read(remote: ObjectStore) -> str:
    data = remote.get_bytes(IDENTITY_NAME)
    try:
        job = json.loads(data)["job"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{IDENTITY_NAME} in the checkpoint location is not spotguard's") from None
    if not is_identity(job):
        raise ValueError(f"{IDENTITY_NAME} in the checkpoint location holds no valid job identity")
    return job


def _vouched(remote: ObjectStore, key: bytes | None) -> tuple[str | None, int]:
    """(the job identity in the newest committed step's manifest that carries one, or None; how many
    steps have a manifest). A manifest that cannot be read, or is not signed with `key`, vouches for
    nothing; a store that cannot answer raises."""
    steps = sorted((step for step, files in scan(remote).items() if MANIFEST_NAME in files), reverse=True)
    for step in steps:
        try:
            job = read_manifest(remote, step, key).job
        except ManifestError:
            continue
        if job is not None:
            return job, len(steps)
    return None, len(steps)


def _body(job: str) -> bytes:
    return json.dumps({"job": job}).encode()
