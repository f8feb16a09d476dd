"""`hfjax serve` of a vision-language model: chat messages with OpenAI `image_url` parts, through the
official openai client, against `Model.generate` and transformers' generate in PyTorch; an image
request beside text requests; and each bad image part an OpenAI-shaped 400 naming its field.

One server: a tiny LLaVA (a fixed image size: its image prefill programs are compiled before
/health), local files allowed under one directory, one image per prompt. A tiny Gemma 3 runs on an
engine in this process (its bidirectional image block in the engine's own prefill chunk)."""

from __future__ import annotations

import base64
import concurrent.futures
import functools
import http.server
import io
import json
import pathlib
import threading

import numpy as np
import PIL.Image
import pytest
import torch
import transformers

import background
import hfjax
from hfjax import serving, testing
from hfjax.generation import chat_with_images

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'hfjax[serve]'")
openai = pytest.importorskip("openai", reason="the openai client is a test dependency: pip install openai")
httpx = pytest.importorskip("httpx", reason="httpx is a test dependency: pip install httpx")
prometheus_parser = pytest.importorskip(
    "prometheus_client.parser", reason="the serve extra is not installed: pip install 'hfjax[serve]'"
)

NAME, LENGTH, NEW_TOKENS = "tiny-llava", 256, 8
QUESTION = "Describe this"
SERVERS = background.Servers("hfjax-serve-vision-test-")
README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _image() -> PIL.Image.Image:
    return PIL.Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 48, 3), dtype=np.uint8))


def start_in_background() -> None:
    """Writes the checkpoint and the image, and starts the server (once); queues the README's example."""
    background.start(
        "vision-readme", background.python(background.README_SERVE_JOB), seconds=60,
        env={"HFJAX_README": str(README), "HFJAX_README_BLOCK": "serve-llava"},
    )  # fmt: skip
    if SERVERS.started:
        return
    llava = testing.save_tiny_checkpoint("llava", SERVERS.directory / "llava", task="image-text-to-text")
    media = SERVERS.directory / "media"
    media.mkdir()
    _image().save(media / "picture.png")
    flags = ("--served-model-name", NAME, "--max-model-len", str(LENGTH), "--max-num-seqs", "4")
    limits = ("--allowed-local-media-path", str(media), "--limit-mm-per-prompt", '{"image": 1}')
    SERVERS.launch("main", llava, *flags, *limits)


@pytest.fixture(scope="module")
def url():
    start_in_background()
    yield SERVERS.wait()["main"]
    SERVERS.stop()


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _png_bytes() -> bytes:
    png = io.BytesIO()
    _image().save(png, "PNG")
    return png.getvalue()


def _data_url(data: bytes = b"") -> str:
    return "data:image/png;base64," + base64.b64encode(data or _png_bytes()).decode()


def _messages(*urls: str, question: str = QUESTION) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


def _chat(client, messages) -> str:
    answer = client.chat.completions.create(model=NAME, messages=messages, max_tokens=NEW_TOKENS, temperature=0)
    return answer.choices[0].message.content


def _compilations(url: str) -> float:
    families = prometheus_parser.text_string_to_metric_families(httpx.get(url + "/metrics").text)
    return next(s.value for f in families for s in f.samples if s.name == "hfjax_compilations_total")


def _transformers_reply(path) -> str:
    processor = transformers.AutoProcessor.from_pretrained(path)
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[[_image()]], return_tensors="pt")
    model = transformers.AutoModelForImageTextToText.from_pretrained(path).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.fixture(scope="module")
def expected(url) -> str:
    """Model.generate's greedy reply (through chat_with_images), checked to be transformers'."""
    path = SERVERS["main"]["checkpoint"]
    conversation = [
        {"role": "user", "content": [{"type": "image", "image": _image()}, {"type": "text", "text": QUESTION}]}
    ]
    reply = chat_with_images(hfjax.load(path), conversation, max_new_tokens=NEW_TOKENS)
    assert reply.strip() and reply == _transformers_reply(path)
    return reply


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # (no line per request on the test's output)
        pass


def test_an_image_chat_equals_generate_and_transformers_by_data_file_and_http_urls(client, url, expected):
    directory = SERVERS.directory / "media"
    handler = functools.partial(_Quiet, directory=str(directory))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as web:
        threading.Thread(target=web.serve_forever, daemon=True).start()
        before = _compilations(url)
        for image in (
            _data_url(),
            f"file://{directory}/picture.png",
            f"http://127.0.0.1:{web.server_port}/picture.png",
        ):
            assert _chat(client, _messages(image)) == expected, image
        web.shutdown()
    assert _compilations(url) == before  # the image prefill's programs were compiled before /health
    assert json.loads(httpx.get(url + "/").text.split("TAKES_IMAGES = ", 1)[1].split(";", 1)[0]) is True


def test_image_requests_beside_text_requests_get_their_answers_alone(client, expected):
    # Image prompts waiting together are prefilled in one turn of the engine, a call each.
    texts = [_messages(question=f"Tell me about the river {i}") for i in range(3)]
    texts = [[{"role": "user", "content": m[0]["content"][-1]["text"]}] for m in texts]
    alone = [_chat(client, m) for m in texts]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        images = [pool.submit(_chat, client, _messages(_data_url())) for _ in range(3)]
        together = list(pool.map(lambda m: _chat(client, m), texts))
    assert [image.result() for image in images] == [expected] * 3
    assert together == alone


