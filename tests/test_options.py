"""Guard settings: typed groups, keyword shortcuts, renamed keywords, one check per value."""

import dataclasses
import warnings

import pytest
import torch.distributed as dist

import spotguard
from spotguard import CoordinationOptions, ExitOptions, NoticeOptions, SaveOptions, StorageOptions
from spotguard.options import SnapshotOptions
from tests.doc_prose import default_of, matches, prose_defaults

STORE = dist.HashStore()


def test_keyword_shortcuts_and_groups_make_the_same_settings(tmp_path):
    flat = spotguard.Guard(tmp_path, cloud="none", keep_last=3, save_interval_s=600, transfer_threads=2, grace_s=10)
    grouped = spotguard.Guard(
        tmp_path,
        notices=NoticeOptions(cloud="none", grace_s=10),
        saving=SaveOptions(keep_last=3, save_interval_s=600),
        storage=StorageOptions(transfer_threads=2),
    )
    assert flat.options == grouped.options
    assert flat.options.saving.keep_last == 3 and flat.options.notices.grace_s == 10.0
    assert flat.options.exiting == ExitOptions() and flat.options.coordination == CoordinationOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        flat.options.saving.keep_last = 5  # type: ignore[misc]


def test_the_settings_in_use_are_checked_and_normalised_once():
    options = NoticeOptions(signals=["SIGTERM", "SIGUSR1"], poll_interval_s=1, metadata_url="http://127.0.0.1:9/")
    assert [s.name for s in options.signals] == ["SIGTERM", "SIGUSR1"]
    assert options.poll_interval_s == 1.0 and isinstance(options.poll_interval_s, float)
    assert options.metadata_url == "http://127.0.0.1:9"
    with pytest.raises(ValueError, match="^keep_last must be >= 1, got 0$"):
        SaveOptions(keep_last=0)  # the group itself refuses, as Guard(keep_last=0) does
    with pytest.raises(ValueError, match='only with save_interval_s="auto"'):
        SaveOptions(min_save_interval_s=60)
    assert SaveOptions(save_interval_s="auto").cadence() is not None and SaveOptions().cadence() is None


def test_renamed_keywords_still_work_with_a_deprecation_warning(tmp_path):
    with pytest.warns(
        DeprecationWarning, match=r"Guard\(poll_interval=\.\.\.\) is deprecated: use poll_interval_s="
    ) as w:
        guard = spotguard.Guard(tmp_path, cloud="none", poll_interval=0.5)
    assert w[0].filename == __file__  # points at the caller's line
    assert guard.options.notices.poll_interval_s == 0.5
    with pytest.warns(DeprecationWarning, match="use transfer_threads="):
        assert spotguard.Guard(tmp_path, cloud="none", thread_count=7).options.storage.transfer_threads == 7
    with pytest.raises(TypeError, match="not both"), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        spotguard.Guard(tmp_path, cloud="none", thread_count=7, transfer_threads=7)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"keep_lst": 3}, TypeError, "Guard() got an unexpected keyword argument 'keep_lst'"),
        ({"saving": SaveOptions(), "keep_last": 3}, TypeError, "keep_last is given twice: as a keyword and in saving="),
        ({"notices": NoticeOptions(), "cloud": "aws"}, TypeError, "cloud is given twice"),
        ({"saving": {"keep_last": 3}}, TypeError, "saving must be a SaveOptions, not dict"),
        ({"rank": 0}, ValueError, "rank and world_size go together"),
        ({"store": STORE, "rank": 1}, ValueError, "rank and world_size go together"),
        ({"rank": 1, "world_size": 4}, ValueError, "a stated rank and world_size need the store the ranks share"),
        ({"local_rank": 0}, ValueError, "local_rank and node need rank and world_size too"),
        ({"checkpoint_key": ""}, ValueError, "checkpoint_key must not be empty"),
        ({"min_nodes": 0}, ValueError, "min_nodes (or $SPOTGUARD_MIN_NODES) must be a positive int"),
        # a stated topology: refused at Guard(), not when the guard starts (store="x" was an AttributeError there)
        ({"store": STORE, "rank": 2, "world_size": 2}, ValueError, "rank must lie in [0, world_size=2), not 2"),
        ({"store": "x", "rank": 0, "world_size": 2}, TypeError, "store must be a torch.distributed.Store, not str"),
        ({"store": "x"}, TypeError, "store must be a torch.distributed.Store, not str"),
        ({"store": STORE, "rank": 1, "world_size": 4, "local_rank": 2}, ValueError, "local_rank (2) cannot exceed"),
        ({"store": STORE, "rank": -1, "world_size": 4}, ValueError, "rank must be >= 0, got -1"),
        ({"store": STORE, "rank": 1.0, "world_size": 4}, TypeError, "rank must be an int, not float"),
        ({"store": STORE, "rank": 0, "world_size": 0}, ValueError, "world_size must be >= 1, got 0"),
        ({"store": STORE, "rank": 0, "world_size": 2, "local_rank": -1}, ValueError, "local_rank must be >= 0"),
        ({"store": STORE, "rank": 0, "world_size": 2, "node": 3}, TypeError, "node must be a str, not int"),
        ({"snapshot_dir": ""}, ValueError, "snapshot_dir must not be empty"),
    ],
)
def test_wrong_settings_are_one_line_errors_at_the_call(tmp_path, kwargs, error, message):
    with pytest.raises(error) as raised:
        spotguard.Guard(tmp_path, **kwargs)
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)


