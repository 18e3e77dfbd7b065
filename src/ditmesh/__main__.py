"""``python -m ditmesh`` = the ``ditmesh`` command."""

import sys

from .cli import main

sys.exit(main())
