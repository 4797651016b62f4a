"""Progress over the slow steps of making a model ready: one bar on a terminal, nothing in a log.

On a terminal (stderr is a tty) one tqdm bar runs across all the steps of a conversion or a load,
named after the step it is in; its clock is redrawn twice a second, so a step that takes ten
seconds still shows it is alive. In a log file, a pipe or a container's log there is no bar, and
the libraries' own bars are turned off too (they would write `\\r` lines into the log): the loader's
"converted in N s" and "loaded in N s" lines say what took how long.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Iterator

_REDRAW_S = 0.5


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


@contextlib.contextmanager
def gguf_bar_off() -> Iterator[None]:
    """transformers dequantizes a GGUF file's tensors under a tqdm bar of its own (a module-level
    `tqdm`, which no setting turns off); it is silenced for the length of the block."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None:  # another transformers: nothing to silence
        yield
        return
    gguf_utils.tqdm = lambda iterable, *args, **kw: iterable
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


class Steps:
    """`with Steps("converting x.gguf", {"tokenizer": 6, "weights": 16}) as steps:` then
    `with steps.step("tokenizer"): ...`. A step's weight is its share of the bar (the seconds it
    took on the embedded model); on anything but a terminal this does nothing."""

    def __init__(self, title: str, weights: dict[str, float], bar: bool = True) -> None:
        """bar: False where another bar shows (a download from the hub keeps its own)."""
        self._title, self._weights, self._show = title, weights, bar
        self._bar = None
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
        yield
        if self._bar is not None:
            self._bar.update(self._weights[name])

    def _redraw(self) -> None:
        while not self._stop.wait(_REDRAW_S):
            self._bar.refresh()
