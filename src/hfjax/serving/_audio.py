"""OpenAI's `POST /v1/audio/transcriptions` for a speech-to-text checkpoint (Whisper).

    multipart form   file (the audio), model, language, prompt, response_format, temperature, as the
                     official `openai` client sends them (`client.audio.transcriptions.create(...)`)
    the audio        read by soundfile (WAV, FLAC, OGG, MP3), averaged to mono, resampled (soxr) to
                     the feature extractor's rate, turned into log-mel features [mels, frames]
    the request      Whisper's decoder prompt ([<|startofprev|>, the prompt's tokens] where a prompt
                     is given, then <|startoftranscript|>, the language, <|transcribe|>,
                     <|notimestamps|>) and the features as its encoder input, decoded by the engine
                     like any request (`Engine.submit`): the prefill runs the encoder and writes the
                     slot's cross-attention keys and values
    the answer       json {"text"}, text, or verbose_json (the task, language, duration and one
                     segment of the whole audio)

Audio longer than the feature extractor's window (Whisper's 30 s) is a 400 naming the limit: the
server transcribes one window (vLLM cuts longer audio into windows). A request without `language`
is transcribed as English, as vLLM defaults it (no language detection pass).
"""

import asyncio

import numpy as np

from .. import tasks
from .._errors import GenerationError, PipelineError, ServingError
from ._protocol import ApiError, check_model, engine_failed, invalid
from ._requests import Event, QueueFullError, SamplingParams

FORMATS = ("json", "text", "verbose_json")  # the response formats answered (OpenAI's srt and vtt need timestamps)
DEFAULT_LANGUAGE = "en"  # vLLM's, where a request names none
_FIELDS = {"file", "model", "language", "prompt", "response_format", "temperature", "stream"}


def speech_model(model) -> bool:
    """Whether `model` transcribes speech (an encoder-decoder whose encoder reads audio features)."""
    return model.task == "automatic-speech-recognition"


