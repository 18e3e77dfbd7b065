"""The launcher between rows: each local launch meets at a fresh store that its rank 0 binds; one whose ranks cannot
meet (the store's port taken) starts once more on a fresh store, and the bench row records why."""

from __future__ import annotations

import json
import socket

import pytest

from ditmesh.runtime import launch as launch_mod

TINY = ["generate", "--model", "flux-tiny", "--steps", "1", "--height", "32", "--width", "32", "--ulysses", "2"]


@pytest.fixture
def taken_port():
    """A port bound by another socket (not listening): a store can neither bind it nor connect to it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def test_a_row_whose_first_rendezvous_fails_is_started_again_and_records_why(tmp_path, monkeypatch, taken_port):
    from ditmesh.cli import main

    tried = []

    def endpoint(attempt):
        tried.append(attempt)
        return f"127.0.0.1:{taken_port}" if attempt == 0 else "127.0.0.1:0"

    monkeypatch.setattr(launch_mod, "local_endpoint", endpoint)
    out = tmp_path / "b.json"
    assert main(["bench", "--model", "flux-tiny", "--gpus", "2", "--methods", "ulysses", "--no-single", "--steps", "1",
                 "--warmup", "0", "--out", str(out)]) == 0  # one row: ulysses on two processes
    assert tried == [0, 1]
    [row] = json.loads(out.read_text())["rows"]
    assert "error" not in row and row["step_ms"] > 0  # the second start ran the row
    assert f"the run's store at 127.0.0.1:{taken_port}" in row["rendezvous_retry"], row["rendezvous_retry"]
    assert "started again after" in out.with_suffix(".md").read_text()


def test_a_second_failure_ends_the_launch_with_both_causes(tmp_path, monkeypatch, taken_port):
    monkeypatch.setattr(launch_mod, "local_endpoint", lambda attempt: f"127.0.0.1:{taken_port}")
    heard = []
    with pytest.raises(launch_mod.RendezvousFailed) as info:
        launch_mod.launch(2, [*TINY, "--out", str(tmp_path / "x.png")], on_retry=heard.append)
    assert len(heard) == 1 and f"the run's store at 127.0.0.1:{taken_port}" in heard[0]
    message = str(info.value)
    assert message.startswith("the local ranks could not meet (") and "then, on a fresh store:" in message
    assert message.count("the run's store at") == 2
    assert not (tmp_path / "x.png").exists()

