"""The progress output of ``rl-dataflow demo`` and the benchmark: one line per step, a bar to the
end. In-process (no Ray), tiny sizes."""

from __future__ import annotations

import io

from rich.console import Console
from rl_dataflow.pipeline import PipelineConfig, R3Format, R3Mode, plan_runs, run_formats
from rl_dataflow.progress import step_progress


def test_every_step_gets_a_line(tmp_path, monkeypatch):
    monkeypatch.setenv("REFSTORE_DIR", str(tmp_path))
    config = PipelineConfig(samples=8, group_size=4, mean_len=32, layers=2, topk=2, hidden=16)
    modes, formats, overlap = [R3Mode.OFF, R3Mode.REF], [R3Format.NUMPY], [R3Mode.REF]
    labels = [label for label, *_ in plan_runs(modes, formats, overlap)]
    assert labels == ["off", "ref/numpy", "ref+overlap/numpy"]
    out = io.StringIO()
    console = Console(file=out, width=120)
    total = 2 * len(labels)
    with step_progress(console, total, "tiny") as progress:
        run_formats(
            config, modes, formats, steps=1, warmup=1, pool_size="16M", local=True,
            overlap=overlap, progress=progress,
        )  # fmt: skip
    lines = [line.split() for line in out.getvalue().splitlines() if " s  (compute" in line]
    assert [(words[0], words[1]) for words in lines] == [(label, "warm-up") for label in labels] + [
        (label, "step") for label in labels
    ]
    assert f"{total}/{total}" in out.getvalue()  # the bar reached the end
