"""The guard's end: after an emergency, the exit code, its records and the order they are written in.

Closing a guard stops what it started (the guard's teardown); this decides what comes around it. The
exit file and the ledger's exit record come before the process leaves, the node's torchrun agent is
left before the teardown (which can take longer than the agent's next round), and an upload abandoned
at the deadline leaves at once: closing the stores would wait for their SDK threads.
"""

from __future__ import annotations

from collections.abc import Callable

from spotguard.checkpoint import SaveReport
from spotguard.ending.exit_policy import ExitPolicy
from spotguard.goodput.recorder import GoodputRecorder
from spotguard.wiring.rounds import EmergencyOutcome


def end(
    exit_policy: ExitPolicy,
    emergency: EmergencyOutcome,
    goodput: GoodputRecorder,
    *,
    error: BaseException | None,
    last_save: SaveReport | None,
    last_step: int | None,
    teardown: Callable[[Callable[[], None]], None],
) -> None:
    """End one started guard: `teardown(saves_done)` stops everything it started and runs `saves_done`
    once the last save has ended; `error` is the exception that ended the training, if any."""
    goes_on = bool(emergency.goes_on)
    code = exit_policy.code(
        interrupted=emergency.interrupted,
        saved=emergency.saved,
        error=error,
        goes_on=goes_on,
        leaving=emergency.leaving,
    )

    silent = goes_on and not emergency.interrupted  # a node lost without a notice: the job goes on in-process
    why = emergency.cause if silent else "joining" if emergency.joining else None

    def ended() -> None:
        goodput.ended(code, None if silent else error, interrupted=emergency.interrupted, committed=emergency.saved,
                      last_step=last_step, why=why)  # fmt: skip

    if code is not None:
        step = last_save.step if last_save else None
        exit_policy.record(code, committed=emergency.saved, step=step, leaving=emergency.leaving, goes_on=goes_on)
    if code is not None and emergency.upload_abandoned:
        exit_policy.leaving_now(code, saved=emergency.saved, why=last_save.error if last_save else None)
        ended()
        goodput.close(timeout_s=2.0)
        exit_policy.leave_agent()
        exit_policy.exit_now(code)
    if code is not None:  # before the teardown: meanwhile the agent could restart this node into the next round
        exit_policy.leave_agent()
    teardown(ended)
    if code is not None:
        exit_policy.exit(code, saved=emergency.saved, goes_on=goes_on)
