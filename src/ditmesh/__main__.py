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

from .cli import main  # noqa: E402

sys.exit(main())
