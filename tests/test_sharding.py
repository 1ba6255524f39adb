"""Sharding rules, the (data, fsdp, tensor) mesh, mixed precision and rematerialisation.

Multi-device checks run in one subprocess with 8 host CPU devices (XLA_FLAGS must be set before
JAX starts; this pytest process has one device)."""

import json
import os
import subprocess
from pathlib import Path

import nnx_posttrain  # noqa: F401
import jax
import jax.numpy as jnp
import keras_hub
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import support
from nnx_posttrain import config, errors, model, sharding, train
from nnx_posttrain.algorithms import SFT
from nnx_posttrain.cli.train_command import parse

MESH = {"data": 1, "fsdp": 4, "tensor": 2}


def _batch(rng, n, length, vocab):
    ids = rng.integers(3, vocab, size=(n, length)).astype(np.int32)
    attention = np.ones((n, length), np.int32)
    loss_mask = np.zeros((n, length), np.float32)
    for i in range(n):
        real = length - i % 3
        attention[i, real:] = 0
        ids[i, real:] = 0
        loss_mask[i, 2:real] = 1
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}


# ----------------------------------------------------------------------------- the rules


def test_one_key_value_head_falls_back_to_replication_gemma_2b_shapes():
    # gemma_2b: 8 query heads, 1 key/value head, hidden 2048, head_dim 256, MLP 16384, vocab 256000
    spec = sharding.spec_for
    assert spec("decoder_block_0/attention/query/kernel", (8, 2048, 256), MESH) == P("tensor", "fsdp")
    assert spec("decoder_block_0/attention/key/kernel", (1, 2048, 256), MESH) == P(None, "fsdp")
    assert spec("decoder_block_0/attention/value/kernel", (1, 2048, 256), MESH) == P(None, "fsdp")
    assert spec("decoder_block_0/attention/attention_output/kernel", (8, 256, 2048), MESH) == \
        P("tensor", None, "fsdp")
    assert spec("decoder_block_0/ffw_gating/kernel", (2048, 16384), MESH) == P("fsdp", "tensor")
    assert spec("decoder_block_0/ffw_linear/kernel", (16384, 2048), MESH) == P("tensor", "fsdp")
    assert spec("token_embedding/embeddings", (256000, 2048), MESH) == P("tensor", "fsdp")
    assert spec("decoder_block_0/pre_attention_norm/scale", (2048,), MESH) == P()
    # a dimension that does not divide is replicated on that axis only; size-1 axes are dropped
    assert spec("token_embedding/embeddings", (314, 30), {"fsdp": 4, "tensor": 2}) == P("tensor")
    assert spec("decoder_block_0/attention/query/kernel", (8, 2048, 256), {"data": 8}) == P()


def _family_backbones():
    # Mistral's variables are Llama's; Gemma 1/2 are the built-in tiny models
    common = dict(vocabulary_size=64, num_layers=1, num_query_heads=4, num_key_value_heads=2,
                  hidden_dim=32, intermediate_dim=48)
    return {
        "llama3": keras_hub.models.Llama3Backbone(**common),
        "qwen2": keras_hub.models.QwenBackbone(**common),
        "qwen3": keras_hub.models.Qwen3Backbone(head_dim=8, **common),
        "gemma3": keras_hub.models.Gemma3Backbone(image_size=None, head_dim=8, **common),
    }