@pytest.mark.parametrize(
    "urls, param, words",
    [
        ((_data_url(b"not an image"),), "messages[0].content[0].image_url.url", "not an image"),
        (("file:///etc/hostname",), "messages[0].content[0].image_url.url", "--allowed-local-media-path"),
        (("/etc/hostname",), "messages[0].content[0].image_url.url", "--allowed-local-media-path"),
        (("ftp://example.com/picture.png",), "messages[0].content[0].image_url.url", "scheme 'ftp'"),
        ((_data_url(), _data_url()), "messages", "--limit-mm-per-prompt"),
    ],
)
def test_bad_image_parts_are_a_400_naming_the_field(url, urls, param, words):
    body = {"model": NAME, "messages": _messages(*urls), "max_tokens": NEW_TOKENS}
    message = background.openai_400(httpx.post(url + "/v1/chat/completions", json=body), param)
    assert words in message


def test_an_image_sent_to_a_text_only_model_is_a_400_naming_the_field(tmp_path):
    from fastapi.testclient import TestClient

    llama = hfjax.load(testing.save_tiny_checkpoint("llama", tmp_path / "llama"))
    engine = serving.Engine(llama, max_model_len=128, max_num_seqs=1)  # (not started: no request reaches it)
    app = TestClient(serving.build_app(llama, served_model_name="tiny-llama", engine=engine))
    body = {"model": "tiny-llama", "messages": _messages(_data_url()), "max_tokens": NEW_TOKENS}
    param = "messages[0].content[0].image_url"
    assert "reads no images" in background.openai_400(app.post("/v1/chat/completions", json=body), param)
    assert "TAKES_IMAGES = false" in app.get("/").text


def test_the_readmes_vision_serve_example_runs():
    job = background.finished("vision-readme", start_in_background)
    assert job.returncode == 0, job.output[-3000:]
    ran = [json.loads(line) for line in job.output.splitlines() if line.startswith('{"command"')]
    assert all(step["returncode"] == 0 for step in ran if step["command"] != "server"), ran
    answer = [step["stdout"] for step in ran if step["command"] == "python"][-1]
    assert answer.strip(), ran
    from test_readme import WARNING

    for log in (step["log"] for step in ran if step["command"] == "server"):
        assert not WARNING.search(log), log


def test_gemma3s_image_block_in_the_engines_own_chunk_gives_transformers_tokens(tmp_path):
    # The server reads a prompt with images in a one-row chunk as wide as a window (not Model.generate's
    # prompt bucket): Gemma 3's bidirectional image block must follow its tokens there too.
    from hfjax import generation

    path = testing.save_tiny_checkpoint("gemma3", tmp_path / "gemma3", task="image-text-to-text")
    model = hfjax.load(path)
    engine = serving.Engine(model, max_model_len=128, max_num_seqs=1).start()
    try:
        conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
        text = model.processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        inputs = generation.processed(model.processor, [text], [[_image()]])
        reference = transformers.AutoModelForImageTextToText.from_pretrained(path).eval()
        with torch.no_grad():
            expected = reference.generate(
                **{name: torch.as_tensor(value) for name, value in inputs.items()}, max_new_tokens=NEW_TOKENS,
                do_sample=False,
            ).numpy()  # fmt: skip
        images = {name: value for name, value in inputs.items() if name not in ("input_ids", "attention_mask")}
        ids = inputs["input_ids"][0].tolist()
        params = serving.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        (event,) = engine.generate([ids], params, images=[images])
        compiled = sum(engine.program_counts.values())
        assert event.token_ids == expected[0, len(ids) :].tolist()
        assert compiled == len(engine.compiler)  # the image prefill was among the programs compiled at start
    finally:
        engine.stop()


def test_the_chat_page_sends_an_image_with_a_message_in_headless_chromium(url, expected):
    browser = background.headless_chromium()
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        browser.get(url + "/")
        WebDriverWait(browser, 30).until(lambda b: b.find_element(By.ID, "model").text == NAME)
        assert browser.find_element(By.ID, "image-label").is_displayed()  # the model reads images
        for field, value in (("temperature", "0"), ("max-tokens", str(NEW_TOKENS))):
            browser.find_element(By.ID, field).clear()
            browser.find_element(By.ID, field).send_keys(value)
        browser.find_element(By.ID, "image").send_keys(str(SERVERS.directory / "media" / "picture.png"))
        browser.find_element(By.ID, "input").send_keys(QUESTION)
        browser.find_element(By.ID, "send").click()
        WebDriverWait(browser, 120).until(lambda b: b.find_elements(By.CSS_SELECTOR, "[data-done='true']"))
        answer = browser.find_elements(By.CSS_SELECTOR, "#messages .message[data-done]")[-1]
        text, kind = answer.get_attribute("textContent"), answer.get_attribute("class")
        sent = browser.find_elements(By.CSS_SELECTOR, "#messages .message.user")[-1].text
    finally:
        browser.quit()
    assert "error" not in kind and text == expected, (kind, text)
    assert sent == f"[image] {QUESTION}"
