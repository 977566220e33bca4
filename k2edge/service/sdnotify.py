"""systemd notification protocol (sd_notify) without libsystemd: one datagram per message."""

from __future__ import annotations

import os
import socket


class Notifier:
    """Sends READY=1, STATUS=..., WATCHDOG=1, STOPPING=1 to ``$NOTIFY_SOCKET`` when systemd set one.

    Args:
        address: the socket path (``@name`` for the abstract namespace); default ``$NOTIFY_SOCKET``.
    """

    def __init__(self, address: str | None = None) -> None:
        self.address = address if address is not None else os.environ.get("NOTIFY_SOCKET")
        self._sock: socket.socket | None = None
        if self.address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, *lines: str) -> bool:
        if self._sock is None:
            return False
        addr = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            self._sock.sendto("\n".join(lines).encode(), addr)
            return True
        except OSError:
            return False  # systemd gone or socket unreachable: nothing to tell

    @staticmethod
    def watchdog_interval() -> float | None:
        """Half of ``$WATCHDOG_USEC`` in seconds when the watchdog is for this process, else None."""
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        if not usec or (pid and pid != str(os.getpid())):
            return None
        try:
            return int(usec) / 2e6
        except ValueError:
            return None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