def test_every_family_gets_sensible_specs():
    for family, backbone in _family_backbones().items():
        specs = {path: (shape, spec) for path, (shape, spec) in (
            (v.path, (tuple(v.value.shape), sharding.spec_for(v.path, tuple(v.value.shape), MESH)))
            for _, v in nnx_flat(backbone))}
        for path, (shape, spec) in specs.items():
            for dim, axis in zip(shape, spec):  # every sharded dimension divides
                assert axis is None or dim % MESH[axis] == 0, (family, path, shape, spec)
            if path.endswith("/bias"):  # Qwen 2 q/k/v biases [heads, head_dim]: by head
                assert spec == P("tensor"), (family, path, spec)
            elif len(shape) == 1:  # norms
                assert spec == P(), (family, path, spec)
            else:  # every matrix is split over fsdp (ZeRO-3)
                assert "fsdp" in spec, (family, path, spec)
        heads_first = family.startswith("gemma")
        q_shape, q_spec = next(v for p, v in specs.items() if p.endswith("query/kernel"))
        head_dim = 0 if heads_first else 1
        assert q_shape[head_dim] == 4 and q_spec[head_dim] == "tensor", (family, q_shape, q_spec)
        up = next(v for p, v in specs.items() if p.endswith(("ffw_gating/kernel", "feedforward_gate_dense/kernel")))
        assert up[1] == P("fsdp", "tensor"), (family, up)


def nnx_flat(module):
    from flax import nnx

    return nnx.to_flat_state(nnx.state(module))


def test_lora_factors_follow_their_kernel_and_heads_are_sharded_sensibly():
    # paths and shapes as KerasHub names them on gemma_micro with --lora.targets all-linear
    mesh = {"fsdp": 2, "tensor": 2}
    spec = sharding.spec_for
    assert spec("decoder_block_0/attention/query/lora_kernel_a", (2, 32, 2), mesh) == P("tensor", "fsdp")
    assert spec("decoder_block_0/attention/query/lora_kernel_b", (2, 16), mesh) == P()
    assert spec("decoder_block_0/attention/attention_output/lora_kernel_a", (2, 16, 2), mesh) == P("tensor")
    assert spec("decoder_block_0/attention/attention_output/lora_kernel_b", (2, 32), mesh) == P(None, "fsdp")
    assert spec("decoder_block_0/ffw_gating/lora_kernel_b", (2, 32), mesh) == P(None, "tensor")
    assert spec("decoder_block_0/ffw_linear/lora_kernel_a", (32, 2), mesh) == P("tensor")
    assert spec("transformer_layer_0/self_attention/key/lora_kernel_a", (32, 2, 2), mesh) == P("fsdp", "tensor")
    assert spec("reward_head/kernel", (32, 1), mesh) == P("fsdp")
    assert spec("value_head/bias", (1,), mesh) == P()
    assert spec("some/unknown/matrix", (7, 32), mesh) == P()  # first dim over fsdp: 7 does not divide
    assert spec("some/unknown/matrix", (8, 32), {"fsdp": 4}) == P("fsdp")


def test_optimizer_state_mirrors_the_parameters_and_scalars_are_replicated(micro):
    _, params, _ = model.split(micro.module)
    tx, _ = train.optimizer(config.OptimConfig(warmup_ratio=0.0), 10)
    state = train.init_state(params, tx, 0)
    specs = sharding.tree_specs(state, MESH)
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    keys = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    flat = dict(zip(keys, jax.tree.leaves(specs, is_leaf=is_spec)))
    params_specs = [s for k, s in flat.items() if k.startswith("['params']")]
    mu = [s for k, s in flat.items() if ".mu" in k]
    nu = [s for k, s in flat.items() if ".nu" in k]
    assert mu == params_specs == nu and any(s != P() for s in mu)
    assert flat["['step']"] == P() and flat["['rng']"] == P()
    full = sharding.per_device_bytes(state, {"fsdp": 1})
    assert sharding.per_device_bytes(state, {"fsdp": 4}) < full / 3


