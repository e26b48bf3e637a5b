"""``mmstore.chat``: chat messages through a family's published chat template and its real
processor to a ``Rollout`` (issue 40, item 2).

Each family whose published template was found (``tests/chat_templates/``, each with its
source on its first line) gets its full transformers processor, built offline over a small
word-level tokenizer that knows the template's special tokens. A chat's row holds exactly the
processor's own ``input_ids`` for the rendered prompt, then the completion; its image refs sit
on the spans; the generation prompt and the completion are kept apart (``prompt_len``,
``loss_mask``); multi-turn chats whose second user turn adds an image work; the rows commit
and read back; and the tiny Qwen2-VL model trains on batches loaded from them.

Kimi-K2.5 has no template here: no copy of its published one with a source to cite was found.
"""

from __future__ import annotations

import base64
import functools
import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import pytest
import torch
from PIL import Image

import mmstore
from mmstore.errors import InvalidArgumentError
from tests.families_common import noise, train_loss, word_level_tokenizer
from tests.family_cases import (
    CASES,
    GEMMA3_NAMES,
    GEMMA3_SEQ,
    GEMMA3_SMALL,
    GEMMA3_WORDS,
    PIXTRAL_VOCAB,
    FamilyCase,
    token_ids,
)

TEMPLATES = Path(__file__).resolve().parent / "chat_templates"


def published(name: str) -> str:
    """A stored template's text as published: the file less its first line (the source)."""
    first, _, template = (TEMPLATES / name).read_text().partition("\n")
    assert first.startswith("{# source: ") and first.endswith(" #}"), name
    return template


# -- processors that know their template's tokens ----------------------------------------------


def qwen_vl(case: FamilyCase) -> Any:
    ids = {**case.small_ids, "<|im_start|>": 15, "<|im_end|>": 16}
    return case.full(case.image_processor(), ids)


def glm4v(case: FamilyCase) -> Any:
    turns = {"[gMASK]": 20, "<sop>": 21, "<|system|>": 22, "<|user|>": 23, "<|assistant|>": 24}
    return case.full(case.image_processor(), {**case.small_ids, **turns})


def gemma3(case: FamilyCase) -> Any:
    """Gemma3Processor over a tokenizer with Gemma's turn tokens and ``<bos>`` as its bos."""
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

    turns = {"<start_of_turn>": 10, "<end_of_turn>": 11, "user": 12, "model": 13}
    names = {GEMMA3_NAMES[k]: v for k, v in GEMMA3_SMALL.items()}
    tokenizer = word_level_tokenizer(
        {**GEMMA3_WORDS, **names, **turns},
        ["<bos>", "<start_of_turn>", "<end_of_turn>"],
        unk="<unk>",
        pad="<pad>",
        bos_token="<bos>",
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )
    tokenizer.add_tokens(["\n\n"])  # one token, as in Gemma's vocabulary
    return Gemma3Processor(
        image_processor=case.image_processor(), tokenizer=tokenizer, image_seq_length=GEMMA3_SEQ
    )


def pixtral(case: FamilyCase) -> Any:
    """PixtralProcessor (Mistral 3's layout) over a tokenizer with Mistral's instruction
    tokens, ``<s>`` and ``</s>`` as bos and eos."""
    from transformers.models.pixtral.processing_pixtral import PixtralProcessor

    turns = {"[INST]": 9, "[/INST]": 10, "[SYSTEM_PROMPT]": 11, "[/SYSTEM_PROMPT]": 12}
    ids = {**case.small_ids, **turns}
    tokenizer = word_level_tokenizer(
        {**PIXTRAL_VOCAB, **ids},
        [*ids, "<s>", "</s>"],
        unk="<unk>",
        pad="<pad>",
        bos_token="<s>",
        eos_token="</s>",
    )
    image_processor = case.image_processor()
    return PixtralProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=image_processor.patch_size,
        spatial_merge_size=2,
    )


