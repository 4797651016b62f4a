"""The LoRA adapters the engine serves, by name: loaded (--lora, LoadAdapter), looked up for each
request, held by the sessions that run with them, and unloaded once none does.

Each load gets a new id, never reused: the rows of a pass name their adapter by it (Row.adapter),
and it is part of the prefix cache's keys (Session.adapter_key), so a reloaded adapter under the same
name never meets pages its predecessor computed. Any thread may call in; loading reads files and
runs torch in the runner, so it is blocking and done off the event loop.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Protocol

from braid.server.engine.types import AlreadyExists, Busy, InvalidArgument, LimitReached, NotFound
from braid.server.runner.rows import AdapterInfo

_NAME = re.compile(r"[A-Za-z0-9._:/-]{1,128}")


class AdapterRunner(Protocol):
    def load_adapter(self, adapter_id: int, name: str, path: str, max_rank: int) -> AdapterInfo:
        """Makes the adapter at `path` resident as adapter_id; ValueError (one line) if it is not a
        LoRA adapter of this model or its rank is past max_rank."""

    def unload_adapter(self, adapter_id: int) -> None:
        """Frees it: no row names it any more."""


@dataclass
class _Entry:
    id: int
    info: AdapterInfo
    users: int = 0  # sessions holding it (admitted, not yet finished)
    unloading: bool = False  # new sessions may no longer take it


class Adapters:
    def __init__(self, runner: AdapterRunner, max_loras: int, max_rank: int, model_names: Iterable[str] = ()) -> None:
        """model_names: the served model's names (--served-model-name), which no adapter may take
        (the OpenAI `model`)."""
        self._runner = runner
        self.max_loras, self.max_rank = max_loras, max_rank
        self._model_names = frozenset(model_names)
        self._changed = threading.Condition()
        self._by_name: dict[str, _Entry] = {}
        self._loading: set[str] = set()
        self._ids = itertools.count(1)

    def list(self) -> list[AdapterInfo]:
        """The loaded adapters (not those being unloaded), by name."""
        with self._changed:
            return [e.info for name, e in sorted(self._by_name.items()) if not e.unloading]

    def load(self, name: str, path: str) -> AdapterInfo:
        """Loads the adapter at `path` as `name`. Raises InvalidArgument (a bad name or adapter,
        naming the tensor), AlreadyExists, LimitReached (--max-loras resident). Blocking."""
        if not _NAME.fullmatch(name):
            raise InvalidArgument("name", f"{name!r} must be 1 to 128 letters, digits or ._:/-")
        if name in self._model_names:
            raise InvalidArgument("name", f"{name!r} is a name of the served model (--served-model-name)")
        if not path:
            raise InvalidArgument("path", "must not be empty")
        with self._changed:
            if name in self._by_name or name in self._loading:
                raise AlreadyExists(f"adapter {name!r} is already loaded (unload it first)")
            if len(self._by_name) + len(self._loading) >= self.max_loras:
                raise LimitReached(
                    f"{self.max_loras} LoRA adapters are loaded, the most --max-loras allows: unload one first"
                )
            self._loading.add(name)
            adapter_id = next(self._ids)
        try:
            info = self._runner.load_adapter(adapter_id, name, path, self.max_rank)
        except ValueError as exc:
            raise InvalidArgument("path", str(exc).splitlines()[0] if str(exc) else "is not a LoRA adapter") from None
        finally:
            with self._changed:
                self._loading.discard(name)
        with self._changed:
            self._by_name[name] = _Entry(adapter_id, info)
        return info

    def acquire(self, name: str) -> tuple[int, str]:
        """A new session's hold on the adapter `name`: its id (Row.adapter) and its prefix-cache key.
        ("" is the base model: (0, "").) Raises NotFound naming it."""
        if not name:
            return 0, ""
        with self._changed:
            entry = self._by_name.get(name)
            if entry is None or entry.unloading:
                raise NotFound(f"adapter {name!r} is not loaded" + (" (it is being unloaded)" if entry else ""))
            entry.users += 1
            return entry.id, f"lora:{entry.id}"

    def retain(self, adapter_id: int) -> None:
        """One more hold on an adapter held already (another sample of the same request)."""
        if adapter_id:
            with self._changed:
                self._entry(adapter_id).users += 1

    def release(self, adapter_id: int) -> None:
        """A session holding the adapter has finished."""
        if adapter_id:
            with self._changed:
                self._entry(adapter_id).users -= 1
                self._changed.notify_all()

    def unload(self, name: str, timeout: float) -> None:
        """Unloads `name` once no session holds it: new sessions get NotFound from now on, those
        running finish with it. Raises NotFound, or Busy (the adapter stays) if they are still
        running after `timeout` seconds. Blocking."""
        deadline = time.monotonic() + timeout
        with self._changed:
            entry = self._by_name.get(name)
            if entry is None or entry.unloading:
                raise NotFound(f"adapter {name!r} is not loaded" + (" (it is being unloaded)" if entry else ""))
            entry.unloading = True
            while entry.users and self._changed.wait(max(0.0, deadline - time.monotonic())):
                pass
            if entry.users:
                entry.unloading = False
                raise Busy(
                    f"adapter {name!r} is still used by {entry.users} generation(s) after {timeout:g} s; "
                    "it stays loaded"
                )
            del self._by_name[name]
        self._runner.unload_adapter(entry.id)

    def users(self) -> dict[str, int]:
        """Sessions holding each adapter now."""
        with self._changed:
            return {name: e.users for name, e in self._by_name.items()}

    def _entry(self, adapter_id: int) -> _Entry:
        return next(e for e in self._by_name.values() if e.id == adapter_id)
