"""The layout planner (lm.plan) and its cost model (lm.planner.cost): the state exact, memory checked
against the compiler (deviceless H100 compiles, or CPU compiles without the plugin), every listed
layout buildable, the ranking against published runs, and its one-line answers."""

import dataclasses
import json
import random

import jax
import pytest
from conftest import assert_one_line_error, recipe, run_cli

from lm import GPU_MEMORY_FRACTION
from lm import plan as lm_plan
from lm.compiler import targets
from lm.config import apply_overrides
from lm.data.corpus import nominal_vocab_size
from lm.hardware.systems import System
from lm.model.flops import split_backward_flops
from lm.planner import calibration as calibrate
from lm.planner import search
from lm.planner.compiled import step_report
from lm.planner.cost import Cost
from lm.planner.memory import calibration, compiler_key
from lm.planner.parallelism import Parallelism
from lm.planner.run import run_of
from lm.program.steps import setup
from sharding.schedule_report import report

# A small model whose state and activations are both a real share of its memory.
SMALL = dict(model__num_layers=4, model__embed_dim=512, model__num_heads=8, model__num_kv_heads=4, model__mlp_dim=1024,
             model__scan_layers=True, data__tokenizer="bpe", data__vocab_size=16384, train__seq_len=256, train__batch_size=16,
             precision__compute_dtype="bfloat16")
# The memory model's stated accuracy on this model's smallest layouts (temporaries, totals):
# on the deviceless H100 compile within 12% and 5% (the bound; measured 2026-11-26 with
# that day's refit: six layouts, temporaries +10.6% at most, totals -0.2% .. +4.9%); on the CPU
# compile, whose einsum attention and fusions the terms fit worse, within 30% and 15%. jax 0.12's
# XLA, fitted on its own (`memory_coefficients`), fits the terms worse: the same six layouts'
# temporaries +2.7% .. +13.2%, totals +1.1% .. +5.0% (2026-11-28), so there 15% and 6%.
TOLERANCES = {"gpu": (0.12, 0.05), "cpu": (0.3, 0.15)} if compiler_key() == "jax0.10" else {"gpu": (0.15, 0.06), "cpu": (0.3, 0.15)}
H100 = System.load("h100")


@pytest.fixture(scope="module")
def small():
    config = recipe("tiny", **SMALL)
    return config, run_of(config)


def test_state_bytes_are_the_sharding_rules_exactly(small):
    config, run = small
    for layout in (Parallelism(fsdp=8), Parallelism(fsdp=4, tensor=2), Parallelism(data=2, stage=2, tensor=2, microbatches=4, schedule="1f1b"),
                   Parallelism(context=2, fsdp=2, tensor=2), Parallelism(data=4, tensor=2, optimizer_over_data=True),
                   Parallelism(data=2, stage=2, fsdp=2, microbatches=4, schedule="gpipe", optimizer_over_data=True)):
        _, summary = step_report(apply_overrides(config, layout.overrides()), jax.devices()[:8], compile_step=False)
        state = Cost(run, layout, H100).state_bytes
        assert state["params"] == summary["per_device"]["params_bytes"], layout
        assert state["opt_state"] == summary["per_device"]["opt_state_bytes"], layout
        assert state["grads"] == summary["per_device"]["grads_bytes"], layout  # as the update takes them


def test_the_update_and_accumulation_traffic_is_counted_so_fewer_passes_rank_first():
    """The optimizer update moves 3 x the gradients' bytes + 2 x the optimizer state's through
    HBM each step, and each extra pass adds a read and write of the float32 accumulator: on one
    H100 a batch-8 llama_1b step was slower per token than larger ones where the matmul model
    saw no difference. Among layouts of equal FLOPs the planner now ranks the fewest passes first."""
    run = run_of(recipe("llama_1b"))
    one, four, eight = (Cost(run, Parallelism(remat="dots", grad_accum=n), H100) for n in (1, 4, 8))
    state = one.state_bytes
    assert one.step_time["update"] == pytest.approx((3 * state["grads"] + 2 * state["opt_state"]) / H100.hbm_bytes_per_s)
    assert eight.step_time["update"] - four.step_time["update"] == pytest.approx(2 * state["grads"] * 4 / H100.hbm_bytes_per_s)
    assert one.step_time["compute"] == pytest.approx(eight.step_time["compute"])
    ranked = search.plan(run, 1, H100, targets.memory_bytes("h100"), remats=("dots",)).ranked
    assert [c.parallelism.grad_accum for c in ranked] == sorted(c.parallelism.grad_accum for c in ranked)


