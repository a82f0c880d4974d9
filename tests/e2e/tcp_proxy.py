"""A TCP proxy a test can cut: the stack's processes reach a service through it, and the test makes
that service unreachable for them (every open connection reset, every new one closed at once)
without stopping the service, which the test process itself and other suites go on using."""

import contextlib
import socket
import struct
import threading


class CuttableProxy:
    """Forwards 127.0.0.1:`port` to `target` until `cut()`, and again after `restore()`.

    `refused` counts the connections closed while cut: proof that someone tried the service then.
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._cut = threading.Event()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self.refused = 0
        threading.Thread(target=self._accept_forever, name="proxy-accept", daemon=True).start()

    def cut(self) -> None:
        """Reset every open connection and close each new one at once, until `restore()`."""
        with self._lock:
            self._cut.set()
            sockets, self._open = self._open, set()
        for sock in sockets:
            _reset(sock)

    def restore(self) -> None:
        self._cut.clear()

    def close(self) -> None:
        self.cut()
        with contextlib.suppress(OSError):
            self._listener.close()

    def _accept_forever(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            if self._cut.is_set():
                self.refused += 1
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                _reset(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._cut.is_set():  # cut while connecting
                    self.refused += 1
                    _reset(client), _reset(upstream)
                    continue
                self._open.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), name="proxy-pump", daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        with self._lock:
            self._open.difference_update((src, dst))
        _reset(src), _reset(dst)


def _reset(sock: socket.socket) -> None:
    """Close with a reset (SO_LINGER 0), waking a thread blocked in recv on it."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
