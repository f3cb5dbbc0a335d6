"""Orpheus's prompt and what its answer may be: the text as a human turn, SNAC codes as the answer.

Orpheus (Canopy Labs' Llama 3.2 fine-tune) reads ``<custom_token_3>`` (start of the human turn),
``voice: text`` (the voice prefix only where the model was tuned with speakers: ``tara``, ``leah``,
...), ``<|eot_id|>``, ``<custom_token_4>`` (end of the human turn), and answers
``<custom_token_5>`` (start of the AI turn), ``<custom_token_1>`` (start of speech), seven codec
tokens a frame, ``<custom_token_2>`` (end of speech). The prompt here ends with the two opening
markers, so the first token of the answer is the first code of the first frame.

The answer is held to that shape by a GBNF grammar over the tokens' text (llama.cpp matches a
special token by its text): whole frames whose seven tokens are each in their position's range,
then optionally the end-of-speech marker. A model that strays from the frames cannot make the
decoder read noise; the grammar's text form keeps it a few hundred bytes, where one alternative a
token id would be 28,672 alternatives for the sampler to try per token.
"""

from __future__ import annotations

import re

from studio.speech.snac import CODEBOOK, FIRST_CODE_TOKEN, FRAME

START_HUMAN, END_HUMAN, START_AI, START_SPEECH, END_SPEECH = (
    "<custom_token_3>",
    "<custom_token_4>",
    "<custom_token_5>",
    "<custom_token_1>",
    "<custom_token_2>",
)
END_OF_TURN = "<|eot_id|>"
#: The speakers of Canopy Labs' English fine-tune (``canopylabs/orpheus-3b-0.1-ft``), in its order.
VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
#: Characters of text per generation: Orpheus loses its way in long passages (the reference splits at 400).
CHUNK_CHARS = 300
#: Sampling as the reference backend samples Orpheus; below 1.1 repetition penalty it tends to loop.
SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 50, "min_p": 0.0, "repeat_penalty": 1.1}

# The prompt's own markers, and any special-token spelling: llama-server would read them as tokens.
_MARKUP = re.compile(r"<custom_token_\d+>|<\|[A-Za-z0-9_]+\|>")
_SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+")


def prompt(text: str, voice: str | None) -> str:
    """Return the ``/completion`` prompt that has the model speak ``text`` (in ``voice``, when given)."""
    said = _MARKUP.sub("", text).strip()
    spoken = f"{voice}: {said}" if voice else said
    return f"{START_HUMAN}{spoken}{END_OF_TURN}{END_HUMAN}{START_AI}{START_SPEECH}"


def grammar() -> str:
    """Return the GBNF grammar of an answer: whole frames of in-range codec tokens, then maybe the end marker."""
    slots = " ".join(f'"<custom_token_" p{p} ">"' for p in range(FRAME))
    rules = [f'root ::= frame* "{END_SPEECH}"?', f"frame ::= {slots}"]
    for p in range(FRAME):
        low = FIRST_CODE_TOKEN + p * CODEBOOK
        rules.append(f"p{p} ::= " + " | ".join(number_range(low, low + CODEBOOK - 1)))
    return "\n".join(rules) + "\n"


def number_range(low: int, high: int) -> list[str]:
    """Return GBNF alternatives that match exactly the decimal numbers ``low``..``high`` (no leading zeros)."""
    out: list[str] = []
    for digits in range(len(str(low)), len(str(high)) + 1):
        a, b = max(low, 10 ** (digits - 1) if digits > 1 else 0), min(high, 10**digits - 1)
        if a <= b:
            out += [" ".join(p) for p in _same_length(str(a), str(b))]
    return out


def _same_length(a: str, b: str) -> list[list[str]]:
    """Element sequences matching the digit strings ``a``..``b`` of one length (leading zeros allowed inside)."""
    if a == b:
        return [[f'"{a}"']] if a else [[]]
    if a[0] == b[0]:
        return [[f'"{a[0]}"', *rest] for rest in _same_length(a[1:], b[1:])]
    k = len(a) - 1
    out: list[list[str]] = []
    first, last = int(a[0]), int(b[0])
    if a[1:] != "0" * k:  # a partial first block
        out += [[f'"{a[0]}"', *rest] for rest in _same_length(a[1:], "9" * k)]
        first += 1
    tail: list[list[str]] = []
    if b[1:] != "9" * k:  # a partial last block
        tail = [[f'"{b[0]}"', *rest] for rest in _same_length("0" * k, b[1:])]
        last -= 1
    if first <= last:
        out.append([f"[{first}-{last}]"] + ["[0-9]"] * k)
    return out + tail


def chunks(text: str, limit: int = CHUNK_CHARS) -> list[str]:
    """Return ``text`` in pieces of whole sentences up to ``limit`` characters (a longer sentence is cut at words)."""
    pieces: list[str] = []
    for sentence in _SENTENCE_END.split(text.strip()):
        while len(sentence) > limit:
            cut = sentence.rfind(" ", 0, limit)
            cut = cut if cut > 0 else limit
            pieces.append(sentence[:cut])
            sentence = sentence[cut:].lstrip()
        if sentence:
            pieces.append(sentence)
    out: list[str] = []
    for piece in pieces:
        if out and len(out[-1]) + 1 + len(piece) <= limit:
            out[-1] += " " + piece
        else:
            out.append(piece)
    return out


def frame_budget(text: str) -> int:
    """Frames a generation of ``text`` may take at most: about twice the time a speaker needs, and a floor."""
    return 12 + 2 * len(text)  # ~12 frames a second of speech, ~15 characters a second spoken