@dataclass(frozen=True, eq=False)
class ChatCase:
    family: str  # a key of CASES
    template: str  # its file in tests/chat_templates/
    build: Callable[[FamilyCase], Any]

    def __str__(self) -> str:  # the pytest id
        return self.family

    @property
    def case(self) -> FamilyCase:
        return CASES[self.family]

    @functools.cached_property
    def processor(self) -> Any:
        processor = self.build(self.case)
        processor.chat_template = published(self.template)
        return processor

    def words(self, n: int = 2) -> str:
        return " ".join(self.case.words[:n])

    @property
    def completion(self) -> list[int]:
        return token_ids(self.processor, self.case.completion_text)


CHATS = [
    ChatCase("qwen-vl", "qwen2_5_vl.jinja", qwen_vl),
    ChatCase("glm4v", "glm4v.jinja", glm4v),
    ChatCase("gemma3", "gemma3.jinja", gemma3),
    ChatCase("pixtral", "mistral3.jinja", pixtral),
]


@pytest.fixture(scope="module", params=CHATS, ids=str)
def chat(request: pytest.FixtureRequest) -> ChatCase:
    return request.param


def images(chat: ChatCase) -> list[Image.Image]:
    return [noise(w, h, seed) for seed, (w, h) in enumerate(chat.case.store_sizes, start=1)]


def user(*content: Any) -> dict[str, Any]:
    return {"role": "user", "content": list(content)}


def image(picture: Any) -> dict[str, Any]:
    return {"type": "image", "image": picture}


def text(words: str) -> dict[str, Any]:
    return {"type": "text", "text": words}


def processed(processor: Any, rendered: str, pictures: list[Image.Image]) -> list[int]:
    """The processor's own ``input_ids`` for ``rendered`` and ``pictures``."""
    out = processor(text=rendered, images=pictures or None)
    return [int(t) for t in np.asarray(out["input_ids"][0])]


def check_spans(prompt: mmstore.chat.ChatPrompt, processor: Any, media: list[Any]) -> None:
    """Each ref sits on its image's span, and the row is what ``expand`` makes of the
    template's own text tokenized (one placeholder per image)."""
    adapter = prompt.adapter
    for ref in prompt.images:
        span = prompt.tokens[ref.offset : ref.offset + ref.length]
        assert span == adapter.expansion(ref.width, ref.height)
    tokens, refs = adapter.expand(token_ids(processor, prompt.text), media)
    assert tokens == prompt.tokens and refs == prompt.images


# -- the templates -----------------------------------------------------------------------------


def test_every_stored_template_names_its_source_and_compiles():
    names = sorted(p.name for p in TEMPLATES.glob("*.jinja"))
    assert names == sorted(c.template for c in CHATS)
    for name in names:
        jinja2.Environment().parse(published(name))  # one line of source, then the template


# -- one turn, several turns -------------------------------------------------------------------


def test_one_turn_with_one_image(chat, tmp_path):
    store = mmstore.Store.open(tmp_path / "store", create=True)
    a = images(chat)[0]
    processor = chat.processor
    prompt = mmstore.chat.prompt(store, processor, [user(image(a), text(chat.words()))])

    assert prompt.tokens == processed(processor, prompt.text, [a])
    assert prompt.adapter.family == chat.family
    (ref,) = prompt.images
    assert (ref.width, ref.height) == a.size
    assert np.array_equal(np.asarray(store.open_image(ref.uri, ref.hash)), np.asarray(a))
    check_spans(prompt, processor, [store.put_image(a)])
    # The template's generation prompt (the assistant's header; Mistral's has none: its
    # [/INST] ends the user turn) ends the prompt, and the completion follows it.
    bare = mmstore.chat.prompt(
        store, processor, [user(image(a), text(chat.words()))], add_generation_prompt=False
    )
    assert prompt.tokens[: len(bare.tokens)] == bare.tokens
    assert len(bare.tokens) < len(prompt.tokens) or chat.family == "pixtral"

    completion = chat.completion
    row = prompt.rollout(
        "s0",
        completion,
        logprobs=[-0.5] * len(completion),
        group_id="g0",
        reward=1.0,
        advantage=0.5,
        policy_version=3,
    )
    n = len(prompt.tokens)
    assert row.tokens == prompt.tokens + completion and row.prompt_len == n
    assert row.loss_mask == [False] * n + [True] * len(completion)
    assert row.logprobs == [0.0] * n + [-0.5] * len(completion)
    assert row.images == prompt.images
    assert (row.group_id, row.reward, row.advantage, row.policy_version) == ("g0", 1.0, 0.5, 3)
    with store.writer(run_id="chat", step=0, adapter=prompt.adapter) as writer:
        writer.write(row)
    assert store.rollouts("chat") == [row]


