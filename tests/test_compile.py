"""hfjax.jit: weights as arguments, static flags, compile cache, caches in and out."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torchax
import transformers

import hfjax
from hfjax import testing, tolerances
from hfjax.bridge import _env

ATOL = tolerances.DEFAULT.atol


@pytest.fixture(scope="module")
def llama():
    # Big enough that its embedding (1 MiB+) would show up as a constant if captured.
    config = testing.tiny_config("llama", hidden_size=256, intermediate_size=256, vocab_size=1024)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _largest_constant_bytes(lowered) -> int:
    text = lowered.as_text()
    largest = 0
    for match in re.finditer(r"stablehlo\.constant dense<[^>]*> : tensor<([0-9x]+)x(f32|bf16|f16|i32|i64|i1)>", text):
        dims, dtype = match.groups()
        count = int(np.prod([int(d) for d in dims.split("x")]))
        largest = max(largest, count * {"f32": 4, "i32": 4, "i64": 8, "bf16": 2, "f16": 2, "i1": 1}[dtype])
    return largest


def test_weights_are_arguments_not_constants(llama):
    weight_bytes = sum(p.numel() * 4 for p in llama.parameters())
    assert weight_bytes > 3 * 2**20
    lowered = hfjax.jit(llama).lower("forward", torch.tensor([[1, 2, 3]]), use_cache=False)
    assert _largest_constant_bytes(lowered) < 2**20
    # and the weights are inputs of the program
    assert set(lowered.args_info[0][0]) >= set(llama.state_dict())


def test_static_flags_and_compile_cache(llama):
    fast = hfjax.jit(llama)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        expected = llama(ids, use_cache=False).logits.numpy()
    out = fast(ids, use_cache=False, return_dict=True, output_hidden_states=True)
    np.testing.assert_allclose(np.asarray(out.logits), expected, atol=ATOL)
    assert len(out.hidden_states) == llama.config.num_hidden_layers + 1
    assert fast.compile_count == 1
    fast(ids + 1, use_cache=False, return_dict=True, output_hidden_states=True)
    assert fast.compile_count == 1, "same shapes and flags must reuse the compiled program"
    tuple_out = fast(ids, use_cache=False, return_dict=False)
    assert isinstance(tuple_out, tuple)
    np.testing.assert_allclose(np.asarray(tuple_out[0]), expected, atol=ATOL)
    assert fast.compile_count == 2
    fast(torch.tensor([[1, 2, 3, 4, 5]]), use_cache=False, return_dict=False)
    assert fast.compile_counts() == {"forward": 3}


def test_accepts_jax_arrays_and_returns_jax_arrays(llama):
    fast = hfjax.jit(llama)
    out = fast(jnp.array([[1, 2, 3]]), use_cache=False)
    assert isinstance(out, transformers.modeling_outputs.CausalLMOutputWithPast)
    assert isinstance(out.logits, jax.Array)
    with torch.no_grad():
        expected = llama(torch.tensor([[1, 2, 3]]), use_cache=False).logits.numpy()
    np.testing.assert_allclose(np.asarray(out.logits), expected, atol=ATOL)


def test_drop_in_attributes(llama):
    fast = hfjax.jit(llama)
    assert isinstance(fast, torch.nn.Module)
    assert fast.config is llama.config
    assert fast.model is llama.model


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
def test_decode_step_with_cache_matches_torch(llama, cache_kind):
    def make_cache():
        if cache_kind == "static":
            return transformers.StaticCache(config=llama.config, max_cache_len=16)
        return transformers.DynamicCache(config=llama.config)

    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        ref_cache = make_cache()
        first = llama(prompt, past_key_values=ref_cache)
        token = first.logits[:, -1:].argmax(-1)
        second = llama(token, past_key_values=ref_cache).logits.numpy()
    fast = hfjax.jit(llama)
    cache = make_cache()
    out = fast(prompt, past_key_values=cache)
    assert out.past_key_values is cache, "the cache passed in comes back, updated in place"
    step = fast(torch.from_numpy(np.asarray(out.logits[:, -1:].argmax(-1))), past_key_values=cache)
    np.testing.assert_allclose(np.asarray(step.logits), second, atol=ATOL)
    with _env.env():
        assert cache.get_seq_length() == 6


def test_tied_weights_are_passed_once(checkpoint):
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint("gpt2"))
    fast = hfjax.jit(model)
    assert "lm_head.weight" not in fast.params
    ids = torch.tensor([[4, 5, 6]])
    with torch.no_grad():
        expected = model(ids).logits.numpy()
    np.testing.assert_allclose(np.asarray(fast(ids).logits), expected, atol=ATOL)


class _NeedsGeqrf(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.geqrf(self.proj(x))[0]


def test_unsupported_op_names_op_and_module():
    wrapper = torch.nn.Sequential(_NeedsGeqrf())
    with pytest.raises(hfjax.UnsupportedOpError, match=r"aten::geqrf.*0 \(_NeedsGeqrf\)"):
        hfjax.jit(wrapper)(torch.ones(4, 4))


def test_unhashable_static_argument_is_explained(llama):
    with pytest.raises(TypeError, match=r"neither an array nor hashable"):
        hfjax.jit(llama)(torch.tensor([[1, 2]]), use_cache=False, extra=object.__new__(_Unhashable))


class _Unhashable:
    __hash__ = None


def test_unknown_method_is_explained(llama):
    with pytest.raises(ValueError, match=r"has no method 'decode'"):
        hfjax.jit(llama, methods=("decode",))


def test_transformers_value_checks_do_not_break_jit():
    # prophetnet runs torch_compilable_check on tensor values, which a trace cannot read.
    from hfjax.tasks import _check

    report = _check.check_arch("prophetnet", eager=False, repeats=1)
    assert report.passed, report.table()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.bool])
def test_a_tensor_moved_to_the_cpu_owns_its_memory(dtype):
    # torchax's conversion wraps JAX's read-only buffer: writing into it changed the jax.Array.
    environment = _env.env()
    array = jax.numpy.arange(6).reshape(2, 3).astype(_env.to_jax(torch.zeros((), dtype=dtype)).dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it wraps a read-only numpy array
        with environment:
            host = torchax.tensor.Tensor(array, environment).to("cpu")
    assert host.device.type == "cpu" and host.dtype == dtype
    expected = torch.from_numpy(np.array(array.astype(jax.numpy.float32))).to(dtype)
    assert torch.equal(host, expected)
    host.zero_()
    assert np.array(array.astype(jax.numpy.float32)).tolist() == expected.float().tolist()


# -- forwards that read values of their data (hfjax._specialize) ----------------


class _EosPooler(torch.nn.Module):
    """Pools each row's last EOS after checking every row has as many, as T5 and BART classifiers do."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, ids):
        hidden = self.embed(ids)
        eos = ids.eq(2)
        if len(torch.unique_consecutive(eos.sum(1))) > 1:
            raise ValueError("All examples must have the same number of <eos> tokens.")
        pooled = hidden[eos, :].view(hidden.size(0), -1, hidden.size(-1))[:, -1, :]
        return self.head(pooled)


