r"""Makes the small English->X parallel corpus in gpipe_tf/data/multilingual from Django's
translation catalogs (BSD-3-Clause).

    python -m gpipe_tf.tools.make_multilingual_corpus \
        --output_dir=gpipe_tf/data/multilingual [--wheel=PATH]

Without --wheel it runs `pip download django==DJANGO_VERSION --no-deps` into a temporary
directory (Django is read as a zip, never installed). The output is a function of the wheel alone,
so the same wheel reproduces the shipped files byte for byte.

What is extracted, per language in --languages: every `django/**/locale/<lang>/LC_MESSAGES/*.po`
catalog in the wheel (Django's core catalog and those of its contrib apps), in sorted path order.
An entry becomes a pair (English msgid, translated msgstr) unless it is the header (empty msgid),
fuzzy, obsolete (`#~`), a plural entry (msgid_plural: skipped entirely, since msgstr[0] is not the
singular in every language's plural rule), untranslated (empty msgstr), or either side contains a
newline, another control character (a tab would break the TSV), or more than --max_chars
characters. msgctxt is read and ignored: the same msgid may then have several translations, and
each distinct (source, target) pair is kept once.

The split is decided by the English side alone: the first 8 bytes of SHA-256 of the UTF-8 msgid,
modulo 100, put it in train (< 80), dev (< 90) or test, so a dev or test English sentence is in
no language's train split. Files are UTF-8, '\n'-terminated lines of
`source_language<TAB>target_language<TAB>source<TAB>target`, without a header, sorted by
(target_language, source, target).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile

from absl import app
from absl import flags
from absl import logging

# The Django release the shipped corpus was made from (the newest for Python 3.11 when made).
DJANGO_VERSION = '5.2.19'
LANGUAGES = ('de', 'es', 'fr', 'it', 'nl', 'pt_BR', 'ru')
SOURCE_LANGUAGE = 'en'
SPLITS = ('train', 'dev', 'test')
# Upper bounds (exclusive) of each split's share of the hash range [0, 100).
_SPLIT_BOUNDS = (('train', 80), ('dev', 90), ('test', 100))
_ESCAPES = {'n': '\n', 't': '\t', 'r': '\r', '"': '"', '\\': '\\', 'a': '\a', 'b': '\b',
            'f': '\f', 'v': '\v'}
_CONTROL = re.compile(r'[\x00-\x1f\x7f-\x9f\u2028\u2029]')

flags.DEFINE_string('output_dir', None, 'Directory the corpus files are written to.')
flags.DEFINE_string('wheel', None, 'A Django wheel to read; default: pip download '
                    f'django=={DJANGO_VERSION} into a temporary directory.')
flags.DEFINE_list('languages', list(LANGUAGES), 'Target languages (Django locale names).')
flags.DEFINE_integer('max_chars', 60, 'Drop pairs with more characters than this on either side.')
FLAGS = flags.FLAGS


@dataclasses.dataclass
class PoEntry:
    """One entry of a .po catalog, its strings unescaped."""
    msgid: str
    msgstr: str
    msgctxt: str | None = None
    msgid_plural: str | None = None
    plural_msgstrs: list[str] = dataclasses.field(default_factory=list)
    fuzzy: bool = False
    line: int = 0  # Line number of the entry's msgid, from 1.


def UnescapePoString(quoted: str) -> str:
    """The value of one C-style quoted .po string, e.g. '"a \\"b\\"\\n"' -> 'a "b"\n'.

    Raises:
      ValueError: if `quoted` is not a double-quoted string or has an unknown escape.
    """
    if len(quoted) < 2 or quoted[0] != '"' or quoted[-1] != '"':
        raise ValueError(f'Expected a double-quoted .po string, got {quoted!r}.')
    body, out, i = quoted[1:-1], [], 0
    while i < len(body):
        c = body[i]
        if c != '\\':
            out.append(c)
            i += 1
            continue
        if i + 1 >= len(body) or body[i + 1] not in _ESCAPES:
            known = ' '.join('\\' + e for e in _ESCAPES)
            raise ValueError(f'Unknown escape {body[i:i + 2]!r} in .po string {quoted!r}; '
                             f'expected one of {known}.')
        out.append(_ESCAPES[body[i + 1]])
        i += 2
    return ''.join(out)


def ParsePo(text: str) -> list[PoEntry]:
    """The entries of a .po file's text, in file order (the header entry included).

    Continuation lines (a quoted string alone on a line) extend the preceding keyword's string.
    Obsolete entries (`#~`) and other comments are skipped; `#, fuzzy` marks the next entry.

    Raises:
      ValueError: on a line that is neither a comment, a keyword line nor a continuation.
    """
    entries, current, key, fuzzy = [], None, None, False

    def Finish():
        if current is not None and 'msgid' in current:
            entries.append(PoEntry(
                msgid=current['msgid'], msgstr=current.get('msgstr', ''),
                msgctxt=current.get('msgctxt'), msgid_plural=current.get('msgid_plural'),
                plural_msgstrs=[current[k] for k in sorted(
                    (k for k in current if k.startswith('msgstr[')),
                    key=lambda k: int(k[len('msgstr['):-1]))],
                fuzzy=current['fuzzy'], line=current['line']))

    keyword = re.compile(r'^(msgctxt|msgid_plural|msgid|msgstr(?:\[\d+\])?)\s+(".*")\s*$')
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith('#'):
            if line.startswith('#,') and 'fuzzy' in (f.strip() for f in line[2:].split(',')):
                fuzzy = True
            continue
        match = keyword.match(line)
        if match:
            key, value = match.group(1), UnescapePoString(match.group(2))
            # A new entry starts at msgctxt, or at msgid unless msgctxt just opened it.
            if key == 'msgctxt' or (key == 'msgid' and (current is None or 'msgid' in current)):
                Finish()
                current = {'fuzzy': fuzzy, 'line': number}
                fuzzy = False
            elif current is None:
                raise ValueError(f'.po line {number}: {key} before any msgid, got {raw!r}.')
            if key == 'msgid':
                current['line'] = number
            current[key] = value
        elif line.startswith('"') and key is not None and current is not None:
            current[key] += UnescapePoString(line)
        else:
            raise ValueError(f'.po line {number}: expected a comment, a msgctxt/msgid/'
                             f'msgid_plural/msgstr line or a quoted continuation, got {raw!r}.')
    Finish()
    return entries


def _Usable(text: str, max_chars: int) -> bool:
    return 0 < len(text) <= max_chars and not _CONTROL.search(text)


def Pairs(entries: list[PoEntry], max_chars: int) -> list[tuple[str, str]]:
    """(source, target) pairs of a catalog's entries, after the filters of the module docstring."""
    return [(e.msgid, e.msgstr) for e in entries
            if e.msgid and not e.fuzzy and e.msgid_plural is None
            and _Usable(e.msgid, max_chars) and _Usable(e.msgstr, max_chars)]