def test_mesh_sizes_and_their_validation():
    mc = config.MeshConfig
    assert train.mesh_shape(mc(), 8) == {"data": 8, "fsdp": 1, "tensor": 1}
    assert train.mesh_shape(mc(data=1, fsdp=-1, tensor=2), 8) == {"data": 1, "fsdp": 4, "tensor": 2}
    assert train.mesh_shape(mc(data=-1, fsdp=2, tensor=2), 8)["data"] == 2
    with pytest.raises(errors.ConfigError, match="product must equal the device count"):
        train.mesh_shape(mc(data=2, fsdp=2, tensor=1), 8)
    with pytest.raises(errors.ConfigError, match="do not divide"):
        train.mesh_shape(mc(data=-1, fsdp=3), 8)
    default = config.Config()
    with pytest.raises(errors.ConfigError, match="at most one of --mesh.data"):
        parse(default, args=["--mesh.fsdp", "-1"])
    with pytest.raises(errors.ConfigError, match="--mesh.tensor must be a positive"):
        parse(default, args=["--mesh.tensor", "0"])
    with pytest.raises(errors.ConfigError, match="--mesh.process-id must be in"):
        parse(default, args=["--mesh.num-processes", "2", "--mesh.process-id", "2"])
    cfg = parse(default, args=["--mesh.fsdp", "4", "--mesh.tensor", "2", "--remat", "blocks"])
    assert (cfg.mesh.fsdp, cfg.mesh.tensor, cfg.remat) == (4, 2, "blocks")


# ----------------------------------------------------------------------------- precision, remat


def _loss(lm, remat=False, grads=True):
    model.set_remat(lm.module, remat)
    graphdef, params, frozen = model.split(lm.module)
    model.set_remat(lm.module, False)
    algo = SFT(SFT.Config(), logprob_chunk=8)
    batch = {k: jnp.asarray(v) for k, v in _batch(np.random.default_rng(0), 4, 16,
                                                   lm.tokenizer.vocab_size).items()}

    def loss(params):
        total, weight, _ = algo.loss(train.merge(graphdef, params, {"model": frozen})[0], batch)
        return total / weight

    if not grads:
        return jax.jit(loss)(params), params, loss
    value, g = jax.jit(jax.value_and_grad(loss))(params)
    return value, g, params, loss


@pytest.fixture(scope="module")
def float32_loss(micro):
    return _loss(micro)


@pytest.mark.slow
def test_bfloat16_compute_keeps_float32_weights_and_loss_close_to_float32(float32_loss):
    f32 = float(float32_loss[0])
    bf16, params, _ = _loss(model.load("gemma_micro", dtype="bfloat16", seed=0), grads=False)
    assert bf16.dtype == jnp.float32  # float32 loss reductions
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("float32")}  # master weights
    print(f"loss float32 {f32:.6f} bfloat16 {float(bf16):.6f} difference {float(bf16) - f32:.2e}")
    assert float(bf16) == pytest.approx(f32, rel=1e-2)
    assert float(bf16) != f32  # bfloat16 compute really happened


