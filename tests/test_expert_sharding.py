"""``--mesh.expert``: the expert axis of mixtures of experts (``sharding``). Every MoE family's
rules put its stacked experts' leading dimension on the axis (and nothing else on it), the mesh
gains the axis only when it is asked for (a mesh with --mesh.expert 1 is the three-axis one), the
batch splits over it as over data, and a tiny Qwen3-MoE and Mixtral train the same losses on one
device and on meshes with --mesh.expert 2 of host CPU devices (one subprocess: XLA_FLAGS must be
set before JAX starts), with their experts' arrays really split over the axis. A model without
experts, or an expert count the axis does not divide, is refused by name."""

import json

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import support
from nnx_posttrain import config, errors, families, sharding, train
from nnx_posttrain.cli.train_command import parse

# the tiny configurations with experts (Gemma 4's dense ones have none)
MOE = [v for f in families.FAMILIES.values() if f.moe for v, kw in f.tiny.items()
       if kw.get("num_experts")]
MESH = {"data": 1, "fsdp": 2, "expert": 2, "tensor": 2}


def _variables(tree) -> list:
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _specs(backbone, mesh) -> dict:
    return {v.path: (tuple(v.value.shape), sharding.spec_for(v.path, tuple(v.value.shape), mesh))
            for _, v in nnx.to_flat_state(nnx.state(backbone))}


@pytest.mark.parametrize("variant", MOE)
def test_every_moe_familys_experts_are_split_over_the_expert_axis(variant):
    bb = support.TINY_FAMILIES[variant]()
    experts = sharding.expert_count(bb)
    assert experts == 4
    specs = _specs(bb, MESH)
    on_axis = {p: s for p, s in specs.items() if "expert" in s[1]}
    # the stacked experts: every matrix (and GPT-OSS's biases) of an expert bank, [E, ...]
    # (not Qwen 3.5 MoE's shared expert: Dense layers every token takes, sharded as an MLP)
    stacked = {p for p, (shape, _) in specs.items()
               if "expert" in p and "shared_expert" not in p and len(shape) >= 2}
    assert stacked and set(on_axis) == stacked, (variant, sorted(on_axis), sorted(stacked))
    for path, (shape, spec) in on_axis.items():
        assert shape[0] == experts and spec[0] == "expert", (path, shape, spec)
        assert "expert" not in spec[1:], (path, spec)
    # with --mesh.expert 1 an expert bank's spec is the one without the axis
    for path in on_axis:
        shape = specs[path][0]
        assert sharding.spec_for(path, shape, dict(MESH, expert=1)) == \
            sharding.spec_for(path, shape, {"data": 1, "fsdp": 2, "tensor": 2})


def test_dense_families_put_nothing_on_the_expert_axis():
    for variant in ("llama3", "qwen3", "gemma4"):
        specs = _specs(support.TINY_FAMILIES[variant](), MESH)
        assert not [p for p, (_, s) in specs.items() if "expert" in s], variant


def test_the_mesh_gains_the_expert_axis_only_when_asked():
    mc = config.MeshConfig
    assert train.mesh_shape(mc(), 8) == {"data": 8, "fsdp": 1, "tensor": 1}  # expert 1: none
    assert train.mesh_shape(mc(expert=2), 8) == {"data": 4, "fsdp": 1, "expert": 2, "tensor": 1}
    assert list(train.mesh_shape(mc(data=1, fsdp=-1, expert=2, tensor=2), 8).items()) == [
        ("data", 1), ("fsdp", 2), ("expert", 2), ("tensor", 2)]
    with pytest.raises(errors.ConfigError) as err:
        train.mesh_shape(mc(data=3, expert=2), 8)
    assert "mesh data=3 x fsdp=1 x expert=2 x tensor=1 = 6 devices, but 8" in str(err.value)
    assert "product must equal the device count" in str(err.value)
    assert "--mesh.expert" in str(err.value)
    with pytest.raises(errors.ConfigError, match=r"do not divide .* product 3 \(--mesh.fsdp x "
                       r"--mesh.expert x --mesh.tensor\)"):
        train.mesh_shape(mc(data=-1, expert=3), 8)
    default = config.Config()
    for bad in ("0", "-1"):
        with pytest.raises(errors.ConfigError, match="--mesh.expert must be a positive device"):
            parse(default, args=["--mesh.expert", bad])
    assert parse(default, args=["--mesh.expert", "4"]).mesh.expert == 4


