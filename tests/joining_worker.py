"""The example under torchrun for the join tests (tests/test_inprocess.py), with what they inject: test code,
not spotguard's.

- SPOTGUARD_TEST_GO: a path; the example starts only once it exists. A joining node pays for its
  interpreter and `import torch` first, so that it knocks the moment the test says, not seconds later.
- SPOTGUARD_TEST_FORM_TIMEOUT: a shorter wait for a generation's members (s).
- SPOTGUARD_TEST_VANISH: a joining process dies as soon as the job has taken it in, before it forms the
  generation it was given (its VM reclaimed at that moment).
- SPOTGUARD_TEST_SIGTERM_IN_PAUSE: the node of that number (GROUP_RANK) gets SIGTERM between generations 0
  and 1, as it begins to form generation 1 (its VM stopped at that moment).
"""

import os
import runpy
import signal
import sys
import time
from pathlib import Path

import torch  # noqa: F401 - imported before the wait: the start-up a joining node pays

from spotguard.inprocess import generation, runner

if "SPOTGUARD_TEST_FORM_TIMEOUT" in os.environ:
    generation.FORM_TIMEOUT_S = float(os.environ["SPOTGUARD_TEST_FORM_TIMEOUT"])
if "SPOTGUARD_TEST_VANISH" in os.environ:

    def vanish(*args, **kwargs):
        print("joining process: taken in, vanishing before the generation forms", flush=True)
        os._exit(1)

    runner.form = vanish

if os.environ.get("SPOTGUARD_TEST_SIGTERM_IN_PAUSE", "-") == os.environ.get("GROUP_RANK"):
    forming = runner.form

    def stopped_in_the_pause(following, *args, **kwargs):
        if following.number == 1:
            print("test: SIGTERM between generations", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
        return forming(following, *args, **kwargs)

    runner.form = stopped_in_the_pause

go = os.environ.get("SPOTGUARD_TEST_GO")
deadline = time.monotonic() + 300
while go and not Path(go).exists() and time.monotonic() < deadline:
    time.sleep(0.05)

sys.argv[0] = str(Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py")
runpy.run_path(sys.argv[0], run_name="__main__")
