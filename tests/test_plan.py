"""``nnx-posttrain plan``: a run's step compiled ahead of time for TPU topologies on this CPU host
(libtpu from the test extra's jax[tpu]), abstractly; the report is XLA's own analysis of that
compiled step; what would not fit is refused with the changes estimated to make it fit."""

import json
import re
import sys

import jax
import pytest
from flax import nnx

from nnx_posttrain import api, errors, model, plan
from nnx_posttrain.cli import train_command
from nnx_posttrain.model import device_memory
from nnx_posttrain.plan import build as build_lib, fixes as fixes_lib
from nnx_posttrain.tasks import tokenizer
from nnx_posttrain.train import flops
from support import ask, cli_error, command_output, run_command

MICRO = ["--model", "gemma_micro", "--init-from", "", "--batching.batch-size", "8",
         "--batching.max-length", "24"]
# head size 128 (splash attention's tile), Gemma 2's sliding window and soft caps, micro sizes
model.register_builtin("gemma2_micro_h128", dict(
    num_layers=2, num_query_heads=2, num_key_value_heads=1, hidden_dim=32, intermediate_dim=64,
    head_dim=128, query_head_dim_normalize=True, use_post_ffw_norm=True,
    use_post_attention_norm=True, final_logit_soft_cap=30.0, attention_logit_soft_cap=50.0,
    use_sliding_window_attention=True, sliding_window_size=64), tokenizer.builtin_proto)
# the same without Gemma 2's alternating window: identical blocks (a layer scan)
model.register_builtin("gemma_micro_h128", dict(
    num_layers=2, num_query_heads=2, num_key_value_heads=1, hidden_dim=32, intermediate_dim=64,
    head_dim=128), tokenizer.builtin_proto)


@pytest.fixture(scope="module")
def v5e_8():
    return plan.resolve("v5e-8")


def _cfg(name, *args):
    return train_command.config_from(name, [str(a) for a in args], name)


def _plan(name, topology, *args):
    cfg = _cfg(name, *args)
    return plan.plan(cfg, api.build(cfg), topology, echo=lambda s: None)


def _compiled(name, topology, *args):
    """The same step compiled again outside the plan: (the abstract run, XLA's compiled step)."""
    cfg = _cfg(name, *args)
    run = build_lib.build(cfg, api.build(cfg), topology, echo=lambda s: None)
    return run, plan.compiled.compile_step(run)


def test_slice_names_are_the_chip_grids_cloud_tpu_provisions():
    assert [plan.chip_grid(c, 3) for c in (4, 8, 16, 32, 64, 128)] == [
        (2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4), (4, 4, 4), (4, 4, 8)]
    assert [plan.chip_grid(c, 2) for c in (1, 4, 8, 16, 64, 128, 256)] == [
        (1, 1), (2, 2), (2, 4), (4, 4), (8, 8), (8, 16), (16, 16)]
    v4 = plan.resolve("v4-8")  # 8 TensorCores: 4 chips, one megacore device each
    assert (len(v4.devices), v4.kind, v4.memory_bytes) == (4, "TPU v4", 32 << 30)
    v5p = plan.resolve("v5p-128")
    assert (len(v5p.devices), v5p.memory_bytes) == (64, 95 << 30)
    two = plan.resolve("v5e-16", slices=2)
    assert (len(two.devices), two.kind, two.memory_bytes) == (32, "TPU v5 lite", 16 << 30)


@pytest.mark.parametrize("name, slices, says", [
    ("v5e-12", 1, "not a v5e slice size"), ("v4-2", 1, "not a v4 slice size"),
    ("gpu-8", 1, "CUDA plugin"), ("tpu", 1, "not a topology"), ("v5e-8", 0, "--slices"),
    ("cpu-2", 2, "TPU topologies only"), ("cpu-0", 1, "splits into 1 to 1024 devices"),
    ("cpu-100000", 1, "cpu-N"), ("v4-9", 1, "not a v4 slice size"),
    ("v5e-512", 1, "to a pod's, v5e-256 or less"), ("v4-16384", 1, "v4-8192 or less"),
    ("v5e-256", 1000, "256,000 chips, more than a plan describes")])
