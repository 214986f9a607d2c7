"""A config's sharding plan and its compiled train step, without training (`step_report`): every
parameter's placement and bytes per device, XLA's memory analysis, and for a GPU target what
the optimized HLO runs; `describe` prints it. `python -m lm.layout` is its command.
"""

from __future__ import annotations

import jax
import numpy as np

from lm import GPU_MEMORY_FRACTION
from lm.compiler import hlo, kernels, passes, steptime, targets
from lm.data import corpus as lm_data
from lm.model.flops import flops_per_token, split_backward_flops
from lm.model.latent_attention import cache_values_per_layer
from lm.program.steps import placed, setup
from sharding import report
from sharding.schedule_report import report as pipeline_report


def step_report(config, devices=None, compile_step: bool = True, save_hlo: str | None = None, target: str | None = None) -> tuple[list[report.Row], dict]:
    """(parameter rows, summary): per-device bytes and the compiled train step's memory analysis
    (and, compiled for a GPU, what its optimized HLO runs: GEMM operand types, custom calls,
    collectives); `save_hlo`: a directory to write that HLO into; `target`: the GPU target the
    devices are of, whose memory the step is checked against."""
    program = setup(config, lm_data.nominal_vocab_size(config.data), devices)
    state = program.abstract_sharded_state()
    params = report.device_bytes(state.params)
    summary = {
        "mesh": dict(program.mesh.shape),
        "devices": program.mesh.size,
        "params": sum(int(np.prod(r.shape)) for r in report.rows(state.params)),
        "trained_params": sum(int(np.prod(a.shape)) for a in jax.tree.leaves(program.abstract_model.trainable.part(state.params))),
        "param_bytes_total": report.total_bytes(state.params),
        "per_device": {
            "params_bytes": params,
            # As the update takes them: the parameters' placement, or with ZeRO-1 the optimizer state's.
            # (LoRA: the adapters' alone.)
            "grads_bytes": report.device_bytes(placed(program.abstract_model.trainable.part(state.params), program.grad_shardings)),
            "opt_state_bytes": report.device_bytes(state.opt_state),
        },
    }
    summary["per_device"]["total_state_bytes"] = sum(summary["per_device"].values())
    kept, per_head = cache_values_per_layer(program.spec.model)
    itemsize = np.dtype(program.spec.policy.compute_dtype).itemsize
    summary["decode_cache"] = {"values_per_token_layer": kept, "bytes_per_token": kept * itemsize * program.spec.model.num_layers,
                               "as_heads_values_per_token_layer": per_head}
    summary["pipeline"] = pipeline_report(program.spec.pipeline, program.spec.model.num_layers,
                                          split_backward_flops(program.spec.model, config.train.seq_len, program.spec.model.remat))
    if compile_step:
        batch = jax.ShapeDtypeStruct(
            (config.train.batch_size, config.train.seq_len + 1), np.int32, sharding=program.batch_sharding
        )
        executable = program.train_step.lower(state, batch).compile()
        memory, text = executable.memory_analysis(), executable.as_text()
        if save_hlo:
            hlo.save(text, save_hlo)
        fields = ("argument", "output", "alias", "temp", "generated_code")
        compiled = {f"{f}_bytes": getattr(memory, f"{f}_size_in_bytes", None) for f in fields}
        if None not in compiled.values():
            # Donated state aliases the outputs: live at the peak are arguments, new outputs, temporaries.
            compiled["peak_estimate_bytes"] = (
                compiled["argument_bytes"] + compiled["output_bytes"] - compiled["alias_bytes"] + compiled["temp_bytes"]
            )
        summary["compiled_train_step_per_device"] = compiled
        summary["hlo"] = hlo.summary(text)
        if target:
            summary.update(target=target, device_memory_bytes=targets.memory_bytes(target))
            # Against the pool JAX runs meshlm in, not the whole device.
            summary["fits"] = compiled.get("peak_estimate_bytes", 0) <= GPU_MEMORY_FRACTION * summary["device_memory_bytes"]
            summary["step_time"] = predicted_step(config, program, text, target, executable)
            summary["passes"] = passes.count(text)
            if grouped := summary["step_time"].pop("grouped_gemm", None):
                summary["grouped_gemm"] = grouped
            if choice := program.spec.policy.fp8_choice:  # precision.fp8_sites=auto: what each site chose
                summary["fp8_sites"] = choice.decisions
    return report.rows(state.params, program.abstract_model.logical_axes), summary