def test_dots_keeps_flash_attention_and_dots_no_batch_runs_it_again(small):
    """On GPUs `dots` keeps cuDNN attention's output and float32 softmax statistics (its forward
    runs once); `dots_no_batch` keeps neither and runs the attention forward again in the
    backward, as `sharding.remat` does (tests/test_gpu_compile.py counts the calls)."""
    _, run = small
    m = run.model
    dots, no_batch = (Cost(run, Parallelism(fsdp=8, remat=r), H100) for r in ("dots", "dots_no_batch"))
    kept = lambda c: c._kept_bytes()[c.parallelism.remat]  # noqa: E731
    assert kept(dots) - kept(no_batch) == m.num_heads * m.head_dim * run.compute_bytes + m.num_heads * 4
    _, attention_forward = dots._forward_flops()
    tokens = run.batch * run.seq_len / 8
    assert no_batch.flops()["attention"] - dots.flops()["attention"] == pytest.approx(tokens * attention_forward)
    assert no_batch.flops()["block"] == dots.flops()["block"]
    # The time: attention's forward again, against fewer bytes kept (written and read around the layer).
    (d_terms, n_terms) = (c.compute_terms() for c in (dots, no_batch))
    assert n_terms["attention"] > d_terms["attention"] and n_terms["saved"] < d_terms["saved"]


def test_collectives_across_hosts_use_a_nic_per_gpu_of_the_group_on_each_host():
    """A ring over 16 hosts whose group has all 8 GPUs of each host runs a channel through each
    of their 8 NICs (NCCL's rails): 8 x 50 GB/s. One GPU per host has its own NIC alone; inside
    a host, NVLink."""
    run, gib = run_of(recipe("llama_70b")), 2**30

    def seconds(layout, axes, n):  # a ring whose whole result is n GiB, its hops' latency left out
        ring = Cost(run, layout, H100)._ring
        return ring(axes, 2 * n * gib) - ring(axes, n * gib)

    assert seconds(Parallelism(fsdp=128), ("fsdp",), 128) == pytest.approx(127 * gib / (8 * H100.network_bytes_per_s))
    assert seconds(Parallelism(data=16, fsdp=8), ("data",), 16) == pytest.approx(15 * gib / H100.network_bytes_per_s)
    assert seconds(Parallelism(data=16, fsdp=8), ("fsdp",), 8) == pytest.approx(7 * gib / H100.nvlink_bytes_per_s)


def test_every_listed_layout_divides_the_model_and_the_batch(small):
    config, run = small
    result = search.plan(run, 8, H100, 2**40)
    assert result.dropped["indivisible"] > 0  # e.g. tensor=8 over 4 KV heads
    listed = [c.parallelism for c in result.ranked]
    assert not [lay for lay in listed if lay.tensor == 8]
    meshes = {(tuple(lay.mesh.values()), lay.sequence_parallel): lay for lay in listed}
    sample = random.Random(0).sample(sorted(meshes.values(), key=str), 10)
    sample += [next(lay for lay in listed if lay.schedule == schedule) for schedule in ("1f1b", "1f1b_per_stage", "zero_bubble", "zbv", "dualpipev")]
    sample += [next(lay for lay in listed if lay.repeats > 1), next(lay for lay in listed if lay.context > 1)]
    per_stage = ("1f1b_per_stage", "zero_bubble", "zbv", "dualpipev")
    assert not [lay for lay in listed if lay.schedule in per_stage and (lay.repeats > 1 or lay.context > 1)]  # refused
    for lay in sample:  # setup raises on any dimension or batch the mesh does not divide
        setup(apply_overrides(config, lay.overrides()), nominal_vocab_size(config.data), jax.devices()[:8])


