"""Long text into segments: sentences, then clauses, then words, then characters; exact segments expected. And
text that arrives in pieces (a text session): cut at every clause, the same however it was cut into pieces."""

from __future__ import annotations

import random

import pytest

from higgs_rt.text_split import CLAUSE_END, SENTENCE_END, WORD_END, clause_segments, next_segment, split_text

FOX = "The quick brown fox jumps over the lazy dog."


@pytest.mark.parametrize("text,max_chars,want", [
    # fits: one segment, the text as written (stripped)
    ("  One. Two! Three?\n", 100, ["One. Two! Three?"]),
    ("One. Two! Three?", 6, ["One.", "Two!", "Three?"]),
    ("One. Two! Three?", 10, ["One. Two!", "Three?"]),
    # no clause boundary: words, balanced, never "... the lazy" + "dog."
    (FOX, 40, ["The quick brown fox", "jumps over the lazy dog."]),
    # a clause boundary exists: it is the cut
    ("The quick brown fox jumps over the lazy dog, and the cat sleeps.", 44,
     ["The quick brown fox jumps over the lazy dog,", "and the cat sleeps."]),
    ("The quick brown fox, which was hungry, jumps over the lazy dog.", 40,
     ["The quick brown fox, which was hungry,", "jumps over the lazy dog."]),
    ("First; second: third, fourth.", 8, ["First;", "second:", "third,", "fourth."]),
    ("Wait — then go.", 8, ["Wait —", "then go."]),
    # sentence ends with closing quotes and brackets; decimals are not sentence ends
    ('He said "Hi." Then he left; she stayed. Why?', 20, ['He said "Hi."', "Then he left;", "she stayed. Why?"]),
    ("(It rained.) We stayed in.", 14, ["(It rained.)", "We stayed in."]),
    ("Version 3.5 is out. Pi is 3.14159, roughly.", 25, ["Version 3.5 is out.", "Pi is 3.14159, roughly."]),
    ("Really?! Yes... Fine.", 9, ["Really?!", "Yes...", "Fine."]),
    # full-width punctuation: no spaces needed, none added
    ("你好。今天天气很好，我们去公园吧！好的。", 8, ["你好。", "今天天气很好，", "我们去公园吧！", "好的。"]),
    # a word longer than a segment: characters, evenly
    ("a" * 50, 20, ["a" * 17, "a" * 17, "a" * 16]),
    ("", 10, []),
    ("   \n ", 10, []),
])
def test_exact_segments(text, max_chars, want):
    assert split_text(text, max_chars) == want


def test_spacing_inside_a_segment_is_kept():
    assert split_text("Line one.\nLine  two.", 100) == ["Line one.\nLine  two."]


def test_bad_limit():
    with pytest.raises(ValueError, match="max_chars must be at least 1"):
        split_text("x", 0)


def _piece_around(text: str, patterns, cut: int) -> tuple[int, int]:
    """[start, end) of the piece holding position `cut` when `text` is cut after every match of `patterns`."""
    cuts = sorted({0, len(text), *(m.end() for pattern in patterns for m in pattern.finditer(text))})
    return next((a, b) for a, b in zip(cuts, cuts[1:]) if a <= cut < b)


def test_random_text_is_cut_inside_a_sentence_clause_or_word_only_when_it_does_not_fit():
    rng = random.Random(0)
    words = ["a", "tiny", "word", "considerably", "x" * 30, "end.", "pause,", "why?", "semi;", "—"]
    levels = [(SENTENCE_END,), (SENTENCE_END, CLAUSE_END), (SENTENCE_END, CLAUSE_END, WORD_END)]
    inside = [0, 0, 0]
    for _ in range(300):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 60)))
        limit = rng.randint(1, 80)
        segments = split_text(text, limit)
        assert all(0 < len(s) <= limit and s == s.strip() for s in segments)
        starts, pos = [], 0
        for s in segments:  # every segment is the text's own span, in order, and together they hold all of it
            pos = text.index(s, pos)
            starts.append(pos)
            pos += len(s)
        assert text[:starts[0]].strip() == "" and text[pos:].strip() == ""
        assert "".join(segments).replace(" ", "") == text.replace(" ", "")
        for cut in starts[1:]:
            for i, patterns in enumerate(levels):
                a, b = _piece_around(text, patterns, cut)
                if text[a:cut].strip():  # inside this level's piece: only because the piece does not fit
                    inside[i] += 1
                    assert len(text[a:b].strip()) > limit, (text, limit, segments, cut)
    assert min(inside) > 0  # every level's cut happened somewhere, so every rule above was exercised