def predicted_step(config, program, text: str, target: str, executable, top: int = 15) -> dict:
    """The step-time model's prediction for one compiled step (`lm.compiler.steptime`): step time,
    tokens/s and MFU (dense bf16 peak, `lm.model.flops`'s FLOPs: causal attention at half, the
    head counted, embedding lookups not), its largest kernels, and XLA's own cost analysis beside."""
    prediction = steptime.predict(text, target)
    tokens = config.train.batch_size * config.train.seq_len
    peak = steptime.device(target).bf16_flops * program.mesh.size
    fpt = flops_per_token(program.model_cfg, config.train.seq_len)
    m = program.model_cfg
    grouped = {"grouped_gemm": grouped_gemm_report(m.grouped_gemm, prediction.rows)} if m.moe and m.expert_capacity_factor == 0 else {}
    return grouped | {
        "step_s": prediction.step_s,
        "tokens_per_sec": tokens / prediction.step_s,
        "mfu": tokens * fpt / prediction.step_s / peak,
        "flops_per_token": fpt,
        "by_kind_s": prediction.by_kind(),
        "top": prediction.top(top),
        "xla_cost_analysis": kernels.cost_analysis(executable),
        "kernel_flops": sum(r["count"] * r["flops_per_run"] for r in prediction.rows),
        "kernel_bytes": sum(r["count"] * r["bytes_per_run"] for r in prediction.rows),
    }


def grouped_gemm_report(setting: str, kernel_rows: list[dict]) -> dict:
    """Which grouped GEMM a dropless mixture of experts compiled to (meshlm's Pallas kernels, seen
    in the kernel table, or XLA's `ragged_dot`), its kernels' share of the step, and the
    efficiency it is priced at (with why, where no GPU run has fitted it)."""
    rows = [r for r in kernel_rows if r["kind"] == "grouped_gemm"]
    used = "pallas" if rows else "xla"
    report = {"setting": setting, "implementation": used, "kernels": sum(r["count"] for r in rows),
              "seconds_per_step": sum(r["seconds_per_step"] for r in rows), "tflop_per_step": sum(r["count"] * r["flops_per_run"] for r in rows) / 1e12,
              "efficiency": steptime.constants()["grouped_gemm"], "unfitted": steptime.unfitted().get("grouped_gemm", "")}
    if used == "xla":
        report["note"] = "XLA's ragged_dot: on GPUs one dense GEMM over every expert for every row, masked"
    return report


