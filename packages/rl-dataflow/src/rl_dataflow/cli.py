"""``rl-dataflow demo``: a few steps of the RL loop on the tiny MoE model (vLLM rollout, R3 by
reference, GRPO with routing replay, weights reloaded into the engine); ``rl-dataflow pipeline``:
the Ray pipeline with R3 off, by value and by ref, and its step times."""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import shutil
import sys
import tempfile

from .pipeline import PipelineConfig, R3Format, R3Mode, plan_runs, run


def init_ray(object_store_gib: float = 3.0) -> None:
    import ray

    if "REFSTORE_DIR" not in os.environ:
        # A discovery directory of our own for this run's masters, removed at exit.
        os.environ["REFSTORE_DIR"] = tempfile.mkdtemp(prefix="rl-dataflow-")
        atexit.register(shutil.rmtree, os.environ["REFSTORE_DIR"], True)
    # Under `uv run`, Ray would start its workers with `uv run` in a packaged copy of the working
    # tree (slow, and they never come up when that copy is a uv workspace member). The variable is
    # read once when ray is imported, which pipeline.py has done by now: set the constant too.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    if os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] == "0":
        from ray._private import ray_constants

        ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False
    kwargs = {
        "num_cpus": 2,
        "include_dashboard": False,
        "log_to_driver": False,
        "object_store_memory": int(object_store_gib * (1 << 30)),
        "runtime_env": {"env_vars": {"REFSTORE_DIR": os.environ["REFSTORE_DIR"]}},
    }
    try:
        ray.init(**kwargs)
    except Exception as err:
        # Ray gives its raylet a fixed 30 s to register; on a box loaded by other jobs that is
        # sometimes not enough. One more try, after cleaning up the half-started node.
        if "timed out during startup" not in str(err):
            raise
        ray.shutdown()
        ray.init(**kwargs)