def test_a_topology_that_does_not_exist_is_refused_by_name(name, slices, says):
    with pytest.raises(errors.ConfigError, match=says):
        plan.resolve(name, slices)


def test_a_batch_of_millions_is_planned_from_the_shapes_of_a_small_one(v5e_8):
    """The plan reads only the first batch's shapes: it is built as small as its make-up allows
    (a multiple of the accumulation and the generations) and its rows scaled, never tokenized."""
    cfg = _cfg("grpo", *MICRO, "--batching.batch-size", "3000000", "--batching.grad-accum", "2",
               "--algo.num-generations", "3", "--algo.max-completion-length", "8")
    small, scale = build_lib._sample_batch(cfg, api.build(cfg))
    assert (small.batching.batch_size, scale) == (6, 500_000)
    cfg = _cfg("sft", *MICRO, "--batching.batch-size", "2000000", "--mesh.data", "8")
    run = build_lib.build(cfg, api.build(cfg), v5e_8, echo=lambda s: None)
    assert run.batch["input_ids"].shape == (1, 2_000_000, 24)


def test_an_abstract_prepare_is_the_runs_own_sequence_as_shapes_and_leaves_nothing(tmp_path,
                                                                                  v5e_8):
    """``train.prepare(..., abstract=devices)``, what a plan builds on: the run's mesh over the
    devices, its state and frozen weights as laid-out shapes, no run directory, checkpoint,
    batch source or evaluator, and nothing left open (the mesh in context ends)."""
    import jax

    from nnx_posttrain import train

    cfg = _cfg("sft", *MICRO, "--run-dir", tmp_path / "run", "--mesh.fsdp", "2")
    run = train.prepare(cfg, api.build(cfg), echo=lambda s: None, abstract=v5e_8.devices)
    assert run.abstract and not (tmp_path / "run").exists()
    assert dict(run.mesh.shape) == {"data": 4, "fsdp": 2, "tensor": 1}
    leaves = jax.tree.leaves((run.state, run.frozen))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) and x.sharding.mesh == run.mesh
                          for x in leaves)
    assert (run.checkpointer, run.record, run.source, run.evaluator) == (None,) * 4
    assert run.context.load_run is None and not run.cfg.memory_check
    assert jax.sharding.get_abstract_mesh().empty
    run.close()  # nothing to close


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["sft", "grpo"])
def test_sft_and_grpo_steps_compile_for_a_tpu_topology_and_the_report_is_xlas(algorithm, v5e_8):
    args = [*MICRO, "--batching.batch-size", "16", "--batching.grad-accum", "2", "--mesh.data",
            "4", "--mesh.fsdp", "2"]
    if algorithm == "grpo":
        args += ["--algo.num-generations", "2", "--algo.max-completion-length", "8"]
    p = _plan(algorithm, v5e_8, *args)
    run, compiled = _compiled(algorithm, v5e_8, *args)
    stats = compiled.memory_analysis()
    assert p.parts == {
        "inputs": stats.argument_size_in_bytes, "XLA temporaries": stats.temp_size_in_bytes,
        "outputs not in place": stats.output_size_in_bytes - stats.alias_size_in_bytes,
        "generated code": stats.generated_code_size_in_bytes}
    assert p.total_bytes == sum(p.parts.values()) and p.fits
    # the inputs by kind, from their shapes: XLA pads small TPU arrays to its tiles
    assert 0 < sum(p.inputs.values()) <= p.parts["inputs"]
    assert p.inputs["frozen weights"] == 0 and p.inputs["trainable weights"] > 0
    # XLA's count, with the 2 micro-batches of the accumulation loop both counted (train.flops)
    assert p.flops == pytest.approx(flops.step_flops(compiled))
    assert p.flops > 1.5 * compiled.cost_analysis()["flops"] > 0
    # weights are sharded over fsdp (all-gathered for use), gradients summed over the batch shards
    assert p.collectives["all-gather"]["count"] > 0 and p.collectives["all-reduce"]["count"] > 0
    assert (p.devices, p.device_kind, p.mesh) == (8, "TPU v5 lite",
                                                  {"data": 4, "fsdp": 2, "tensor": 1})
    batch = run.batch["input_ids"]
    assert batch.shape[:2] == (2, 8) and batch.sharding.spec[1] == ("data", "fsdp")
    if algorithm == "grpo":  # a rollout's shapes: prompt + completion, advantages per row
        assert batch.shape[2] == p.run["sequence"] and run.batch["advantages"].shape == (2, 8)


