"""What a checkpoint location holds: list steps, verify them, find the newest good one.

With a checkpoint key (`auth`), a step must also be signed with it, and every file must
match its SHA-256; without one, signatures are neither needed nor checked.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cloud_adapters.storage import LocalStore, ObjectStore, StoreError
from cloud_adapters.stores import open_store
from spotguard.checkpoint.format.auth import signature_problem
from spotguard.checkpoint.format.layout import MANIFEST_NAME, step_dir_name
from spotguard.checkpoint.format.listing import (
    dir_problems,
    listing_problems,
    read_manifest,
    scan,
)
from spotguard.checkpoint.format.manifest import ManifestError, check_file
from spotguard.checkpoint.io.progress import TransferProgress

log = logging.getLogger(__name__)

ProgressFactory = Callable[[str, int], TransferProgress]


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    step: int
    committed: bool  # has a readable manifest whose files are all present with the right sizes
    reason: str | None
    size: int  # bytes
    files: int
    created_at: str | None
    world_size: int | None
    location: str
    problem: str | None = None  # why it is not committed, when it has a manifest
    signed: bool = False  # its manifest carries an HMAC (checked when listed with a key)
    run: str | None = None  # the run that committed it (runs.py)


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    step: int
    ok: bool  # committed, and every file matches the manifest
    problems: list[str]
    location: str
    committed: bool = True  # False: a step directory without a manifest, which is no checkpoint (and no fault)


def list_checkpoints(location: str, *, key: bytes | None = None) -> list[CheckpointInfo]:
    """Every step directory at `location` (path, file://, s3://, gs://, az://), oldest first.

    With a checkpoint `key`, a step not signed with it is listed as not committed, as resume sees it.
    """
    store = open_store(location)
    out = []
    for step, files in sorted(scan(store).items()):
        where = f"{store.url}/{step_dir_name(step)}"
        data = {n: i for n, i in files.items() if n != MANIFEST_NAME}
        info = CheckpointInfo(step, False, None, sum(i.size for i in data.values()), len(data), None, None, where)
        if MANIFEST_NAME in files:
            try:
                manifest = read_manifest(store, step)
                problems = listing_problems(manifest, files)
                if key is not None and (unsigned := signature_problem(manifest, key)):
                    problems.insert(0, unsigned)
                info = dataclasses.replace(
                    info,
                    committed=not problems,
                    reason=manifest.reason,
                    size=manifest.total_bytes,
                    files=len(manifest.files),
                    created_at=manifest.created_at,
                    world_size=manifest.world_size,
                    problem="; ".join(problems) or None,
                    signed=manifest.hmac is not None,
                    run=manifest.run,
                )
            except (ManifestError, StoreError) as exc:
                info = dataclasses.replace(info, problem=str(exc))
        out.append(info)
    return out


def verify_step(
    store: ObjectStore,
    step: int,
    *,
    threads: int = 4,
    progress: ProgressFactory | None = None,
    key: bytes | None = None,
) -> list[str]:
    """Problems with `step` (empty when every file matches the manifest's size and CRC32C, and
    with a checkpoint `key`, the manifest is signed with it and every file matches its SHA-256)."""
    try:
        manifest = read_manifest(store, step, key)
    except (ManifestError, StoreError) as exc:
        return [str(exc)]
    if isinstance(store, LocalStore):
        return dir_problems(store.path(step_dir_name(step)), manifest, threads=threads, key=key)
    problems = listing_problems(manifest, scan(store).get(step, {}))
    if problems:
        return problems
    # A remote object is checked by downloading it to scratch space, a few files at a time.
    shown = progress(f"verifying {step_dir_name(step)}", manifest.total_bytes) if progress else None
    with tempfile.TemporaryDirectory(prefix="spotguard-verify-") as scratch:

        def check(record) -> str | None:
            local = Path(scratch) / record.name
            try:
                store.get_file(f"{step_dir_name(step)}/{record.name}", local, progress=shown)
                return check_file(local, record, sha256=key is not None)
            except StoreError as exc:
                return f"{record.name}: {exc}"
            finally:
                local.unlink(missing_ok=True)

        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="spotguard-verify") as pool:
            problems = [p for p in pool.map(check, manifest.files) if p]
    if shown:
        shown.finish()
    return problems


def verify_checkpoint(
    location: str, step: int | None = None, *, progress: ProgressFactory | None = None, key: bytes | None = None
) -> list[VerifyResult]:
    """Check one step, or every step directory at `location`; each result lists its problems.

    With a checkpoint `key`, a step not signed with it is bad, and files are checked against their SHA-256.

    A step directory without a manifest (a save that never committed, or retention stopped
    half-way, which deletes the manifest first) is reported as uncommitted, not as bad.
    `progress(label, total_bytes)` makes a progress reporter for each remote step downloaded.
    """
    store = open_store(location)
    listing = scan(store)
    results = []
    for s in [step] if step is not None else sorted(listing):
        where = f"{store.url}/{step_dir_name(s)}"
        if s in listing and MANIFEST_NAME not in listing[s]:
            results.append(VerifyResult(s, False, [], where, committed=False))
            continue
        problems = verify_step(store, s, progress=progress, key=key)
        results.append(VerifyResult(s, not problems, problems, where))
    return results