def test_a_stated_topology_is_kept_as_plain_ints():
    import numpy as np

    options = CoordinationOptions(store=STORE, rank=np.int64(3), world_size=np.int32(4), local_rank=np.int8(1))
    assert (options.rank, options.world_size, options.local_rank) == (3, 4, 1)
    assert all(type(v) is int for v in (options.rank, options.world_size, options.local_rank))


@pytest.mark.parametrize("value, message", [("\u00b2", "must be a number of steps"), ("0", "must be >= 1")])
def test_snapshot_every_from_the_environment_is_named_when_wrong(monkeypatch, value, message):
    """'²'.isdigit() is True but int('²') raises an error that named nothing; 0 named snapshot_every."""
    monkeypatch.setenv("SPOTGUARD_SNAPSHOT_EVERY", value)
    with pytest.raises(ValueError) as raised:
        SnapshotOptions()
    assert str(raised.value).startswith("$SPOTGUARD_SNAPSHOT_EVERY " + message), raised.value
    monkeypatch.setenv("SPOTGUARD_SNAPSHOT_EVERY", " 12 ")
    assert SnapshotOptions().snapshot_every == 12


def test_the_checkpoint_key_stays_out_of_reprs(tmp_path):
    guard = spotguard.Guard(tmp_path, cloud="none", checkpoint_key="s3cret-key")
    assert "s3cret" not in repr(guard.options) and "s3cret" not in repr(StorageOptions(checkpoint_key="s3cret"))


def test_guard_options_default_to_the_documented_values():
    """Every default the pages write by an option's name, "`grace_s` (25 s)", "`snapshot_replicas` (default 1)",
    a settings table's default column... (tests/doc_prose.py finds them), is the one the code takes."""
    said = prose_defaults()
    wrong = [f"{s.where()}: {s.name} {s.value}, the code's {default_of(s.name)!r}" for s in said if not matches(s)]
    assert not wrong, "\n".join(wrong)
    found = {s.name for s in said}  # the scan still finds the guides' mentions
    assert found >= {"grace_s", "poll_interval_s", "snapshot_replicas", "snapshot_dir", "peer_timeout_s"}


def test_settings_read_by_their_former_attribute_names_still_answer_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("SPOTGUARD_MIN_NODES", "2")
    guard = spotguard.Guard(tmp_path, cloud="none", exit_code=None, poll_interval_s=0.5, transfer_threads=3)
    with pytest.warns(DeprecationWarning, match=r"Guard.exit_code is deprecated: read guard.options.exiting.exit_code"):
        assert guard.exit_code is None
    with pytest.warns(DeprecationWarning, match="guard.options.notices.poll_interval_s"):
        assert guard.poll_interval == 0.5
    with pytest.warns(DeprecationWarning, match="guard.options.storage.transfer_threads"):
        assert guard.thread_count == 3
    with pytest.warns(DeprecationWarning):
        assert guard.min_nodes == 2  # resolved from the environment, as before
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
        guard.no_such_thing  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'checkpoint_key'"):
        guard.checkpoint_key  # noqa: B018 - never an attribute: the secret stays out of reach


def test_a_renamed_keyword_given_through_an_integration_warns_at_the_user_s_line(tmp_path):
    from spotguard.integrations.lightning import SpotGuardCallback

    with pytest.warns(DeprecationWarning, match="use poll_interval_s=") as w:
        SpotGuardCallback(str(tmp_path), poll_interval=0.5)
    assert w[0].filename == __file__


def test_an_integration_takes_whole_groups_without_naming_the_cloud(tmp_path):
    from spotguard.integrations.lightning import SpotGuardCallback

    callback = SpotGuardCallback(str(tmp_path), notices=NoticeOptions(cloud="none", grace_s=10))
    assert callback.guard.options.notices.grace_s == 10.0


def test_switches_take_booleans_and_their_equals_but_never_strings():
    import numpy as np

    assert StorageOptions(stream_uploads=1).stream_uploads is True
    assert NoticeOptions(save_on_rebalance=np.bool_(False)).save_on_rebalance is False
    for bad in ("false", None, 2, 0.0):
        with pytest.raises(TypeError, match="^stream_uploads must be True or False"):
            StorageOptions(stream_uploads=bad)
