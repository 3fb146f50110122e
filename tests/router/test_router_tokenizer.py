"""The router's tokenization (issue 31, item 2): text and chats to the ids the served model's
engine sees, from the model's tokenizer.json and chat template, and what of a body is
tokenized, refused with a reason when malformed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from blend_router import ModelTokenizer
from blend_router.prompts import (CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH, MalformedRequest,
                                   parse_request)
from blend_router.tokenizer import Chat, Text, to_tokenize
from helpers import build_tokenizer

LANE = "unit"

CORPUS = "The river runs north . Who built the bridge ? Answer briefly , please"


@pytest.fixture
def model(tmp_path):
    build_tokenizer(tmp_path, CORPUS)
    return ModelTokenizer(tmp_path)


def test_text_is_tokenized_as_the_engine_does_with_its_bos(model, tmp_path):
    reference = build_tokenizer(tmp_path / "again", CORPUS)
    ids = model.tokens(Text("The river runs north ."))
    assert ids.dtype == np.uint32
    assert ids.tolist() == reference.encode("The river runs north .").ids
    assert ids[0] == reference.token_to_id("<s>")
    assert model.tokens(Text("The river", add_special_tokens=False)).tolist() == \
        [reference.token_to_id("The"), reference.token_to_id("river")]


def test_a_chat_is_rendered_with_the_models_template(model, tmp_path):
    reference = build_tokenizer(tmp_path / "again", CORPUS)
    chat = Chat([{"role": "system", "content": "Answer briefly"},
                 {"role": "user", "content": "Who built the bridge ?"}])
    rendered = ("<s><|system|> Answer briefly <|end|> <|user|> Who built the bridge ? "
                "<|end|> <|assistant|>")
    assert model.render(chat) == rendered
    assert model.tokens(chat).tolist() == \
        reference.encode(rendered, add_special_tokens=False).ids
    # One BOS, the template's: the tokenizer adds none of its own to a rendered chat.
    assert model.tokens(chat).tolist().count(reference.token_to_id("<s>")) == 1
    no_prompt = Chat(chat.messages, add_generation_prompt=False)
    assert model.tokens(no_prompt).tolist() == model.tokens(chat).tolist()[:-1]


def test_a_chat_template_file_and_a_file_without_template(tmp_path):
    build_tokenizer(tmp_path / "plain", CORPUS, chat_template=None)
    plain = ModelTokenizer(tmp_path / "plain" / "tokenizer.json")
    assert not plain.has_chat_template
    assert plain.tokens(Chat([{"role": "user", "content": "north"}])) is None
    build_tokenizer(tmp_path / "jinja", CORPUS)
    (tmp_path / "jinja" / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert ModelTokenizer(tmp_path / "jinja").render(
        Chat([{"role": "user", "content": "north"}])) == "[north]"


def test_a_chat_the_template_refuses_is_not_tokenized(tmp_path):
    build_tokenizer(tmp_path, CORPUS, chat_template=(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
        "{{ messages[0]['content'] }}"))
    model = ModelTokenizer(tmp_path)
    assert model.tokens(Chat([{"role": "system", "content": "north"}])) is None
    assert model.tokens(Chat([{"role": "user", "content": "north"}])).size == 1


def test_the_template_runs_sandboxed(tmp_path):
    build_tokenizer(tmp_path, CORPUS, chat_template="{{ messages.append(1) }}{{ messages }}")
    assert ModelTokenizer(tmp_path).tokens(Chat([{"role": "user", "content": "x"}])) is None


@pytest.mark.parametrize("setup, says", [
    (lambda p: None, "no such file"),
    (lambda p: (p / "tokenizer.json").write_text("{not json"), "not a tokenizer.json"),
    (lambda p: (build_tokenizer(p, CORPUS),
                (p / "tokenizer_config.json").write_text(json.dumps(
                    {"chat_template": "{% for %}"}))), "does not compile"),
])
def test_a_bad_tokenizer_path_is_a_clear_error(tmp_path, setup, says):
    setup(tmp_path)
    with pytest.raises(RuntimeError, match=says):
        ModelTokenizer(tmp_path / "tokenizer.json" if says != "does not compile" else tmp_path)


def tokenized(path: str, body: dict):
    return to_tokenize(parse_request(path, json.dumps(body).encode()))


def test_what_of_a_body_is_tokenized():
    assert tokenized(COMPLETIONS_PATH, {"prompt": "north"}) == Text("north")
    assert tokenized(COMPLETIONS_PATH, {"prompt": ["north"], "add_special_tokens": False}) == \
        Text("north", add_special_tokens=False)
    chat = tokenized(CHAT_COMPLETIONS_PATH, {"messages": [
        {"role": "system", "content": None},
        {"role": "user", "content": [{"type": "text", "text": "a"},
                                     {"type": "image_url", "image_url": {"url": "x"}},
                                     {"type": "text", "text": "b"}]}],
        "add_generation_prompt": False})
    assert chat == Chat([{"role": "system", "content": ""}, {"role": "user", "content": "a\nb"}],
                        add_generation_prompt=False)
    assert tokenized(CHAT_COMPLETIONS_PATH, {"messages": []}) is None


@pytest.mark.parametrize("path, body", [
    (CHAT_COMPLETIONS_PATH, {"messages": 5}),
    (CHAT_COMPLETIONS_PATH, {"messages": [{"role": "user", "content": 7}]}),
    (CHAT_COMPLETIONS_PATH, {"messages": [{"role": "user", "content": "a"}],
                             "add_generation_prompt": "yes"}),
    (COMPLETIONS_PATH, {"prompt": "a", "add_special_tokens": 1}),
])
def test_a_malformed_body_is_refused_with_a_reason(path, body):
    with pytest.raises(MalformedRequest) as refused:
        parse_request(path, json.dumps(body).encode())
    assert str(refused.value)