def test_a_later_user_turn_adds_an_image(chat, tmp_path):
    store = mmstore.Store.open(tmp_path / "store", create=True)
    a, b, _ = images(chat)
    processor = chat.processor
    first = [user(image(a), text(chat.words()))]
    turn1 = mmstore.chat.prompt(store, processor, first)
    answer = chat.case.completion_text
    # The assistant's turn as text: GLM-4.1V's template writes an assistant's content as is.
    later = [*first, {"role": "assistant", "content": answer}, user(text(chat.words(1)), image(b))]
    turn2 = mmstore.chat.prompt(store, processor, later)

    assert turn2.tokens == processed(processor, turn2.text, [a, b])
    assert [(r.width, r.height) for r in turn2.images] == [a.size, b.size]
    assert turn2.images[0] == turn1.images[0]  # the first turn's span, where it was
    assert turn2.tokens[: len(turn1.tokens)] == turn1.tokens
    assert turn2.images[1].offset > len(turn1.tokens)  # in the later user turn
    check_spans(turn2, processor, [store.put_image(a), store.put_image(b)])

    # The earlier turns, the first answer included, are prompt: only the new completion trains.
    completion = chat.completion
    row = turn2.rollout("s1", completion)
    n = len(turn2.tokens)
    assert row.prompt_len == n and sum(row.loss_mask) == len(completion)
    assert not any(row.loss_mask[:n]) and row.logprobs is None
    rows = [turn1.rollout("s0", completion), row]
    with store.writer(run_id="chat", step=0, adapter=turn2.adapter) as writer:
        for r in rows:
            writer.write(r)
    assert store.rollouts("chat") == rows


def test_a_chat_without_images(chat, tmp_path):
    store = mmstore.Store.open(tmp_path / "store", create=True)
    prompt = mmstore.chat.prompt(store, chat.processor, [user(text(chat.words()))])
    assert prompt.images == []
    assert prompt.tokens == processed(chat.processor, prompt.text, [])


# -- what an image block may hold --------------------------------------------------------------

QWEN = CHATS[0]


def test_every_image_form_gives_the_same_row(tmp_path):
    store = mmstore.Store.open(tmp_path / "store", create=True)
    a = images(QWEN)[0]
    path = tmp_path / "a.png"
    a.save(path)
    data = path.read_bytes()
    b64 = base64.b64encode(data).decode()
    blocks = [
        image(a),
        image(str(path)),
        image(path),
        {"type": "image", "path": str(path)},
        {"type": "image", "url": path.as_uri()},
        {"type": "image", "base64": b64},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}},
        {"type": "image_url", "image_url": path.as_uri()},
    ]
    prompts = [
        mmstore.chat.prompt(store, QWEN.processor, [user(block, text("hello"))]) for block in blocks
    ]
    first = prompts[0]
    for prompt in prompts[1:]:
        assert prompt.tokens == first.tokens and prompt.text == first.text
        (ref,) = prompt.images
        assert (ref.offset, ref.length, ref.width, ref.height) == (
            first.images[0].offset,
            first.images[0].length,
            *a.size,
        )
        assert ref.hash == prompts[1].images[0].hash  # the file's bytes, stored as they are
    assert first.images[0].hash != prompts[1].images[0].hash  # the PIL image, encoded anew


