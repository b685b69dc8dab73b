"""Benchmark: the real-model CPU demo (`bash demo_cpu.sh --real`) with several seeds, its reward per step drawn.

Each seed is one run of the demo as a newcomer runs it (its own server, the unchanged grpo_gsm8k.py, SmolLM2-135M-
Instruct on "Repeat exactly: \\boxed{N}"), in a folder of its own under --out. Printed per seed: the mean reward of the
first 3 and of the last 5 steps, the median seconds a step, the run's time and the demo's verdict; then one PNG with
every seed's reward per step (matplotlib: a dependency of this benchmark alone, `pip install matplotlib`).
Run: python bench/learning_curve.py [--seeds 1 2 3] [--out /tmp/curves] [--png docs/images/real_demo_reward.png]
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP = re.compile(r"^step (\d+): .*\breward=(\S+).*\bstep_s=(\S+)")


def run_demo(seed: int, out: str) -> dict:
    """One `demo_cpu.sh --real --seed SEED` in `out`: its rewards and step times, its verdict and its wall time."""
    venv = os.path.dirname(os.path.dirname(sys.executable))
    env = {**os.environ, "VENV": venv, "DEMO_DIR": out}
    t0 = time.time()
    r = subprocess.run(
        ["bash", os.path.join(ROOT, "demo_cpu.sh"), "--real", "--seed", str(seed)],
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    wall = time.time() - t0
    with open(os.path.join(out, "train.log")) as log:
        steps = [m for m in map(STEP.match, log) if m]
    if not steps:
        sys.exit(f"seed {seed}: no step logged (exit {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return {
        "rewards": [float(m.group(2)) for m in steps],
        "step_s": [float(m.group(3)) for m in steps],
        "learned": r.returncode == 0 and "it learned" in r.stdout,
        "wall_s": wall,
    }


def plot(runs: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    for seed, run in runs.items():
        ax.plot(range(1, len(run["rewards"]) + 1), run["rewards"], marker="o", label=f"seed {seed}")
    ax.set_xlabel("step (4 prompts x 8 completions)")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title('grpo_gsm8k.py on CPU: SmolLM2-135M-Instruct, "Repeat exactly: \\boxed{N}"', fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    fig.savefig(png)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="one demo run per seed")
    parser.add_argument("--out", default="/tmp/cleanrlvr-curves", help="a folder per seed is made in it")
    parser.add_argument("--png", default=os.path.join(ROOT, "docs", "images", "real_demo_reward.png"))
    args = parser.parse_args()
    runs = {}
    for seed in args.seeds:
        runs[seed] = run_demo(seed, os.path.join(args.out, f"seed_{seed}"))
        print(f"seed {seed}: rewards {runs[seed]['rewards']}", flush=True)
    print(f"\n{'seed':>4}  {'first 3':>7}  {'last 5':>6}  {'median step_s':>13}  {'run s':>5}  verdict")
    for seed, run in runs.items():
        first = statistics.mean(run["rewards"][:3])
        last = statistics.mean(run["rewards"][-5:])
        step_s = statistics.median(run["step_s"])
        verdict = "it learned" if run["learned"] else "NOT LEARNED"
        print(f"{seed:>4}  {first:>7.2f}  {last:>6.2f}  {step_s:>13.1f}  {run['wall_s']:>5.0f}  {verdict}")
    plot(runs, args.png)
    print(f"\nthe chart: {args.png}")


if __name__ == "__main__":
    main()
