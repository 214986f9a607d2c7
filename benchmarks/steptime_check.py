"""The GPU step-time model against a stored GPU run, from deviceless compiles on this machine.

    python benchmarks/steptime_check.py [--results=benchmarks/results/h100_2026-11-26.json] [--target=h100]

Each measured case of the run kit's JSON (`benchmarks/gpu.py`: its cases and batch sweep) is
compiled here for the target with the kit's own overrides, and `lm.compiler.steptime` predicts
its step from the optimized program: measured and predicted step, the error, and the predicted
time by kind of kernel. The constants are the stored ones (`lm/hardware/steptime.json`, fitted
on another run: every row is then out of sample). The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "h100_2026-11-26.json"))
    parser.add_argument("--target", default="h100")
    args = parser.parse_args()

    from lm.compiler import targets

    devices = targets.command_devices("benchmarks.steptime_check", sys.argv[1:], args.target, 1)
    from benchmarks.gpu import BF16, FULL, attention, cases
    from lm.compiler import steptime
    from lm.data.corpus import nominal_vocab_size
    from lm.program.steps import setup
    from lm.recipe import load

    run = json.loads(Path(args.results).read_text())
    # Cases run under their own XLA flags (Triton's GEMMs off) are left out: one process compiles
    # under one set of flags.
    overrides = {case.name: (case.config or run["config"], case.overrides) for case in cases("cudnn") if not case.xla_flags}
    for sweep in (k for k in run if k.startswith("batch_sweep_")):
        kernel = sweep.removeprefix("batch_sweep_bf16_")
        for batch in run[sweep]:
            overrides[f"{sweep}:{batch}"] = (run["config"], [*BF16, *attention(kernel), f"--config.train.batch_size={batch}", FULL])
    rows = []
    for name, (config_file, flags) in overrides.items():
        sweep, _, batch = name.partition(":")
        measured = run[sweep][batch] if batch else run.get(name)
        if not measured or not measured.get("ok"):
            continue
        # The runs so far (2026-11-26 / 27) ran the layers scanned, the recipes' way then.
        config = load(str(ROOT / config_file), {"model.scan_layers": "True", **dict(f.removeprefix("--config.").split("=", 1) for f in flags)})
        program = setup(config, nominal_vocab_size(config.data), devices)
        import jax
        import numpy as np

        batch_struct = jax.ShapeDtypeStruct((config.train.batch_size, config.train.seq_len + 1), np.int32, sharding=program.batch_sharding)
        text = program.train_step.lower(program.abstract_sharded_state(), batch_struct).compile().as_text()
        prediction = steptime.predict(text, args.target)
        row = {"case": name, "measured_s": measured["step_time_s"], "predicted_s": prediction.step_s,
               "error": prediction.step_s / measured["step_time_s"] - 1,
               "by_kind_ms": {k: round(1e3 * v, 1) for k, v in prediction.by_kind().items()}}
        rows.append(row)
        print(f"{name:40s} measured {1e3 * row['measured_s']:8.1f} ms  predicted {1e3 * row['predicted_s']:8.1f} "
              f"({100 * row['error']:+.1f}%)  {row['by_kind_ms']}", flush=True)
    print(json.dumps({"results": args.results, "target": args.target, "rows": rows}))


if __name__ == "__main__":
    main()
