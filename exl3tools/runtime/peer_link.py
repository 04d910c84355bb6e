"""Rank 0's link to the other ranks of a tensor-parallel group: commands and shared device tokens
out, the spawned ranks watched, the group lost for good when one of them goes.

A mixin of runtime.runner.Runner (its ``world``, ``_procs``, ``lost``, ``_closed`` and
``on_lost``); the workers' side is runtime.worker.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time

import torch

from exl3tools.errors import RuntimeFailure
from exl3tools.runtime import distributed as D
from exl3tools.text import first_line

WATCH_S = 0.5                         # how often rank 0 polls its spawned ranks (PeerLink._watch)

log = logging.getLogger("exl3tools.runtime")


class PeerLink:
    """Runner methods that reach the other ranks (every one a no-op at world 1)."""

    def _start_watch(self) -> None:
        """Watch the spawned ranks from a daemon thread: one that exits while rank 0 idles (or
        waits on the device) is seen at once, ``lost`` is set and ``on_lost`` called (the engine
        wakes and stops; serve exits 4)."""
        self._stop_watch = threading.Event()
        self._watcher: threading.Thread | None = None
        if self._procs:
            self._watcher = threading.Thread(target=self._watch, name="tp-watch", daemon=True)
            self._watcher.start()

    def _send(self, cmd) -> None:
        if self.world > 1:
            if self.lost:
                raise RuntimeFailure(self.lost)
            try:
                D.broadcast(cmd)
            except RuntimeError as exc:
                raise self._peer_lost(exc) from exc

    def _share(self, tokens: torch.Tensor) -> torch.Tensor:
        """Device tokens of a step just sent, from rank 0 to every worker (``_send`` first: a
        worker takes them with ``worker.receive``); stream-ordered on NCCL, so no host wait."""
        if self.world == 1:
            return tokens
        try:
            return D.broadcast_tensor(tokens.long().contiguous())
        except RuntimeError as exc:
            raise self._peer_lost(exc) from exc

    def _peer_lost(self, exc: BaseException) -> RuntimeFailure:
        """A command or shared tokens could not reach the workers: the group is lost for good."""
        return self._lose(self._exited() or first_line(exc))

    def _lose(self, why: str) -> RuntimeFailure:
        self.lost = f"tensor-parallel peer lost: {why}"
        return RuntimeFailure(self.lost)

    def _watch(self) -> None:
        """Poll the spawned ranks until close(): the first that exits loses the group. On NCCL the
        model's group is aborted, so a collective rank 0 has in flight returns instead of waiting
        out the watchdog (EXL3TOOLS_TP_TIMEOUT); gloo's end with the dead rank's sockets."""
        while not self._closed and not self.lost:
            if any(p.poll() is not None for p in self._procs):
                gone = self._exited()
                if self._closed:        # ranks stopping after close()'s "stop"
                    return
                log.error("%s", self._lose(gone))
                D.abort()
                if self.on_lost is not None:
                    self.on_lost()
                return
            self._stop_watch.wait(WATCH_S)

    def _exited(self) -> str:
        """Which spawned ranks have exited, and how (empty under torchrun or when none has)."""
        time.sleep(0.2)         # a killed worker's sockets close a moment before it is reaped
        out = []
        for r, p in enumerate(self._procs, 1):
            if p.poll() is not None:
                how = f"signal {-p.returncode}" if p.returncode < 0 else f"exit code {p.returncode}"
                out.append(f"rank {r} (pid {p.pid}) exited with {how}")
        return "; ".join(out)

    def _close_peers(self) -> None:
        """Stop the watcher and, at world > 1, the other ranks (close() has set ``_closed``)."""
        self._stop_watch.set()
        if self.world > 1:
            # load_runner's exit hook held this runner (and its model) until the process ended
            atexit.unregister(self.close)
            try:
                D.broadcast(("stop",))
            except Exception:  # noqa: BLE001 - peers may be gone already
                pass
            D.destroy()
            D.reap(self._procs)
        # the watcher's frame holds this runner: a closed runner is freed once it has returned
        # (close() on the watcher itself, through on_lost, cannot wait for its own end)
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=2 * WATCH_S + 1.0)
