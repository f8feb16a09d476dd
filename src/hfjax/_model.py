"""`hfjax.load`, `Model.from_module` and the `Model` they return; `hfjax.jit`."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence

import jax
import numpy as np
import torch

from . import _backend, _classify, _dtypes, _embed, _tasks, bridge, generation, lora, parallel, quantization
from ._errors import GenerationError, LoadError
from .bridge import JittedModule, module_state


class Model:
    """A Hugging Face model whose weights are jax.Arrays and whose forward runs compiled.

    Attributes:
      module: the transformers module. Loaded from a checkpoint, its parameters live on the meta
        device and the real weights are `params`; from `Model.from_module`, it is the module given.
      params: {parameter or buffer name: jax.Array}.
      aliases: {tied parameter name: the name in `params` it shares}.
      config: the transformers config.
      tokenizer: the checkpoint's tokenizer, or None.
      processor: the checkpoint's processor as transformers' AutoProcessor loads it (a multimodal
        processor with image processor, tokenizer and chat template; an image processor; a feature
        extractor), read when first asked for; else the tokenizer.
      task: the transformers pipeline task the model was loaded for.
      path: the local checkpoint directory, or None for a model built from a module in memory.
      mesh: the device mesh the weights are split over (`mesh=`), or None. `generate` splits the
        batch over its "data" axis.
      matmul_precision: the precision of its float32 products ("highest", "high", "medium"), or
        None: torch's `get_float32_matmul_precision()` when each program is built.
      quantization: what `quantize=` or a quantized checkpoint made quantized
        (`hfjax.quantization.Quantized`: its linear layers and their layouts), or None.
    """

    def __init__(
        self,
        module,
        params,
        aliases,
        *,
        config,
        tokenizer,
        task: str,
        path: pathlib.Path | None,
        mesh=None,
        matmul_precision: bridge.Precision | None = None,
    ):
        self.module = module
        self.mesh = mesh
        self.params = params
        self.config = config
        self.tokenizer = tokenizer
        self.task = task
        self.path = path
        self.aliases = aliases
        self.compiled = JittedModule(
            module, ("forward",), params=params, aliases=aliases, matmul_precision=matmul_precision
        )
        self._generator = None
        self._generation_config = None
        self._processor = None
        self.quantization: quantization.Quantized | None = None
        # The LoRA adapter slots (`reserve_adapters`, `load_adapter`), or None; `_reserved`: by the caller
        # (fixed), else by the first load (grown when an adapter does not fit).
        self.adapter_slots: lora.AdapterSlots | None = None
        self._reserved = False

    @classmethod
    def from_module(
        cls,
        module: torch.nn.Module,
        tokenizer=None,
        *,
        task: str | None = None,
        dtype=None,
        mesh=None,
        processor=None,
        matmul_precision: bridge.Precision | None = None,
        quantize: str | quantization.Quantization | None = None,
        quantize_lm_head: bool = False,
    ) -> Model:
        """A `Model` of a transformers model already in memory: generate, classify and embed it on JAX.

        The module's weights are copied into jax.Arrays (the module itself is not changed, and
        keeps its own copy: call it in eval mode, as `from_pretrained` returns it).

        Args:
          module: a transformers `PreTrainedModel` (e.g. from `AutoModelForCausalLM.from_pretrained`).
          tokenizer: its tokenizer, for `generate_text`, `classify` and `embed`.
          task: as for `hfjax.load`; default: from the module's class.
          dtype: cast floating weights to this dtype ("float32", "bfloat16", "float16", a torch or
            jnp dtype); "auto" or None keeps the module's.
          mesh: as for `hfjax.load`.
          processor: a vision-language model's processor (transformers' AutoProcessor), for
            `hfjax.generation.chat_with_images`; its tokenizer is the default `tokenizer`.
          matmul_precision: as for `hfjax.load`.
          quantize, quantize_lm_head: as for `hfjax.load`: the module's linear layers quantized
            (the module itself is not changed; the Model's `module` is a quantized copy of it).

        Example:
          >>> torch_model = transformers.AutoModelForCausalLM.from_pretrained(path)
          >>> model = hfjax.Model.from_module(torch_model, tokenizer)
          >>> model.generate_text("Hello", max_new_tokens=8)
        """
        if not isinstance(module, torch.nn.Module) or not hasattr(module, "config"):
            raise LoadError(
                f"hfjax.Model.from_module: module is a {type(module).__name__}; pass a transformers model "
                "(a torch.nn.Module with a .config), e.g. AutoModelForCausalLM.from_pretrained(path)"
            )
        task = _tasks.check(task, caller="hfjax.Model.from_module") or _tasks.of_module(module)
        dtype = _dtypes.resolve(dtype, caller="hfjax.Model.from_module")
        parallel.check_mesh(mesh, caller="hfjax.Model.from_module")
        bridge.check_precision(matmul_precision, caller="hfjax.Model.from_module", error=LoadError)
        quantize = quantization.settings(quantize, quantize_lm_head, caller="hfjax.Model.from_module")
        backend = _backend.active()
        backend.prepare()
        params, aliases = module_state(module)
        if dtype is not None:
            target = _dtypes.jax_dtype(dtype)
            params = {
                n: a.astype(target) if jax.numpy.issubdtype(a.dtype, jax.numpy.floating) else a
                for n, a in params.items()
            }
        summary = None
        if quantize is not None:
            module, params, aliases, summary = quantization.quantize_module(module, params, aliases, quantize)
        if mesh is not None:
            shardings = parallel.plan(module, mesh).shardings(mesh)
            replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            params = {n: jax.device_put(a, shardings.get(n, replicated)) for n, a in params.items()}
        backend.prepare_weights(params)
        if tokenizer is None and processor is not None:
            tokenizer = getattr(processor, "tokenizer", None)
        model = cls(
            module, params, aliases, config=module.config, tokenizer=tokenizer, task=task, path=None, mesh=mesh,
            matmul_precision=matmul_precision,
        )  # fmt: skip
        model.processor = processor
        model.quantization = summary
        return model

    def __repr__(self):
        n = sum(int(np.prod(a.shape)) for a in self.params.values())
        dtypes = sorted({str(a.dtype) for a in self.params.values()})
        return f"hfjax.Model({type(self.module).__name__}, task={self.task!r}, params={n:,}, dtype={'/'.join(dtypes)})"

    @property
    def matmul_precision(self) -> str | None:
        """The precision of float32 products in the model's programs (`hfjax.load`'s argument), or
        None: torch's `get_float32_matmul_precision()`, read when each program is built."""
        return self.compiled.matmul_precision

    @property
    def source(self) -> str:
        """Where the model came from, for messages: its checkpoint directory, or the module's class."""
        return f"the checkpoint at {str(self.path)!r}" if self.path else f"the {type(self.module).__name__} given"

    def __call__(self, *args, **kwargs):
        """Runs the compiled forward on the module's own arguments, positional and keyword, as its
        `forward` takes them: one array is its first input (`input_ids` of a text model, `pixel_values`
        of an image classifier, `input_values` of a CTC speech model). Returns the transformers output
        type with jax.Array fields.

        Example:
          >>> out = model(jnp.array([[1, 2, 3]]))
          >>> out.logits.shape  # (1, 3, vocab)
        """
        return self.compiled(*args, **kwargs)

    def eager(self, *args, **kwargs):
        """The same forward, with the same arguments, run op by op through torchax without jit (for debugging)."""
        return self.compiled.eager("forward")(*args, **kwargs)

    @property
    def processor(self):
        """The checkpoint's processor (read on first use; the one given to `from_module`), or, for a
        checkpoint without one (text models), its tokenizer."""
        if self._processor is None:
            self._processor = _processor(self.path)
        return self._processor if self._processor is not None else self.tokenizer

    @processor.setter
    def processor(self, processor):
        self._processor = processor

    @property
    def generation_config(self):
        """The checkpoint's generation_config.json (transformers' GenerationConfig); a module's own
        `generation_config`; else one made from config."""
        if self._generation_config is None:
            from transformers import GenerationConfig

            if self.path is not None and (self.path / "generation_config.json").is_file():
                self._generation_config = GenerationConfig.from_pretrained(self.path)
            elif self.path is None and getattr(self.module, "generation_config", None) is not None:
                self._generation_config = self.module.generation_config
            else:
                self._generation_config = GenerationConfig.from_model_config(self.config)
        return self._generation_config

    def generate(
        self,
        input_ids=None,
        attention_mask=None,
        *,
        max_new_tokens: int | None = None,
        min_new_tokens: int | None = None,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        generation_config=None,
        seed: int = 0,
        streamer=None,
        **settings,
    ):
        """Generates tokens, as transformers' `generate` does, with the whole decode loop compiled.

        Args mirror transformers' `generate`; unset ones come from `generation_config`, then from
        the checkpoint's generation_config.json. Prompts of different lengths are passed
        left-padded with an `attention_mask`; each row gets what that prompt alone would.
        `seed` seeds the in-program sampler: the same seed gives the same tokens.
        `streamer` follows transformers' streamer interface (`put`, `end`), e.g. `TextStreamer`.
        `settings`: other transformers generation settings, of which hfjax carries out
        `max_length`, `min_length`, `no_repeat_ngram_size`, `encoder_no_repeat_ngram_size`,
        `bad_words_ids`, `sequence_bias`, `suppress_tokens`, `begin_suppress_tokens`, `forced_bos_token_id`,
        `forced_eos_token_id`, `decoder_start_token_id`, `decoder_input_ids` (an encoder-decoder's
        first decoder tokens, int [B, D] or [D]), `num_return_sequences` and beam
        search (`num_beams`, `length_penalty`, `early_stopping`), and
        `return_dict_in_generate` with `output_scores` / `output_logits`; array arguments that
        the model's forward takes (a processor's `pixel_values`, `image_grid_thw`,
        `pixel_attention_mask`, `token_type_ids`, `mm_token_type_ids`, ...) go to the prefill
        only, as transformers' generate gives them; one that would change
        the output and that it cannot carry out (beam sampling, `typical_p`,
        `output_attentions`, ...) raises a GenerationError that names it.
        Structured outputs: one of `json_schema` (a JSON schema, dict or text), `regex`, `choice` (a
        list of strings), `grammar` (a Lark grammar) or `response_format` (OpenAI's) makes every
        row's answer follow it (llguidance, in the `serve` extra, masks the tokens it does not allow);
        a row whose grammar is complete may only choose EOS. Decoder-only models, num_beams=1.
        Speculative decoding (decoder-only models, num_beams=1, no constraint): `prompt_lookup_num_tokens=k`
        (with `max_matching_ngram_size`, default 2) drafts k tokens a round from the row's own tokens,
        `assistant_model=` (an hfjax Model or a checkpoint's path, same vocabulary; `num_assistant_tokens`,
        default 5) from a draft model; the target verifies them in one forward, inside the compiled
        loop. The tokens (greedy) and their distribution (sampling) are those without it;
        `last_generation_stats` counts the drafted and accepted tokens and the target's forwards.

        Returns:
          int32 jax.Array [B * num_return_sequences, S + T] (for encoder-decoders
          [.., D + T], starting with the decoder start token or decoder_input_ids): the prompt as given, then the
          new tokens, padded with `pad_token_id` after a row has produced EOS.
          T <= max_new_tokens. A prompt's `num_return_sequences` rows are adjacent (with beam
          search, its best finished beams, best first). With return_dict_in_generate=True,
          transformers' Generate*Output of jax.Arrays: `sequences` as above, and `scores` /
          `logits` as tuples of T [rows, V] arrays where asked for.

        Example:
          >>> batch = model.tokenizer(["Hi", "Hello there"], padding=True, return_tensors="np")
          >>> model.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=16)
          >>> model.generate_text("Pick one:", choice=["yes", "no"], max_new_tokens=4)
        """
        if self.task not in _tasks.GENERATIVE and not self.module.can_generate():  # speech seq2seq can
            raise GenerationError(
                f"Model.generate: this model was loaded for task={self.task!r}; load a causal or sequence-to-sequence "
                "LM (hfjax.load(path, task='text-generation'))"
            )
        if self._generator is None:
            self._generator = generation.Generator(self)
        assistant = settings.get("assistant_model")
        if isinstance(assistant, (str, os.PathLike)):  # a draft model's checkpoint, loaded once
            assistants = self.__dict__.setdefault("_assistants", {})
            if os.fspath(assistant) not in assistants:
                assistants[os.fspath(assistant)] = load(assistant, mesh=self.mesh)
            settings["assistant_model"] = assistants[os.fspath(assistant)]
        return generation.generate(
            self._generator,
            input_ids,
            attention_mask,
            generation_config=generation_config,
            seed=seed,
            streamer=streamer,
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            **settings,
        )

    def generate_text(self, prompts, **kwargs) -> str | list[str]:
        """Text in, text out: tokenizes (left-padded), generates, and decodes the new tokens only.

        `prompts`: a text, a conversation (a list of {"role": ..., "content": ...} messages,
        put through the tokenizer's chat template with the assistant's turn opened, as
        transformers' text-generation pipeline does), or a list of either.
        Keyword arguments are those of `generate`. Returns one text per prompt, or, with
        `num_return_sequences=n`, a list of n texts per prompt, side by side in one list.

        Example:
          >>> model.generate_text("The capital of France is", max_new_tokens=8)
          >>> model.generate_text([{"role": "user", "content": "Hi!"}], max_new_tokens=32)
        """
        if self.tokenizer is None:
            raise LoadError(
                f"Model.generate_text: {self.source} has no tokenizer; use generate(input_ids), or "
                "hfjax.Model.from_module(module, tokenizer)"
            )
        single = isinstance(prompts, str) or _is_conversation(prompts)
        batch = [prompts] if single else list(prompts)
        conversations = [_is_conversation(prompt) for prompt in batch]
        if any(conversations):
            if not all(conversations):
                raise GenerationError(
                    "Model.generate_text: prompts mix texts and conversations; pass a list of texts or a list of "
                    "conversations (each a list of {'role': ..., 'content': ...} messages)"
                )
            if not self.tokenizer.chat_template:
                raise GenerationError(
                    f"Model.generate_text: the tokenizer of {self.source} has no chat template, so a conversation "
                    "cannot be put into text; pass the prompt as text"
                )
            batch = [chat_prompt(self.tokenizer, conversation) for conversation in batch]
        self.tokenizer.padding_side = "left"
        # A chat prompt holds its own BOS.
        encoded = self.tokenizer(batch, padding=True, return_tensors="np", add_special_tokens=not any(conversations))
        out = np.asarray(self.generate(encoded["input_ids"], encoded["attention_mask"], **kwargs))
        start = 1 if getattr(self.config, "is_encoder_decoder", False) else encoded["input_ids"].shape[1]
        texts = self.tokenizer.batch_decode(out[:, start:], skip_special_tokens=True)
        return texts[0] if single and len(texts) == 1 else texts

    def classify(
        self, texts: str | list[str], labels: list[str] | None = None, *, template: str | None = None
    ) -> list[dict[str, float]]:
        """Label probabilities per text: the classification head's softmax, or zero-shot with a causal LM.

        With a causal LM each label is scored as the continuation of `template` (a `{text}`
        field, optionally `{labels}`), and `labels` is required.

        Returns:
          one {label: probability} dict per text, keys in label order.

        Example:
          >>> model.classify(["I loved it", "Terrible."], labels=["positive", "negative"])
        """
        return _classify.classify(self, texts, labels, template=template)

    def embed(self, texts: str | list[str], *, batch_size: int = 32) -> jax.Array:
        """Sentence embeddings, pooled and normalised as the checkpoint's sentence-transformers config says.

        Without such a config: L2-normalised mean pooling over an encoder's tokens, or a decoder-only
        model's last token (as vLLM and sentence-transformers pool decoders). A causal LM, classifier
        or sequence-to-sequence model embeds through its base model (its encoder); a model of another
        task raises `hfjax.LoadError`.

        Returns:
          float32 jax.Array of shape [len(texts), hidden_size].

        Example:
          >>> model = hfjax.load("path/to/encoder", task="feature-extraction")
          >>> model.embed(["a cat", "a dog"]).shape  # (2, hidden)
        """
        return _embed.embed(self, texts, batch_size=batch_size)

    # -- LoRA adapters, served beside the weights ---------------------------------

    def reserve_adapters(self, max_loras: int = 4, max_lora_rank: int = 16, target_modules=None) -> None:
        """Fixes the adapter slots: up to `max_loras` adapters of rank up to `max_lora_rank` on the linear
        layers `target_modules` (names or their tails, as peft takes them, e.g. ["q_proj", "v_proj"];
        None: every linear layer but the LM head). Afterwards, loading and deleting adapters never
        changes a program (a server's set); an adapter that does not fit is an error. Without it, the
        first `load_adapter` reserves slots for what it reads and later loads grow them (recompiling).
        Drops the adapters already loaded.

        Example:
          >>> model.reserve_adapters(max_loras=8, max_lora_rank=32)
        """
        caller = "Model.reserve_adapters"
        if self.adapter_slots is not None:
            self.adapter_slots.drop()
        self.adapter_slots = lora.AdapterSlots(
            self, max_loras=max_loras, max_rank=max_lora_rank, targets=target_modules, caller=caller
        )
        self._reserved = True
        self._generator = None  # its programs were made for the params as they were

    def load_adapter(self, path, adapter_name: str = "default") -> lora.Adapter:
        """Loads a peft LoRA adapter (the directory `PeftModel.save_pretrained` or `hfjax finetune --lora-r`
        writes) beside the weights, unmerged, as `adapter_name`. Many adapters may be held at once;
        `generate(adapter=...)` picks one per call or per prompt, `set_adapter` the default.

        Returns the `hfjax.lora.Adapter` held (its name, rank and slot).

        Example:
          >>> model.load_adapter("out/adapter", adapter_name="support")
          >>> model.generate_text("Hi", adapter="support", max_new_tokens=16)
        """
        caller = "Model.load_adapter"
        adapter = lora.read_adapter(path, caller=caller)
        slots = self.adapter_slots
        if slots is None or (not self._reserved and not slots.fits(adapter)):
            self._grow_adapter_slots(adapter)
        return self.adapter_slots.load(adapter, adapter_name, caller=caller)

    def _grow_adapter_slots(self, adapter) -> None:
        """Slots (not reserved by the caller) that hold the adapters loaded so far and `adapter`."""
        old = self.adapter_slots
        held = {} if old is None else dict(old.read)
        active = None
        if old is not None:
            active = next((n for n, a in old.adapters.items() if a.index == old.active()), None)
            old.drop()
        every = [*held.values(), adapter]
        rank = max(a.rank for a in every)
        self.adapter_slots = lora.AdapterSlots(
            self,
            max_loras=max(4, 1 << (len(every) - 1).bit_length()),
            max_rank=max(8, 1 << (rank - 1).bit_length()),
            targets=sorted({layer for a in every for layer in a.layers}),
            caller="Model.load_adapter",
        )
        for name, read in held.items():
            self.adapter_slots.load(read, name, caller="Model.load_adapter")
        if active is not None:
            self.adapter_slots.set_active(active, caller="Model.load_adapter")
        self._generator = None  # its programs were made for the params as they were

    def delete_adapter(self, adapter_name: str) -> None:
        """Drops a loaded adapter; its slot is free for the next `load_adapter`."""
        self._adapter_slots("Model.delete_adapter").delete(adapter_name, caller="Model.delete_adapter")

    def set_adapter(self, adapter_name: str | None) -> None:
        """The adapter that calls without `adapter=` use (the forward, `generate`, pipelines); None: the base."""
        if adapter_name is None and self.adapter_slots is None:
            return
        self._adapter_slots("Model.set_adapter").set_active(adapter_name, caller="Model.set_adapter")

    @property
    def adapters(self) -> dict[str, lora.Adapter]:
        """{name: `hfjax.lora.Adapter`} of the adapters loaded."""
        return {} if self.adapter_slots is None else dict(self.adapter_slots.adapters)

    def _adapter_slots(self, caller: str) -> lora.AdapterSlots:
        if self.adapter_slots is None:
            raise LoadError(f"{caller}: no adapter is loaded; load one with Model.load_adapter(path, adapter_name=...)")
        return self.adapter_slots

    @property
    def last_generation_stats(self):
        """Timings of the last `generate` call: time_to_first_token, tokens_per_second, ..."""
        return None if self._generator is None else self._generator.last_stats

    @property
    def generation_programs(self) -> generation.GenerationPrograms:
        """Which programs `generate` has prepared (traced or read from disk) and where its calls ran,
        read-only (`hfjax.generation.GenerationPrograms`): the face tests use to see inside the engine."""
        return generation.GenerationPrograms(lambda: self._generator)


