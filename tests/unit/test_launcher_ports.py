"""The launcher's check that a port is free before it starts a service there."""

from __future__ import annotations

import socket

from kvmesh.launcher import _port_free


def test_a_listener_takes_a_port_and_a_stopped_server_s_connections_do_not():
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn and gRPC bind
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    assert not _port_free("127.0.0.1", port)
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server closes first: its side of the connection stays in TIME_WAIT
    client.close()
    server.close()
    assert _port_free("127.0.0.1", port)  # as the next server binds it: SO_REUSEADDR