def test_the_batch_splits_over_the_expert_axis_as_over_data():
    three = {"data": 2, "fsdp": 2, "tensor": 2}
    four = {"data": 1, "fsdp": 2, "expert": 2, "tensor": 2}
    assert sharding.batch_spec(3, three, leading=1) == P(None, ("data", "fsdp"), None)
    assert sharding.batch_spec(3, four, leading=1) == P(None, ("data", "fsdp", "expert"), None)
    assert sharding.batch_divisor(three) == 4 and sharding.batch_divisor(four) == 4
    assert sharding.batch_flags(three) == "--mesh.data x --mesh.fsdp"
    assert sharding.batch_flags(four) == "--mesh.data x --mesh.fsdp x --mesh.expert"


def test_an_expert_count_the_axis_does_not_divide_and_a_dense_model_are_refused():
    qwen = support.TINY_FAMILIES["qwen3_moe"]()
    for ok in (1, 2, 4):
        sharding.check_experts(ok, qwen, "tiny")
    with pytest.raises(errors.ConfigError) as err:
        sharding.check_experts(3, qwen, "tiny")
    assert str(err.value) == ("--mesh.expert 3: model tiny has 4 experts per MoE layer, which do "
                              "not divide over 3 devices; valid values: 1, 2, 4")
    sharding.check_experts(1, support.TINY_FAMILIES["llama3"](), "dense")
    for variant in ("llama3", "gemma4"):  # Gemma 4 without its MoE block: no experts
        bb = support.TINY_FAMILIES[variant]()
        with pytest.raises(errors.ConfigError) as err:
            sharding.check_experts(2, bb, "dense")
        assert str(err.value).startswith(
            f"--mesh.expert 2: model dense ({type(bb).__name__}) has no experts"), str(err.value)