def load(
    path_or_hub_id: str | os.PathLike | torch.nn.Module,
    *,
    task: str | None = None,
    dtype=None,
    mesh: jax.sharding.Mesh | None = None,
    progress: bool | None = None,
    matmul_precision: bridge.Precision | None = None,
    quantize: str | quantization.Quantization | None = None,
    quantize_lm_head: bool = False,
    revision: str | None = None,
    token: str | bool | None = None,
) -> Model:
    """Loads a Hugging Face checkpoint onto JAX.

    Args:
      path_or_hub_id: a local checkpoint directory (config.json + *.safetensors), or a Hugging Face
        Hub id such as "Qwen/Qwen3-0.6B", downloaded into huggingface_hub's cache (HF_HUB_CACHE;
        with HF_HUB_OFFLINE=1 read from there only). A transformers model already in memory is
        taken too (`Model.from_module`, which also takes its tokenizer).
      task: a transformers pipeline task: "text-generation", "text2text-generation",
        "text-classification", "zero-shot-classification", "feature-extraction",
        "image-classification", "zero-shot-image-classification", "image-feature-extraction",
        "automatic-speech-recognition" or "image-text-to-text" (a vision-language model; its
        processor is `Model.processor`); default: inferred from config.architectures.
      dtype: "float32", "bfloat16" or "float16", or a torch / jnp dtype; "auto" or None: the
        checkpoint's.
      mesh: a `jax.sharding.Mesh` with a "model" axis (see `hfjax.make_mesh`): each weight is
        split over it as `hfjax.parallel.plan` says, read slice by slice into the devices.
      progress: show a progress bar while reading weights (default: for large checkpoints).
      matmul_precision: the precision of float32 products and convolutions in every program the
        model runs, as `torch.set_float32_matmul_precision` names it: "highest" (full float32),
        "high" (TF32 on GPUs, 3 bfloat16 passes on TPUs), "medium" (the backend's fastest: one
        bfloat16 pass on TPUs). None (the default) follows torch's setting, read when each program
        is built: "highest" unless the process changed it, so results match PyTorch's.
      quantize: "int8" (a scale per output channel), "fp8" (e4m3, a scale per output channel) or
        "int4" (groups of 128 inputs, two values per byte), or a `hfjax.quantization.Quantization`
        (fp8 in 128 x 128 blocks, another group size): the linear layers of the model's body are
        quantized one tensor at a time as they are read, and stay quantized on the device; products
        dequantize inside the compiled programs. Embeddings, norms and the LM head keep `dtype`.
        A checkpoint published quantized (transformers' fine-grained fp8, compressed-tensors, GPTQ,
        AWQ) is read as it is, without `quantize`.
      quantize_lm_head: quantize the LM head too.
      revision: for a hub id, the branch, tag or commit hash to load (default: the main branch).
      token: for a hub id, the access token for a gated or private repository (default: the one
        `hf auth login` stored, or HF_TOKEN), as transformers' `from_pretrained` takes it.

    Returns:
      A `Model`: call it for the compiled forward; `generate`, `generate_text`, `classify`,
      `embed`; `.params`, `.module`, `.config`, `.tokenizer`.

    Example:
      >>> model = hfjax.load("./tiny-llama")
      >>> model(jnp.array([[1, 2, 3]])).logits.shape
    """
    if isinstance(path_or_hub_id, torch.nn.Module):
        return Model.from_module(
            path_or_hub_id, task=task, dtype=dtype, mesh=mesh, matmul_precision=matmul_precision, quantize=quantize,
            quantize_lm_head=quantize_lm_head,
        )  # fmt: skip
    dtype = _dtypes.resolve(dtype, caller="hfjax.load")
    quantize = quantization.settings(quantize, quantize_lm_head, caller="hfjax.load")
    bridge.check_precision(matmul_precision, caller="hfjax.load", error=LoadError)
    task = _tasks.check(task, caller="hfjax.load")
    parallel.check_mesh(mesh, caller="hfjax.load")
    path = bridge.resolve_checkpoint(path_or_hub_id, revision=revision, token=token)
    config = bridge.read_config(path)
    task = task or _tasks.infer(config)
    files = bridge.weight_files(path)
    dtype = dtype or bridge.checkpoint_dtype(files)
    module = bridge.build_skeleton(config, task, dtype)
    quantized = quantization.prepare_load(module, config, files, quantize, dtype)  # swaps the quantized layers
    convert, summary = quantized or (None, None)
    backend = _backend.active()
    backend.prepare()
    shardings = None if mesh is None else parallel.plan(module, mesh).shardings(mesh)
    params, aliases = bridge.load_weights(module, files, dtype, progress=progress, shardings=shardings, convert=convert)
    backend.prepare_weights(params)
    model = Model(
        module, params, aliases, config=config, tokenizer=_tokenizer(path), task=task, path=path, mesh=mesh,
        matmul_precision=matmul_precision,
    )  # fmt: skip
    model.quantization = summary
    return model


