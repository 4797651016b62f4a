"""Progress over the slow steps of making a model ready: one bar on a terminal, nothing in a log.

On a terminal (stderr is a tty) one tqdm bar runs across all the steps of a conversion or a load,
named after the step it is in; its clock is redrawn twice a second, so a step that takes ten
seconds still shows it is alive. Within a step that walks a file's tensors the bar moves tensor by
tensor (`Steps.advance`, `counted`): a conversion's bar sat at 14% for 70 of its 78 s while
transformers dequantized the weights. In a log file, a pipe or a container's log there is no bar, and
the libraries' own bars are turned off too (they would write `\\r` lines into the log): the loader's
"converted in N s" and "loaded in N s" lines say what took how long.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Callable, Iterable, Iterator, TypeVar

_REDRAW_S = 0.5
T = TypeVar("T")


def on_terminal() -> bool:
    return sys.stderr.isatty()


def quiet_libraries() -> None:
    """transformers' and huggingface_hub's own output: their bars off (braid's covers a conversion,
    and a log gets none; on a terminal a download from the hub keeps its bar, it may take minutes),
    their records through braid's handler only (a JSON log stays JSON, and no line comes twice)."""
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    logging.getLogger("huggingface_hub").handlers.clear()
    if not on_terminal():
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


def counted(items: Iterable[T], advance: Callable[[float], None]) -> Iterator[T]:
    """items, saying after each how far through them the loop is (a fraction: advance(3 / 10))."""
    items = list(items)
    for done, item in enumerate(items, 1):
        yield item
        advance(done / len(items))


class Steps:
    """`with Steps("converting x.gguf", {"tokenizer": 6, "weights": 16}) as steps:` then
    `with steps.step("tokenizer"): ...`. A step's weight is its share of the bar (the seconds it
    took on the embedded model); on anything but a terminal this does nothing."""

    def __init__(self, title: str, weights: dict[str, float], bar: bool = True) -> None:
        """bar: False where another bar shows (a download from the hub keeps its own)."""
        self._title, self._weights, self._show = title, weights, bar
        self._bar = None
        self._current: str | None = None  # the step running now
        self._before = 0.0  # the weight of the steps done
        self._stop = threading.Event()
        self._redrawer = threading.Thread(target=self._redraw, name="braid-progress", daemon=True)

    def __enter__(self) -> Steps:
        if self._show and on_terminal():
            from tqdm import tqdm

            self._bar = tqdm(
                total=sum(self._weights.values()),
                desc=self._title,
                file=sys.stderr,
                leave=False,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}",
            )
            self._redrawer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._bar is not None:
            self._redrawer.join()
            self._bar.close()

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        if self._bar is not None:
            self._bar.set_description_str(f"{self._title} ({name})")
        self._current = name
        yield
        self._current = None
        self._before += self._weights[name]
        self._move_to(self._before)

    def advance(self, fraction: float) -> None:
        """How far through the running step the work is, 0 to 1 (tensors read so far): the bar
        moves within the step's share. Any thread; never backwards."""
        if self._current is not None:
            self._move_to(self._before + self._weights[self._current] * min(max(fraction, 0.0), 1.0))

    @property
    def position(self) -> float:
        """Where the bar stands, in the steps' weights (0 with no bar)."""
        return self._bar.n if self._bar is not None else 0.0

    def _move_to(self, position: float) -> None:
        if self._bar is not None and position > self._bar.n:
            self._bar.update(position - self._bar.n)

    def _redraw(self) -> None:
        while not self._stop.wait(_REDRAW_S):
            self._bar.refresh()