def test_the_memory_estimate_counts_a_devices_share_of_the_experts():
    from nnx_posttrain import model
    from nnx_posttrain.train import memory

    _, params, _ = model.split(support.TINY_FAMILIES["qwen3_moe"]())
    specs = _specs(support.TINY_FAMILIES["qwen3_moe"](), MESH)
    experts = sum(int(np.prod(shape)) for shape, spec in specs.values() if "expert" in spec)
    total, nbytes = memory._per_device(params, {})
    assert nbytes == 4 * total and experts > total / 3
    assert memory._per_device(params, {"expert": 1, "fsdp": 2}) == (total // 2, nbytes // 2)
    assert memory._per_device(params, {"expert": 2})[0] == total - experts // 2


@pytest.mark.slow  # 10-30 s: the full suite runs it
def test_the_command_refuses_the_expert_axis_on_a_dense_model(tmp_path):
    proc = support.sft_command(tmp_path / "dense", "--model", "gemma_micro", "--steps", "1",
                               "--mesh.cpu-devices", "2", "--mesh.data", "1", "--mesh.expert", "2")
    assert proc.returncode != 0
    assert ("error: --mesh.expert 2: model gemma_micro (GemmaBackbone) has no experts"
            in proc.stderr), proc.stderr[-3000:]
    assert "mesh: data 1 x fsdp 1 x expert 2 x tensor 1 (2 cpu devices)" in proc.stdout


# ----------------------------------------------------------------------------- 4 CPU devices

SCRIPT = r'''
import json, sys
import nnx_posttrain
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import Mesh
sys.path.insert(0, "tests")
import support
from test_sharding import _batch
from nnx_posttrain import config, model, sharding, train
from nnx_posttrain.algorithms import SFT
from nnx_posttrain.train.step import jit_train_step

assert jax.device_count() == 4, jax.devices()
MESHES = {"1": None, "expert=2": dict(data=2, expert=2), "fsdp=2,expert=2": dict(data=1, fsdp=2, expert=2),
          "expert=2,tensor=2": dict(data=1, expert=2, tensor=2)}
out = {"losses": {}, "expert_specs": {}, "expert_shard_rows": {}, "drift": {}}
for item in sys.argv[1].split(","):  # VARIANT, or VARIANT:TARGETS
    variant, _, targets = item.partition(":")
    bb = support.tiny_backbone(variant)
    if targets:  # LoRA on these targets: the trained variables are its factors
        model.enable_lora(bb, 2, targets=targets)
    graphdef, params0, frozen0 = model.split(bb)
    tx, lr = train.optimizer(config.OptimConfig(learning_rate=1e-2, schedule="constant", warmup_ratio=0.0), 10)
    algo = SFT(SFT.Config(), logprob_chunk=8)
    algo.setup(bb)
    rng = np.random.default_rng(0)
    batches = [_batch(rng, 8, 12, 64) for _ in range(3)]
    for name, axes in MESHES.items():
        if axes is None:
            mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), sharding.AXES)
        else:
            mesh = train.make_mesh(config.MeshConfig(**axes))
            sharding.check_experts(mesh.shape["expert"], bb, variant)
        state = train.init_state(jax.tree.map(jnp.copy, params0), tx, 0)
        shardings = sharding.tree_shardings(state, mesh)
        state = sharding.put(state, shardings)
        frozen = sharding.put({"model": frozen0, "reference": None},
                              sharding.tree_shardings({"model": frozen0, "reference": None}, mesh))
        step = jit_train_step(graphdef, algo.loss, (tx, lr), shardings, mesh)
        before = [x.sharding for x in jax.tree.leaves(state)]
        losses = []
        with jax.set_mesh(mesh):
            for batch in batches:
                state, metrics = step(state, frozen, train.shard_batch(batch, mesh, 1))
                losses.append(float(metrics["loss"]))
        key = f"{variant} {name}"
        out["losses"][key] = losses
        out["drift"][key] = sum(a != b for a, b in zip(before, [x.sharding for x in jax.tree.leaves(state)]))
        variables = jax.tree.leaves(state["params"], is_leaf=lambda x: isinstance(x, nnx.Variable))
        experts = {v.path: v.value for v in variables if "/experts/" in v.path}
        out["expert_specs"][key] = sorted({str(x.sharding.spec) for x in experts.values()})
        out["expert_shard_rows"][key] = sorted({s.data.shape[0] for x in experts.values() for s in x.addressable_shards})
print("RESULT " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def four_devices():
    """Every mesh of the tiny Qwen3-MoE and Mixtral, and of GPT-OSS with LoRA on its experts
    alone, in one process."""
    return support.on_cpu_devices(SCRIPT, 4, "qwen3_moe,mixtral,gpt_oss:experts", timeout=900)


@pytest.mark.slow
def test_the_same_losses_with_the_experts_split(four_devices):
    losses = four_devices["losses"]
    print(json.dumps(losses, indent=1))
    for variant in ("qwen3_moe", "mixtral"):
        reference = losses[f"{variant} 1"]
        assert len(reference) == 3 and reference[0] != reference[-1]  # it trains
        for name, values in losses.items():
            if name.startswith(variant):
                np.testing.assert_allclose(values, reference, rtol=2e-5, err_msg=name)


@pytest.mark.slow  # 10-30 s: the full suite runs it
def test_the_experts_arrays_are_split_over_the_expert_axis(four_devices):
    specs, rows = four_devices["expert_specs"], four_devices["expert_shard_rows"]
    for variant in ("qwen3_moe", "mixtral"):
        assert specs[f"{variant} 1"] == ["P()"]
        assert rows[f"{variant} 1"] == [4]  # every device (one) holds the 4 experts
        assert specs[f"{variant} expert=2"] == ["P('expert',)"]
        assert set(specs[f"{variant} fsdp=2,expert=2"]) == {
            "P('expert', 'fsdp')", "P('expert', None, 'fsdp')"}
        assert set(specs[f"{variant} expert=2,tensor=2"]) == {
            "P('expert', None, 'tensor')", "P('expert', 'tensor')"}
        for name in ("expert=2", "fsdp=2,expert=2", "expert=2,tensor=2"):
            assert rows[f"{variant} {name}"] == [2], (variant, name)  # 2 of the 4 experts each
    assert all(n == 0 for n in four_devices["drift"].values()), four_devices["drift"]


@pytest.mark.slow
def test_expert_lora_factors_split_over_the_expert_axis_with_the_losses_of_one_device(
        four_devices):
    """GPT-OSS with LoRA on its experts alone (``model.expert_lora``): the factors A [E, in, r]
    and B [E, r, out] lie on the expert axis as their kernels do (2 of the 4 experts a device),
    and the losses are one device's."""
    result = {k: {name: v for name, v in values.items() if name.startswith("gpt_oss ")}
              for k, values in four_devices.items()}
    losses, specs, rows = result["losses"], result["expert_specs"], result["expert_shard_rows"]
    assert len(losses) == 4  # the meshes of the script
    reference = losses["gpt_oss 1"]
    assert len(reference) == 3 and reference[0] != reference[-1]  # the factors train
    for name, values in losses.items():
        np.testing.assert_allclose(values, reference, rtol=2e-5, err_msg=name)
        if name != "gpt_oss 1":
            assert all(spec.startswith("P('expert'") for spec in specs[name]), (name, specs)
            assert rows[name] == [2], (name, rows)
    assert all(n == 0 for n in result["drift"].values()), result["drift"]


# ----------------------------------------------------------------------------- plans


@pytest.fixture(scope="module")
def qwen3_moe_preset(tmp_path_factory):
    from tools import make_preset

    path = tmp_path_factory.mktemp("qwen3_moe")
    dims = dict(families.FAMILIES["qwen3_moe"].tiny["qwen3_moe"], vocabulary_size=1024)
    make_preset._task("qwen3_moe", dims, 1024, "float32").save_to_preset(str(path))
    return path


def _plan_cfg(preset, *extra):
    from nnx_posttrain.cli import train_command

    args = ["--model", str(preset), "--init-from", "", "--batching.batch-size", "8",
            "--batching.max-length", "96", *extra]
    return train_command.config_from("sft", args, "sft")


@pytest.mark.slow  # 10-30 s: the full suite runs it
def test_a_plan_lays_the_experts_on_the_expert_axis_of_the_topology(qwen3_moe_preset):
    from nnx_posttrain import api, plan
    from nnx_posttrain.plan import build as build_lib
    from nnx_posttrain.train.mesh import abstract_mesh

    v5e_8 = plan.resolve("v5e-8")
    cfg = _plan_cfg(qwen3_moe_preset, "--mesh.expert", "2")
    run = build_lib.build(cfg, api.build(cfg), v5e_8, echo=lambda s: None)
    assert dict(run.mesh.shape) == {"data": 4, "fsdp": 1, "expert": 2, "tensor": 1}
    experts = [v for v in _variables(run.state["params"]) if "/experts/" in v.path]
    assert experts and {v.value.sharding.spec[0] for v in experts} == {"expert"}
    assert run.batch["input_ids"].sharding.spec[1] == ("data", "fsdp", "expert")
    planned = plan.plan(cfg, api.build(cfg), v5e_8, echo=lambda s: None)  # compiled for it
    assert planned.mesh == {"data": 4, "fsdp": 1, "expert": 2, "tensor": 1} and planned.fits
    # over two slices the data axis spans them, the expert axis stays within a slice
    mesh = abstract_mesh(config.MeshConfig(data=2, fsdp=-1, expert=4),
                         plan.resolve("v5e-16", slices=2).devices, slices=2)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "expert": 4, "tensor": 1}
    bad = _plan_cfg(qwen3_moe_preset, "--mesh.expert", "8")
    with pytest.raises(errors.ConfigError, match="--mesh.expert 8: model .* has 4 experts per "
                       "MoE layer, which do not divide over 8 devices; valid values: 1, 2, 4"):
        build_lib.build(bad, api.build(bad), v5e_8, echo=lambda s: None)


@pytest.mark.slow
def test_the_command_trains_with_the_experts_split_and_the_losses_of_one_device(
        qwen3_moe_preset, tmp_path):
    """The run's own path (mesh, placement, batches, checkpoints) with --mesh.expert 2, in a
    process of its own (2 CPU devices), against the one-device run in this process; on 16
    records of the built-in task with its recipe's optimizer settings."""
    data = support.builtin_file(tmp_path / "sft.jsonl", n=16)
    args = ["--model", qwen3_moe_preset, "--data", data, "--steps", "3", "--log-every", "1",
            "--eval.every", "0", "--checkpoint.every", "0", "--batching.batch-size", "4",
            "--batching.grad-accum", "1", "--batching.max-length", "96", "--remat", "none",
            "--optim.learning-rate", "1e-3", "--optim.warmup-steps", "30",
            "--optim.weight-decay", "1.0"]

    def losses(name):
        return [r["loss"] for r in support.records(tmp_path / name)]

    support.train_run("sft", *args, "--run-dir", tmp_path / "one", echo=lambda _: None)
    proc = support.sft_command(tmp_path / "split", *args, "--mesh.cpu-devices", "2",
                               "--mesh.data", "1", "--mesh.expert", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mesh: data 1 x fsdp 1 x expert 2 x tensor 1 (2 cpu devices)" in proc.stdout, \
        proc.stdout
    assert len(losses("one")) == 3
    np.testing.assert_allclose(losses("split"), losses("one"), rtol=2e-5)