def SplitOf(source: str) -> str:
    """'train', 'dev' or 'test': a stable function of the English sentence alone."""
    bucket = int.from_bytes(hashlib.sha256(source.encode('utf-8')).digest()[:8], 'big') % 100
    return next(split for split, bound in _SPLIT_BOUNDS if bucket < bound)


def CatalogPaths(names, language: str) -> list[str]:
    """The wheel's .po catalogs of `language`, sorted."""
    pattern = re.compile(rf'^django/(?:.+/)?locale/{re.escape(language)}/LC_MESSAGES/[^/]+\.po$')
    return sorted(n for n in names if pattern.match(n))


def WheelInfo(wheel: zipfile.ZipFile) -> tuple[str, str]:
    """(Django version, licence text) from the wheel's dist-info."""
    names = wheel.namelist()
    metadata = next(n for n in names if re.match(r'^[^/]+\.dist-info/METADATA$', n))
    version = re.search(r'^Version: (\S+)$', wheel.read(metadata).decode('utf-8'), re.M).group(1)
    licence = next(n for n in sorted(names)
                   if re.match(r'^[^/]+\.dist-info/(?:licenses/)?LICENSE$', n))
    return version, wheel.read(licence).decode('utf-8')


def MakeCorpus(wheel_path: str, languages, max_chars: int) -> dict:
    """{split: sorted list of (src_lang, tgt_lang, source, target)} from a Django wheel.

    Raises:
      ValueError: if a language has no catalog in the wheel.
    """
    splits = {split: set() for split in SPLITS}
    with zipfile.ZipFile(wheel_path) as wheel:
        names = wheel.namelist()
        for language in languages:
            paths = CatalogPaths(names, language)
            if not paths:
                raise ValueError(f'{wheel_path} has no catalogs for language {language!r}; '
                                 f'expected django/**/locale/{language}/LC_MESSAGES/*.po.')
            for path in paths:
                try:
                    entries = ParsePo(wheel.read(path).decode('utf-8'))
                except ValueError as e:
                    raise ValueError(f'{wheel_path}:{path}: {e}') from e
                for source, target in Pairs(entries, max_chars):
                    splits[SplitOf(source)].add((SOURCE_LANGUAGE, language, source, target))
    return {split: sorted(rows, key=lambda r: (r[1], r[2], r[3])) for split, rows in
            splits.items()}


