#!/usr/bin/env python
"""Retrain the shipped tiny FLUX pipeline: ``python scripts/train_tiny.py [--work-dir DIR] [--out DIR] ...``.

The same code as ``ditmesh train-tiny`` (``ditmesh.tiny.train``); rerunning with the same ``--work-dir``
resumes from the last checkpoint. Run ``python scripts/train_tiny.py --help`` for every option.
"""

from ditmesh.tiny.train import main

if __name__ == "__main__":
    raise SystemExit(main())