def jit(
    module: torch.nn.Module,
    methods: Sequence[str] = ("forward",),
    *,
    matmul_precision: bridge.Precision | None = None,
) -> bridge.JittedModule:
    """Compiles the listed methods of a torch module with XLA, weights passed as arguments.

    Args:
      module: any `torch.nn.Module` (a transformers or diffusers model, typically).
      methods: names of the methods to compile; each runs as one XLA program per
        argument structure, shapes and static values.
      matmul_precision: the precision of float32 products and convolutions, as
        `torch.set_float32_matmul_precision` names it ("highest", "high", "medium"); None follows
        torch's setting ("highest" unless changed: full float32, as PyTorch computes), read when
        each program is built.

    Returns:
      A `JittedModule`: call it like the module. Inputs may be torch tensors or
      jax.Arrays; outputs are the module's usual types holding jax.Arrays (torchax
      tensors when called with torchax tensors).

    Example:
      >>> fast = hfjax.jit(model)
      >>> out = fast(input_ids, use_cache=False)
      >>> out.logits  # jax.Array
    """
    _backend.active()  # the backend's hook first: JittedModule prepares it (the CPU's kernels)
    return bridge.JittedModule(module, methods, matmul_precision=matmul_precision)


def _processor(path: pathlib.Path | None):
    if path is None or not any(
        (path / name).is_file() for name in ("preprocessor_config.json", "processor_config.json")
    ):
        return None
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path)
    except ImportError as error:  # e.g. Qwen2-VL's processor needs torchvision for its video part
        raise LoadError(
            f"hfjax.load: the processor of the checkpoint at {str(path)!r} cannot be built here ({error}); "
            "install what it names (pip install torchvision), or pass the processor's outputs to Model.generate"
        ) from error


def _tokenizer(path: pathlib.Path):
    if not any(
        (path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt")
    ):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def chat_prompt(tokenizer, conversation: list[dict]) -> str:
    """`conversation` (role/content messages) as prompt text: the tokenizer's chat template with
    the assistant's turn opened. Tokenize it without special tokens: the template writes its own BOS."""
    return tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)


def _is_conversation(prompt) -> bool:
    return (
        isinstance(prompt, (list, tuple))
        and len(prompt) > 0
        and all(isinstance(message, dict) and "role" in message for message in prompt)
    )