def _CountsTable(corpus: dict, languages) -> str:
    counts = {s: collections.Counter(r[1] for r in rows) for s, rows in corpus.items()}
    lines = ['| language | ' + ' | '.join(SPLITS) + ' |', '|---' * (len(SPLITS) + 1) + '|']
    for language in languages:
        lines.append(f'| {language} | ' + ' | '.join(str(counts[s][language]) for s in SPLITS)
                     + ' |')
    lines.append('| all | ' + ' | '.join(str(len(corpus[s])) for s in SPLITS) + ' |')
    return '\n'.join(lines)


def _Readme(corpus: dict, languages, version: str, sha256: str, max_chars: int) -> str:
    return f"""# A small English->X parallel corpus from Django's translation catalogs

Sentence pairs from the translation catalogs (`.po` files) of Django {version}, which is
BSD-3-Clause licensed (see `LICENSE` in this directory). The translations are the work of
Django's translators, credited in each catalog's header.

Made by `python -m gpipe_tf.tools.make_multilingual_corpus --output_dir=gpipe_tf/data/multilingual`
from `django-{version}-py3-none-any.whl`, SHA-256
`{sha256}`;
the tool's docstring gives every filter. In short: all
`django/**/locale/<lang>/LC_MESSAGES/*.po` catalogs; fuzzy, plural, untranslated and header
entries dropped; pairs with a newline or control character, or more than {max_chars} characters on
either side, dropped; msgctxt ignored and duplicates removed.

Files `train.tsv`, `dev.tsv`, `test.tsv`: UTF-8, one pair a line, no header, columns
`source_language<TAB>target_language<TAB>source<TAB>target`; the source is always English (`en`).
The split is a hash of the English sentence, so no dev or test English sentence occurs in train
for any language. The strings are user-interface messages: short, and often with Python format
placeholders such as `%(value)s`, which translations copy.

Pairs per split and target language:

{_CountsTable(corpus, languages)}
"""


def _Notice(version: str, licence: str) -> str:
    return (f'The corpus files in this directory are derived from the translation catalogs of '
            f'Django {version}\n(https://www.djangoproject.com/), distributed under the '
            f'following licence:\n\n{licence}')


def WriteCorpus(wheel_path: str, output_dir: str, languages, max_chars: int) -> dict:
    """Writes train/dev/test.tsv, LICENSE and README.md to `output_dir`; returns the corpus."""
    corpus = MakeCorpus(wheel_path, languages, max_chars)
    with zipfile.ZipFile(wheel_path) as wheel:
        version, licence = WheelInfo(wheel)
    with open(wheel_path, 'rb') as f:
        sha256 = hashlib.sha256(f.read()).hexdigest()
    os.makedirs(output_dir, exist_ok=True)
    files = {f'{split}.tsv': ''.join('\t'.join(row) + '\n' for row in rows)
             for split, rows in corpus.items()}
    files['LICENSE'] = _Notice(version, licence)
    files['README.md'] = _Readme(corpus, languages, version, sha256, max_chars)
    for name, text in files.items():
        with open(os.path.join(output_dir, name), 'w', encoding='utf-8', newline='\n') as f:
            f.write(text)
    return corpus


def DownloadWheel(directory: str) -> str:
    """Path of django==DJANGO_VERSION's wheel, fetched by pip into `directory`."""
    subprocess.run([sys.executable, '-m', 'pip', 'download', f'django=={DJANGO_VERSION}',
                    '--no-deps', '--only-binary=:all:', '-d', directory], check=True)
    wheels = [n for n in os.listdir(directory) if n.endswith('.whl')]
    if len(wheels) != 1:
        raise RuntimeError(f'Expected one wheel in {directory} after pip download, got {wheels}.')
    return os.path.join(directory, wheels[0])


def main(argv):
    del argv
    if not FLAGS.output_dir:
        raise app.UsageError('--output_dir is required.')
    with tempfile.TemporaryDirectory() as tmp:
        wheel = FLAGS.wheel or DownloadWheel(tmp)
        corpus = WriteCorpus(wheel, FLAGS.output_dir, FLAGS.languages, FLAGS.max_chars)
    for split, rows in corpus.items():
        logging.info('%s: %d pairs', split, len(rows))
    print(_CountsTable(corpus, FLAGS.languages))


if __name__ == '__main__':
    app.run(main)
