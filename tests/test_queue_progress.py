"""report_queue: a waiting session's stream says where it stands until its first token."""

from __future__ import annotations

import threading

from conftest import LONG, SLOW, tiny_server, wait_for


def test_queued_sessions_hear_their_position_then_get_their_tokens(tiny_dir):
    server = tiny_server(tiny_dir, "--mode", "sequential", env=SLOW)
    try:
        with server.client() as client:
            hold = client.stream("Hold the model", **LONG)
            next(iter(hold))  # it runs: the next ones queue behind it
            seen: dict[str, list] = {"second": [], "third": []}

            def waiting(name: str) -> None:
                for message in client.stream(f"{name} in line", max_new_tokens=3, report_queue=True):
                    seen[name].append(message)

            second = threading.Thread(target=waiting, args=("second",), daemon=True)
            second.start()
            wait_for(lambda: client.server_status().sessions_queued == 1)
            third = threading.Thread(target=waiting, args=("third",), daemon=True)
            third.start()
            # the third has heard where it stands on arrival: the hold has done its part
            wait_for(lambda: any(m.queue_position for m in seen["third"]))
            hold.cancel()
            for thread in (second, third):
                thread.join(60)
        for name, first_position in (("second", 1), ("third", 2)):
            messages = seen[name]
            positions = [m.queue_position for m in messages if m.queue_position]
            first_token = next(i for i, m in enumerate(messages) if m.token_ids)
            # heard on arrival, then on every change (at most once a second), counting down
            assert positions[0] == first_position and positions == sorted(set(positions), reverse=True)
            assert all(not m.text and not m.token_ids for m in messages if m.queue_position)
            assert all(not m.queue_position for m in messages[first_token:])
        with server.client() as client:
            assert not any(m.queue_position for m in client.stream("No report", max_new_tokens=2))
    finally:
        server.stop()
