"""Per-step progress lines and a bar (rich) for the long runs: ``rl-dataflow demo`` and the
benchmark. Only the CLI and the benchmark import this (rich stays out of the pipeline)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from .pipeline import Progress as ProgressCallback

_LOOP_FIELDS = ("generate", "records", "ray", "materialise", "compute", "reload", "step")


def console() -> Console:
    return Console() if sys.stdout.isatty() else Console(width=100)


@contextlib.contextmanager
def step_progress(out: Console, total: int, title: str) -> Iterator[ProgressCallback]:
    """A bar over ``total`` steps and one line per step; yields the ``progress`` callback of
    ``run_formats``."""
    bar = Progress(
        SpinnerColumn(),
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=out,
    )
    with bar:
        task = bar.add_task(title, total=total)

        def on_step(label: str, step: int, outcome: dict[str, Any]) -> None:
            t = outcome["timings"]
            which = "warm-up" if step < 0 else f"step {step + 1}"
            bar.console.print(
                f"  {label:18} {which:8} {outcome['step_s']:7.3f} s"
                f"  (compute {t['compute']:.3f} s, data path"
                f" {outcome['step_s'] - t['compute']:.3f} s)"
            )
            bar.advance(task)

        yield on_step


@contextlib.contextmanager
def loop_progress(out: Console, total: int, title: str) -> Iterator[Any]:
    """A bar over the RL loop's ``total`` steps and one line per step (reward, how the trainer
    agrees with the rollout, where the time went); yields ``run_loop``'s ``progress``."""
    bar = Progress(
        SpinnerColumn(),
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=out,
    )
    with bar:
        task = bar.add_task(title, total=total)

        def on_step(result: dict[str, Any]) -> None:
            t = result["timings"]
            times = " ".join(f"{k} {t[k] * 1e3:.0f}" for k in _LOOP_FIELDS if k in t)
            bar.console.print(
                f"  step {result['step']:3}  reward {result['reward']:.3f}"
                f"  |logp diff| {result['logprob_abs_diff_mean']:.4f}"
                f"  rerouted {result['rerouted_token_share']:.3f}  ms: {times}"
            )
            bar.advance(task)

        yield on_step