def test_a_jpeg_data_url_is_stored_as_a_jpeg(tmp_path):
    store = mmstore.Store.open(tmp_path / "store", create=True)
    buf = io.BytesIO()
    images(QWEN)[0].save(buf, format="JPEG")
    url = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
    block = {"type": "image_url", "image_url": {"url": url}}
    prompt = mmstore.chat.prompt(store, QWEN.processor, [user(block)])
    assert prompt.images[0].uri.endswith(".jpg")


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "downloads"),
        ({"type": "image", "url": "http://example.com/a.png"}, "downloads"),
        ({"type": "image"}, "needs one of"),
        ({"type": "video", "video": "clip.mp4"}, "not videos"),
        ({"type": "image_url", "image_url": {"url": "data:image/png,abc"}}, "base64"),
    ],
    ids=["https", "http", "empty", "video", "not-base64"],
)
def test_what_cannot_be_stored_is_refused(tmp_path, content, match):
    store = mmstore.Store.open(tmp_path / "store", create=True)
    with pytest.raises(InvalidArgumentError, match=match):
        mmstore.chat.prompt(store, QWEN.processor, [user(content, text("hello"))])


def test_an_image_processor_alone_is_refused(tmp_path):
    store = mmstore.Store.open(tmp_path / "store", create=True)
    with pytest.raises(InvalidArgumentError, match="full processor"):
        mmstore.chat.prompt(store, QWEN.processor.image_processor, [user(text("hello"))])


def test_template_keywords_and_another_template(tmp_path):
    store = mmstore.Store.open(tmp_path / "store", create=True)
    messages = [user(image(images(QWEN)[0]), text("hello"))]
    numbered = mmstore.chat.prompt(store, QWEN.processor, messages, add_vision_id=True)
    assert "Picture 1: <|vision_start|>" in numbered.text
    bare = qwen_vl(QWEN.case)  # no template of its own: chat_template= gives one
    given = mmstore.chat.prompt(store, bare, messages, chat_template=published(QWEN.template))
    own = mmstore.chat.prompt(store, QWEN.processor, messages)
    assert (given.tokens, given.images, given.text) == (own.tokens, own.images, own.text)


def test_logprobs_are_one_per_completion_token(tmp_path):
    store = mmstore.Store.open(tmp_path / "store", create=True)
    prompt = mmstore.chat.prompt(store, QWEN.processor, [user(text("hello"))])
    with pytest.raises(InvalidArgumentError, match="one per completion token"):
        prompt.rollout("s", [2, 3], logprobs=[-1.0])


# -- the model takes the rows ------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_the_tiny_qwen2_vl_model_trains_on_chat_rows(tmp_path):
    store = mmstore.Store.open(tmp_path / "store", create=True)
    processor = QWEN.processor
    a, b, c = images(QWEN)
    answer = QWEN.case.completion_text
    chats = {
        "one": [user(image(a), text("hello look"))],
        "two": [
            user(image(b), text("hello")),
            {"role": "assistant", "content": answer},
            user(text("look"), image(c)),
        ],
        "text": [user(text("hello"))],
        "again": [user(text("look"), image(a))],
    }
    completion = QWEN.completion
    # adapter=: the writer checks spans against this tokenizer's ids, not the published ones
    with store.writer(run_id="chat", step=0, adapter=mmstore.adapter_for(processor)) as writer:
        for sample_id, messages in chats.items():
            prompt = mmstore.chat.prompt(store, processor, messages)
            writer.write(prompt.rollout(sample_id, completion, reward=1.0, advantage=0.5))
    model = QWEN.case.tiny_model(torch.float32)
    ds = mmstore.RolloutDataset(store, processor, runs=["chat"], shuffle=False)
    loader = mmstore.RolloutLoader(ds, batch_size=2)
    batches = list(loader)
    assert [s for batch in batches for s in batch["sample_ids"]] == list(chats)
    for batch in batches:
        assert batch["loss_mask"].sum(dim=1).tolist() == [len(completion)] * 2
        assert torch.isfinite(train_loss(model, loader, batch)), batch["sample_ids"]