class Transcriber:
    """The transcriptions of one served speech model, through `engine`."""

    def __init__(self, model, engine, names):
        self.model, self.engine, self.names = model, engine, names
        self.extractor = model.processor.feature_extractor if hasattr(model.processor, "feature_extractor") else None
        if self.extractor is None:
            self.extractor = model.processor
        self.rate = int(self.extractor.sampling_rate)
        self.window = float(self.extractor.chunk_length)  # seconds of audio one request may hold

    async def form(self, request) -> dict:
        """The request's multipart form as {field: str, "file": (name, bytes)}; a 400 naming what is wrong."""
        content_type = request.headers.get("content-type", "")
        if not content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
            raise invalid(
                "file",
                f"the request's content-type is {content_type!r}; send multipart/form-data with the audio as 'file'",
            )
        form = await request.form()
        fields = {}
        for name, value in form.multi_items():
            if name not in _FIELDS:
                raise invalid(name, f"{name!r} is not a field of /v1/audio/transcriptions; pass {sorted(_FIELDS)}")
            if name == "file":
                if isinstance(value, str):
                    raise invalid("file", "file is text; send the audio file's bytes as the multipart field 'file'")
                fields[name] = (value.filename or "audio", await value.read())
            else:
                fields[name] = value if isinstance(value, str) else (await value.read()).decode(errors="replace")
        return fields

    async def transcribe(self, request) -> tuple[dict | str, str]:
        """(the answer, its response_format) for one transcription request."""
        fields = await self.form(request)
        check_model(fields, self.names)
        if "file" not in fields:
            raise invalid("file", "the request has no 'file'; send the audio as the multipart field 'file'")
        response_format = fields.get("response_format", "json")
        if response_format not in FORMATS:
            raise invalid("response_format", f"response_format={response_format!r}; pass one of {', '.join(FORMATS)}")
        if fields.get("stream", "false").lower() not in ("false", "0", ""):
            raise invalid("stream", "stream=true: transcriptions are answered whole here; leave stream out")
        temperature = _temperature(fields.get("temperature"))
        language = fields.get("language") or None
        multilingual = getattr(self.model.generation_config, "is_multilingual", True) is not False
        if language is not None and not multilingual:
            raise invalid("language", f"language={language!r}: this checkpoint is English-only; leave language out")
        if language is None and multilingual:
            language = DEFAULT_LANGUAGE
        filename, audio = fields["file"]
        loop = asyncio.get_running_loop()
        features, seconds = await loop.run_in_executor(None, self.features, filename, audio)
        prompt = self.decoder_prompt(features, language, fields.get("prompt") or "")
        positions = min(self.model.config.max_target_positions, self.engine.max_model_len)  # the decoder's
        if len(prompt) >= positions:
            raise invalid(
                "prompt",
                f"the prompt and Whisper's prefix take {len(prompt)} of the decoder's {positions} positions, leaving "
                "none for the transcription; shorten the prompt",
            )
        params = SamplingParams(max_tokens=positions - len(prompt), temperature=temperature)
        events: asyncio.Queue[Event] = asyncio.Queue()
        try:
            submitted = self.engine.submit(
                prompt, params, lambda event: loop.call_soon_threadsafe(events.put_nowait, event),
                inputs={self.model.module.main_input_name: features},
            )  # fmt: skip
        except QueueFullError as error:
            raise ApiError(429, str(error), code="rate_limit_exceeded") from None
        except GenerationError as error:
            raise invalid("file", str(error)) from None
        except ServingError:
            if self.engine.failure is None:
                raise
            raise engine_failed(self.engine.failure) from None
        tokens, usage = [], None
        try:
            while usage is None:
                event = await events.get()
                tokens.extend(event.token_ids)
                if event.finish_reason is not None:
                    usage = event
        finally:
            if not submitted.finished:
                self.engine.cancel(submitted)
        text = self.model.tokenizer.decode(tokens, skip_special_tokens=True)
        if response_format == "text":
            return text, response_format
        if response_format == "json":
            return {"text": text, "usage": {"type": "duration", "seconds": int(np.ceil(seconds))}}, response_format
        return {
            "task": "transcribe",
            "language": _language_name(language),
            "duration": seconds,
            "text": text,
            "segments": [
                {
                    "id": 0, "seek": 0, "start": 0.0, "end": seconds, "text": text, "tokens": tokens,
                    "temperature": temperature,
                }
            ],
        }, response_format  # fmt: skip

    def features(self, filename: str, audio: bytes) -> tuple[np.ndarray, float]:
        """(the audio's log-mel features [mels, frames] float32, its seconds); a 400 naming `file` where
        it cannot be read or is longer than the window."""
        if not audio:
            raise invalid("file", f"file {filename!r} is empty; send an audio file (WAV, FLAC, OGG or MP3)")
        try:
            samples, rate = tasks.read_audio(audio)
        except PipelineError as error:
            raise invalid("file", f"file {filename!r}: {error}".replace("audio file '<bytes>' ", "")) from None
        seconds = len(samples) / rate
        if seconds > self.window:
            raise invalid(
                "file",
                f"file {filename!r} holds {seconds:.1f} s of audio, more than the {self.window:g} s one transcription "
                f"reads here; cut it into pieces of at most {self.window:g} s",
            )
        samples = tasks.resample(samples, rate, self.rate)
        features = self.extractor(samples, sampling_rate=self.rate, return_tensors="np")["input_features"][0]
        return features.astype(np.float32), seconds

    def decoder_prompt(self, features: np.ndarray, language: str | None, prompt: str) -> list[int]:
        """Whisper's decoder prompt for transcribing in `language` (None: an English-only checkpoint's), after `prompt`'s tokens where given
        (transformers' prompt_ids: <|startofprev|> and the text with a space before it)."""
        task = None if language is None else "transcribe"  # (an English-only checkpoint's prompt names neither)
        try:
            start = tasks.whisper_decoder_prompt(self.model, features[None], language=language, task=task)
        except PipelineError as error:
            raise invalid("language", str(error).replace("hfjax.pipeline: ", "")) from None
        before = []
        if prompt:
            tokenizer = self.model.tokenizer
            previous = tokenizer.convert_tokens_to_ids("<|startofprev|>")
            if previous is None or previous == tokenizer.unk_token_id:
                raise invalid("prompt", "this checkpoint's tokenizer has no <|startofprev|> token; leave prompt out")
            before = [previous, *tokenizer(" " + prompt.strip(), add_special_tokens=False)["input_ids"]]
        return [*before, *(int(t) for t in start[0])]


def _language_name(language: str | None) -> str:
    """OpenAI's verbose_json language: its name in English ("english"), from a code or a name."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    if language is None:
        return "english"
    code = language.lower().strip("<|>")
    return LANGUAGES.get(code, code)


def _temperature(value: str | None) -> float:
    if value is None or value == "":
        return 0.0
    try:
        temperature = float(value)
    except ValueError:
        raise invalid("temperature", f"temperature={value!r} is not a number; pass one in [0, 1]") from None
    if not 0 <= temperature <= 1:
        raise invalid("temperature", f"temperature={value!r} is out of range; pass a value in [0, 1]")
    return temperature


def add_route(app, model, engine, names) -> None:
    """Adds POST /v1/audio/transcriptions to `app`: a speech model's transcriptions, else a 400."""
    from fastapi import Request
    from fastapi.responses import PlainTextResponse

    transcriber = Transcriber(model, engine, names) if engine is not None and speech_model(model) else None

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request):
        if transcriber is None:
            raise invalid(
                "model",
                f"{names[0]!r} is a {model.task} model, not a speech-to-text one; send transcriptions to a server "
                "of a speech checkpoint (Whisper)",
            )
        answer, response_format = await transcriber.transcribe(request)
        if response_format == "text":
            return PlainTextResponse(answer)
        return answer