@pytest.mark.slow
def test_on_a_cpu_device_the_inputs_are_the_state_the_frozen_weights_and_the_batch():
    p = _plan("sft", plan.resolve("cpu-1"), *MICRO, "--lora.rank", "2")
    assert abs(sum(p.inputs.values()) - p.parts["inputs"]) <= 64  # no tiles to pad to on CPU
    assert p.inputs["frozen weights"] > p.inputs["trainable weights"] > 0
    # DPO with LoRA: the reference is the base (adapters off), no copy; the batch carries two
    # layouts of the pairs and the step reads one (jit leaves the other out of its inputs)
    p = _plan("dpo", plan.resolve("cpu-1"), *MICRO, "--lora.rank", "2")
    assert p.inputs["reference copy"] == 0
    assert 0 < sum(p.inputs.values()) - p.parts["inputs"] < p.inputs["batch"]


@pytest.mark.slow
def test_an_abstract_gemma4_vision_models_converter_makes_the_models_own_patches():
    """A plan builds the model abstractly and makes its image converter again from its config;
    KerasHub 0.32's ``Gemma4ImageConverter.get_config`` leaves out ``max_soft_tokens`` and
    ``pooling_kernel_size``, and made from it alone the converter padded each picture of
    ``gemma4_vision_micro`` to its defaults' 280 x 3^2 = 2520 patches instead of 16 (the planned
    step: 12.5 GiB of XLA temporaries, 1.0e11 FLOPs, instead of 0.02 GiB and 4.2e8)."""
    import keras_hub
    import numpy as np

    from nnx_posttrain import runs
    from support import picture

    converter = keras_hub.layers.Gemma4ImageConverter(patch_size=4, max_soft_tokens=4,
                                                      pooling_kernel_size=2, scale=1 / 255)
    again = type(converter).from_config(model.converters.full_config(converter))
    assert (again.max_soft_tokens, again.pooling_kernel_size, again.patch_size) == (4, 2, 4)
    lm, _ = runs.build_model(runs.ModelSpec("gemma4_vision_micro", "float32"),
                             echo=lambda _: None, abstract=True)
    # (max images, patches: (16 / 4)^2, 3 x 4^2 pixels + the patch's (x, y))
    assert lm.images.pixels([picture(0, (32, 32))]).shape == (2, 16, 50)
    assert np.all(lm.images.pixels([])[..., -2:] == -1)  # no image: padding patches only


@pytest.mark.slow
def test_a_vision_runs_first_batch_is_made_under_a_tpu_topologys_mesh(tmp_path):
    """The data's image converter runs eager JAX operations, which a TPU topology's devices
    cannot run: under the plan's mesh it failed ("'Executable' object has no attribute
    'local_devices'"); it runs on this host's CPU, and the batch holds the data's own patches."""
    from support import picture
    from PIL import Image

    Image.fromarray(picture(0, (32, 24))).save(tmp_path / "p.png")
    (tmp_path / "d.jsonl").write_text(json.dumps({"images": [str(tmp_path / "p.png")],
                                                  "messages": ask("How many?", "2")}) + "\n")
    cfg = _cfg("sft", "--model", "gemma4_vision_micro", "--data", tmp_path / "d.jsonl",
               "--batching.batch-size", "4", "--batching.max-length", "32")
    run = build_lib.build(cfg, api.build(cfg), plan.resolve("v5e-1"), echo=lambda s: None)
    assert run.batch["pixel_values"].shape[1:] == (4 // cfg.batching.grad_accum, 2, 16, 50)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3_vision_micro", "gemma4_vision_micro"])
def test_a_vision_model_is_planned_with_its_tower_and_the_batchs_images(name, tmp_path):
    """Built abstractly, a vision model's image converter still reads the data, and a layer's
    constant array (Gemma 3's vision position ids) stays an input of the step: the plan
    compiles, its frozen weights hold the tower and its batch the pixel values."""
    import numpy as np
    from PIL import Image

    path = tmp_path / "dot.png"
    Image.fromarray(np.full((16, 16, 3), 200, np.uint8)).save(path)
    data = tmp_path / "images.jsonl"
    data.write_text("".join(json.dumps({"images": [str(path)], "messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"{i}?"}]},
        {"role": "assistant", "content": str(i)}]}) + "\n" for i in range(4)))
    p = _plan("sft", plan.resolve("cpu-1"), "--model", name, "--data", data, "--lora.rank", "2",
              "--batching.batch-size", "4", "--batching.max-length", "64")
    lm = model.load(name)
    tower = sum(int(np.prod(v.shape)) * v.dtype.itemsize for v in
                jax.tree.leaves(nnx.state(lm.module.vision_encoder)))
    assert p.inputs["frozen weights"] >= tower > 0
    assert p.inputs["batch"] >= 4 * 16 * 16 * 3 * 4  # four rows' pixel values, float32
    # the data's own patches (Gemma 4: 16 a picture): 2520 made > 0.7 GiB of attention scores
    assert p.parts["XLA temporaries"] < 64 * 2**20, p.parts


