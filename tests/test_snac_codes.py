"""Orpheus's codec tokens to SNAC's layers, the answer's grammar, and the decoder on the real onnxruntime."""

from __future__ import annotations

import io
import re
import wave

import numpy as np
import pytest

from studio.errors import BadRequestError
from studio.speech import orpheus, snac
from studio.speech.wav import wav_bytes
from tests.support.snac_model import expected_samples, write_snac_decoder


def tokens_of(frames: list[list[int]]) -> list[int]:
    """The ``N`` of ``<custom_token_N>`` for frames of codes, as Orpheus writes them."""
    return [10 + position * 4096 + code for frame in frames for position, code in enumerate(frame)]


def test_a_frame_of_seven_tokens_feeds_the_three_layers_one_two_and_four_codes():
    numbers = tokens_of([[1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 14, 15, 16, 17]])
    layers = snac.layers(snac.codes_of(numbers))
    assert layers.coarse == (1, 11)
    assert layers.middle == (2, 5, 12, 15)
    assert layers.fine == (3, 4, 6, 7, 13, 14, 16, 17)
    assert layers.frames == 2 and layers.samples == 2 * 2048


def test_each_position_takes_off_its_own_4096_offset():
    numbers = tokens_of([[0, 4095, 0, 4095, 0, 4095, 0]])
    assert numbers == [10, 4106 + 4095, 8202, 12298 + 4095, 16394, 20490 + 4095, 24586]
    assert snac.codes_of(numbers) == [0, 4095, 0, 4095, 0, 4095, 0]


def test_an_incomplete_last_frame_is_dropped():
    codes = snac.codes_of(tokens_of([[1, 2, 3, 4, 5, 6, 7], [8, 9, 10]]))
    layers = snac.layers(codes)
    assert layers.frames == 1 and layers.fine == (3, 4, 6, 7)
    assert snac.layers([]).frames == 0


def test_a_token_outside_its_position_range_is_refused_with_where():
    with pytest.raises(BadRequestError, match=r"audio token 1 \(<custom_token_10>\) is not a code of frame position 1"):
        snac.codes_of([10, 10])


def test_codec_tokens_are_read_out_of_text_in_order():
    assert snac.token_numbers("<custom_token_10>x<custom_token_4200> <custom_token_2>") == [10, 4200, 2]


def test_the_prompt_puts_the_voice_in_a_human_turn_and_opens_the_speech():
    assert orpheus.prompt("Hello there.", "tara") == (
        "<custom_token_3>tara: Hello there.<|eot_id|><custom_token_4><custom_token_5><custom_token_1>"
    )


def test_markers_typed_in_the_text_do_not_reach_the_prompt():
    said = orpheus.prompt("say <custom_token_2> and <|eot_id|> <laugh> now", None)
    assert said.count("<custom_token_2>") == 0 and said.count("<|eot_id|>") == 1 and "<laugh>" in said


@pytest.mark.parametrize(("low", "high"), [(10, 4105), (4106, 8201), (0, 9), (7, 12), (99, 101), (24586, 28681)])
def test_the_grammar_number_ranges_match_exactly_their_numbers(low, high):
    alternatives = orpheus.number_range(low, high)
    pattern = re.compile(
        "|".join("".join(part.strip('"') if part.startswith('"') else part for part in a.split()) for a in alternatives)
    )
    matched = {n for n in range(0, 30000) if pattern.fullmatch(str(n))}
    assert matched == set(range(low, high + 1))


def test_the_grammar_has_a_rule_per_position_and_ends_with_the_end_of_speech():
    text = orpheus.grammar()
    assert text.startswith('root ::= frame* "<custom_token_2>"?')
    assert all(f"p{p} ::= " in text for p in range(7)) and len(text) < 2000


def test_long_text_is_split_at_sentences_within_the_limit():
    text = "One two three. " * 30 + "A" * 50 + " " + "word " * 80
    pieces = orpheus.chunks(text, limit=100)
    assert all(len(p) <= 100 for p in pieces)
    assert " ".join(pieces).split() == text.split()
    assert orpheus.chunks("Hi. There!") == ["Hi. There!"]


def test_the_tiny_decoder_runs_on_onnxruntime_and_makes_2048_samples_a_frame(tmp_path):
    path = write_snac_decoder(tmp_path / "decoder_model.onnx")
    frames = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300, 400, 500, 600, 700], [4095, 0, 1, 2, 3, 4, 5]]
    layers = snac.layers(snac.codes_of(tokens_of(frames)))
    audio = snac.decoder(path).decode(layers)
    assert audio.dtype == np.float32 and audio.shape == (3 * 2048,)
    np.testing.assert_allclose(audio, expected_samples(list(layers.coarse), list(layers.middle), list(layers.fine)))
    assert snac.decoder(path) is snac.decoder(path)  # loaded once per version of the file


def test_a_decoder_with_other_inputs_is_refused(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("codes", TensorProto.INT64, [1, "n"])
    y = helper.make_tensor_value_info("audio", TensorProto.INT64, [1, "n"])
    model = helper.make_model(
        helper.make_graph([helper.make_node("Identity", ["codes"], ["audio"])], "other", [x], [y]),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "other.onnx"))
    with pytest.raises(BadRequestError, match="is not SNAC 24 kHz's decoder: its inputs are codes"):
        snac.SnacDecoder(tmp_path / "other.onnx")


def test_the_wav_is_16_bit_mono_at_the_rate_given():
    data = wav_bytes(np.array([0.0, 0.5, -2.0], dtype=np.float32), 24000)
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()) == (1, 2, 24000, 3)
        assert np.frombuffer(w.readframes(3), "<i2").tolist() == [0, 16383, -32767]
