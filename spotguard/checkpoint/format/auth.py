"""Optional checkpoint authentication: an HMAC-SHA256 over the manifest, a SHA-256 of every file in it.

A CRC32C catches accidents, but anyone who can write a checkpoint can rewrite the manifest
or forge a file's CRC32C. With a key, the coordinator signs the manifest, and the SHA-256 of
every file (which the HMAC covers) ties the data to it: a writer without the key cannot make
resume accept a step. Without a key nothing is signed or checked, and a signed step loads
like any other.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os

from spotguard.checkpoint.format.manifest import Manifest

KEY_ENV = "SPOTGUARD_CHECKPOINT_KEY"

CheckpointKey = bytes | str


def resolve_key(key: CheckpointKey | None = None) -> bytes | None:
    """The key to sign and check with: `key` when given, else $SPOTGUARD_CHECKPOINT_KEY, else None (none)."""
    if key is None:
        key = os.environ.get(KEY_ENV) or None  # set but empty: no key
        if key is None:
            return None
    if isinstance(key, str):
        key = key.encode()
    if not isinstance(key, bytes):
        raise TypeError(f"checkpoint_key must be bytes or str, not {type(key).__name__}")
    if not key:
        raise ValueError("checkpoint_key must not be empty")
    return key


def sign(manifest: Manifest, key: bytes) -> Manifest:
    return dataclasses.replace(manifest, hmac=_mac(manifest, key))


def signature_problem(manifest: Manifest, key: bytes) -> str | None:
    """None when `key` signed `manifest`, else why the step must not be trusted (one line)."""
    if manifest.hmac is None:
        return "unsigned: its manifest has no HMAC, and a checkpoint key is set"
    if not hmac.compare_digest(manifest.hmac.encode(), _mac(manifest, key).encode()):
        return "signed with another key (or altered): its manifest's HMAC does not match"
    return None


def _mac(manifest: Manifest, key: bytes) -> str:
    return hmac.new(key, manifest.unsigned_bytes(), hashlib.sha256).hexdigest()
