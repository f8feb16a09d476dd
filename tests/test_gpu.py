"""The GPU's hook (`hfjax.gpu`), on the CPU: what it asks of XLA, and its attention lowering.

The levers only pay on a GPU (benchmarks/decode.py --gpu-levers measures them there); here the
tests check what can be checked without one: that the looping programs get the command-buffer
option (the decode by default, diffusion's whole loop when asked), that XLA takes that option as
hfjax passes it, that cuDNN's custom calls are named for programs kept on disk, that a model under
the hook with both levers on generates transformers' tokens through the fused attention call, and
that the attention lowering equals torch's (with XLA's implementation of
`jax.nn.dot_product_attention`, the call cuDNN runs on a GPU).
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
import torch
import transformers

from hfjax import bridge, gpu, testing
from hfjax.bridge import _ops
from hfjax.gpu import _attention
from op_helpers import ATTENTION_CASES, check_attention, environment, jit_modes


@pytest.fixture(scope="module")
def env():
    return environment(backend="gpu")


def test_the_decode_gets_command_buffers_unless_turned_off_and_the_whole_loop_when_asked(monkeypatch):
    hook = gpu.Gpu()
    monkeypatch.delenv(gpu.COMMAND_BUFFERS, raising=False)
    options = hook.compiler_options("decode")
    assert "WHILE" in options["xla_gpu_enable_command_buffer"].split(",")
    assert hook.compiler_options("whole loop") is None and hook.compiler_options("prefill") is None
    fingerprints = {hook.fingerprint()}
    monkeypatch.setenv(gpu.COMMAND_BUFFERS, "1")
    assert hook.compiler_options("whole loop") == options == hook.compiler_options("decode")
    assert hook.compiler_options("prefill") is None
    fingerprints.add(hook.fingerprint())
    monkeypatch.setenv(gpu.COMMAND_BUFFERS, "0")
    assert all(hook.compiler_options(stage) is None for stage in ("decode", "whole loop", "prefill"))
    fingerprints.add(hook.fingerprint())
    assert len(fingerprints) == 3  # programs kept on disk are kept apart
    monkeypatch.setenv(gpu.COMMAND_BUFFERS, "yes")
    with pytest.raises(ValueError, match="HFJAX_GPU_COMMAND_BUFFERS='yes': pass 1 .* or 0"):
        hook.compiler_options("decode")
    # XLA takes the option as the hook writes it (on the CPU it changes nothing).
    loop = jax.jit(lambda x: jax.lax.fori_loop(0, 3, lambda i, y: y * 2, x), compiler_options=options)
    assert loop(jnp.ones(2)).tolist() == [8.0, 8.0]


def test_cudnn_attention_names_its_custom_calls_for_programs_kept_on_disk(monkeypatch):
    # The first GPU run (2026-12-04) found jax.export refusing `__cudnn$fmhaScaleBiasSoftmax` in a decode
    # program: the hook names the targets only while the switch asks for cuDNN.
    hook = gpu.Gpu()
    monkeypatch.delenv(_attention.ATTENTION, raising=False)
    assert hook.custom_calls() == ()
    monkeypatch.setenv(_attention.ATTENTION, "cudnn")
    assert "__cudnn$fmhaScaleBiasSoftmax" in hook.custom_calls()


@jit_modes
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_fused_attention_matches_torch(env, case, jit, monkeypatch):
    monkeypatch.setenv(_attention.ATTENTION, "cudnn")
    check_attention(env, case, jit)


def test_the_switch_alone_runs_the_fused_call(monkeypatch):
    calls = []
    monkeypatch.setattr(_attention, "fused", lambda *args, **kwargs: calls.append(kwargs["implementation"]) or args[0])
    q, k = jnp.ones((1, 4, 3, 8), jnp.bfloat16), jnp.ones((1, 2, 5, 8), jnp.bfloat16)
    monkeypatch.delenv(_attention.ATTENTION, raising=False)
    _attention._sdpa(q, k, k)
    assert calls == []
    monkeypatch.setenv(_attention.ATTENTION, "cudnn")
    _attention._sdpa(q, k, k)
    _attention._sdpa(q, k, k, attn_mask=jnp.zeros((5,), jnp.float32))  # a float mask: the generic lowering
    assert calls == ["cudnn" if jax.default_backend() == "gpu" else "xla"]
    monkeypatch.setenv(_attention.ATTENTION, "flash")
    with pytest.raises(ValueError, match="HFJAX_GPU_ATTENTION='flash': pass one of generic, cudnn"):
        _attention.choice()


def test_every_gpu_override_has_a_reason_and_a_parity_test():
    registered = {entry.op: entry for entry in _ops.registered() if entry.backend == "gpu"}
    tested = {torch.nn.functional.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention}
    assert set(registered) == tested and all(entry.why.strip() for entry in registered.values())


_UNDER_THE_HOOK = r"""
import sys, jax, numpy as np
cpu = jax.default_backend
jax.default_backend = lambda: "gpu"  # the hook hfjax picks on a GPU ...
from hfjax import _backend, testing
hook = _backend.active()
jax.default_backend = cpu  # ... whose attention switch then runs XLA's implementation of the fused call
assert type(hook).__name__ == "Gpu", hook
import hfjax
from hfjax.gpu import _attention
fused, asked = [], {}
call, options = _attention.fused, hook.compiler_options
_attention.fused = lambda *args, **kwargs: fused.append(kwargs["implementation"]) or call(*args, **kwargs)
hook.compiler_options = lambda stage: asked.setdefault(stage, options(stage))
model = hfjax.load(sys.argv[1])
ids = np.array(eval(sys.argv[2]), np.int32)
out = model.generate(ids, attention_mask=(ids > 0).astype(np.int32), max_new_tokens=8, do_sample=False)
print("TOKENS", np.asarray(out).tolist())
print("OPTIONS", sorted((stage, str(value)) for stage, value in asked.items()))
print("FUSED", sorted(set(fused)))
"""
PROMPTS = [[5, 6, 7, 8, 9, 10], [0, 0, 0, 11, 12, 13]]  # the second left-padded: rows that attend to nothing


def test_generate_under_the_gpu_hook_with_both_levers_gives_transformers_tokens(tmp_path):
    path = testing.save_tiny_checkpoint("llama", tmp_path / "llama")

    def run(**switches) -> dict[str, str]:
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **switches}
        ran = subprocess.run(
            [sys.executable, "-c", _UNDER_THE_HOOK, str(path), repr(PROMPTS)],
            capture_output=True, text=True, timeout=600, env=env,
        )  # fmt: skip
        assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-3000:]
        return dict(line.split(" ", 1) for line in ran.stdout.splitlines() if line.split(" ")[0].isupper())

    ids = torch.tensor(PROMPTS)
    with torch.no_grad():
        want = (
            transformers.AutoModelForCausalLM.from_pretrained(path)
            .eval()
            .generate(ids, attention_mask=(ids > 0).long(), max_new_tokens=8, do_sample=False, pad_token_id=0)
        )
    levers = run(**{_attention.ATTENTION: "cudnn"})  # command buffers are on by default
    assert levers["TOKENS"] == str(want.tolist())
    assert levers["FUSED"] == "['xla']"  # the fused call ran (on a GPU: cuDNN's)
    # generate's decode program was compiled with the command buffers, unless they are turned off
    assert "('decode', \"{'xla_gpu_enable_command_buffer'" in levers["OPTIONS"] and "WHILE" in levers["OPTIONS"]
    off = run(**{gpu.COMMAND_BUFFERS: "0", _attention.ATTENTION: "generic"})
    assert off["FUSED"] == "[]" and "('decode', 'None')" in off["OPTIONS"]
    assert bridge.Backend().compiler_options("decode") is None
