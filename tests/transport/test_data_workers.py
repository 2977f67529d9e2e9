"""The transfer worker threads shared by the local and mooncake backends keep running when a job blows up."""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvstage.transport.data.base import Completion
from kvstage.transport.data.workers import JobRunner


@dataclass(frozen=True)
class Job:
    transfer_id: int
    ops: int = 1


def run(job: Job) -> Completion:
    if job.transfer_id == 2:
        raise RuntimeError("backend bug")
    return Completion(job.transfer_id, True, "", job.ops)


def test_a_job_that_raises_fails_its_transfer_and_the_worker_serves_the_next_one() -> None:
    runner: JobRunner[Job] = JobRunner("test", run, threads=1)
    for transfer_id in (1, 2, 3):
        runner.submit(Job(transfer_id))
    done: list[Completion] = []
    deadline = time.monotonic() + 10
    while len(done) < 3 and time.monotonic() < deadline:
        done += runner.drain()
        time.sleep(0.001)
    runner.stop()

    by_id = {c.transfer_id: c for c in done}
    assert sorted(by_id) == [1, 2, 3]
    assert by_id[1].ok and by_id[3].ok
    assert not by_id[2].ok and "backend bug" in by_id[2].reason
