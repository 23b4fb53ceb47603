r"""A character vocabulary shared by all languages and by source and target (GPipe §5's one
vocabulary, at character level so a small corpus needs no subword model).

Token ids, in this order:
  0 `<pad>`, 1 `<s>` (begin of sentence), 2 `</s>` (end of sentence), 3 `<unk>`;
  then one target-language token `<2xx>` per language, sorted by language name;
  then single characters by descending count in the texts the vocabulary was built from, ties by
  code point; characters seen fewer than `min_count` times are left out and encode as `<unk>`.

Text encodes character by character: the string "<2de>" in a sentence is five characters, never
the language token, which only the input generator inserts (by id).

Vocabulary files: UTF-8, one token per line, line i (from 0) holding token i. So that every
token is one visible line that no editor trims, a backslash is written `\\` and every whitespace
or non-printable character (space, tab, newline, no-break space, control characters; anything
that is `c.isspace() or not c.isprintable()`) is written `\uXXXX` (or `\UXXXXXXXX` above
U+FFFF) with lower-case hex. Nothing else is escaped.

(A SentencePiece model is not supported; the character vocabulary needs nothing outside TF.)
"""

from __future__ import annotations

import collections
import os
import re
from typing import Iterable, Sequence

from gpipe_tf import errors
from gpipe_tf.input import text_files

PAD, BOS, EOS, UNK = '<pad>', '<s>', '</s>', '<unk>'
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(len(SPECIAL_TOKENS))
_LANGUAGE_TOKEN = re.compile(r'^<2([^<>\s]+)>$')
_ESCAPE = re.compile(r'\\(\\|u[0-9a-f]{4}|U[0-9a-f]{8})')


def LanguageToken(language: str) -> str:
    """The target-language token of `language`, e.g. 'de' -> '<2de>'."""
    return f'<2{language}>'


def EscapeToken(token: str) -> str:
    """A token as written on its line of a vocabulary file (see the module docstring)."""
    out = []
    for c in token:
        if c == '\\':
            out.append('\\\\')
        elif c.isspace() or not c.isprintable():
            out.append(f'\\u{ord(c):04x}' if ord(c) <= 0xFFFF else f'\\U{ord(c):08x}')
        else:
            out.append(c)
    return ''.join(out)


def UnescapeToken(line: str) -> str:
    """The token a vocabulary file's line holds; inverse of `EscapeToken`.

    Raises:
      ValueError: on a backslash that starts none of \\\\, \\uXXXX, \\UXXXXXXXX.
    """
    out, i = [], 0
    while i < len(line):
        if line[i] != '\\':
            out.append(line[i])
            i += 1
            continue
        match = _ESCAPE.match(line, i)
        if not match:
            raise ValueError(f'Bad escape {line[i:i + 2]!r} in vocabulary line '
                             f'{errors.Excerpt(line)}; expected '
                             f'\\\\, \\uXXXX or \\UXXXXXXXX (lower-case hex).')
        escape = match.group(1)
        out.append('\\' if escape == '\\' else chr(int(escape[1:], 16)))
        i = match.end()
    return ''.join(out)


