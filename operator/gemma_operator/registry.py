"""The operator process's state, in one owner: its settings, API client, pod poller and resync pool, each made
on first use, and what it holds for each GemmaRustServer it has seen.

kopf's handlers, the resync thread and the poller's callback run on different threads and all reach this
state; `Registry` is its only writer. A server's entry is made the first time anything asks about it and
goes, whole, with `forget` (the watch saw the server deleted), which also stops the polling of its pods.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from .kube import Kube
from .poller import PodPoller
from .settings import Settings

RESYNC_WORKERS = 4


@dataclass
class ServerState:
    """What the operator holds for one GemmaRustServer (by uid)."""

    namespace: str
    name: str
    # Held while the server is synced: two syncs of one server never interleave.
    lock: threading.Lock = field(default_factory=threading.Lock)
    known: bool = False  # the watch has seen it (the resync pass visits it)
    written: dict[str, Any] | None = None  # the last status written (the operator is its only writer)
    # (kind, name) of children seen to be this server's: checked once per process, not every sync.
    own_children: set[tuple[str, str]] = field(default_factory=set)

    @property
    def key(self) -> str:
        """The server as the poller knows it: "namespace/name"."""
        return f"{self.namespace}/{self.name}"


class Registry:
    """The operator's state (see the module docstring).

    Args:
        settings: the operator's settings (default: read from the environment on first use).
        kube: the API client (default: made from the kubeconfig or in-cluster credentials on first use).
        poller: the pod poller (default: made on first use, calling `on_report_changed`).
        on_report_changed: called with "namespace/name" when a pod's /v1/engine report changes stage (the
            poller's `on_change`; it runs on the polling thread).
    """

    def __init__(self, *, settings: Settings | None = None, kube: Kube | None = None, poller: PodPoller | None = None,
                 on_report_changed: Callable[[str], None] | None = None):
        self._settings, self._kube, self._poller = settings, kube, poller
        self._pool: ThreadPoolExecutor | None = None
        self._on_report_changed = on_report_changed
        self._servers: dict[str, ServerState] = {}
        self._guard = threading.RLock()  # over the dict and the making of each process-wide piece
        self.stop = threading.Event()  # set at shutdown: the resync loop ends
        self.logger = logging.getLogger("gemma_operator")  # kopf's, once the operator has started

    # -- process-wide pieces -----------------------------------------------------------------------------

    @property
    def settings(self) -> Settings:
        with self._guard:
            if self._settings is None:
                self._settings = Settings.from_env()
            return self._settings

    @property
    def kube(self) -> Kube:
        with self._guard:
            if self._kube is None:
                self._kube = Kube(discovery_ttl=self.settings.discovery_ttl_seconds)
            return self._kube

    @property
    def poller(self) -> PodPoller:
        with self._guard:
            if self._poller is None:
                self._poller = PodPoller(on_change=self._on_report_changed,
                                         allow_test_urls=self.settings.test_engine_urls)
            return self._poller

    @property
    def pool(self) -> ThreadPoolExecutor:
        """The threads that resync servers (the periodic pass, and a refresh the poller asked for)."""
        with self._guard:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=RESYNC_WORKERS, thread_name_prefix="resync")
            return self._pool

    def start(self, settings: Settings, logger: logging.Logger) -> None:
        """At the operator's startup: use `settings` (read afresh) and kopf's logger from now on, and make the
        API client and the poller now rather than at the first event."""
        with self._guard:
            self._settings, self.logger = settings, logger
            self.stop = threading.Event()
        _ = self.kube, self.poller  # made now, so a startup without credentials fails at once

    def close(self) -> None:
        """Stop the resync loop and the poller (at shutdown)."""
        self.stop.set()
        with self._guard:
            poller, self._poller = self._poller, None
        if poller is not None:
            poller.close()

    # -- per server ----------------------------------------------------------------------------------------

    def server(self, uid: str, namespace: str, name: str) -> ServerState:
        """The entry of the server `uid`, made if there is none."""
        with self._guard:
            state = self._servers.get(uid)
            if state is None:
                state = self._servers[uid] = ServerState(namespace, name)
            return state

    def track(self, uid: str, namespace: str, name: str) -> None:
        """The watch saw the server: the resync pass visits it from now on."""
        self.server(uid, namespace, name).known = True

    def known(self) -> list[tuple[str, str]]:
        """(namespace, name) of every server the watch has seen and not seen deleted."""
        with self._guard:
            return [(s.namespace, s.name) for s in self._servers.values() if s.known]

    def forget(self, uid: str) -> None:
        """Drop everything held for the server `uid` (it was deleted), and stop polling its pods."""
        with self._guard:
            state = self._servers.pop(uid, None)
            poller = self._poller
        if state is not None and poller is not None:
            poller.forget(state.key)
