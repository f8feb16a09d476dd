"""Sharding over a device mesh: parity with one device, per-device shards, plans, multi-process.

The mesh checks need 8 devices, and the rest of the suite must see one, so they run in a
child process with 8 simulated CPU devices (`python tests/test_sharding.py OUT`), which
writes one JSON record per (family, mesh); the tests here assert on those records.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys
import traceback

import pytest

import background

# (family, overrides): 8 query heads divide every mesh; the key/value head counts cover
# splitting the KV projections (8), replicating them (2 < 8) and both by mesh (gemma2: 4).
CASES = {
    "llama": {"num_attention_heads": 8, "num_key_value_heads": 8},
    "qwen3": {"num_attention_heads": 8, "num_key_value_heads": 2},
    "gemma2": {"num_attention_heads": 8, "num_key_value_heads": 4},
    "gpt2": {"n_head": 8},
    "mixtral": {"num_attention_heads": 8, "num_key_value_heads": 8},
    "gpt_neox": {"num_attention_heads": 8},  # no rules: the structural fallback
}
MESHES = [(1, 8), (2, 4), (8, 1)]
# llama takes every mesh; the others the meshes that show what differs for them: gemma2's 4
# key/value heads replicated (1x8) and split (2x4), the others' rules or fallback over 8 devices.
FAMILY_MESHES = {"llama": MESHES, "gpt2": MESHES[:1], "qwen3": MESHES[1:2], "gemma2": MESHES[:2],
                 "mixtral": MESHES[:1], "gpt_neox": MESHES[:1]}  # fmt: skip
PROMPTS = [[1, 5, 9, 23, 42, 7], [1, 30, 31, 32, 33, 34]]
NEW_TOKENS = 6
LONG_TOKENS = 70  # past the decode loop's first 64-slot cache window


def _cli(argv: list[str]) -> int:
    from hfjax import cli

    return cli.main(argv)


# ---- the child process: 8 simulated devices ---------------------------------------


def _child(out: pathlib.Path) -> None:
    import jax
    import numpy as np

    import hfjax
    from hfjax import parallel, testing

    assert jax.device_count() == 8, jax.devices()
    records, one_device = [], {}  # one_device: each family's tokens on one device
    ids = np.array(PROMPTS, np.int32)
    for family, overrides in CASES.items():
        path = testing.save_tiny_checkpoint(family, out / family, **overrides)
        reference = hfjax.load(path)
        want_logits = np.asarray(reference(ids).logits)
        want_tokens = np.asarray(reference.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)).tolist()
        one_device[family] = want_tokens
        for data, model_size in FAMILY_MESHES[family]:
            record = {"family": family, "mesh": [data, model_size]}
            try:
                mesh = parallel.make_mesh(data=data, model=model_size)
                model = hfjax.load(path, mesh=mesh)
                plan = parallel.plan(model, mesh)
                record["max_diff"] = float(np.abs(np.asarray(model(ids).logits) - want_logits).max())
                with _prefill_state(model) as state:
                    got = np.asarray(model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)).tolist()
                record["tokens"], record["want_tokens"] = got, want_tokens
                record["on_slots"] = model.generation_programs.on_slot_core
                record["split"] = sum("model" in spec for spec in plan.values())
                record["bad_shards"] = _bad_shards(model.params, plan, model_size)
                record["kv_cache"] = _kv_cache_shards(state)
                if family == "llama":
                    # A long answer: the decode loop reads the split cache in windows of 64 and 128 slots.
                    long = dict(max_new_tokens=LONG_TOKENS, min_new_tokens=LONG_TOKENS, do_sample=False)
                    record["long_tokens"] = np.asarray(model.generate(ids, **long)).tolist()
                    record["want_long_tokens"] = np.asarray(reference.generate(ids, **long)).tolist()
                if family == "llama":
                    # hfjax serve's engine on the mesh: its slot state split as generate's.
                    record["served"] = _served(model)
                    record["want_served"] = np.asarray(
                        reference.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
                    )[:, ids.shape[1] :].tolist()
                if family == "llama" and data > 1:
                    # A batch that does not divide over "data" is padded for the mesh, then trimmed.
                    odd = np.array(PROMPTS + PROMPTS[:1], np.int32)
                    record["odd_batch_tokens"] = np.asarray(
                        model.generate(odd, max_new_tokens=NEW_TOKENS, do_sample=False)
                    ).tolist()
                    record["want_odd_batch_tokens"] = np.asarray(
                        reference.generate(odd, max_new_tokens=NEW_TOKENS, do_sample=False)
                    ).tolist()
                    # Beam search: 3 prompts x 2 beams split over "data", the cache reordered across devices.
                    beams = dict(max_new_tokens=NEW_TOKENS, num_beams=2, num_return_sequences=2)
                    record["beam_tokens"] = np.asarray(model.generate(odd, **beams)).tolist()
                    record["want_beam_tokens"] = np.asarray(reference.generate(odd, **beams)).tolist()
                if family == "llama" and data > 1 and model_size > 1:  # both flags at once
                    record["cli"] = _cli_text(path, ["--data-parallel", str(data), "--model-parallel", str(model_size)])
                    record["want_cli"] = _cli_text(path, [])
                config = model.config.get_text_config()
                record["kv_heads"] = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
            except Exception:  # recorded, so one case's failure is reported by its own test
                record["error"] = traceback.format_exc()
            records.append(record)
            (out / "records.json").write_text(json.dumps(records))
    records += _diffusion_records(out)
    (out / "records.json").write_text(json.dumps(records))
    # Two processes of one run (`hfjax launch`) on llama's checkpoint, against its one-device tokens.
    (out / "two_processes.json").write_text(json.dumps(_two_processes(out, out / "llama", one_device["llama"])))


def _served(model) -> list[list[int]]:
    """Greedy answers of PROMPTS from `serving.Engine` (4 slots), NEW_TOKENS each."""
    from hfjax.serving import Engine, SamplingParams

    engine = Engine(model, max_num_seqs=4, max_model_len=64).start()
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        return [event.token_ids for event in engine.generate(PROMPTS, params)]
    finally:
        engine.stop()


def _diffusion_records(out: pathlib.Path) -> list[dict]:
    # A tiny Stable Diffusion pipeline on a (2, 4) mesh, per step and whole loop, against one device.
    import jax
    import numpy as np
    import torch

    import hfjax
    from hfjax import testing

    path = testing.save_tiny_pipeline("stable-diffusion", out / "sd")

    def image(pipe):
        return np.asarray(
            pipe(
                "a red cat",
                num_inference_steps=3,
                height=32,
                width=32,
                output_type="np",
                generator=torch.Generator().manual_seed(0),
            ).images
        )

    want = image(hfjax.load_pipeline(path))
    records = []
    for whole_loop in (False, True):
        record = {"family": "stable-diffusion" + ("-whole-loop" if whole_loop else ""), "mesh": [2, 4]}
        try:
            pipe = hfjax.load_pipeline(path, mesh=hfjax.make_mesh(data=2, model=4), whole_loop=whole_loop)
            calls, program = [], pipe.unet._program

            def spying(*args, **kwargs):
                compiled, dynamic = program(*args, **kwargs)
                calls.extend(
                    str(x.sharding.spec) for x in dynamic if x.ndim == 4 and not isinstance(x, jax.core.Tracer)
                )
                return compiled, dynamic

            object.__setattr__(pipe.unet, "_program", spying)
            record["max_diff"] = float(np.abs(image(pipe) - want).max())
            record["path"], record["latent_specs"] = pipe.hfjax_path, sorted(set(calls))
        except Exception:
            record["error"] = traceback.format_exc()
        records.append(record)
    return records


def _cli_text(path, flags: list[str]) -> str:
    import contextlib
    import io

    from hfjax import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(
            ["generate", "--model", str(path), "Hello there", "--max-new-tokens", "5", "--temperature", "0", *flags]
        )
    return f"exit {code}: {out.getvalue()}"


def _bad_shards(params, plan, model_size: int) -> list[str]:
    # Every shard of a weight split over "model" holds 1/model_size of it; others hold all of it.
    bad = []
    for name, array in params.items():
        expected = array.size // model_size if "model" in plan[name] else array.size
        if array.sharding.spec != plan[name] and not (len(plan[name]) == 0 and array.sharding.is_fully_replicated):
            bad.append(f"{name}: spec {array.sharding.spec}, plan {plan[name]}")
        for shard in array.addressable_shards:
            if shard.data.size != expected:
                bad.append(f"{name}: shard of {shard.data.size} elements, expected {expected} of {array.size}")
    return bad


@contextlib.contextmanager
def _prefill_state(model):
    """Catches what the compiled prefill returns (the decode's state and the first tokens) while the
    block generates, by wrapping the prefill program (the slot core's or `Generator`'s: they share
    the program cache)."""
    from hfjax import generation

    generator = model._generator or generation.Generator(model)
    model._generator = generator
    get, caught = generator.programs.get, []

    def catching(key, *rest, **kwargs):
        program = get(key, *rest, **kwargs)
        if key[0] == "prefill":
            run = program.run
            program.run = lambda *args: caught.append(run(*args)) or caught[-1]
        return program

    generator.programs.get = catching
    try:
        yield caught
    finally:
        del generator.programs.get


def _kv_cache_shards(state) -> list[list[int]]:
    # The shard shapes of the KV cache in the last prefill's output ([B, KV heads, L, D] blocks, then the full shape).
    import jax

    leaves = [leaf for leaf in jax.tree_util.tree_leaves(state[-1]) if leaf.ndim == 4]
    return [list(leaf.sharding.shard_shape(leaf.shape)) + list(leaf.shape) for leaf in leaves]


# ---- the tests ----------------------------------------------------------------------


def start_in_background() -> None:
    """Starts the 8-device child, which ends with the two-process run (conftest.py calls this after collection)."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
    background.start(
        "sharding", [sys.executable, __file__], env={"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}, seconds=145
    )


@pytest.fixture(scope="module")
def records():
    child = background.finished("sharding", start_in_background)
    assert child.returncode == 0, child.output[-4000:]
    return {(r["family"], tuple(r["mesh"])): r for r in json.loads((child.directory / "records.json").read_text())}


def _cases():
    for family in CASES:
        for mesh in FAMILY_MESHES[family]:
            yield pytest.param(family, mesh, id=f"{family}-{mesh[0]}x{mesh[1]}")


@pytest.mark.parametrize("family,mesh", list(_cases()))
def test_sharded_model_matches_one_device(records, family, mesh):
    from hfjax.tolerances import DEFAULT

    record = records[(family, mesh)]
    assert "error" not in record, record.get("error")
    assert record["max_diff"] <= DEFAULT.atol, f"logits differ by {record['max_diff']} (tolerance {DEFAULT.atol})"
    assert record["tokens"] == record["want_tokens"]
    if family == "llama":  # a mesh of one process runs generate on the slot core (hfjax serve's programs)
        assert record["on_slots"]
        assert record["served"] == record["want_served"]
    assert record["bad_shards"] == []
    if mesh[1] > 1:
        assert record["split"] > 0
    if mesh[1] > 1 and record["kv_heads"] >= mesh[1]:
        # The KV cache follows the key/value projections: split over heads.
        assert record["kv_cache"], "the prefill returned no [B, heads, L, D] cache arrays"
        for shard_and_full in record["kv_cache"]:
            block, full = shard_and_full[:4], shard_and_full[4:]
            assert block[1] == full[1] // mesh[1], f"KV cache block {block} of {full}"
    if mesh[0] > 1:
        # The batch is split over "data", and the KV cache with it.
        assert record["kv_cache"], "the prefill returned no [B, heads, L, D] cache arrays"
        for shard_and_full in record["kv_cache"]:
            block, full = shard_and_full[:4], shard_and_full[4:]
            assert block[0] == full[0] // mesh[0], f"KV cache block {block} of {full}"
    if family == "llama":
        assert record["long_tokens"] == record["want_long_tokens"]
    if "want_odd_batch_tokens" in record:
        assert record["odd_batch_tokens"] == record["want_odd_batch_tokens"]
        assert record["beam_tokens"] == record["want_beam_tokens"]
    if family == "llama" and mesh == (2, 4):
        # `hfjax generate --data-parallel D --model-parallel M` prints what one device prints.
        assert record["cli"].startswith("exit 0: ") and record["cli"] == record["want_cli"]


@pytest.mark.parametrize("family", ["stable-diffusion", "stable-diffusion-whole-loop"])
def test_diffusion_pipeline_on_a_mesh_splits_images_over_data(records, family):
    from hfjax.tolerances import DEFAULT

    record = records[(family, (2, 4))]
    assert "error" not in record, record.get("error")
    assert record["max_diff"] <= DEFAULT.atol, f"images differ by {record['max_diff']} (tolerance {DEFAULT.atol})"
    assert record["path"] == ("whole-loop" if family.endswith("whole-loop") else "per-step")
    # The UNet's latents (the image and its guidance copy) arrive split over "data".
    assert record["latent_specs"] == ["P('data',)"]


def test_head_count_error_names_heads_and_mesh():
    import jax

    import hfjax
    from hfjax import parallel, testing

    config = testing.tiny_config("llama", num_attention_heads=8, num_key_value_heads=8)
    with pytest.raises(hfjax.ShardingError, match=r"num_attention_heads=8 .* size 3 \(mesh data=1, model=3\)"):
        parallel.plan(config, jax.sharding.AbstractMesh((1, 3), ("data", "model")))
    config = testing.tiny_config("llama", hidden_size=96, num_attention_heads=12, num_key_value_heads=6, head_dim=8)
    with pytest.raises(hfjax.ShardingError, match=r"num_key_value_heads=6 .* size 4"):
        parallel.plan(config, jax.sharding.AbstractMesh((1, 4), ("data", "model")))


def test_fewer_kv_heads_than_devices_replicates_them():
    import jax
    from jax.sharding import PartitionSpec as P

    from hfjax import parallel, testing

    config = testing.tiny_config("llama", num_attention_heads=8, num_key_value_heads=2)
    plan = parallel.plan(config, jax.sharding.AbstractMesh((1, 8), ("data", "model")))
    assert plan["model.layers.0.self_attn.k_proj.weight"] == P()
    assert plan["model.layers.0.self_attn.q_proj.weight"] == P("model", None)
    assert any("num_key_value_heads=2" in note for note in plan.notes)


def test_gpt2_conv1d_weights_are_split_in_their_layout():
    import jax
    from jax.sharding import PartitionSpec as P

    from hfjax import parallel, testing

    plan = parallel.plan(testing.tiny_config("gpt2", n_head=8), jax.sharding.AbstractMesh((1, 8), ("data", "model")))
    assert plan["transformer.h.0.attn.c_attn.weight"] == P(None, "model")  # [in, out]: split out
    assert plan["transformer.h.0.mlp.c_proj.weight"] == P("model", None)  # [in, out]: split in
    assert plan["transformer.h.0.mlp.c_proj.bias"] == P()


def test_fallback_places_a_family_without_rules():
    import jax
    from jax.sharding import PartitionSpec as P

    from hfjax import parallel, testing

    plan = parallel.plan(
        testing.tiny_config("gpt_neox", num_attention_heads=8), jax.sharding.AbstractMesh((1, 8), ("data", "model"))
    )
    layer = "gpt_neox.layers.0"
    assert plan[f"{layer}.attention.query_key_value.weight"] == P("model", None)
    assert plan[f"{layer}.attention.dense.weight"] == P(None, "model")
    assert plan[f"{layer}.mlp.dense_h_to_4h.weight"] == P("model", None)
    assert plan[f"{layer}.mlp.dense_4h_to_h.weight"] == P(None, "model")
    assert plan["gpt_neox.embed_in.weight"] == P("model", None)
    assert plan["lm_head.weight"] == P("model", None)


def test_shard_plan_cli(checkpoint, capsys):
    path = checkpoint("llama", num_attention_heads=8, num_key_value_heads=8)
    assert _cli(["shard-plan", "--model", str(path), "--model-parallel", "8"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0.self_attn.q_proj.weight" in out and "P('model', None)" in out
    # 512 x 64 float32 embedding over 8 devices: 16,384 bytes each.
    assert "model.embed_tokens.weight" in out and "16,384" in out
    assert "total per device:" in out
    assert _cli(["shard-plan", "--model", str(path), "--model-parallel", "3"]) == 1
    assert "num_attention_heads=8" in capsys.readouterr().err


# Two processes of one jax.distributed run, through `hfjax launch`, against one device; the call
# runs on the slot core (the decode programs of `hfjax serve`), whose arrays span both processes.
_RUN = f"""
import sys, json, numpy as np, jax, hfjax
from hfjax import parallel
from hfjax import generation
hfjax.distributed.initialize()  # hfjax launch has joined the run already: nothing more to do
assert jax.process_count() == 2 and jax.device_count() == 8
decodes = []
decode = generation.SlotPrograms.decode
generation.SlotPrograms.decode = lambda self, *a, **k: decodes.append(1) or decode(self, *a, **k)
model = hfjax.load(sys.argv[1], mesh=parallel.make_mesh(data=2, model=4))
out = model.generate(np.array({PROMPTS}, np.int32), max_new_tokens={NEW_TOKENS}, do_sample=False)
print('TOKENS', json.dumps(np.asarray(out).tolist()))
print('SLOT DECODES', len(decodes))
"""


def _two_processes(out: pathlib.Path, path: pathlib.Path, want: list) -> dict:
    # Run by the 8-device child, which has the checkpoint and its one-device tokens (launch gives
    # each process 4 devices in place of the child's 8).
    import subprocess

    (out / "run.py").write_text(_RUN)
    command = [sys.executable, "-m", "hfjax.cli", "launch", "--nproc", "2", "--devices-per-proc", "4", "--",
               str(out / "run.py"), str(path)]  # fmt: skip
    launched = subprocess.run(command, capture_output=True, text=True, timeout=600)
    lines = launched.stdout.splitlines()
    tokens = [json.loads(line.split("TOKENS", 1)[1]) for line in lines if "TOKENS" in line]
    decodes = [int(line.split("SLOT DECODES", 1)[1]) for line in lines if "SLOT DECODES" in line]
    output = (launched.stdout + launched.stderr)[-4000:]
    return {"code": launched.returncode, "tokens": tokens, "want": want, "decodes": decodes, "output": output}


def test_two_processes_give_one_device_tokens():
    child = background.finished("sharding", start_in_background)
    assert child.returncode == 0, child.output[-4000:]
    result = json.loads((child.directory / "two_processes.json").read_text())
    assert result["code"] == 0, result["output"]
    assert result["tokens"] == [result["want"], result["want"]], result["output"]
    assert len(result["decodes"]) == 2 and min(result["decodes"]) > 0, "the call did not run on the slot core"


if __name__ == "__main__":
    _child(pathlib.Path(sys.argv[1]))
