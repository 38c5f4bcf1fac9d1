"""The responses the server keeps for ``previous_response_id`` and ``GET /v1/responses/{id}``: the last
:data:`CAPACITY` ones in memory, the least recently used forgotten first.

A response is kept with its conversation: the input items it was given (those of the response it followed first)
and its output items, read back as input items. A request that names it as ``previous_response_id`` continues that
conversation, so a client that keeps no history of its own (``store`` is true by default) sends only what is new.
Nothing is written to disk: a restarted server knows none of them (the API's answer for an unknown id, a 404, says
so), and a request with ``store: false`` is not kept at all (Codex CLI sends its whole history each turn and asks
for that).

One store per app (:func:`store_of`); the routes use it from the event loop, the lock makes it safe from any thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

#: How many responses are kept
CAPACITY = 256


@dataclass(frozen=True)
class Stored:
    response: dict  # the response object, as GET /v1/responses/{id} returns it
    items: tuple  # the conversation up to and including its output, as validated input items


class ResponseStore:
    """A bounded, thread-safe map of response id -> :class:`Stored` (an LRU: a lookup counts as a use)."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: Stored) -> None:
        with self._lock:
            self._items[response_id] = stored
            self._items.move_to_end(response_id)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            stored = self._items.get(response_id)
            if stored is not None:
                self._items.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


def store_of(app) -> ResponseStore:
    """The app's store, made on first use (from the event loop: no other task runs between the look and the set)."""
    store = getattr(app.state, "responses", None)
    if store is None:
        store = app.state.responses = ResponseStore()
    return store