def test_remat_gives_the_same_loss_and_gradients(micro, float32_loss):
    plain, plain_grads, _, _ = float32_loss
    remat, remat_grads, params, loss = _loss(micro, remat=True)
    assert "remat" in str(jax.make_jaxpr(loss)(params))  # the blocks are checkpointed
    assert float(remat) == pytest.approx(float(plain), rel=1e-6)
    for a, b in zip(jax.tree.leaves(remat_grads), jax.tree.leaves(plain_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- 8 CPU devices

SCRIPT = r'''
import json, sys, time
T0 = time.time()
import nnx_posttrain
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
sys.path.insert(0, "tests")
from test_sharding import _batch
from nnx_posttrain import config, model, sharding, tasks, train
from nnx_posttrain.algorithms import SFT

assert jax.device_count() == 8, jax.devices()
tasks.register()  # the built-in models
lm = model.load("gemma_micro", seed=0)
graphdef, params0, frozen0 = model.split(lm.module)
tx, lr = train.optimizer(config.OptimConfig(learning_rate=1e-3, schedule="constant", warmup_ratio=0.0), 10)
algo = SFT(SFT.Config(), logprob_chunk=8)
rng = np.random.default_rng(0)
batches = [_batch(rng, 8, 16, lm.tokenizer.vocab_size) for _ in range(3)]
out = {"losses": {}, "param_bytes": {}, "drift": {}, "specs": {}, "seconds": {}}
out["seconds"]["setup"] = round(time.time() - T0, 1)
trained = ("1", "data=8", "fsdp=4,tensor=2", "data=2,fsdp=2,tensor=2")
for name, (d, f, t) in {"1": (1, 1, 1), "data=8": (8, 1, 1), "fsdp=8": (1, 8, 1),
                        "fsdp=4,tensor=2": (1, 4, 2), "data=2,fsdp=2,tensor=2": (2, 2, 2),
                        "data=4,fsdp=2": (4, 2, 1), "data=2,fsdp=4": (2, 4, 1)}.items():
    if d * f * t == 8:
        mesh = train.make_mesh(config.MeshConfig(data=d, fsdp=f, tensor=t))
    else:
        mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), sharding.AXES)
    params = jax.tree.map(jnp.copy, params0)
    state = sharding.put(train.init_state(params, tx, 0), sharding.tree_shardings(train.init_state(params, tx, 0), mesh))
    frozen = {"model": frozen0, "reference": None}
    shardings = sharding.tree_shardings(state, mesh)
    step = jax.jit(train.make_train_step(graphdef, algo.loss, tx, lr), donate_argnums=(0,),
                   out_shardings=(shardings, NamedSharding(mesh, P())))
    before = [x.sharding for x in jax.tree.leaves(state)]
    per_device = sharding.device_bytes(state["params"])
    out["param_bytes"][name] = max(per_device.values())
    if name not in trained:
        continue
    losses, t0 = [], time.time()
    for batch in batches:
        state, metrics = step(state, frozen, train.shard_batch(batch, mesh, 1))
        losses.append(float(metrics["loss"]))
    after = [x.sharding for x in jax.tree.leaves(state)]
    out["drift"][name] = sum(a != b for a, b in zip(before, after))
    out["losses"][name] = losses
    out["seconds"][name] = round(time.time() - t0, 1)
    out["specs"][name] = sorted({str(x.sharding.spec) for x in jax.tree.leaves(state["params"])})
    assert step._cache_size() == 1
print("RESULT " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def eight_devices():
    return support.on_cpu_devices(SCRIPT, 8)  # every mesh compared within that one process


@pytest.mark.slow
def test_same_loss_whatever_the_mesh(eight_devices):
    losses = eight_devices["losses"]
    print(json.dumps(losses, indent=1))
    reference = losses["1"]
    for name, values in losses.items():
        np.testing.assert_allclose(values, reference, rtol=2e-5, err_msg=name)
    assert "P('tensor', 'fsdp')" in eight_devices["specs"]["fsdp=4,tensor=2"]


@pytest.mark.slow
def test_shardings_unchanged_after_a_step(eight_devices):
    assert all(n == 0 for n in eight_devices["drift"].values()), eight_devices["drift"]


@pytest.mark.slow
def test_per_device_parameter_bytes_shrink_as_fsdp_grows(eight_devices):
    b = eight_devices["param_bytes"]
    print(json.dumps(b, indent=1))
    assert b["data=8"] == b["1"]  # replicated
    assert b["1"] > b["data=4,fsdp=2"] > b["data=2,fsdp=4"] > b["fsdp=8"]
    assert b["fsdp=8"] < b["1"] / 6  # norms and the odd dimension stay replicated


# ----------------------------------------------------------------------------- --mesh.cpu-devices


# three steps of the micro model; the evaluations at the start and the end read one batch and
# answer no prompt (the recipe's 500 greedy answers, twice, are asserted nowhere here)
CPU_RUN = ["--model", "gemma_micro", "--steps", "3", "--log-every", "1", "--eval.every", "0",
           "--eval.batches", "1", "--eval.exact-match", "0", "--checkpoint.every", "0"]


def _sft_command(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return support.sft_command(run_dir, *CPU_RUN, *extra)


def _train_losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["split"] == "train"]


@pytest.mark.slow
def test_cpu_devices_auto_splits_each_batch_over_the_cores_with_the_same_losses(tmp_path):
    """``--mesh.cpu-devices auto`` takes one device per core (that divides the micro-batch) for
    a built-in model, and the split run's losses are the one-device run's."""
    cores = len(os.sched_getaffinity(0))
    n = max(k for k in range(1, cores + 1) if 32 % k == 0)  # gemma_micro's micro-batch: 32
    said = []  # the one-device run: in this process (one CPU device)
    support.train_run("sft", *CPU_RUN, "--run-dir", tmp_path / "one", echo=said.append)
    auto = _sft_command(tmp_path / "auto", "--mesh.cpu-devices", "auto")
    assert auto.returncode == 0, auto.stderr[-3000:]
    assert not any("mesh:" in line for line in said), said
    plural = "s" * (n != 1)
    assert f"mesh: {n} cpu device{plural} (auto: {cores} core{'s' * (cores != 1)}, micro-batch 32)" \
        in auto.stdout, auto.stdout
    if n > 1:
        assert f"mesh: data {n} x fsdp 1 x tensor 1 ({n} cpu devices)" in auto.stdout, auto.stdout
    losses = _train_losses(tmp_path / "auto")
    assert len(losses) == 3
    np.testing.assert_allclose(losses, _train_losses(tmp_path / "one"), rtol=2e-5)


def test_cpu_devices_auto_rule():
    from nnx_posttrain.train.mesh import cpu_devices_for

    def count(cores, model="gemma_micro", batch=32, accum=1, **mesh):
        cfg = config.Config(model=model, mesh=config.MeshConfig(cpu_devices="auto", **mesh),
                            batching=config.BatchingConfig(batch_size=batch, grad_accum=accum))
        return cpu_devices_for(cfg, cores)

    assert count(2) == (2, "2 cpu devices (auto: 2 cores, micro-batch 32)")
    assert count(3)[0] == 2 and count(4)[0] == 4  # the most that divides the micro-batch
    assert count(4, batch=12, accum=2) == (3, "3 cpu devices (auto: 4 cores, micro-batch 6)")
    assert count(1) == (1, "1 cpu device (auto: 1 core, micro-batch 32)")
    # other models (no gain measured at the medium size, a replica of the state per device)
    assert count(2, model="gemma_2b") == (1, "1 cpu device (auto: gemma_2b is not a built-in tiny model)")
    # a mesh shaped by hand, or several processes: the devices are the user's to count
    for mesh in ({"fsdp": 2}, {"data": 2}, {"tensor": 2}, {"num_processes": 2}):
        assert count(2, **mesh)[0] == 1, mesh
    explicit = config.Config(mesh=config.MeshConfig(cpu_devices=3))
    assert cpu_devices_for(explicit) == (3, None)


@pytest.mark.slow
def test_cpu_devices_that_do_not_divide_the_micro_batch_are_refused(tmp_path):
    proc = _sft_command(tmp_path / "three", "--mesh.cpu-devices", "3")
    assert proc.returncode != 0
    assert ("error: micro-batch 32 (--batching.batch-size 32 / --batching.grad-accum 1) does not "
            "divide over the 3 batch shards (--mesh.cpu-devices 3)") in proc.stderr, proc.stderr[-3000:]


def test_cpu_devices_once_jax_has_started_name_the_option_and_the_fix():
    from nnx_posttrain.train.mesh import split_host_cpu

    have = len(jax.devices("cpu"))  # JAX's backends are up in this process
    assert split_host_cpu(have, have) == have  # what it has: fine
    assert split_host_cpu(have + 1, "auto") == have  # auto takes what it has
    with pytest.raises(errors.ConfigError) as err:
        split_host_cpu(have + 1, have + 1)
    message = str(err.value)
    assert f"--mesh.cpu-devices {have + 1}: this process already started JAX with {have} CPU" in message
    assert f"jax.config.update('jax_num_cpu_devices', {have + 1})" in message
    assert config.MeshConfig(cpu_devices=0).problems() == [
        "--mesh.cpu-devices must be a count >= 1 or 'auto', got 0"]
    assert config.MeshConfig(cpu_devices="auto").problems() == []