class CharVocabulary:
    """Special tokens, target-language tokens and characters (see the module docstring)."""

    def __init__(self, tokens: Sequence[str]):
        """Args:
          tokens: every token, in id order.

        Raises:
          ValueError: if the special tokens are not first, a token is repeated, or a token is
            neither a special token, a language token `<2xx>` nor a single character.
        """
        tokens = tuple(tokens)
        if tokens[:len(SPECIAL_TOKENS)] != SPECIAL_TOKENS:
            raise ValueError(f'A vocabulary must start with {list(SPECIAL_TOKENS)}, got '
                             f'{list(tokens[:len(SPECIAL_TOKENS)])}.')
        repeated = sorted(t for t, n in collections.Counter(tokens).items() if n > 1)
        if repeated:
            raise ValueError(f'Vocabulary tokens must be distinct; repeated: {repeated}.')
        self._tokens = tokens
        self._char_ids, self._language_ids = {}, {}
        for i, token in enumerate(tokens[len(SPECIAL_TOKENS):], start=len(SPECIAL_TOKENS)):
            match = _LANGUAGE_TOKEN.match(token)
            if match:
                self._language_ids[match.group(1)] = i
            elif len(token) == 1:
                self._char_ids[token] = i
            else:
                raise ValueError(f'Vocabulary token {i} is {token!r}; expected a language token '
                                 f'<2xx> or a single character.')

    @classmethod
    def Build(cls, texts: Iterable[str], languages: Iterable[str],
              min_count: int = 1) -> 'CharVocabulary':
        """The vocabulary of `texts` with a token per language in `languages`.

        Raises:
          ValueError: if min_count < 1 or a language name cannot form a token.
        """
        if min_count < 1:
            raise ValueError(f'min_count must be >= 1, got {min_count}.')
        counts = collections.Counter()
        for text in texts:
            counts.update(text)
        languages = sorted(set(languages))
        bad = [lang for lang in languages if not _LANGUAGE_TOKEN.match(LanguageToken(lang))]
        if bad:
            raise ValueError(f'Language names must be non-empty without whitespace or <>, got '
                             f'{bad}.')
        chars = sorted((c for c, n in counts.items() if n >= min_count),
                       key=lambda c: (-counts[c], ord(c)))
        return cls(SPECIAL_TOKENS + tuple(LanguageToken(lang) for lang in languages)
                   + tuple(chars))

    @classmethod
    def Load(cls, path: str) -> 'CharVocabulary':
        """The vocabulary saved in `path` by `Save`.

        Raises:
          errors.MissingInputError (a FileNotFoundError): if `path` does not exist.
          errors.InputError (a ValueError): if `path` cannot be read (a directory, no
            permission) or is not a vocabulary file.
        """
        if not os.path.exists(path):
            raise errors.MissingInputError(f'Vocabulary file not found: {path}')
        lines = text_files.ReadLines(path, 'a readable UTF-8 vocabulary file, one token a line, '
                                           'as CharVocabulary.Save writes')
        if lines[-1] != '':
            raise errors.InputError(f'{path}: expected a vocabulary file ending in a newline.')
        try:
            return cls([UnescapeToken(line) for line in lines[:-1]])
        except ValueError as e:
            raise errors.InputError(f'{path}: not a vocabulary file: {e}') from e

    def Save(self, path: str) -> None:
        """Writes the vocabulary to `path`, one escaped token a line."""
        with open(path, 'w', encoding='utf-8', newline='\n') as f:
            f.write(''.join(EscapeToken(t) + '\n' for t in self._tokens))

    @property
    def size(self) -> int:
        """Number of tokens (the model's vocab_size must be at least this)."""
        return len(self._tokens)

    @property
    def tokens(self) -> tuple[str, ...]:
        return self._tokens

    @property
    def languages(self) -> tuple[str, ...]:
        """The target languages that have a token, sorted."""
        return tuple(sorted(self._language_ids))

    def LanguageId(self, language: str) -> int:
        """Id of the target-language token `<2language>`.

        Raises:
          ValueError: if the vocabulary has no token for `language`.
        """
        if language not in self._language_ids:
            raise ValueError(f'Unknown target language {errors.Excerpt(language)}; the '
                             f'vocabulary knows {list(self.languages)}.')
        return self._language_ids[language]

    def Encode(self, text: str) -> list[int]:
        """Character ids of `text` (`<unk>` for characters not in the vocabulary), no BOS/EOS."""
        return [self._char_ids.get(c, UNK_ID) for c in text]

    def Decode(self, ids: Iterable[int]) -> str:
        """The text of `ids` up to the first `</s>`; `<pad>` and `<s>` are skipped, `<unk>` and
        language tokens are written as their token text.

        Raises:
          ValueError: on an id outside [0, size).
        """
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self._tokens):
                raise ValueError(f'Token id {i} is outside the vocabulary [0, {self.size}).')
            if i == EOS_ID:
                break
            if i not in (PAD_ID, BOS_ID):
                out.append(self._tokens[i])
        return ''.join(out)

    def __eq__(self, other) -> bool:
        return isinstance(other, CharVocabulary) and self._tokens == other._tokens

    def __repr__(self) -> str:
        return (f'CharVocabulary(size={self.size}, languages={list(self.languages)}, '
                f'chars={len(self._char_ids)})')
