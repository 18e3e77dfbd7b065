"""``python -m ditmesh`` = the ``ditmesh`` command."""

import os
import signal
import sys

if os.environ.get("DITMESH_ERROR_DIR") and "RANK" in os.environ:
    # A rank of ditmesh's own launcher: Ctrl-C and the launcher's SIGTERM end it at once, also while it is
    # importing or blocked inside a collective (a Python handler would wait for the call to return), and
    # without a traceback. The launcher reports the interruption once.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # the launcher's SIGUSR1 (a run past its time limit): every thread's Python stack to stderr, then on
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)

from .cli import main  # noqa: E402

code = main()
if next((a for a in sys.argv[1:] if not a.startswith("-")), None) == "generate":
    # Everything is written and closed by now (outputs are written whole, then renamed). The interpreter's own
    # finalization of a process that holds torch (and, in the launcher, the elastic agent's threads) takes seconds
    # a user would wait for after the picture is there: leave at once, as the ranks do (runtime.generate.end_rank_process).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
