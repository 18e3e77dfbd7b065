"""Launching processes, running a pipeline call on all ranks, consistency checks and the run report."""