@pytest.mark.slow
def test_the_command_plans_a_cpu_mesh_and_writes_the_plan(tmp_path):
    out = tmp_path / "plan.json"
    proc = run_command([sys.executable, "-m", "nnx_posttrain.cli", "plan", "sft", *MICRO,
                        "--topology", "cpu-2", "--json", str(out)])
    assert "plan: sft on cpu-2 (2 x cpu; mesh data 2 x fsdp 1 x tensor 1)" in proc.stdout
    saved = json.loads(out.read_text())
    assert saved["devices"] == 2 and saved["fits"] and saved["total_bytes"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("packing", [False, True])
def test_splash_attention_compiles_for_tpu_with_packing_and_a_sliding_window(packing, v5e_8):
    args = ["--model", "gemma2_micro_h128", "--init-from", "", "--attention", "splash",
            "--batching.batch-size", "8", "--batching.max-length", "256", "--mesh.data", "4",
            "--mesh.fsdp", "2", *(["--batching.packing"] if packing else [])]
    run, compiled = _compiled("sft", v5e_8, *args)
    assert run.attention == "splash"
    assert ("segment_ids" in run.batch) == packing
    assert "tpu_custom_call" in compiled.as_text()  # the Pallas (Mosaic) kernel, per device


@pytest.mark.slow
def test_the_layer_scan_compiles_for_tpu_with_splash_fsdp_packing_and_lora(v5e_8):
    """The blocks as one scan (model.layer_scan) on 8 devices: splash attention per device in
    its body, the rows laid out over the batch axes, the FSDP-sharded weights stacked."""
    args = ["--model", "gemma_micro_h128", "--init-from", "", "--attention", "splash",
            "--scan-layers", "on", "--lora.rank", "2", "--batching.batch-size", "8",
            "--batching.max-length", "256", "--mesh.data", "4", "--mesh.fsdp", "2",
            "--batching.packing"]
    run, compiled = _compiled("sft", v5e_8, *args)
    assert run.attention == "splash" and model.scanning(run.lm.module)
    assert "tpu_custom_call" in compiled.as_text()


@pytest.mark.slow
def test_a_plan_that_does_not_fit_is_refused_with_the_changes_estimated_to_fit(v5e_8, capsys,
                                                                               monkeypatch):
    args = [*MICRO, "--batching.batch-size", "16", "--lora.rank", "2"]
    p = _plan("sft", v5e_8, *args)
    assert [f["change"] for f in p.fixes] == [
        "--quantize int8", "--batching.grad-accum 2", "--remat blocks",
        "--mesh.data 1 --mesh.fsdp -1", "--batching.max-length 12"]
    assert all(f["estimated_total_bytes"] < p.total_bytes for f in p.fixes)
    p.memory_bytes = p.total_bytes - 1
    p.fixes = fixes_lib.estimate(p, _cfg("sft", *args), *_estimate_inputs(args, v5e_8))
    refusal = p.refusal()
    assert refusal.startswith(f"the sft step needs {p.total_bytes / 2**30:.2f} GiB per device "
                              "on v5e-8") and "would not fit" in refusal
    assert "Estimated to fit, cheapest first: --quantize int8" in refusal  # a sliver to shed
    assert "Plan the changed run to confirm" in refusal
    # the command: the plan printed, then refused (exit status 1)
    monkeypatch.setitem(plan.GENERATIONS, "v5e", plan.topology.Generation("v5e", False, 2, 1024))
    code, out, err = command_output(capsys, monkeypatch, ["plan", "sft", *args, "--topology", "v5e-8"])
    assert code == 1 and "DOES NOT FIT" in out
    assert re.search("error: the sft step needs .* would not fit", err), err


def _estimate_inputs(args, topology):
    cfg = _cfg("sft", *args)
    algorithm = api.build(cfg)
    run = build_lib.build(cfg, algorithm, topology, echo=lambda s: None)
    return run.lm.module, run.state["params"], algorithm.sequences_per_example, 4


def test_distillation_is_refused_before_anything_loads(v5e_8):
    with pytest.raises(errors.ConfigError, match="distill cannot be planned yet"):
        _plan("distill", v5e_8, *MICRO)


def test_the_tpu_compilers_refusal_is_read_for_its_figures():
    exc = RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required "
                       "for HLO temporaries (17.79G) exceeds available HBM (15.75G).")
    assert device_memory.refused_figures(exc) == (int(17.79 * 2**30), int(15.75 * 2**30))
    assert device_memory.refused_figures(RuntimeError("INVALID_ARGUMENT: shapes")) is None


