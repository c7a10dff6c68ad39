"""Listing a checkpoint location: its step directories, their manifests, and which look committed.

The cheap checks (a readable manifest, signed with the checkpoint key when one is set, every file
present with its size) and the full check of a local directory (CRC32C, SHA-256 with a key), shared
by the save path (retention), the resume path and the catalog (`spotguard.checkpoint.catalog`).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cloud_adapters.storage import NotFound, ObjectInfo, ObjectStore
from spotguard.checkpoint.format.auth import signature_problem
from spotguard.checkpoint.format.layout import MANIFEST_NAME, manifest_key, parse_step_dir, step_dir_name
from spotguard.checkpoint.format.manifest import Manifest, ManifestError, check_file

log = logging.getLogger(__name__)

# What every step directory's name starts with (layout.step_dir_name): a bucket shared with
# other applications is listed no wider than that.
STEP_PREFIX = "step-"


def scan(store: ObjectStore) -> dict[int, dict[str, ObjectInfo]]:
    """{step: {file name: info}} for every `step-N/` directory in the store (leftover siblings excluded)."""
    steps: dict[int, dict[str, ObjectInfo]] = defaultdict(dict)
    for info in store.list(STEP_PREFIX):  # a bucket shared with others: list only what may be ours
        step = step_of_key(info.key)
        if step is not None:
            steps[step][info.key.partition("/")[2]] = info
    return dict(steps)


def step_of_key(key: str) -> int | None:
    """The step of a key that is a file of a step directory (`step-N/name`), None for any other key."""
    head, _, name = key.partition("/")
    return parse_step_dir(head) if name and "/" not in name else None


def read_manifest(store: ObjectStore, step: int, key: bytes | None = None) -> Manifest:
    """The manifest of `step`; ManifestError when missing, malformed, about another step, or
    (with a checkpoint `key`) not signed with `key`.

    Any other StoreError (an unreachable store) propagates: it says nothing about the step.
    """
    try:
        manifest = Manifest.from_bytes(store.get_bytes(manifest_key(step)))
    except NotFound as exc:
        raise ManifestError(f"no manifest: {exc}") from exc
    if manifest.step != step:
        raise ManifestError(f"manifest says step {manifest.step}, directory says {step}")
    if key is not None and (unsigned := signature_problem(manifest, key)):
        raise ManifestError(unsigned)
    return manifest


def listing_problems(manifest: Manifest, files: dict[str, ObjectInfo]) -> list[str]:
    """Cheap check against a listing: every manifest file present with its size."""
    problems = []
    for record in manifest.files:
        info = files.get(record.name)
        if info is None:
            problems.append(f"{record.name}: missing")
        elif info.size != record.size:
            problems.append(f"{record.name}: size {info.size} != {record.size} in the manifest")
    return problems


def dir_problems(
    step_dir: Path, manifest: Manifest, *, threads: int = 4, key: bytes | None = None, contents: bool = True
) -> list[str]:
    """Full check of a local directory: sizes and CRC32C of every manifest file; with a checkpoint
    `key`, the manifest's HMAC first and every file's SHA-256. Without `contents`, the files are
    not read (the load that reads them checks them: shard_read.py)."""
    if step_dir.is_symlink():  # its files would be wherever it points
        return [f"{step_dir} is a symlink, not a step directory"]
    if key is not None and (unsigned := signature_problem(manifest, key)):  # nothing in it is worth reading then
        return [unsigned]
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="spotguard-verify") as pool:
        results = pool.map(
            lambda r: check_file(step_dir / r.name, r, sha256=key is not None, contents=contents), manifest.files
        )
        return [p for p in results if p]


def committed_manifests(
    store: ObjectStore, listing: dict[int, dict[str, ObjectInfo]] | None = None, *, key: bytes | None = None
) -> list[Manifest]:
    """Manifests of the steps that look committed (manifest readable, signed with `key` when one
    is given, files present), newest first.

    This does not read the data; checksums are checked before a step is loaded.
    `listing` is `scan(store)` when the caller already has it. A manifest the store cannot
    deliver (StoreError) fails the whole call: skipping it would make an older step look newest.
    """
    good = []
    for step, files in sorted((scan(store) if listing is None else listing).items(), reverse=True):
        if MANIFEST_NAME not in files:
            continue
        try:
            manifest = read_manifest(store, step, key)
        except ManifestError as exc:
            log.warning("ignoring %s/%s: %s", store.url, step_dir_name(step), exc)
            continue
        problems = listing_problems(manifest, files)
        if problems:
            log.warning("ignoring %s/%s: %s", store.url, step_dir_name(step), "; ".join(problems))
            continue
        good.append(manifest)
    return good
