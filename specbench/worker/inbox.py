"""The worker's socket, owned by one I/O thread, so a request is time-stamped when it arrives.

Why: the worker computes a batch for seconds at a time (a 1.5B target on a CPU); a request that
arrives meanwhile used to wait unread in ZeroMQ's buffer, and its wait showed up in the client's
network time, not in `queue_s`. Here a thread reads every message as it arrives (while the main
thread computes: torch releases the GIL) and stamps it; the main thread takes messages in arrival
order and hands replies back, which the thread sends. The buffer is bounded: with `capacity`
messages waiting the thread stops reading, and ZeroMQ's own high-water mark and then TCP
backpressure hold the rest, as before.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import zmq

_names = itertools.count()


@dataclass
class Message:
    identity: bytes  # the connection (ROUTER routing id)
    envelope: list
    frames: list[bytes]
    curve_key: str = ""
    received: float = field(default_factory=time.perf_counter)  # when it arrived (read off the socket)
    started: Optional[float] = None  # when the worker took it up
    host_s: float = 0.0  # the worker's own work on it outside the forward so far (parsing, checks)
    request_id: Optional[int] = None


class Inbox:
    """A bound ROUTER socket served by a thread: `poll`/`take` messages, `send` replies, `close`."""

    def __init__(self, socket: zmq.Socket, capacity: int, curve: bool):
        self._socket, self._capacity, self._curve = socket, max(1, capacity), curve
        self._waiting: deque[Message] = deque()
        self._outbox: deque[list] = deque()
        self._ready = threading.Condition()
        self._stopping = False
        self._failure: Optional[BaseException] = None
        address = f"inproc://specbench-inbox-{next(_names)}"
        context = zmq.Context.instance()
        self._wake_in = context.socket(zmq.PAIR)  # the thread's end: a byte means "look at the outbox"
        self._wake_in.bind(address)
        self._wake_out = context.socket(zmq.PAIR)  # the main thread's end
        self._wake_out.connect(address)
        self._thread = threading.Thread(target=self._run, name="specbench-worker-io", daemon=True)
        self._thread.start()

    # -- main thread -----------------------------------------------------------------------------
    def poll(self, timeout_ms: int) -> bool:
        """True once a message is waiting (at most `timeout_ms` from now)."""
        deadline = time.perf_counter() + timeout_ms / 1000
        with self._ready:
            while not self._waiting:
                self._check()
                left = deadline - time.perf_counter()
                if left <= 0:
                    return False
                self._ready.wait(left)
            return True

    def take(self) -> Message:
        """The oldest waiting message (call after `poll` said there is one)."""
        with self._ready:
            message = self._waiting.popleft()
        self._wake()  # a full buffer has room again: the thread may read on
        return message

    def send(self, frames: list) -> None:
        self._check()
        self._outbox.append(frames)
        self._wake()

    def close(self) -> None:
        """Send what is queued, stop the thread, close the socket."""
        self._stopping = True
        self._wake()
        self._thread.join(10)
        self._wake_out.close(0)

    def _wake(self) -> None:
        try:
            self._wake_out.send(b"", zmq.NOBLOCK)
        except zmq.Again:  # a thousand wakes already pending: the thread is bound to look
            pass

    def _check(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"the worker's I/O thread failed: {self._failure!r}") from self._failure

    # -- I/O thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_in, zmq.POLLIN)
        try:
            while not self._stopping:
                reading = len(self._waiting) < self._capacity
                poller.register(self._socket, zmq.POLLIN if reading else 0)
                events = dict(poller.poll(1000))
                if self._wake_in in events:
                    while self._wake_in.poll(0):
                        self._wake_in.recv()
                self._flush()
                if events.get(self._socket):
                    self._read()
            self._flush()
        except BaseException as error:  # noqa: BLE001 - surfaced to the main thread by `_check`
            self._failure = error
            with self._ready:
                self._ready.notify_all()
        finally:
            self._socket.close(0)
            self._wake_in.close(0)

    def _flush(self) -> None:
        while self._outbox:
            self._socket.send_multipart(self._outbox.popleft())

    def _read(self) -> None:
        while len(self._waiting) < self._capacity and self._socket.poll(0):
            frames = self._socket.recv_multipart(copy=False)
            received = time.perf_counter()
            identity, body = frames[0].bytes, frames[1:]
            envelope = [b""] if body and body[0].bytes == b"" else []
            key = (body[-1].get("User-Id") or "") if self._curve and body else ""
            message = Message(identity, envelope, [f.bytes for f in body[len(envelope):]], key, received)
            with self._ready:
                self._waiting.append(message)
                self._ready.notify_all()