def format_table(results: dict, config: PipelineConfig, r3_format: str | None = None) -> str:
    """``results``: one format's ``{label: results}`` (``r3_format``, default the config's).
    "vs off" compares with R3 off in the same schedule (``off+overlap`` for ``ref+overlap``)."""
    r3_mib = config.samples * config.mean_len * config.row_bytes / 2**20
    lines = [
        f"R3 recordings per batch: ~{r3_mib:.0f} MiB ({config.samples} samples x ~{config.mean_len}"
        f" tokens x [{config.layers} layers, top-{config.topk}] int32, as"
        f" {r3_format or config.r3_format})",
        f"{'R3':12} {'step s':>8} {'vs off':>8} {'data path s':>12} {'materialise s':>14}",
    ]
    for label, entry in results.items():
        off = results.get("off+overlap" if label.endswith("+overlap") else "off", {}).get("step_s")
        ratio = f"{entry['step_s'] / off:8.3f}" if off else f"{'':8}"
        lines.append(
            f"{label:12} {entry['step_s']:8.3f} {ratio} {entry['data_path_s']:12.3f} "
            f"{entry['materialise_s']:14.3f}"
        )
    if "value" in results and "ref" in results:
        step_x = results["value"]["step_s"] / results["ref"]["step_s"]
        path_x = results["value"]["data_path_s"] / results["ref"]["data_path_s"]
        lines.append(
            f"by ref vs by value: step {step_x:.2f}x faster, data path (step minus the stand-in "
            f"model's compute) {path_x:.2f}x faster"
        )
    memcpy = next((e["memcpy_s"] for e in results.values() if "memcpy_s" in e), None)
    if memcpy is not None:
        lines.append(f"one memcpy of a by-ref step's R3 bytes (warm buffers): {memcpy:.3f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rl-dataflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    loop = sub.add_parser("demo", help="a few RL steps on the tiny MoE model with R3 replay")
    loop.add_argument("--steps", type=int, default=8)
    loop.add_argument("--prompts", type=int, default=8)
    loop.add_argument("--group-size", type=int, default=8)
    loop.add_argument("--completion-len", type=int, default=16)
    loop.add_argument("--lr", type=float, default=2e-2)
    loop.add_argument("--r3", choices=["off", "replay"], default="replay")
    loop.add_argument(
        "--serving",
        choices=["offline", "pd"],
        default="offline",
        help="rollout on vLLM in this process, or on a 1P1D of vLLM's servers behind the proxy",
    )
    loop.add_argument(
        "--r3-transport",
        choices=["ref", "value"],
        default="ref",
        help="records to the trainer by reference (refstore manifests) or by value through Ray",
    )
    loop.add_argument("--model", help="model directory (default: the tiny qwen3-moe, built)")
    demo = sub.add_parser("pipeline", help="run the pipeline with R3 off / by value / by ref")
    demo.add_argument("--steps", type=int, default=3)
    demo.add_argument("--samples", type=int, default=64)
    demo.add_argument("--mean-len", type=int, default=1024)
    demo.add_argument("--layers", type=int, default=32)
    demo.add_argument("--topk", type=int, default=32)
    demo.add_argument("--train-passes", type=int, default=1)
    demo.add_argument("--modes", default="off,value,ref")
    demo.add_argument(
        "--overlap",
        default="off,ref",
        help="modes to run a second time overlapped: the next batch goes through the rollout, the"
        " stages and the trainer's prefetch while this one trains ('' for none)",
    )
    demo.add_argument(
        "--r3-format",
        choices=[f.value for f in R3Format],
        default=R3Format.TORCH.value,
        help="the rollout's recordings: torch tensors (as an inference engine's) or numpy arrays",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.command == "demo":
        return _demo(args)
    config = PipelineConfig(
        samples=args.samples,
        mean_len=args.mean_len,
        layers=args.layers,
        topk=args.topk,
        train_passes=args.train_passes,
        r3_format=args.r3_format,
    )
    modes = [R3Mode(m) for m in args.modes.split(",")]
    overlap = [R3Mode(m) for m in args.overlap.split(",") if m]
    import ray

    from .progress import console, step_progress

    out = console()
    total = (args.steps + 1) * len(plan_runs(modes, [R3Format(args.r3_format)], overlap))
    with out.status("starting Ray (15-60 s on a small box)"):
        init_ray()
    try:
        with step_progress(out, total, f"{total} steps, modes interleaved") as progress:
            results = run(config, modes, steps=args.steps, overlap=overlap, progress=progress)
    finally:
        ray.shutdown()
    out.print(format_table(results, config))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .progress import console, loop_progress
    from .rl_loop import LoopConfig, run_loop

    config = LoopConfig(
        prompts=args.prompts,
        group_size=args.group_size,
        completion_len=args.completion_len,
        lr=args.lr,
        r3=args.r3,
        serving=args.serving,
        r3_transport=args.r3_transport,
    )
    out = console()
    with tempfile.TemporaryDirectory(prefix="rl-dataflow-loop-") as work:
        os.environ.setdefault("REFSTORE_DIR", work)
        model = args.model
        if model is None:
            from hybrid_connector.tiny_model import make_tiny_model

            model = make_tiny_model(os.path.join(work, "qwen3-moe"), arch="qwen3-moe")
        title = f"RL loop, R3 {args.r3} ({args.r3_transport}), rollout {args.serving}"
        if args.serving == "pd":
            out.print("starting P and D (vLLM's OpenAI servers, 1-3 min on a small box)")
        with loop_progress(out, args.steps, title) as progress:
            result = run_loop(config, model, work, args.steps, progress=progress)
    rewards = [s["reward"] for s in result["steps"]]
    engines = "".join(f", {'on' if on else 'off'} in an engine" for on in result["engine_memprof"])
    out.print(
        f"reward {rewards[0]:.3f} -> {rewards[-1]:.3f} over {len(rewards)} steps; refstore pool"
        f" back to baseline: {result['pool_back_to_baseline']}; memprof: {result['memprof']}"
        f" here{engines}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