def test_a_forward_that_reads_its_data_is_compiled_per_value_and_guarded():
    model = _EosPooler().eval()
    fast = hfjax.jit(model)

    def check(ids):
        with torch.no_grad():
            expected = model(torch.tensor(ids)).numpy()
        np.testing.assert_allclose(np.asarray(fast(torch.tensor(ids))), expected, atol=ATOL)

    check([[5, 6, 2, 7], [8, 2, 9, 1]])
    programs = fast.compile_count
    check([[5, 2, 3, 7], [8, 2, 9, 9]])  # the same values read (one EOS a row): the same program
    check([[2, 6, 3, 7], [8, 4, 9, 2]])
    assert fast.compile_count == programs
    check([[2, 6, 2, 7], [2, 2, 9, 1]])  # two a row: another program, found from the guards
    assert fast.compile_count > programs
    with pytest.raises(ValueError, match="same number of <eos>"):  # as in PyTorch
        fast(torch.tensor([[2, 6, 2, 7], [8, 2, 9, 1]]))


class _ExpertLoop(torch.nn.Module):
    """A mixture of experts run expert by expert over the tokens routed to each, as transformers'
    "eager" experts and DBRX do: nonzero and torch.where sizes change with every input."""

    def __init__(self, experts: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.router = torch.nn.Linear(8, experts)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(experts))

    def forward(self, hidden):
        weights, chosen = torch.topk(self.router(hidden).softmax(-1), 2, dim=-1)
        routed = torch.nn.functional.one_hot(chosen, len(self.experts)).permute(2, 1, 0)  # [expert, k, token]
        out = torch.zeros_like(hidden)
        for expert in torch.greater(routed.sum(dim=(-1, -2)), 0).nonzero():
            slot, token = torch.where(routed[expert[0]])
            out.index_add_(0, token, self.experts[expert[0]](hidden[token]) * weights[token, slot, None])
        return out


