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
