"""`hfjax generate` and `hfjax chat`, run as a user runs them, against `Model.generate`."""

from __future__ import annotations

import io
import sys

import numpy as np
import pytest
import transformers

import hfjax
from hfjax import cli

PROMPT = "The river ran quietly past"


@pytest.fixture(scope="module")
def llama(checkpoint):
    path = checkpoint("llama")
    return path, hfjax.load(path)


def _new_text(model, prompt_ids, **kwargs) -> str:
    out = np.asarray(model.generate(prompt_ids, **kwargs))  # [1, S + T]
    return model.tokenizer.decode(out[0, prompt_ids.shape[1] :], skip_special_tokens=True)


def _chat_reply(model, messages, max_new_tokens) -> str:
    text = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = model.tokenizer(text, add_special_tokens=False, return_tensors="np")["input_ids"]
    return _new_text(model, ids, max_new_tokens=max_new_tokens, do_sample=False)


def test_generate_streams_the_greedy_text_of_model_generate(llama, capsys, monkeypatch):
    path, model = llama
    ids = model.tokenizer(PROMPT, return_tensors="np")["input_ids"]
    expected = _new_text(model, ids, max_new_tokens=24, do_sample=False)
    assert expected.strip()

    pieces = []
    original = transformers.TextStreamer.on_finalized_text

    def record(self, text, stream_end=False):
        pieces.append(text)
        original(self, text, stream_end)

    monkeypatch.setattr(transformers.TextStreamer, "on_finalized_text", record)
    code = cli.main(
        ["generate", "--model", str(path), PROMPT, "--max-new-tokens", "24", "--temperature", "0", "--stats"]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out == expected + "\n"
    assert sum(bool(piece) for piece in pieces) > 1  # text arrived in pieces, not all at the end
    assert "time to first token" in captured.err and "tokens/s" in captured.err


def test_generate_decodes_a_beam_search_checkpoint_greedily_with_its_other_settings(checkpoint, capsys, tmp_path):
    import json
    import shutil

    path = shutil.copytree(checkpoint("llama"), tmp_path / "llama")
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "num_beams": 4, "no_repeat_ngram_size": 1}))
    model = hfjax.load(path)
    ids = model.tokenizer(PROMPT, return_tensors="np")["input_ids"]
    expected = _new_text(model, ids, max_new_tokens=24, do_sample=False, num_beams=1)
    assert expected != _new_text(model, ids, max_new_tokens=24, do_sample=False, num_beams=1, no_repeat_ngram_size=0)
    code = cli.main(["generate", "--model", str(path), PROMPT, "--max-new-tokens", "24", "--temperature", "0"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out == expected + "\n"


def test_generate_samples_with_the_given_settings_and_seed(llama, capsys):
    path, model = llama
    ids = model.tokenizer(PROMPT, return_tensors="np")["input_ids"]
    settings = dict(max_new_tokens=16, do_sample=True, temperature=0.9, top_k=40, top_p=0.95, seed=7)
    expected = _new_text(model, ids, **settings)
    assert expected != _new_text(model, ids, **{**settings, "seed": 8})  # so the seed has to be passed on
    flags = ["--max-new-tokens", "16", "--temperature", "0.9", "--top-k", "40", "--top-p", "0.95", "--seed", "7"]
    assert cli.main(["generate", "--model", str(path), PROMPT, *flags]) == 0
    assert capsys.readouterr().out == expected + "\n"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--top-p", "1.5"], "top_p=1.5 is outside (0, 1]"),
        (["--temperature", "-1"], "temperature=-1.0 must be strictly positive"),
        (["--top-k", "-3"], "top_k=-3 is not a non-negative integer"),
        (["--max-new-tokens", "0"], "max_new_tokens=0 must be a positive integer"),
        (["--model-parallel", "0"], "--model-parallel=0 must be at least 1"),
    ],
)
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_bad_settings_are_one_line_on_stderr(checkpoint, capsys, command, flags, message):
    argv = [command, "--model", str(checkpoint("llama")), *([PROMPT] if command == "generate" else []), *flags]
    capsys.readouterr()  # writing the checkpoint shows a progress bar
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"hfjax {command}: ") and message in err
    assert len(err.strip().splitlines()) == 1


def test_a_mesh_larger_than_the_devices_is_one_line_on_stderr(checkpoint, capsys):
    path = checkpoint("llama")
    capsys.readouterr()  # writing the checkpoint shows a progress bar
    code = cli.main(["generate", "--model", str(path), PROMPT, "--model-parallel", "3"])
    err = capsys.readouterr().err
    assert code == 1
    assert "model=3" in err and "there are 1" in err and len(err.strip().splitlines()) == 1


def test_generate_with_a_classifier_says_it_cannot_generate(checkpoint, capsys):
    path = checkpoint("qwen3", task="text-classification")
    capsys.readouterr()  # writing the checkpoint shows a progress bar
    code = cli.main(["generate", "--model", str(path), PROMPT])
    err = capsys.readouterr().err
    assert code == 1
    assert "task='text-classification'" in err and len(err.strip().splitlines()) == 1


def test_chat_reset_starts_a_new_conversation(llama, capsys, monkeypatch):
    path, model = llama
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n/reset\nhello\n/exit\nnot read\n"))
    code = cli.main(["chat", "--model", str(path), "--max-new-tokens", "10", "--temperature", "0"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    first = _chat_reply(model, [{"role": "user", "content": "hi"}], 10)
    second = _chat_reply(model, [{"role": "user", "content": "hello"}], 10)
    assert captured.out == f"{first}\n{second}\n"
    assert "[new conversation]" in captured.err


def test_chat_keeps_the_history_and_ends_at_end_of_input(llama, capsys, monkeypatch):
    path, model = llama
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\nhello"))  # no /exit, no final newline
    code = cli.main(
        ["chat", "--model", str(path), "--system", "Be brief.", "--max-new-tokens", "10", "--temperature", "0"]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    first = _chat_reply(model, messages, 10)
    messages += [{"role": "assistant", "content": first.strip()}, {"role": "user", "content": "hello"}]
    second = _chat_reply(model, messages, 10)
    assert captured.out == f"{first}\n{second}\n"


class _InterruptingStdin(io.StringIO):
    def readline(self, *args):
        raise KeyboardInterrupt


def test_chat_ctrl_c_stops_a_reply_then_exits_cleanly(llama, capsys, monkeypatch):
    path, model = llama
    original = hfjax.Model.generate
    calls = []

    def interrupt_first_reply(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(hfjax.Model, "generate", interrupt_first_reply)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\nhello\n"))
    code = cli.main(["chat", "--model", str(path), "--max-new-tokens", "10", "--temperature", "0"])
    captured = capsys.readouterr()
    assert code == 0 and "[reply interrupted]" in captured.err
    # The interrupted turn is dropped from the conversation.
    monkeypatch.setattr(hfjax.Model, "generate", original)
    assert captured.out == _chat_reply(model, [{"role": "user", "content": "hello"}], 10) + "\n"

    monkeypatch.setattr(sys, "stdin", _InterruptingStdin())
    assert cli.main(["chat", "--model", str(path)]) == 0


def test_chat_stops_when_the_conversation_fills_the_context(llama, capsys, monkeypatch):
    path, _ = llama
    long_message = "the river " * 130  # more than the tiny model's 256 positions
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{long_message}\n/exit\n"))
    assert cli.main(["chat", "--model", str(path), "--max-new-tokens", "4"]) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "fills the model's context of 256 tokens; /reset" in captured.err
