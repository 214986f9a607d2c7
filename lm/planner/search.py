"""The planner's search: every layout of a config on N GPUs enumerated (`layouts`), costed by
`lm.planner.cost`, the fitting ones ranked by predicted tokens/s per GPU (`plan`), and the best
compiled for the target in rank order until K fit (`verified`). `python -m lm.plan` is its
command, and its docstring says what the user sees.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator

from lm.config import apply_overrides
from lm.hardware.systems import System
from lm.model.config import moe_problem
from lm.model.flops import flops_per_token
from lm.planner.compiled import step_report
from lm.planner.cost import Cost
from lm.planner.memory import calibration
from lm.planner.parallelism import Parallelism
from lm.planner.run import Run
from sharding.mesh import MESH_AXES
from sharding.remat import REMAT
from sharding.schedules import PER_STAGE, V_SHAPED, least_microbatches

# (schedule, pipeline.remat): what a tick or slot keeps, `full` recomputing it.
SCHEDULES = (("gpipe", "full"), ("1f1b", "full"), ("1f1b", "none"), ("1f1b_per_stage", "full"), ("1f1b_per_stage", "none"),
             ("zero_bubble", "full"), ("zero_bubble", "none"), ("zbv", "none"), ("dualpipev", "none"))  # ZB-V recomputing: a bubble above 1F1B's
MAX_BUBBLE = 0.5  # pipelines idling more than this are dropped
# A layout may fill this share of a GPU's memory: the temporaries model is within ~10-25% of
# XLA's (lm.calibrate), and the allocator needs slack.
MEMORY_FRACTION = 0.9
MAX_SEARCHED_GPUS = 1 << 16  # how far an impossible request looks for a GPU count that fits
MAX_VERIFIED = 3  # --verify compiles at most this many layouts per one asked for


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(gpus: int) -> Iterator[tuple[int, ...]]:
    """Every (data, stage, context, expert, fsdp, tensor) whose product is `gpus`."""

    def split(n: int, axes: int):
        if axes == 1:
            yield (n,)
            return
        for d in divisors(n):
            for rest in split(n // d, axes - 1):
                yield (d, *rest)

    yield from split(gpus, len(MESH_AXES))


def mesh_problem(run: Run, mesh: dict, gpus_per_host: int) -> str | None:
    """Why a mesh cannot carry this run (None: it can)."""
    m = run.model
    if mesh["tensor"] > gpus_per_host:
        return "tensor parallelism across hosts"
    if any(n % mesh["tensor"] for n in (m.num_heads, m.num_kv_heads, m.mlp_dim)) or m.vocab_size % (mesh["stage"] * mesh["tensor"]):
        return "indivisible"  # heads, MLP or vocabulary by tensor (x stage)
    if m.embed_dim % (mesh["context"] * mesh["fsdp"]) or m.pipelined_layers % mesh["stage"]:
        return "indivisible"
    if run.batch % (mesh["data"] * mesh["expert"] * mesh["fsdp"]) or (mesh["context"] > 1 and run.seq_len % (2 * mesh["context"])):
        return "indivisible"
    if mesh["expert"] > 1 and (not m.moe or m.num_experts % mesh["expert"]):
        return "indivisible"  # experts by expert, or no experts to split
    if m.moe and m.expert_width % mesh["tensor"]:
        return "indivisible"
    if mesh["stage"] > 1 and unstaged(m, mesh["stage"]):
        return "not pipelined"
    return None


def unstaged(m, stages: int, repeats: int = 1, schedule: str = "gpipe") -> bool:
    """Whether the model cannot run in `stages` pipeline stages (`repeats` chunks each, by
    `schedule`): dense and sparse layers a chunk cannot hold alike."""
    return moe_problem(m, 0, stages, repeats, schedule) is not None


def layouts(run: Run, gpus: int, gpus_per_host: int, remats=REMAT) -> Iterator[Parallelism | tuple[Parallelism, str]]:
    """Every candidate layout, or (layout, why it cannot run) for the ones the run cannot take."""
    for sizes in meshes(gpus):
        mesh = dict(zip(MESH_AXES, sizes))
        # Replicas spread the optimizer state (ZeRO-1) where that costs no traffic: without FSDP
        # (under it XLA all-reduces the gradients over the replicas, then gathers the parameters).
        zero = mesh["data"] > 1 and mesh["fsdp"] * mesh["context"] == 1
        base = Parallelism(**mesh, optimizer_over_data=zero)
        problem = mesh_problem(run, mesh, gpus_per_host)
        if problem:
            yield base, problem
            continue
        replica = run.batch // (mesh["data"] * mesh["expert"] * mesh["fsdp"])
        for sp in (False, True) if mesh["tensor"] > 1 else (False,):
            if sp and run.seq_len % (mesh["context"] * mesh["tensor"]):
                yield dataclasses.replace(base, sequence_parallel=True), "indivisible"
                continue
            for remat in remats:
                layout = dataclasses.replace(base, sequence_parallel=sp, remat=remat)
                if mesh["stage"] == 1:
                    yield from (dataclasses.replace(layout, grad_accum=a) for a in divisors(replica))
                    continue
                counts = [m for m in (mesh["stage"] * k for k in (1, 2, 4, 8)) if replica % m == 0]
                if not counts:
                    yield dataclasses.replace(layout, microbatches=mesh["stage"], schedule="gpipe"), "indivisible"
                circular = run.model.pipelined_layers % (2 * mesh["stage"]) == 0  # two chunks per stage
                for microbatches in counts:
                    # GPipe recomputes its ticks; 1F1B recomputes them or keeps their residuals.
                    for schedule, pipeline_remat in SCHEDULES:
                        if schedule in PER_STAGE and mesh["context"] > 1:
                            continue  # refused by sharding.schedules.check: not a layout this config allows
                        piped = dataclasses.replace(layout, microbatches=microbatches, schedule=schedule, pipeline_remat=pipeline_remat)
                        if schedule in V_SHAPED and not circular:
                            yield piped, "indivisible"  # refused by sharding.schedules.check: two equal chunks a stage
                            continue
                        if microbatches < least_microbatches(schedule, mesh["stage"]):
                            continue  # refused by sharding.schedules.check: not a layout this config allows
                        yield (piped, "not pipelined") if unstaged(run.model, mesh["stage"], 1, schedule) else piped
                        if circular and schedule not in PER_STAGE and not unstaged(run.model, mesh["stage"], 2, schedule):  # circular GPipe, interleaved 1F1B
                            yield dataclasses.replace(piped, repeats=2)


@dataclasses.dataclass
class Plan:
    ranked: list[Cost]  # layouts that fit, fastest first
    dropped: Counter  # reason -> count
    evaluated: int
    device_memory: int


def plan(run: Run, gpus: int, system: System, device_memory: int, gpus_per_host: int | None = None, remats=REMAT) -> Plan:
    """Every layout of `run` on `gpus` GPUs of `system`, costed; those that fit ranked."""
    gpus_per_host = gpus_per_host or system.gpus_per_host
    system = dataclasses.replace(system, gpus_per_host=gpus_per_host)
    constants = calibration()
    fitting, dropped, evaluated = [], Counter(), 0
    for candidate in layouts(run, gpus, gpus_per_host, remats):
        evaluated += 1
        if isinstance(candidate, tuple):
            dropped[candidate[1]] += 1
            continue
        c = Cost(run, candidate, system, constants=constants)
        if c.memory["total"] > device_memory:
            dropped["does not fit"] += 1
        elif candidate.stage > 1 and c.bubble_fraction() > MAX_BUBBLE:
            dropped["bubble too large"] += 1
        else:
            fitting.append(c)
    fitting.sort(key=lambda c: (-c.tokens_per_s_per_gpu(), c.memory["total"]))
    ranked = distinct(fitting)
    if len(ranked) < len(fitting):
        dropped["same cost as a listed one"] = len(fitting) - len(ranked)
    return Plan(ranked, dropped, evaluated, device_memory)


def distinct(costs: list[Cost]) -> list[Cost]:
    """`costs` without layouts that differ from an earlier one in the remat policy alone and
    cost the same: nothing to choose between them."""
    seen, out = set(), []
    for c in costs:
        key = (dataclasses.replace(c.parallelism, remat=""), c.memory["total"], c.step_time["total"])
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def smallest_fit(run: Run, gpus: int, system: System, device_memory: int, remats=REMAT) -> tuple[int, int] | None:
    """(GPUs, a fitting layout's bytes per GPU) for the smallest GPU count above `gpus`, among its
    power-of-two multiples and the powers of two (a count like 3 may divide nothing), on which
    some layout's memory fits, counting memory only (None: none up to MAX_SEARCHED_GPUS)."""
    constants = calibration()
    counts = {n << k for n in (gpus, 1) for k in range(MAX_SEARCHED_GPUS.bit_length())}
    for n in sorted(c for c in counts if gpus < c <= MAX_SEARCHED_GPUS):
        for candidate in layouts(run, n, system.gpus_per_host, remats):
            if not isinstance(candidate, tuple):
                total = Cost(run, candidate, system, constants=constants).memory["total"]
                if total <= device_memory:
                    return n, total
    return None


def entry(c: Cost) -> dict:
    """One ranked layout as the JSON line gives it."""
    return {
        "layout": c.parallelism.name(c.run.model.num_layers),
        "overrides": c.parallelism.overrides(),
        "memory_bytes": c.memory,
        "step_time_s": c.step_time,
        "tokens_per_s_per_gpu": c.tokens_per_s_per_gpu(),
    }


def verify(config, costs: list[Cost], devices: list, platform: str, target: str | None = None) -> list[dict]:
    """Each layout's train step compiled on `devices` (XLA's memory per device) beside the
    prediction; with a `target`, also its step time by the kernel model of the compiled program
    (`lm.compiler.steptime`, its collectives left to the cost model's network terms) beside the
    cost model's."""
    out = []
    for c in costs:
        _, summary = step_report(apply_overrides(config, c.parallelism.overrides()), devices, target=target)
        compiled = summary["compiled_train_step_per_device"]
        state = summary["per_device"]["params_bytes"] + summary["per_device"]["opt_state_bytes"]
        predicted = Cost(c.run, c.parallelism, c.system, platform).memory
        out.append({
            "layout": c.parallelism.name(c.run.model.num_layers),
            "predicted_bytes": predicted,
            "compiled_state_bytes": state,
            "compiled_temp_bytes": compiled["temp_bytes"],
            "compiled_peak_bytes": compiled["peak_estimate_bytes"],
            "memory_error": predicted["total"] / compiled["peak_estimate_bytes"] - 1,  # the model's, per device
            # The cost model hides FSDP's collectives behind compute: what XLA's schedule hides.
            "collectives": summary["hlo"]["collectives"],
            "collectives_overlapped": summary["hlo"]["collectives_overlapped"],
            "collective_bytes": collective_check(c, summary["hlo"]["collective_bytes"]),
        })
        if timed := summary.get("step_time"):
            network = c.network_seconds()
            step = c.with_network(timed["step_s"], timed["by_kind_s"])
            out[-1]["step_time_s"] = {"kernels": step, "of_which_network": network, "cost_model": c.step_time["total"]}
            out[-1]["tokens_per_s_per_gpu"] = {"kernels": c.run.batch * c.run.seq_len / step / c.parallelism.gpus,
                                               "cost_model": c.tokens_per_s_per_gpu()}
            # Model FLOPs (active parameters, no recompute) over the compute dtype's dense peak.
            per_token = flops_per_token(c.run.model, c.run.seq_len) / c.system.peak(c.run.compute_dtype)
            out[-1]["mfu"] = {k: t * per_token for k, t in out[-1]["tokens_per_s_per_gpu"].items()}
    return out


def collective_check(c: Cost, moved: dict) -> dict:
    """{kind: [model's, compiled] bytes per step and device} for FSDP's gathers and scatters,
    tensor parallelism's reductions (an all-reduce as a gather plus a scatter) and the experts'
    all-to-alls; `moved`: the
    compiled step's `lm.compiler.hlo.summary` collective bytes, told apart by replica group size (FSDP's
    groups are fsdp x context devices, tensor parallelism's tensor: equal sizes are compared
    together, as `fsdp and tensor`)."""
    model = c.collective_bytes()
    fsdp, tensor = c.parallelism.fsdp * c.parallelism.context, c.parallelism.tensor
    bytes_of = lambda op, n: moved.get(f"{op} over {n}", 0) if n > 1 else 0  # noqa: E731
    compiled = {
        "fsdp_gather": bytes_of("all-gather", fsdp),
        "fsdp_scatter": bytes_of("reduce-scatter", fsdp),
        "tensor": 2 * bytes_of("all-reduce", tensor) + bytes_of("all-gather", tensor) + bytes_of("reduce-scatter", tensor),
        "expert": bytes_of("all-to-all", c.parallelism.expert),
    }
    if fsdp == tensor > 1:
        return {"fsdp and tensor": [model["fsdp_gather"] + model["fsdp_scatter"] + model["tensor"], compiled["tensor"]]}
    return {k: [model[k], compiled[k]] for k in model if model[k] or compiled[k]}


def verified(config, ranked: list[Cost], top: int, devices: list, pool: float, target: str | None = None) -> tuple[list[Cost], list[dict]]:
    """The first `top` of `ranked` whose compiled step fits `pool` bytes per device, compiling in
    rank order (at most MAX_VERIFIED x `top` compiles): a layout the memory model put under the
    limit but XLA does not is dropped, and the next one compiled. Returns them, ranked by the
    kernel model's tokens/s where a `target` gives it one, and every check."""
    kept, checked = [], []
    for c in ranked[: MAX_VERIFIED * top]:
        (check,) = verify(config, [c], devices, "gpu", target)
        check["fits"] = check["compiled_peak_bytes"] <= pool
        checked.append(check)
        kept += [(c, check)] if check["fits"] else []
        if len(kept) == top:
            break
    if target:
        kept.sort(key=lambda pair: -pair[1]["tokens_per_s_per_gpu"]["kernels"])
    return [c for c, _ in kept], checked


def fitting(result: Plan) -> int:
    """How many layouts fit: by the memory model, less those a compile put over the pool."""
    return len(result.ranked) - result.dropped["over the pool when compiled"]


def describe(result: Plan, shown: list[Cost]) -> str:
    gib = lambda b: f"{b / 2**30:7.2f}"  # noqa: E731
    lines = [f"{'tokens/s/GPU':>12} {'step s':>7} {'GiB/GPU':>8} {'temps':>7}  layout"]
    for c in shown:
        m = c.memory
        lines.append(f"{c.tokens_per_s_per_gpu():12.0f} {c.step_time['total']:7.3f} {gib(m['total']):>8} {gib(m['temporaries'])}  {c.parallelism.name(c.run.model.num_layers)}")
    reasons = ", ".join(f"{n} {why}" for why, n in result.dropped.most_common()) or "none"
    lines.append(f"{fitting(result)} of {result.evaluated} layouts fit {result.device_memory / 2**30:.1f} GiB; dropped: {reasons}")
    return "\n".join(lines)


def train_command(config_file: str | None, user_overrides: dict, config, layout: Parallelism) -> str:
    """The `lm.train` command line that trains `config` (its file and the user's overrides) with
    `layout`: the layout's keys whose values differ from the config's or that the user set."""
    chosen = layout.overrides()
    flags = [f"--config={config_file}"] if config_file else []
    flags += [f"--config.{k}={v}" for k, v in user_overrides.items() if k not in chosen]
    for key, value in chosen.items():
        group, name = key.split(".")
        if config[group][name] != value or key in user_overrides:
            flags.append(f"--config.{key}={value}")
    return " ".join(["python -m lm.train", *flags, "--workdir=WORKDIR"])