def test_values_that_change_with_every_input_stay_correct_and_end_op_by_op(monkeypatch):
    from hfjax.bridge import _specialize

    monkeypatch.setattr(_specialize, "MAX_SPECIALIZATIONS", 2)
    model = _ExpertLoop().eval()
    fast = hfjax.jit(model)
    generator = torch.Generator().manual_seed(1)
    with pytest.warns(UserWarning, match="run op by op"):
        for _ in range(4):
            hidden = torch.randn(6, 8, generator=generator)
            with torch.no_grad():
                expected = model(hidden).numpy()
            np.testing.assert_allclose(np.asarray(fast(hidden)), expected, atol=ATOL)
    assert len(next(iter(fast._programs.values())).specialized.built) == 2


def test_a_plain_trace_names_the_line_that_reads_the_data():
    with pytest.raises(hfjax.DataDependentError, match=r"runs in torch.unique_consecutive at test_compile\.py:\d+"):
        hfjax.jit(_EosPooler().eval()).lower("forward", torch.tensor([[5, 6, 2, 7], [8, 2, 9, 1]]))


# A process of its own, with a compilation cache of its own (the suite's is off): a program is
# compiled, then asked for again once the process has forgotten it, then compiled on another thread.
_CACHED = """
import json, sys, threading
import jax, jax.numpy as jnp
import hfjax
from hfjax import bridge

hfjax.set_cache_dir(sys.argv[1])
x = jnp.arange(4.0)
program = bridge.jit_program(lambda v: jnp.sin(v) * 3, stage="test")
with bridge.Compiles() as first:
    program.lower(x).compile()
jax.clear_caches()
with bridge.Compiles() as again:
    program.lower(x).compile()
other = bridge.jit_program(lambda v: jnp.cos(v) + 1, stage="test")
with bridge.Compiles() as elsewhere:
    thread = threading.Thread(target=lambda: other.lower(x).compile())
    thread.start()
    thread.join()
print(json.dumps([[c.requested, c.from_cache, c.compiled] for c in (first, again, elsewhere)]))
"""


def test_compiles_tells_a_compile_from_a_cache_hit_on_its_own_thread(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", _CACHED, str(tmp_path / "xla")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    first, again, elsewhere = json.loads(done.stdout.splitlines()[-1])
    assert first == [1, 0, True]  # XLA compiled it
    assert again == [1, 1, False]  # the cache answered
    assert elsewhere == [0, 0, False]  # another thread's compile is not this one's


def test_hfjax_gives_no_advice_to_install_a_cuda_kernel_for_pytorch():
    # Without mamba_ssm and causal_conv1d, transformers notes (once per process) that Mamba's functions
    # fall back to their reference implementations and advises installing those CUDA packages, which
    # hfjax cannot run: what it compiles is the reference. PyTorch's own run still gets the note.
    module = transformers.AutoModelForCausalLM.from_config(testing.tiny_config("mamba")).eval()
    logger = logging.getLogger("transformers.integrations.hub_kernels")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        logging.Logger.warning_once.cache_clear()  # (transformers' once-per-process notes)
        ids = torch.randint(3, module.config.vocab_size, (1, 4))
        hfjax.jit(module)(ids, use_cache=False)
        assert [r.getMessage() for r in records if "falling back" in r.getMessage()] == []
        with torch.no_grad():
            module(ids, use_cache=False)
        assert any("install `mamba_ssm`" in r.getMessage() for r in records)  # PyTorch's run: the note
    finally:
        logger.removeHandler(handler)
        logging.Logger.warning_once.cache_clear()


@pytest.mark.parametrize("family", ["mamba", "zamba"])
def test_a_selective_scan_written_as_a_python_loop_compiles_to_one_scan(family):
    # transformers' reference selective scan (Mamba 1's mixers, without mamba_ssm) loops over the
    # sequence in Python: unrolled, a prompt's program grows with its length. As one lax.scan it does
    # not, and its logits are PyTorch's.
    torch.manual_seed(0)
    module = transformers.AutoModelForCausalLM.from_config(testing.tiny_config(family)).eval()
    fast = hfjax.jit(module)
    owner = sys.modules[type(module).__module__]
    reference_scan = owner.mamba_selective_scan
    sizes = {}
    for length in (8, 64):
        ids = torch.randint(3, module.config.vocab_size, (2, length))
        sizes[length] = len(fast.lower("forward", ids, use_cache=False).as_text())
    assert sizes[64] < 1.2 * sizes[8], sizes  # unrolled, the 64-token program is several times the 8-token one
    assert owner.mamba_selective_scan is reference_scan  # the module's own, once the trace is done
    with torch.no_grad():
        want = module(ids, use_cache=False).logits.numpy()  # PyTorch's own loop, here in this thread
    got = np.asarray(fast(ids, use_cache=False, return_dict=True).logits)
    np.testing.assert_allclose(got, want, atol=tolerances.for_family(family).atol)