def test_a_refused_plans_total_is_the_compilers_figure_its_inputs_counted_once(v5e_8,
                                                                               monkeypatch):
    """The TPU compiler's "HLO temporaries (X)" of a refusal is the program's whole need, its
    arguments included (Gemma 4 E4B's LoRA SimPO step: 14.02 GiB of arguments + 4.94 GiB of
    temporaries, refused as 18.96G): the plan's total is X, not the inputs plus X."""
    import jax

    def refuse(run):
        inputs = sum(plan.compiled._device_bytes(t) for t in (run.state, run.frozen, run.batch))
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
            f"temporaries ({(inputs + 2**30) / 2**30:.2f}G) exceeds available HBM (15.75G).")

    monkeypatch.setattr(plan.compiled, "compile_step", refuse)
    p = _plan("sft", v5e_8, *MICRO, "--lora.rank", "2")
    assert abs(p.parts["XLA temporaries"] - 2**30) < 0.01 * 2**30
    assert abs(p.total_bytes - (p.parts["inputs"] + 2**30)) < 0.01 * 2**30
    assert p.memory_bytes == int(15.75 * 2**30) and p.fits and p.flops is None


@pytest.mark.slow
def test_a_quantized_base_is_planned_and_its_frozen_weights_are_what_the_estimate_counts():
    """``--quantize int8`` quantizes the abstract model's layers as a run's (traced, no values);
    its frozen weights come out at what the estimate of the change counted: the share int8
    converts in 1 byte instead of the weights' width, plus the scales."""
    from nnx_posttrain.model.quantize import quantized_share

    cpu = plan.resolve("cpu-1")
    args = [*MICRO, "--lora.rank", "2"]
    p = _plan("sft", cpu, *args)
    q = _plan("sft", cpu, *args, "--quantize", "int8")
    assert q.run["quantize"] == "int8" and q.fits
    module, _, _, width = _estimate_inputs(args, cpu)
    counted = p.inputs["frozen weights"] * (1 - quantized_share(module) * (1 - 1 / width))
    # plus the scales: a float32 per output channel, an eighth of a 32-wide int8 kernel here
    assert counted <= q.inputs["frozen weights"] < 1.15 * counted
    assert q.inputs["trainable weights"] == p.inputs["trainable weights"]


def test_the_commands_help_lists_the_runs_options(capsys):
    from nnx_posttrain import cli

    assert cli.main(["plan", "sft", "--help"]) == 0
    assert "--batching.max-length" in capsys.readouterr().out


def test_a_plan_file_in_a_missing_directory_is_refused_before_compiling(tmp_path, capsys):
    cli_error(capsys, ["plan", "sft", *MICRO, "--topology", "cpu-1", "--json",
                       str(tmp_path / "missing" / "plan.json")], match="does not exist")