# ---------------------------------------------------------------- text in pieces (higgs_rt.session)


@pytest.mark.parametrize("text,max_chars,want", [
    ("Hello there, how are you? I am fine.", 100, ["Hello there,", "how are you?", "I am fine."]),
    ("Wait — then go; now: 3.14 is pi.", 100, ["Wait —", "then go;", "now:", "3.14 is pi."]),
    ('He said "Hi." Then left', 100, ['He said "Hi."', "Then left"]),
    ("你好。「好」，再见", 100, ["你好。", "「好」，", "再见"]),
    # a clause longer than max_chars: the most whole words that fit, then the rest
    ("The quick brown fox jumps over the lazy dog.", 20, ["The quick brown fox", "jumps over the lazy", "dog."]),
    ("Supercalifragilistic, yes", 10, ["Supercalif", "ragilistic", ",", "yes"]),
    ("   ", 10, []),
])
def test_clause_segments(text, max_chars, want):
    assert clause_segments(text, max_chars) == want


def incremental(pieces: list[str], max_chars: int) -> list[str]:
    """What a session cuts: the pieces appended to a buffer one by one, complete segments taken after each,
    the rest at the end (close)."""
    buffer, out = "", []
    for piece in pieces:
        buffer += piece
        while (cut := next_segment(buffer, 0, max_chars, final=False)) is not None:
            out.append(cut[0])
            buffer = buffer[cut[1]:]
    while (cut := next_segment(buffer, 0, max_chars, final=True)) is not None:
        out.append(cut[0])
        buffer = buffer[cut[1]:]
    return out


def test_a_boundary_waits_for_what_follows_it():
    assert next_segment("Hi.", 0, 50, final=False) is None  # "Hi.." or "Hi.5" may follow
    assert next_segment("Hi. ", 0, 50, final=False) == ("Hi.", 4)
    assert next_segment("Hi.", 0, 50, final=True) == ("Hi.", 3)
    assert next_segment("你好。", 0, 50, final=False) is None  # a closing 」 may follow
    assert next_segment("你好。x", 0, 50, final=False) == ("你好。", 3)
    assert next_segment("no boundary yet", 0, 50, final=False) is None
    assert next_segment("abc def ghi", 0, 10, final=False) == ("abc def", 7)  # past max_chars: cut at words


def test_any_pieces_cut_the_same_as_the_whole_text():
    """Random texts of words, spaces and every kind of boundary mark, cut into random pieces (empty ones too):
    the segments are always the whole text's, each within max_chars, and together they hold all its text."""
    marks = ["word", "a", " ", "  ", "\n", ".", ",", "!", "?", ";", ":", "—", " – ", "…", "。", "，", "」", '"', ")",
             "3.14"]
    rng = random.Random(21)
    for _ in range(3000):
        text = "".join(rng.choice(marks) for _ in range(rng.randint(0, 30)))
        max_chars = rng.randint(1, 14)
        cuts = sorted(rng.choices(range(len(text) + 1), k=rng.randint(0, 8)))
        pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        want = clause_segments(text, max_chars)
        assert incremental(pieces, max_chars) == want, (text, pieces)
        assert all(0 < len(s) <= max_chars and s == s.strip() for s in want)
        assert "".join("".join(want).split()) == "".join(text.split())