ALL_SCHEDULES = ("gpipe", "1f1b", "1f1b_per_stage", "zero_bubble", "zbv", "dualpipev")


@pytest.mark.parametrize("moe_layers, mtp, pipelined", [("every:2", 0, ALL_SCHEDULES[:3]), ("from:2", 0, ALL_SCHEDULES[:4]), ("from:1", 0, ()),
                                                         ("all", 1, ALL_SCHEDULES)])
def test_pipelines_are_listed_only_where_the_model_stages_alike(moe_layers, mtp, pipelined):
    """Of moe_tiny's 4 layers: dense among sparse ones pipeline where every chunk holds whole
    repeats of the pattern (not under zero-bubble's split backward: dropped as "not pipelined");
    DeepSeek's leading dense layers run with the embedding and the sparse ones split into the
    stages (2 do into 2 stages, but not into ZB-V's 4 chunks; 3 into none of 2, 4, 8: "indivisible"), multi-token prediction
    runs with the head: all as training takes them."""
    config = recipe("moe_tiny", model__moe_layers=moe_layers, model__mtp_depth=mtp)
    result = search.plan(run_of(config), 8, H100, 2**40)
    staged = [c.parallelism for c in result.ranked if c.parallelism.stage > 1]
    assert {lay.schedule for lay in staged} == set(pipelined)
    assert (result.dropped["not pipelined"] > 0) == (moe_layers == "every:2")
    assert not [lay for lay in staged if lay.repeats > 1 and moe_layers != "all"]  # chunks of 1 break the pattern or the 2 sparse layers
    if moe_layers == "from:2":
        # The first stage runs the embedding and 2 dense layers beside its sparse one: the step priced at its pace.
        cost = next(c for c in result.ranked if c.parallelism.stage == 2)
        assert cost.layers == 3


@pytest.mark.slow
def test_memory_predictions_match_the_compiler_and_rejections_do_not_fit(small):
    """With a memory limit that admits three or so layouts of 4 GPUs: each admitted one's
    compiled state equals the prediction, its temporaries and total are within the stated
    tolerances; the smallest layout rejected by a clear margin really exceeds the limit."""
    config, run = small
    if targets.compiler_available():
        platform, devices = "gpu", targets.devices("h100", 4)
    else:
        platform, devices = "cpu", jax.devices()[:4]
    system = dataclasses.replace(H100, gpus_per_host=4)
    remats = ("full", "dots_no_batch")
    every = search.plan(run, 4, system, 2**40, remats=remats).ranked
    totals = sorted(Cost(run, c.parallelism, system, platform).memory["total"] for c in every)
    limit = totals[2]  # three layouts (or a few more, on ties) fit
    admitted = [c for c in every if Cost(run, c.parallelism, system, platform).memory["total"] <= limit]
    rejected = [c for c in every if Cost(run, c.parallelism, system, platform).memory["total"] > 1.25 * limit]
    rejected = sorted(rejected, key=lambda c: Cost(run, c.parallelism, system, platform).memory["total"])[:1]
    assert 3 <= len(admitted) <= 6 and len(rejected) == 1
    temporaries_tolerance, total_tolerance = TOLERANCES[platform]
    for c in admitted:
        (checked,) = search.verify(config, [c], devices, platform)
        predicted = checked["predicted_bytes"]
        assert predicted["params"] + predicted["opt_state"] - checked["compiled_state_bytes"] < 64, checked  # step, fp8: scalars
        assert abs(predicted["temporaries"] / checked["compiled_temp_bytes"] - 1) < temporaries_tolerance, checked
        assert abs(checked["memory_error"]) < total_tolerance, checked
    for c in rejected:
        (checked,) = search.verify(config, [c], devices, platform)
        assert checked["compiled_peak_bytes"] > limit, checked


