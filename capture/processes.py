"""Child processes that a capture starts and always stops: in their own session, logged to a file, shut down
in order (SIGINT, SIGTERM, SIGKILL) also on errors, Ctrl-C and SIGTERM.

Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import threading
import time
from pathlib import Path

class ManagedProcess:
    """A child in its own session, logging to a file. A terminal's Ctrl-C reaches only kvtrace, which then
    stops the whole group in order: SIGINT (nsys finalizes its report, vLLM shuts down), then SIGTERM,
    then SIGKILL."""

    def __init__(self, command: list[str], env: dict, log_path: Path, *, append: bool = False, stdin=None):
        self.command, self.env, self.log_path, self.append, self.stdin = command, env, log_path, append, stdin
        self.process: subprocess.Popen | None = None

    def start(self) -> "ManagedProcess":
        self._log = open(self.log_path, "a" if self.append else "w")
        self._log.write(f"$ {shlex.join(self.command)}\n")
        self._log.flush()
        try:
            self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                            stdin=self.stdin, env=self.env, start_new_session=True)
        except OSError:
            self._log.close()
            raise
        return self

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait(self) -> int:
        # Poll instead of blocking in waitpid(): a Ctrl-C that the kernel hands to another thread must
        # still raise KeyboardInterrupt in the main thread promptly.
        while True:
            with contextlib.suppress(subprocess.TimeoutExpired):
                return self.process.wait(timeout=0.5)

    def stop(self, grace_s: float) -> int | None:
        """Exit code after the group is gone (the child's own when it had already exited)."""
        if self.process is None:
            return None
        try:
            for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, None)):
                if self.process.poll() is not None:
                    break
                self._signal(sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(wait_s)
            self._end_stragglers()
        except KeyboardInterrupt:  # a second Ctrl-C: no more waiting
            self._signal(signal.SIGKILL)
            self.process.wait()
            raise
        finally:
            self._log.close()
        return self.process.returncode

    def _end_stragglers(self) -> None:
        """The leader (nsys) can exit before the rest of its group (vLLM's server or engine core, holding GPU
        memory the next arm needs): nothing may outlive it for more than a moment."""
        deadline = time.monotonic() + 5.0
        while self._signal(0):
            if time.monotonic() > deadline:
                self._signal(signal.SIGKILL)
                return
            time.sleep(0.05)

    def _signal(self, sig: int) -> bool:
        """Signal the whole group; False once nothing is left in it."""
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):  # gone, or only others' processes reuse the id
            return False
        return True


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM (a scheduler, `timeout`) gets the same orderly shutdown as Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