def describe(param_rows: list[report.Row], summary: dict) -> str:
    fmt = report.format_bytes
    per_device = summary["per_device"]
    lines = [
        report.table(param_rows),
        "",
        f"mesh {summary['mesh']} ({summary['devices']} devices), {summary['params'] / 1e6:.1f}M parameters "
        f"({fmt(summary['param_bytes_total'])} in all)",
        "per device:",
        *(f"  {name.removesuffix('_bytes'):<18} {fmt(b)}" for name, b in per_device.items()),
    ]
    cache = summary["decode_cache"]
    lines.append(f"decode cache per token: {cache['values_per_token_layer']:,} values a layer, {fmt(cache['bytes_per_token'])} over the layers"
                 + (f" (keys and values per head would be {cache['as_heads_values_per_token_layer']:,}: "
                    f"{cache['as_heads_values_per_token_layer'] / cache['values_per_token_layer']:.0f}x)"
                    if cache["as_heads_values_per_token_layer"] != cache["values_per_token_layer"] else ""))
    pipe = summary["pipeline"]
    if pipe["schedule"] != "none":
        lines.append(f"pipeline: {pipe['schedule']}, bubble {pipe['bubble']:.3f}, {pipe['stash_depth']} microbatches' {pipe['stash']} kept per stage")
    compiled = summary.get("compiled_train_step_per_device")
    if compiled:
        lines.append("compiled train step, per device (XLA memory analysis):")
        lines += [f"  {name.removesuffix('_bytes'):<18} {fmt(b)}" for name, b in compiled.items() if b is not None]
    if "target" in summary:
        verdict = "fits" if summary["fits"] else "does NOT fit"
        pool = f"JAX's pool: {GPU_MEMORY_FRACTION:.0%}, {fmt(int(GPU_MEMORY_FRACTION * summary['device_memory_bytes']))}"
        lines.append(f"target {summary['target']}: {fmt(summary['device_memory_bytes'])} per device ({pool}); the step {verdict}")
    if timed := summary.get("step_time"):
        lines.append(f"predicted on {summary['target']} (lm.compiler.steptime): step {1e3 * timed['step_s']:.1f} ms, "
                     f"{timed['tokens_per_sec']:,.0f} tokens/s, MFU {100 * timed['mfu']:.1f}% (bf16 peak; causal attention at half)")
        lines.append("  by kind: " + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in timed["by_kind_s"].items()))
        xla = timed["xla_cost_analysis"]
        lines.append(f"  kernels: {timed['kernel_flops'] / 1e12:.2f} TFLOP, {timed['kernel_bytes'] / 1e9:.2f} GB per step "
                     f"(XLA's cost analysis: {xla.get('flops', 0) / 1e12:.2f} TFLOP, "
                     f"{xla.get('bytes accessed', 0) / 1e9:.2f} GB)")
        lines.append(f"  {'ms/step':>8} {'share':>6} {'runs':>5} {'kind':10} {'GFLOP/run':>10} {'MB/run':>9}  kernel, result")
        lines += [f"  {1e3 * r['seconds_per_step']:8.2f} {100 * r['share']:5.1f}% {round(r['count']):5d} {r['kind']:10} "
                  f"{r['flops_per_run'] / 1e9:10.2f} {r['bytes_per_run'] / 1e6:9.1f}  {r['name']}, {r['shape']}" for r in timed["top"]]
    if grouped := summary.get("grouped_gemm"):
        line = (f"grouped GEMM (model.grouped_gemm={grouped['setting']}): {grouped['implementation']}, {grouped['kernels']} kernels a step, "
                f"{grouped['tflop_per_step']:.2f} TFLOP (the real rows'), {1e3 * grouped['seconds_per_step']:.1f} ms at efficiency {grouped['efficiency']:.2f}")
        line += f" ({grouped['unfitted']})" if grouped["unfitted"] and grouped["implementation"] == "pallas" else ""
        lines.append(line + (f"; {grouped['note']}" if "note" in grouped else ""))
    if counted := summary.get("passes"):
        lines.append(passes.describe(counted))
    if sites := summary.get("fp8_sites"):
        lines.append("fp8 sites (precision.fp8_sites=auto; predicted forward + backward GEMMs per device, fp8 with its passes):")
        lines += [f"  {'fp8 ' if d['fp8'] else 'bf16'} {1e6 * d['bf16_s']:8.1f} us bf16 {1e6 * d['fp8_s']:8.1f} us fp8  {site}"
                  for site, d in sites.items()]
    if summary.get("hlo", {}).get("gemm_operand_types"):
        lines.append("GEMMs (operand types -> result): " + ", ".join(f"{k}: {n}" for k, n in summary["hlo"]["gemm_operand_types"].items()))
        overlapped = summary["hlo"]["collectives_overlapped"]
        lines.append("collectives (of them overlapped with compute): "
                     + (", ".join(f"{k}: {n} ({overlapped.get(k, 0)})" for k, n in summary["hlo"]["collectives"].items()) or "none"))
        if moved := {k: b for k, b in summary["hlo"]["collective_bytes"].items() if b}:
            lines.append("collective bytes per step and device (by replica group size): "
                         + ", ".join(f"{k} devices: {fmt(int(b))}" for k, b in sorted(moved.items(), key=lambda kv: -kv[1])))
    return "\n".join(lines)