# Published runs the prediction must land within 20% of (the rest: see PERFORMANCE.md).
WITHIN_20_PERCENT = ("maxtext-llama3-70b-bf16-128", "maxtext-llama3-70b-fp8-128", "maxtext-llama3-70b-bf16-2048", "megatron-gpt-7.1b-tp2-96",
                     "megatron-gpt-70b-tp8-pp2-768", "meshlm-llama-1b-1xh100-dots-b8", "meshlm-llama-1b-1xh100-full-b64")


def test_memory_coefficients_are_those_fitted_on_this_jax_else_the_nearest_release():
    from lm.planner import memory

    fitted = {"memory": {"gpu": {"jax0.10": {"grads": 10.0}, "jax0.12": {"grads": 12.0}}}}
    picked = {}
    for release in ("0.10.2", "0.11.2", "0.12.0.1", "0.13.1", "1.0.0"):
        picked[release] = memory.memory_coefficients(fitted, "gpu", release)["grads"]
    assert picked == {"0.10.2": 10.0, "0.11.2": 10.0, "0.12.0.1": 12.0, "0.13.1": 12.0, "1.0.0": 10.0}
    assert memory.compiler_key() == "jax{}.{}".format(*jax.__version__.split(".")[:2])  # by default, the installed jax
    # The stored file holds a fit for each stack the suite runs on.
    assert {"jax0.10", "jax0.12"} <= set(calibration()["memory"]["gpu"])


def test_published_runs_are_predicted_within_20_percent():
    """MaxText's, Megatron's and meshlm's own H100 runs (the step-time constants are fitted to
    none of them). The single matmul efficiency fitted to MaxText's 70B step, as the cost model
    had it, put meshlm's measured `llama_1b` b8 row 33% optimistic: the negative control."""
    rows = {r["name"]: r for r in calibrate.published_rows()}
    assert len(rows) >= 9
    for name in WITHIN_20_PERCENT:
        result = calibrate.compare(rows[name])
        assert abs(result["error"]) < 0.2, result
    single = {**calibration(), "step_time": {**SINGLE_EFFICIENCY}}
    assert calibrate.compare(rows["meshlm-llama-1b-1xh100-dots-b8"], single)["error"] > 0.3


# The cost model before its step time had terms for attention and the memory-bound passes: one
# share of peak for every FLOP, fitted to MaxText's Llama-3-70B step on 128 H100s.
SINGLE_EFFICIENCY = {"matmul_efficiency": 0.625, "attention_efficiency": 0.625, "saved_passes": 0.0, "fused_saved_passes": 0.0, "logits_passes": 0.0,
                     "tensor_passes": 0.0}


def test_the_cost_model_agrees_with_the_kernel_model_within_15_percent():
    """On every stored layout of the real recipes that fits its GPU (`lm.calibrate --kernels`:
    llama_1b on 1 and 8 H100s, llama_8b on 8 incl. tensor, sequence and pipeline parallelism,
    70B-wide layers, GPT-2, Mixtral and Qwen3-MoE on 64; remat dots to full), the cost model's
    step is within 15% of the kernel model's for the compiled program (the fit holds every row
    within `calibrate.AGREEMENT`, 12%), so `lm.plan` ranks as `--verify` would. The stored
    constants are what the fit gives back (the file is not hand-edited). Negative control: one
    efficiency for every FLOP and no passes misses by over 20%."""
    rows = calibrate.stored_kernel_rows()
    assert len([r for r in rows if r["fits"]]) >= 24 and len({r["config"] for r in rows}) >= 6
    table = calibrate.kernel_table(rows)
    assert max(abs(r["error"]) for r in table if r["fits"]) < min(0.15, calibrate.AGREEMENT + 0.005), table
    assert max(abs(r["error"]) for r in calibrate.kernel_table(rows, {**calibration(), "step_time": SINGLE_EFFICIENCY}) if r["fits"]) > 0.2
    fitted = calibrate.fit_step_time(rows, calibration())
    assert fitted == pytest.approx(calibration()["step_time"], rel=1e-3)


