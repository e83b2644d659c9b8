"""The promotion gate against a poisoned run (issue #26), on the CPU demo.

The default CPU job (``conf/rl.yaml`` + ``conf/cpu.yaml``: SmolLM2-135M, the ``brief`` preference,
Binary RL) runs ``--steps`` updates. From update ``--poison-from`` on, every reward is inverted before
the advantages are computed: the learner's view of a judge that flips its verdicts (+1 <-> -1). Once
without the gate (``deploy.gate=false``), once with it. The job's own evaluation (the eval split, every
held-out prompt x 2, 95% Wilson CIs) runs before, every ``--eval-every`` updates and after, on rollout
engine 0: the version users are served at that moment. Printed per run: the served version's solved
rate at each evaluation, the gate's decisions, the loop's wall time and what the gate cost (probe
seconds, seconds users were held per decision).

    python bench/poisoned_run.py --model $SMOL [--steps 20] [--poison-from 10] [--eval-every 5]
        [--modes off,on] [--seed 7] [--probe-prompts 32] [--json out.json]

``--poison-from`` larger than ``--steps`` runs the clean demo (the gate's cost on a normal run).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def run_once(args, gate: bool) -> dict:
    """One job; returns its evaluations, gate records and timings."""
    import clawray.driver as drv
    from clawray.config import load_config

    run_dir = tempfile.mkdtemp(prefix=f"poisoned-{'gate' if gate else 'plain'}-")
    cfg = load_config(
        ["conf/rl.yaml", "conf/cpu.yaml"],
        [
            f"model.path={args.model}",
            f"run_dir={run_dir}",
            f"seed={args.seed}",
            f"trainer.num_steps={args.steps}",
            f"eval.every_steps={args.eval_every}",
            "wandb.mode=disabled",
            "checkpoint.every_steps=0",
            "checkpoint.save_at_exit=false",
            f"deploy.gate={str(gate).lower()}",
            f"deploy.probe_prompts={args.probe_prompts}",
            *args.override,
        ],
    )
    driver = drv.Driver(cfg)
    clean = drv.batch_advantages

    def poisoned(rewards, *a, **k):  # a judge that flips its verdicts from --poison-from on
        if driver.steps_done >= args.poison_from:
            rewards = [-r for r in rewards]
        return clean(rewards, *a, **k)

    drv.batch_advantages = poisoned
    t0 = time.perf_counter()
    stopped = ""
    try:
        driver.run()
    except RuntimeError as e:  # GateStopped: the run stops itself
        stopped = str(e)
        driver.users.stop()
        driver.evaluate("after")  # what users are served when it stopped
    finally:
        drv.batch_advantages = clean
        driver.close()
    evals = [
        {
            "when": r["when"],
            "step": r["step"],
            "served_version": r["policy_versions"][0] if r["policy_versions"] else r["policy_version"],
            "solved": r["metrics"]["solved"]["mean"],
            "lo": r["metrics"]["solved"]["lo"],
            "hi": r["metrics"]["solved"]["hi"],
        }
        for r in driver.eval_results
    ]
    held = [m["deploy/users_held_s"] for m in driver.history if "deploy/users_held_s" in m]
    return {
        "gate": gate,
        "run_dir": run_dir,
        "seconds": time.perf_counter() - t0,
        "steps": driver.steps_done,
        "stopped": stopped,
        "evals": evals,
        "decisions": [{k: r.get(k) for k in ("version", "decision", "reason", "probe_s")} for r in driver.gate.records],
        "users_held_s": held,
        "probe_s": sum(r.get("probe_s") or 0.0 for r in driver.gate.records),
    }


def report(out: dict) -> None:
    name = "gate on" if out["gate"] else "gate off"
    print(f"\n== {name}: {out['steps']} updates in {out['seconds']:.0f} s ({out['run_dir']})")
    for e in out["evals"]:
        print(
            f"  eval {e['when']:6s} step {e['step']:2d}: served v{e['served_version']:<3d} solved "
            f"{100 * e['solved']:.1f}% [{100 * e['lo']:.1f}, {100 * e['hi']:.1f}]"
        )
    if out["gate"]:
        counts: dict[str, int] = {}
        for d in out["decisions"]:
            counts[d["decision"]] = counts.get(d["decision"], 0) + 1
        held = out["users_held_s"]
        print(
            f"  gate: {counts}; probe {out['probe_s']:.0f} s in all; users held per decision "
            f"mean {sum(held) / max(len(held), 1):.1f} s, max {max(held, default=0.0):.1f} s"
        )
        for d in out["decisions"]:
            if d["decision"] != "promoted":
                print(f"    v{d['version']}: {d.get('reason') or d['decision']}")
    if out["stopped"]:
        print(f"  stopped: {out['stopped']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.path.expanduser("~/.cache/clawray/models/smollm2-135m-instruct"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--poison-from", type=int, default=10, help="invert the rewards from this update on")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--modes", default="off,on", help="off, on or off,on (gate)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--probe-prompts", type=int, default=32)
    p.add_argument("--override", action="append", default=[], help="more key=value config overrides")
    p.add_argument("--json", default="")
    args = p.parse_args()
    outs = [run_once(args, mode == "on") for mode in args.modes.split(",")]
    for out in outs:
        report(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": outs}, f, indent=2)


if __name__ == "__main__":
    main()
