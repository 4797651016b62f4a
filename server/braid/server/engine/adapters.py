"""The LoRA adapters the engine serves, by name: loaded (--lora, LoadAdapter), looked up for each
request, held by the sessions that run with them, and unloaded once none does.

Each load gets a new id, never reused: the rows of a pass name their adapter by it (Row.adapter),
and it is part of the prefix cache's keys (Session.adapter_key), so a reloaded adapter under the same
name never meets pages its predecessor computed. Any thread may call in; loading reads files and
runs torch in the runner, so it is blocking and done off the event loop. Unloading never blocks: it
gives a future that the last session to let the adapter go completes, and a front end awaits it
without holding a thread (six unloads waiting in asyncio's default pool once kept a LoadAdapter
waiting behind them).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import re
import threading
from dataclasses import dataclass, field
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
    # done once it is freed, after an unload began and its last session let it go (Adapters.unload)
    freed: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)


class Adapters:
    def __init__(self, runner: AdapterRunner, max_loras: int, max_rank: int, model_names: Iterable[str] = ()) -> None:
        """model_names: the served model's names (--served-model-name), which no adapter may take
        (the OpenAI `model`)."""
        self._runner = runner
        self.max_loras, self.max_rank = max_loras, max_rank
        self._model_names = frozenset(model_names)
        self._lock = threading.Lock()
        self._by_name: dict[str, _Entry] = {}
        self._loading: set[str] = set()
        self._ids = itertools.count(1)

    def list(self) -> list[AdapterInfo]:
        """The loaded adapters (not those being unloaded), by name."""
        with self._lock:
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
        with self._lock:
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
            with self._lock:
                self._loading.discard(name)
        with self._lock:
            self._by_name[name] = _Entry(adapter_id, info)
        return info

    def acquire(self, name: str) -> tuple[int, str]:
        """A new session's hold on the adapter `name`: its id (Row.adapter) and its prefix-cache key.
        ("" is the base model: (0, "").) Raises NotFound naming it."""
        if not name:
            return 0, ""
        with self._lock:
            entry = self._by_name.get(name)
            if entry is None or entry.unloading:
                raise NotFound(f"adapter {name!r} is not loaded" + (" (it is being unloaded)" if entry else ""))
            entry.users += 1
            return entry.id, f"lora:{entry.id}"

    def retain(self, adapter_id: int) -> None:
        """One more hold on an adapter held already (another sample of the same request)."""
        if adapter_id:
            with self._lock:
                self._entry(adapter_id).users += 1

    def release(self, adapter_id: int) -> None:
        """A session holding the adapter has finished; the last to let go of one being unloaded
        frees it."""
        if adapter_id:
            with self._lock:
                entry = self._entry(adapter_id)
                entry.users -= 1
                if entry.users or not entry.unloading:
                    return
                del self._by_name[entry.info.name]
            self._free(entry)

    def unload(self, name: str) -> concurrent.futures.Future[None]:
        """Begins unloading `name`: new sessions get NotFound from now on, those running finish with
        it. The future is done once the last has and the adapter is freed (at once where none holds
        it); until then keep(name) calls the unload off. Raises NotFound. Never blocks."""
        with self._lock:
            entry = self._by_name.get(name)
            if entry is None or entry.unloading:
                raise NotFound(f"adapter {name!r} is not loaded" + (" (it is being unloaded)" if entry else ""))
            entry.unloading = True
            if entry.users:
                return entry.freed
            del self._by_name[name]
        self._free(entry)
        return entry.freed

    def keep(self, name: str, waited: float) -> None:
        """Calls off the unload of `name` begun by unload() (its caller waited `waited` seconds):
        it stays loaded, and Busy says how many sessions still hold it. Nothing where the unload
        has finished meanwhile (the adapter is gone, or another has been loaded under its name)."""
        with self._lock:
            entry = self._by_name.get(name)
            if entry is None or not entry.unloading:
                return
            entry.unloading, entry.freed = False, concurrent.futures.Future()  # for a later unload
            users = entry.users
        raise Busy(f"adapter {name!r} is still used by {users} generation(s) after {waited:g} s; it stays loaded")

    def users(self) -> dict[str, int]:
        """Sessions holding each adapter now."""
        with self._lock:
            return {name: e.users for name, e in self._by_name.items()}

    def _entry(self, adapter_id: int) -> _Entry:
        return next(e for e in self._by_name.values() if e.id == adapter_id)

    def _free(self, entry: _Entry) -> None:
        """Frees an adapter no session holds and no new one can take (out of _by_name)."""
        self._runner.unload_adapter(entry.id)
        if entry.freed.set_running_or_notify_cancel():  # False: its waiter has given up (cancelled it)
            entry.freed.set_result(None)