@pytest.mark.parametrize("stages, pipeline_remat, remat, stretch", [
    (4, "none", "dots", 4 / 3), (4, "full", "dots", 3 / 2),  # one layer per stage: whole backwards
    (2, "none", "dots", 1), (2, "none", "full", 9 / 8),  # two: balanced slots, the backward in halves
])
def test_per_stage_1f1b_slots_last_their_longest_work_and_keep_less(small, stages, pipeline_remat, remat, stretch):
    """Both 1F1B schedules idle (S - 1)/(M + S - 1) of the time, but per-stage slots each last
    their longest piece of work on any stage: a backward (2 forwards keeping residuals, 3
    recomputing), so each microbatch takes 2B per stage instead of F + B; in balanced slots half
    a backward, 3 max(F, B / 2) (equal to F + B when B = 2F, as with `dots`; the recompute
    `full` adds makes it 4.5 forwards against 4). It keeps S sets where lockstep keeps 2S - 1."""
    _, run = small
    microbatches = 2 * stages  # the per-replica batch: 16 sequences over 8 // stages FSDP devices
    lockstep, per_stage = (Cost(run, Parallelism(stage=stages, fsdp=8 // stages, remat=remat, microbatches=microbatches, schedule=schedule,
                                            pipeline_remat=pipeline_remat), H100) for schedule in ("1f1b", "1f1b_per_stage"))
    assert per_stage.microbatch == 1 and per_stage.bubble_fraction() == lockstep.bubble_fraction()
    assert per_stage.bubble_fraction() == pytest.approx((stages - 1) / (microbatches + stages - 1))
    busy = lambda c: c.step_time["compute"] + c.step_time["bubble"]  # noqa: E731
    assert busy(per_stage) == pytest.approx(stretch * busy(lockstep))
    assert per_stage.memory["temporaries"] < lockstep.memory["temporaries"]
    balanced = stages == 2 and pipeline_remat == "none"  # two layers per stage halve; residuals kept
    assert per_stage.parallelism.name(run.model.num_layers).endswith(f"{'balanced ' * balanced}1f1b_per_stage M={microbatches}"
                                                                 + ", pipeline remat=none" * (pipeline_remat == "none"))


def test_zero_bubble_slots_are_priced_by_their_ops_flops_and_its_taps_by_their_bytes(small):
    """ZB-H1 in the one program: each slot lasts its longest op, F, B and W costed by their FLOPs,
    so its step's bubble is the report's `slot_bubble`; B's taps kept until W add memory."""
    _, run = small
    lay = dict(stage=4, fsdp=2, remat="dots", microbatches=8, pipeline_remat="none")
    per_stage, zero_bubble = (Cost(run, Parallelism(**lay, schedule=schedule), H100) for schedule in ("1f1b_per_stage", "zero_bubble"))
    costs = split_backward_flops(run.model, run.seq_len, "dots")
    assert zero_bubble.bubble_fraction() == pytest.approx(report(zero_bubble.parallelism.plan, run.model.num_layers, costs)["slot_bubble"])
    assert zero_bubble.bubble_fraction() < per_stage.bubble_fraction()
    assert zero_bubble.step_time["total"] < per_stage.step_time["total"]
    assert zero_bubble.memory["temporaries"] > per_stage.memory["temporaries"]  # the taps
    # ZB-V (keeping residuals): a smaller bubble than ZB-H1's, its half-stage chunks' taps fewer.
    zbv = Cost(run, Parallelism(**lay, schedule="zbv"), H100)
    assert zbv.bubble_fraction() == pytest.approx(report(zbv.parallelism.plan, run.model.num_layers, costs)["slot_bubble"])
    assert zbv.bubble_fraction() < zero_bubble.bubble_fraction() and zbv.step_time["total"] < zero_bubble.step_time["total"]
    assert per_stage.memory["temporaries"] < zbv.memory["temporaries"] < zero_bubble.memory["temporaries"]
    # DualPipeV: each slot priced at its longest cell on any stage, a pair in its middle; a chunk more
    # kept from F to W than ZB-V but fewer B's taps waiting (its middle runs backwards whole), as
    # compiled (deviceless llama_8b {stage 4, fsdp 2}: 51.8 GiB of temporaries against ZB-V's 57.6).
    dualpipev = Cost(run, Parallelism(**lay, schedule="dualpipev"), H100)
    assert dualpipev.bubble_fraction() == pytest.approx(report(dualpipev.parallelism.plan, run.model.num_layers, costs)["slot_bubble"])
    assert dualpipev.bubble_fraction() > zbv.bubble_fraction()
    assert per_stage.memory["temporaries"] < dualpipev.memory["temporaries"] < zbv.memory["temporaries"]


