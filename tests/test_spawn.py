"""tests.spawn: the process group meets at a store the parent serves, on a port it holds from the moment the kernel
gives it until the children are done (a port chosen free, closed, and bound again by rank 0 later raced with every
other process on the machine)."""

from __future__ import annotations

import errno
import socket

import pytest

from tests.spawn import HOST, serve_store


def test_the_store_holds_its_port_until_dropped():
    store = serve_store()
    port = store.port
    with socket.socket() as s, pytest.raises(OSError) as e:
        s.bind((HOST, port))  # another process asking for that port now is refused: nothing can take it
    assert e.value.errno == errno.EADDRINUSE
    del store
    with socket.socket() as s:  # the control: once dropped, the port is free again (so the check above can fail)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((HOST, port))
