"""How a guarded process ends after an emergency: the exit code, the exit file, the agent.

Leaving the `with` block after an emergency exits with `exit_code` (143) when its checkpoint was
committed where a new VM finds it, `lost_exit_code` (75) when not; `UNAVAILABLE_EXIT_CODE` (69)
when committed checkpoints exist but cannot be read at resume; `NO_RESTART_EXIT_CODE` (78) when the
job hung at the step its previous start hung at (restarting it would only end it there again).
Launchers such as torchrun replace the workers' exit codes with their own, so the node leader also
writes why the job ended to
`$SPOTGUARD_EXIT_FILE` for a startup script to read.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path

from cloud_adapters.notice import isoformat_z, utc_now
from cloud_adapters.storage import write_durably
from spotguard.ending import elastic
from spotguard.job.topology import Topology

log = logging.getLogger(__name__)

DEFAULT_EXIT_CODE = 143  # 128 + SIGTERM: what schedulers read as "terminated, restart me"
DEFAULT_LOST_EXIT_CODE = 75  # EX_TEMPFAIL: interrupted, and no new checkpoint was committed
UNAVAILABLE_EXIT_CODE = 69  # EX_UNAVAILABLE: committed checkpoints exist but cannot be read now
NO_RESTART_EXIT_CODE = 78  # EX_CONFIG: the same hang at the same step again; a setting must change, not the VM
EXIT_FILE_ENV = "SPOTGUARD_EXIT_FILE"


class ExitPolicy:
    """The end of one guard's run, on one rank. `node_leader`: this rank speaks for its node (the
    exit file, the elastic agent)."""

    def __init__(self, exit_code: int | None, lost_exit_code: int, *, node: str, node_leader: bool) -> None:
        self.exit_code = exit_code
        self.lost_exit_code = lost_exit_code
        self.node = node
        self.node_leader = node_leader
        self.withdrawal: str | None = None  # why this node's torchrun agent must not restart it

    @classmethod
    def on(cls, topology: Topology, exit_code: int | None, lost_exit_code: int) -> ExitPolicy:
        """The policy with these codes on this rank (its node, and whether it speaks for it)."""
        return cls(exit_code, lost_exit_code, node=topology.node, node_leader=topology.is_node_leader)

    def code(
        self,
        *,
        interrupted: bool,
        saved: bool,
        error: BaseException | None,
        goes_on: bool = False,
        leaving: bool = False,
    ) -> int | None:
        """The code to exit with when the guard closes, or None to return to the caller: no emergency,
        `exit_code=None`, the training ended with an exception of its own (it propagates), or the job goes on
        in this process (`goes_on`, in-process recovery). A leaving node whose share goes on in the survivors'
        processes ends with 0: nothing of it is to be restarted."""
        if not interrupted or self.exit_code is None or error is not None:
            return None
        if goes_on:
            return 0 if leaving else None
        return self.exit_code if saved else self.lost_exit_code

    def record(
        self,
        code: int,
        *,
        committed: bool,
        step: int | None,
        leaving: bool,
        cause: str = "interruption",
        culprit: str | None = None,
        for_node: bool = False,
        quiet: bool = False,
        goes_on: bool = False,
    ) -> None:
        """Write $SPOTGUARD_EXIT_FILE (node leader, or `for_node`: a rank that speaks for a node whose
        leader does not): why this node's job is about to exit (`cause`: an interruption notice, or a silent
        failure: `peer-lost`, `hang`, with the node or ranks to blame; `join`: under `spotguard.run`, neither
        the generation with joining nodes nor the one after it without them formed; `goes_on`: the job goes
        on without this node, in the survivors' processes). `quiet`: no log line, even on a failure (the
        caller's output may be blocked)."""
        path = os.environ.get(EXIT_FILE_ENV)
        if not path or not (self.node_leader or for_node):
            return
        record = {
            "exit_code": code,
            "committed": committed,
            "step": step if committed else None,
            "leaving": leaving,
            "cause": cause,
            **({"culprit": culprit} if culprit is not None else {}),
            **({"job_goes_on": True} if goes_on else {}),
            "node": self.node,
            "at": isoformat_z(utc_now()),
        }
        try:
            write_durably(Path(path), (json.dumps(record) + "\n").encode())
        except OSError as exc:
            if not quiet:
                log.warning("could not write %s=%s: %s", EXIT_FILE_ENV, path, exc)

    def leave_agent(self, *, quiet: bool = False) -> None:
        """Before exiting: stop this node's elastic agent from restarting it, where it must not (`quiet`: no
        log line, the caller's output may be blocked)."""
        if self.withdrawal and self.node_leader:
            elastic.withdraw_agent(self.withdrawal, quiet=quiet)

    def keep_sigterm_away(self) -> None:
        """Once the watcher gave the signal handlers back: a withdrawn agent passes its SIGTERM on to
        the workers, who are exiting anyway."""
        if self.withdrawal and self.node_leader:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    @staticmethod
    def leaving_now(code: int, *, saved: bool, why: str | None) -> None:
        """Say, first, why the process is about to leave without closing anything (`exit_now`): an upload
        abandoned at the deadline (`why`) still has SDK threads sending it, which closing the stores would
        wait for, and the VM is going away."""
        if saved:  # leaving: the survivors committed it and upload it
            log.warning("emergency checkpoint committed, not by this node (%s); exiting with code %d now", why, code)
        else:
            log.error(
                "interrupted without a new checkpoint; exiting with code %d now (only this VM's disk has it: %s)",
                code,
                why,
            )

    @staticmethod
    def exit_now(code: int) -> None:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def exit(self, code: int, *, saved: bool, goes_on: bool = False) -> None:
        if goes_on:
            log.warning("emergency checkpoint committed; this node leaves and the job goes on in the survivors' "
                        "processes: exiting with code %d", code)  # fmt: skip
        elif saved:
            log.warning("emergency checkpoint committed; exiting with code %d so the job is restarted", code)
        else:
            log.error("interrupted without a new checkpoint; exiting with code %d so the job is restarted", code)
        sys.exit(code)