def test_with_maxtext_remat_the_planner_picks_maxtexts_layout(capsys):
    """Given MaxText's remat policy, the planner's first choice for llama_70b on 128 H100s is
    MaxText's own layout (FSDP over all 128, no accumulation). Over every policy it prefers
    tensor parallelism without recompute (PERFORMANCE.md, "Choosing a layout")."""
    result = run_cli(capsys, lm_plan.main, "--config=configs/llama_70b.py", "--gpus=128", "--target=h100", "--top=5", "--remat=qkv_proj",
                     "--config.train.steps=500")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["gpus"] == 128 and summary["hosts"] == 16 and len(summary["top"]) == 5
    assert summary["top"][0]["layout"] == Parallelism(fsdp=128, remat="qkv_proj").name()
    # The lm.train command for the first: the recipe, the user's overrides, the layout's keys the recipe differs in.
    command = summary["train_command"]
    assert f"to train with the first: {command}" in result.stdout
    program, recipe_flag, steps, *_ = command.split(" --")
    assert program == "python -m lm.train" and recipe_flag.endswith("configs/llama_70b.py") and steps == "config.train.steps=500"
    assert command.endswith(" --workdir=WORKDIR")
    flags = dict(arg[len("--config."):].split("=", 1) for arg in command.split() if arg.startswith("--config."))
    trained = apply_overrides(recipe("llama_70b"), flags)
    assert trained.train.steps == 500 and "mesh.data" not in flags  # the recipe's data=1 already
    assert all(trained[k.split(".")[0]][k.split(".")[1]] == v for k, v in summary["top"][0]["overrides"].items())
    speeds = [t["tokens_per_s_per_gpu"] for t in summary["top"]]
    assert speeds == sorted(speeds, reverse=True)
    assert all(t["memory_bytes"]["total"] <= targets.memory_bytes("h100") for t in summary["top"])
    assert summary["dropped"]["does not fit"] > 0 and "layouts fit" in result.stdout


@pytest.mark.slow
def test_an_impossible_request_names_the_smallest_gpu_count_that_fits(capsys):
    result = run_cli(capsys, lm_plan.main, "--config=configs/llama_70b.py", "--gpus=4", "--target=h100")
    assert_one_line_error(result, "no layout of this config fits 4 h100 GPUs", "the smallest GPU count that fits is 32")
    run, memory = run_of(recipe("llama_70b")), targets.memory_bytes("h100")
    assert not search.plan(run, 16, H100, memory).ranked and search.plan(run, 32, H100, memory).ranked


