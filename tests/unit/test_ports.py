"""The tests' free ports (braid_testing.process.free_port): a server given one binds it seconds
later, so it must be a port no outgoing connection can take meanwhile (one below the kernel's
ephemeral range) and one no other test worker is handed at the same time."""

from __future__ import annotations

import socket

from braid_testing import process


def test_a_free_port_lies_below_the_ephemeral_range_and_is_not_handed_out_twice():
    ports = [process.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(1024 < port < process._ephemeral_low() for port in ports)


def test_two_workers_take_their_ports_from_bands_of_their_own(monkeypatch):
    picked = {}
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        picked[worker] = {process.free_port() for _ in range(20)}
    assert not picked["gw0"] & picked["gw1"]


def test_a_port_something_listens_on_is_passed_over():
    taken = process.free_port()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", taken + 1))
        listener.listen()
        assert process.free_port() != taken + 1
