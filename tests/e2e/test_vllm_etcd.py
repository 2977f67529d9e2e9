"""vLLM with its directory on etcd: the vLLM demo (prefill TP=2, decode TP=1, the router in front) with every rank
and the router on a real etcd server instead of `kvstage bootstrap`; every request verified (KV bit-exact, tokens
equal to a single-instance run). Starts servers of its own (not the session cluster): 58 s measured on 2 cores
with vLLM's compile cache warm, minutes when cold; so it is opt-in (`--run-slow`)."""

from __future__ import annotations

import pytest

from kvstage.demo.vllm import DemoOptions, run_demo


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_vllm_demo_with_its_directory_on_etcd_verifies_every_request(etcd):
    report = run_demo(DemoOptions(bootstrap=etcd.address("vllm"), requests=4), quiet=True)
    assert report.ok, report
    assert report.verified == 4 and report.leaked_bytes == 0
