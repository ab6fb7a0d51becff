"""Long text cut into segments of at most `max_chars`, at the most natural boundary that fits.

Sentences first (after . ! ? … and their closing quotes or brackets, or after 。！？); a sentence longer than a
segment at clauses (after , ; : and their full-width forms, around a dash — or –); a clause still too long at
words; a word longer than a segment at characters. So a cut falls inside a sentence only when the sentence
does not fit, and at a word only when its clause does not fit. The pieces are then packed into the fewest
segments that hold them, as evenly as possible: "The quick brown fox jumps over the lazy dog." with a limit
of 40 becomes "The quick brown fox" + "jumps over the lazy dog.", never "... the lazy" + "dog.". Segments are
spans of the original text, its spacing kept, stripped at both ends.
"""

from __future__ import annotations

import re

# a boundary is a position between two pieces: after the punctuation (and closing marks), before the next text
_CLOSERS = re.escape("\"'”’»)]}」』")
SENTENCE_END = re.compile(rf"[.!?…]+[{_CLOSERS}]*\s+|[。！？]+[{_CLOSERS}]*\s*")
CLAUSE_END = re.compile(rf"[,;:]+[{_CLOSERS}]*\s+|[，、；：]\s*|\s+[—–]\s*|—\s*")
WORD_END = re.compile(r"\s+")


Span = tuple[int, int]  # [start, end) in the text, stripped of surrounding whitespace


def _strip(text: str, start: int, end: int) -> Span | None:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return (start, end) if start < end else None


def _pieces(text: str, span: Span, boundary: re.Pattern) -> list[Span]:
    """`span` cut after every boundary match inside it."""
    out, start = [], span[0]
    for m in boundary.finditer(text, span[0], span[1]):
        piece = _strip(text, start, m.end())
        if piece is not None:
            out.append(piece)
            start = m.end()
    piece = _strip(text, start, span[1])
    return out + [piece] if piece is not None else out


def _greedy(pieces: list[Span], width: int) -> list[Span]:
    """Consecutive pieces joined while the joined span (the text between them included) fits `width`."""
    segments: list[Span] = []
    for s, e in pieces:
        if segments and e - segments[-1][0] <= width:
            segments[-1] = (segments[-1][0], e)
        else:
            segments.append((s, e))
    return segments


def _pack(pieces: list[Span], max_chars: int) -> list[Span]:
    """Pieces (each at most max_chars) joined into the fewest segments of at most max_chars, balanced: packed
    at the narrowest width that still gives the fewest segments."""
    if not pieces:
        return []
    fewest = len(_greedy(pieces, max_chars))
    lo, hi = max(e - s for s, e in pieces), max_chars
    while lo < hi:  # the segment count only falls as the width grows
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(_greedy(pieces, mid)) <= fewest else (mid + 1, hi)
    return _greedy(pieces, lo)


def _pieces_that_fit(text: str, span: Span, max_chars: int, levels: tuple[re.Pattern, ...]) -> list[Span]:
    """`span` whole if it fits; else its pieces at the first level, each cut further (next levels) if too long."""
    start, end = span
    if end - start <= max_chars:
        return [span]
    if not levels:  # a word longer than a segment: characters, as evenly as the count allows
        size = -(-(end - start) // -(-(end - start) // max_chars))
        return [(i, min(i + size, end)) for i in range(start, end, size)]
    return [p for piece in _pieces(text, span, levels[0]) for p in _pieces_that_fit(text, piece, max_chars, levels[1:])]


def split_text(text: str, max_chars: int) -> list[str]:
    """`text` as segments of at most `max_chars` characters, cut at sentences, then clauses, then words."""
    if max_chars < 1:
        raise ValueError(f"max_chars must be at least 1, got {max_chars}")
    span = _strip(text, 0, len(text))
    if span is None:
        return []
    pieces = _pieces_that_fit(text, span, max_chars, (SENTENCE_END, CLAUSE_END, WORD_END))
    return [text[s:e] for s, e in _pack(pieces, max_chars)]


# ---- text that arrives in pieces (`higgs_rt.session`) ------------------------------------------------------
# A session speaks each clause as soon as it is complete, so it cuts at every sentence and clause boundary
# (never packs them), and a clause longer than max_chars at the last word that fits. Where a cut falls depends
# only on the text, never on how it was cut into pieces: `next_segment` waits until the text decides it.

BOUNDARY = re.compile(f"{SENTENCE_END.pattern}|{CLAUSE_END.pattern}")


def _word_cut(text: str, start: int, max_chars: int) -> tuple[str, int]:
    """The longest run of whole words from `start` that fits max_chars (a longer word: max_chars characters)."""
    cut = start + max_chars
    spaces = [m.start() for m in WORD_END.finditer(text, start, cut + 1)]
    end = spaces[-1] if spaces else cut
    return text[start:end].rstrip(), end


def next_segment(text: str, start: int, max_chars: int, final: bool) -> tuple[str, int] | None:
    """The next segment of `text` from `start` and where the rest begins, or None when the text so far cannot
    decide it yet (more may come; with `final`, none will). A segment ends at the first sentence or clause
    boundary; a boundary at the very end of the text counts once what follows cannot change it (its whitespace,
    or the next character, has come). A clause longer than max_chars is cut at words, once a character past
    max_chars has come."""
    while start < len(text) and text[start].isspace():
        start += 1
    if start == len(text):
        return None
    m = BOUNDARY.search(text, start)
    if m is not None:
        end = _strip(text, start, m.end())[1]
        if end - start <= max_chars:
            settled = final or m.end() < len(text) or text[m.end() - 1].isspace()
            return (text[start:end], m.end()) if settled else None
    elif final and _strip(text, start, len(text))[1] - start <= max_chars:
        return text[start:].rstrip(), len(text)
    if not text[start + max_chars:].strip():  # the clause may still end within max_chars
        return None
    return _word_cut(text, start, max_chars)


def clause_segments(text: str, max_chars: int) -> list[str]:
    """The segments a session fed `text` (in any pieces) and then closed speaks: cut at every sentence and clause
    boundary, and at words within max_chars."""
    if max_chars < 1:
        raise ValueError(f"max_chars must be at least 1, got {max_chars}")
    out, start = [], 0
    while (cut := next_segment(text, start, max_chars, final=True)) is not None:
        out.append(cut[0])
        start = cut[1]
    return out
