"""`freetoken serve --max-seqs 4`: continuous batching behind the same APIs, against the real `openai` client.

Behaviour tests of tests/test_serve.py run here again on a batching server (imported below, so they take this
module's ``server``): whole and streamed replies agree, stop strings, seeded sampling, 16 concurrent streams each
with its own answer (greedy: the same tokens as asked one at a time, within float32 rounding of a batched product),
a killed client freeing its seat, metrics, a forced tool call (a grammar per request).
Then what batching adds: requests do run together, and a client that leaves is dropped whether it runs or waits for a
seat.
"""

from __future__ import annotations

import threading
import time

import pytest
from live_server import MODEL, Server, running_server
from test_serve import (  # noqa: F401 - collected here, against this module's server
    _chat,
    _run_client,
    _wait_for,
    endless_client,
    test_a_killed_client_frees_the_engine,
    test_chat_whole_and_streamed_agree,
    test_forced_tool_call_round_trip_with_the_bundled_model,
    test_metrics,
    test_seeded_sampling_repeats,
    test_sixteen_concurrent_streams_get_their_own_answers,
    test_stop_strings,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from running_server(tmp_path_factory, "--served-model-name", f"{MODEL},gpt-4o-mini", "--max-seqs", "4")


def test_requests_run_together(server):
    """Four long requests at once: the server reports more than one running at the same time."""
    done = []

    def one(i):
        done.append(_chat(server.client(), f"def f{i}(x):", max_tokens=60, temperature=1.0, seed=i))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    most = 0
    while any(t.is_alive() for t in threads):
        most = max(most, server.metric("freetoken_requests_running"))
        time.sleep(0.02)
    for t in threads:
        t.join()
    assert len(done) == 4 and most >= 2
    # the step loop's metrics saw it: steps of more than one request, every step in the histograms
    steps = server.metric("freetoken_steps_total")
    one = server.metric("freetoken_step_batch_size_bucket", '{le="1.0"}')
    assert steps > 0 and server.metric("freetoken_step_batch_size_bucket", '{le="+Inf"}') == steps > one
    assert server.metric("freetoken_step_tokens_count") == steps
    assert server.metric("freetoken_step_tokens_sum") >= server.metric("freetoken_step_batch_size_sum") > steps
    assert server.metric("freetoken_preemptions_total") == 0


def test_leaving_clients_are_dropped_running_or_waiting(tmp_path):
    """Two seats: two non-streamed requests with a large max_tokens run, a third waits for a seat; its client leaves
    (dropped from the queue), then the two running ones' (stopped before the next step); each counted cancelled."""
    server = Server(tmp_path, "--max-seqs", "2", ctx=None)  # the model's own 32k context
    try:
        client = endless_client(server)
        generated = server.metric("freetoken_generated_tokens_total")
        running = [_run_client(client) for _ in range(2)]
        try:
            _wait_for(server, "freetoken_requests_running", 2)
            waiting = _run_client(client)
            try:
                _wait_for(server, "freetoken_queue_length", 1)
            finally:
                waiting.kill()
                waiting.wait()
            _wait_for(server, "freetoken_queue_length", 0, 10)
            assert server.metric("freetoken_requests_cancelled_total") == 1
            assert server.metric("freetoken_requests_running") == 2
        finally:
            for p in running:
                p.kill()
                p.wait()
        _wait_for(server, "freetoken_requests_running", 0, 10)
        assert server.metric("freetoken_requests_cancelled_total") == 3
        assert server.metric("freetoken_generated_tokens_total") == generated  # none finished
    finally:
        server.stop()