def test_a_gpu_count_nothing_divides_says_so_and_names_a_power_of_two_that_fits(capsys):
    # 3 divides no dimension of the 70B's (batch 256, 64 heads, 80 layers), nor do its multiples
    # 6, 12, 24, ...: the answer says the layouts were indivisible, and looks at powers of two too.
    result = run_cli(capsys, lm_plan.main, "--config=configs/llama_70b.py", "--gpus=3", "--target=h100")
    assert_one_line_error(result, "no layout of this config fits 3 h100 GPUs", "of 6 layouts: indivisible 6",
                          "the smallest GPU count that fits is 32")
    for flags, fragment in [(["--gpus=0"], "--gpus=0 and --top=5 must be at least 1"), (["--gpus=8", "--top=-1"], "--top=-1 must be"),
                            (["--gpus=8", "--memory_gib=-5"], "--memory_gib=-5.0 at least 0"), (["--gpus=8", "--remat=,"], "names no remat policy")]:
        assert_one_line_error(run_cli(capsys, lm_plan.main, "--config=configs/tiny.py", *flags), fragment)


@pytest.mark.slow
@pytest.mark.skipif(not targets.compiler_available(), reason="the XLA GPU compiler plugin is not installed (make gpu-compiler)")
def test_verify_compiles_the_top_layouts_for_the_target(capsys):
    result = run_cli(capsys, lm_plan.main, "--config=configs/tiny.py", "--gpus=8", "--target=h100", "--top=2", "--verify", "--remat=full")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    # Compiled in the cost model's order, shown in the kernel model's.
    by_kernels = sorted(summary["verify"], key=lambda v: -v["tokens_per_s_per_gpu"]["kernels"])
    assert [v["layout"] for v in by_kernels] == [t["layout"] for t in summary["top"]]
    assert all(isinstance(v["collective_bytes"], dict) for v in summary["verify"])  # model / compiled, where there are any
    assert all(v["compiled_peak_bytes"] > 0 and v["fits"] for v in summary["verify"]) and f"within JAX's {GPU_MEMORY_FRACTION * targets.memory_bytes('h100') / 2**30:.2f} GiB pool" in result.stdout
    first = summary["verify"][0]
    assert first["memory_error"] == pytest.approx(first["predicted_bytes"]["total"] / first["compiled_peak_bytes"] - 1)
    assert f"(model {100 * first['memory_error']:+.1f}%;" in result.stdout


@pytest.mark.slow
@pytest.mark.skipif(not targets.compiler_available(), reason="the XLA GPU compiler plugin is not installed (make gpu-compiler)")
def test_verify_drops_what_compiles_over_the_pool_and_compiles_the_next(capsys, monkeypatch):
    """The tiny config is far below the calibration's sizes and the model misses it by up to 65%:
    with the limit at 31.2 MiB the two fastest layouts it admits compile over the pool (95% of
    that), and are dropped for the next; in rank order, until the asked-for count fit."""
    args = ["--config=configs/tiny.py", "--gpus=2", "--target=h100", "--memory_fraction=1"]
    result = run_cli(capsys, lm_plan.main, *args, "--remat=none,full", "--memory_gib=0.0305", "--top=2", "--verify")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    checked = summary["verify"]
    ranked = search.plan(run_of(recipe("tiny")), 2, H100, int(0.0305 * 2**30), remats=("none", "full")).ranked
    assert [v["layout"] for v in checked] == [c.parallelism.name(2) for c in ranked[: len(checked)]]  # in rank order
    assert all(v["fits"] == (v["compiled_peak_bytes"] <= GPU_MEMORY_FRACTION * 0.0305 * 2**30) for v in checked)
    over = [v["layout"] for v in checked if not v["fits"]]
    assert over and summary["dropped"]["over the pool when compiled"] == len(over) and "OVER JAX's 0.03 GiB pool: dropped" in result.stdout
    assert [t["layout"] for t in summary["top"]] == [v["layout"] for v in checked if v["fits"]] and len(summary["top"]) == 2
    assert summary["fitting"] == len(ranked) - len(over)
    # Nothing within MAX_VERIFIED x --top compiles fits: a one-line answer.
    monkeypatch.setattr(search, "MAX_VERIFIED", 1)
    assert_one_line_error(run_cli(capsys, lm_plan.main, *args, "--remat=full", "--memory_gib=0.01416", "--top=1", "--verify"),
                          "none of the 1 fastest layouts that the memory model fits", "lower --memory_fraction (now 1.0)")
