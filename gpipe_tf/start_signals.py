"""SIGINT honoured from the trainer's first line, whatever the parent did with it.

A process started with SIGINT ignored (by a shell script that runs it in the background, by
`nohup`-like wrappers) inherits the ignoring, and Python keeps it: such a trainer ignored Ctrl-C
through its start-up (importing TensorFlow, building the model: seconds) until the training
loop installed its own handler. And Python's own handler raises KeyboardInterrupt wherever the
interpreter happens to be, which may be code that catches every exception (library code run
while TensorFlow imports), so the interrupt can be lost there too, or code that turns it into
an error of its own (a C extension's initialization: `ImportError: initialization failed`).

`Listen()`, the trainer's first step, installs a handler that both records the signal and
raises KeyboardInterrupt (what the trainer's start-up catches, to stop in one line); whatever
swallows the exception, the record remains, and the trainer checks it when its start-up ends
(`Pending`), as the training loop does before its first step. No TensorFlow here: it must run
before TensorFlow is imported.
"""

from __future__ import annotations

import signal

_received: list[int] = []


def Listen() -> None:
    """From now on, SIGINT is recorded and raises KeyboardInterrupt (also if it was ignored)."""
    del _received[:]
    signal.signal(signal.SIGINT, _Handle)


def _Handle(signum, frame) -> None:
    del frame
    _received.append(signum)
    raise KeyboardInterrupt


def Pending() -> int | None:
    """The first signal received since `Listen`, or None."""
    return _received[0] if _received else None
